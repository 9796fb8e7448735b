"""ELECTRA beyond the proofs every adapter gets (tests/symmetry/test_adapters.py); ALBERT and MPNet
have theirs in tests/symmetry/test_adapters_albert_mpnet.py.

Negative controls: the constraints the adapters declare are real. ELECTRA's embedding space is one
space shared by the tables, their LayerNorm, ``embeddings_project``'s columns and the generator's
tied head: permuting it without one of them moves the outputs, and so does rotating it (a LayerNorm
normalizes it). The CLI verifies saved models of both classes.
"""

from __future__ import annotations

import pytest
import torch

import tiny
from hf_rebasin.alignment.verify import TOLERANCE, verify_model
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.transforms import AxisMap, random_orthogonal
from symmetry_checks import output_gap, permuted

ELECTRA = ("electra", "electra-mlm", "electra-mlm-equal", "electra-cls", "electra-cls-equal", "electra-base")


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {case: tiny.FACTORIES[case](0) for case in ELECTRA}


# ------------------------------------------------------------------------------------------------
# ELECTRA: the embedding space
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ELECTRA)
def test_electra_embedding_space_exists_only_where_projected(models, case):
    model = models[case]
    graph = graph_for(model.config, model.state_dict().keys())
    projected = model.config.embedding_size != model.config.hidden_size
    assert ("emb" in graph.spaces) == projected
    if projected:
        assert graph.spaces["emb"].size == model.config.embedding_size == 16
        assert graph.spaces["emb"].max_class == "permutation"


@pytest.mark.parametrize("case", ["electra", "electra-mlm", "electra-base"])
def test_electra_embedding_permutation_needs_embeddings_project(models, case):
    """Permuting the tables and their LayerNorm is exact with ``embeddings_project``'s columns
    permuted too, and moves the outputs without."""
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = permuted(graph, "emb")
    moved = graph.apply(sd, t)
    assert output_gap(model, graph, moved, t) <= TOLERANCE
    (project,) = [k for k in sd if k.endswith("embeddings_project.weight")]
    partial = {**moved, project: sd[project]}
    assert output_gap(model, graph, partial, t) > 1e-3


def test_electra_generator_head_writes_the_embedding_space(models):
    """The generator's head writes ``emb`` (read by the tied word embeddings): leaving its dense
    rows and LayerNorm unpermuted moves the logits."""
    model = models["electra-mlm"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = permuted(graph, "emb", seed=1)
    moved = graph.apply(sd, t)
    assert output_gap(model, graph, moved, t) <= TOLERANCE
    head = [k for k in sd if k.startswith("generator_predictions.")]
    assert output_gap(model, graph, {**moved, **{k: sd[k] for k in head}}, t) > 1e-3


def test_electra_embedding_rotation_moves_the_outputs(models):
    """An orthogonal map of ``emb`` that fixes the all-ones vector still breaks: the embeddings'
    LayerNorm scales features one by one, so only permutations commute with it."""
    model = models["electra"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = graph.identity()
    q = random_orthogonal(16, torch.Generator().manual_seed(0), fix_ones=True)
    t["emb"] = AxisMap(16, blocks=q[None])
    assert output_gap(model, graph, graph.apply(sd, t, check=False), t) > 1e-3


@pytest.mark.parametrize("case", ["electra", "electra-mlm"])
def test_electra_orthogonal_falls_back_to_permutation_with_the_reason(models, case):
    report = verify_model(models[case], "orthogonal", seed=0)
    assert report.classes["res"] == report.classes["emb"] == "permutation"
    assert report.max_abs_diff <= TOLERANCE
    (note,) = [n for n in report.fallbacks if "'res'" in n]
    assert "post-norm" in note
