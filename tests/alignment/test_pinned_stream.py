"""A pinned residual stream (Marian's, M2M100's: sinusoidal positions regenerated on load) keeps the
identity in every transform and every strategy, while heads and hidden units still move; a map of it
is refused by name."""

from __future__ import annotations

import pytest
import torch

import tiny
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.alignment.verify import example_inputs, outputs_of
from hf_rebasin.core.errors import PinnedSpaceError, TransformError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import REGISTRY, graph_for
from hf_rebasin.symmetry.spaces import Space
from hf_rebasin.symmetry.transforms import AxisMap

STRATEGIES = ["weight-matching", "generalized-orthogonal", "transfusion"]


def _logits(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(5))
    return outputs_of(rebuild(model, sd), spec, inputs)["logits"]


def _stream_permuted(graph, transform, size: int) -> dict:
    """``transform`` with the stream permuted too: what a strategy that ignored the pin would find."""
    return {**transform, "res": AxisMap(size, index=torch.randperm(size, generator=torch.Generator().manual_seed(3)))}


@pytest.mark.parametrize("case", ["marian", "m2m100"])
def test_pinned_stream_keeps_the_identity_in_random_transforms_and_is_refused(case):
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    space = graph.spaces["res"]
    assert isinstance(space, Space) and space.pinned and "regenerated on load" in space.reason
    for cls in ("permutation", "orthogonal"):
        transform = graph.random_transform(cls, torch.Generator().manual_seed(1))
        assert transform["res"].is_identity()
        assert not all(m.is_identity() for m in transform.values())  # heads and units still move
        assert graph.classes(cls)["res"].startswith("pinned")
        assert graph.fallbacks(cls) == []  # not a fallback to permutations: no map at all
    assert graph.pinned() == ["residual stream pinned: sinusoidal positions are regenerated on load"]
    bad = _stream_permuted(graph, graph.identity(), space.size)
    with pytest.raises(PinnedSpaceError, match="'res' is pinned") as err:
        graph.apply(sd, bad)
    assert isinstance(err.value, TransformError)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_leave_a_pinned_stream_at_the_identity_and_still_match_heads_and_units(strategy):
    """B is A with its heads and units permuted (allowed) and its stream permuted too (forced past
    the check). The embeddings pin that stream map down exactly, so a strategy that solved the stream
    would find it; every strategy must keep the identity there, still undo the head and unit maps of
    a B without the stream map, and give a B whose logits the stock class keeps."""
    model = tiny.marian(0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    allowed = graph.random_transform("permutation", torch.Generator().manual_seed(2))
    sd_b = graph.apply(sd, allowed)
    clean = align(strategy, Pair(graph, sd, sd_b))
    assert clean.transform["res"].is_identity()
    moved = [n for n, m in clean.transform.items() if not m.is_identity()]
    assert moved and all(n != "res" for n in moved)
    aligned = clean.aligned_b()
    assert max((aligned[k].double() - clean.sd_a[k].double()).abs().max().item() for k in aligned) < 1e-5
    # the aligned B computes what B computes, through transformers' own MarianMTModel
    aligned_logits = _logits(model, dict(clean.graph.apply(clean.sd_b, clean.transform)))
    assert (aligned_logits - _logits(model, dict(sd_b))).abs().max().item() < 1e-4

    forced = graph.apply(sd, _stream_permuted(graph, allowed, graph.spaces["res"].size), check=False)
    alignment = align(strategy, Pair(graph, sd, forced))
    assert alignment.transform["res"].is_identity()
    assert any(not m.is_identity() for n, m in alignment.transform.items() if n != "res")
    out = alignment.graph.apply(alignment.sd_b, alignment.transform)  # check_transform accepts it
    assert (_logits(model, dict(out)) - _logits(model, dict(alignment.sd_b))).abs().max().item() < 1e-4


def test_a_universe_merge_of_three_marians_keeps_the_stream_pinned():
    """Three copies of one Marian, heads and units permuted, the stream forced to move in two of them:
    every model's map into the merge's basis keeps the stream at the identity, and each aligned copy
    computes what that copy computes (MarianMTModel's logits)."""
    from hf_rebasin.merging.universe import universe_merge

    model = tiny.marian(0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    size = graph.spaces["res"].size
    copies = [dict(sd)]
    for k in (1, 2):
        moved = graph.random_transform("permutation", torch.Generator().manual_seed(10 + k))
        copies.append(dict(graph.apply(sd, _stream_permuted(graph, moved, size), check=False)))
    result = universe_merge("weight-matching", None, graph, copies, [1 / 3] * 3, iterations=2)
    for copy, alignment in zip(copies, result.alignments, strict=True):
        assert alignment.transform["res"].is_identity()
        aligned = alignment.graph.apply(alignment.sd_b, alignment.transform)
        assert (_logits(model, dict(aligned)) - _logits(model, copy)).abs().max().item() < 1e-4
    assert any(not m.is_identity() for al in result.alignments for n, m in al.transform.items() if n != "res")
