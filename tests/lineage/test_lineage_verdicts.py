"""*Same basis* is a claim about every space: copies in which only some spaces moved are related
up to symmetry, and the record names what moved and what stayed in place."""

from __future__ import annotations

import pytest
import torch
from test_glu import random_scales
from test_lineage import _fine_tuned

import tiny
from hf_rebasin.lineage import compare
from hf_rebasin.lineage.record import moved_spaces, next_step
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.spaces import Space


def _partly_moved(family: str, moved: set[str]) -> tuple[object, dict, dict]:
    """A fine-tune of seed 0 with the spaces in ``moved`` permuted at random, the others in place."""
    a = tiny.FACTORIES[family](0).eval()
    sd = a.state_dict()
    graph = graph_for(a.config, sd.keys())
    drawn = graph.random_transform("permutation", torch.Generator().manual_seed(5))
    transform = {**graph.identity(), **{k: v for k, v in drawn.items() if k in moved}}
    return graph, sd, graph.apply(_fine_tuned(sd), transform)


def _kinds(graph: object, kind: str) -> set[str]:
    return {n for n, s in graph.spaces.items() if getattr(s, "kind", None) == kind}  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa"])
def test_units_moved_in_every_layer_and_heads_in_place_are_not_one_basis(family: str) -> None:
    a = tiny.FACTORIES[family](0).eval()
    graph = graph_for(a.config, a.state_dict().keys())
    graph, sd, child = _partly_moved(family, _kinds(graph, "mlp"))
    found = compare(graph, sd, child)
    assert found.verdict == "related up to symmetry", [(e.space, e.in_place, e.gap_z) for e in found.spaces]
    words = moved_spaces(found.spaces)
    assert words is not None and "MLP units moved" in words and "heads in place" in words, words
    assert "not every space is in place" in next_step(found.verdict, [], words)
    assert all(e.in_place == (".mlp" not in e.space) for e in found.spaces if e.counted)


def test_a_single_layer_moved_is_named() -> None:
    graph, sd, child = _partly_moved("gpt2", {"h.1.mlp"})
    found = compare(graph, sd, child)
    assert found.verdict == "related up to symmetry"
    assert [e.space for e in found.spaces if e.counted and not e.in_place] == ["h.1.mlp"]
    assert (
        moved_spaces(found.spaces)
        == "MLP units moved in layer 1; heads in place in layers 0–1; MLP units in place in layer 0"
    )


def test_gated_units_rescaled_with_signs_and_attention_untouched_are_not_one_basis() -> None:
    a = tiny.FACTORIES["llama-gqa"](0).eval()
    sd = a.state_dict()
    graph = graph_for(a.config, sd.keys())
    rescaled = glu.apply_unit_scales(graph, _fine_tuned(sd), random_scales(graph, 3))
    found = compare(graph, sd, rescaled)
    assert found.verdict == "related up to symmetry", [(e.space, e.raw_similarity, e.gap_z) for e in found.spaces]
    assert all(e.in_place == (".mlp" not in e.space) for e in found.spaces if e.counted)
    assert found.statistic > 0.9  # aligned: the units' scales are a symmetry, balanced away


def test_a_fine_tune_is_one_basis_in_every_space() -> None:
    a = tiny.FACTORIES["llama-gqa"](0).eval()
    sd = a.state_dict()
    graph = graph_for(a.config, sd.keys())
    found = compare(graph, sd, _fine_tuned(sd))
    assert found.verdict == "same basis"
    assert all(e.in_place for e in found.spaces) and moved_spaces(found.spaces) is None
    assert isinstance(graph.spaces["res"], Space)
