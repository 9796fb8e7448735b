"""SigLIP beyond the proofs every adapter gets (tests/test_adapters.py).

The stock ``SiglipModel`` forward, loaded from a transformed state dict, gives the same logits.
Negative controls: what the adapter leaves out really changes the outputs (a rotation of the text
residual that moves 1, a rotation of the vision residual or of the joint space, heads of the
pooling attention mixed, an MLP unit space rotated, the probe or one side of the joint space left
behind), and the two permutation-only spaces are permutation-only for the stated reason: the
rotations they lack are exact once that reason is out of the way.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.adapters import get_adapter, graph_for
from hf_rebasin.canonical import canonicalize
from hf_rebasin.errors import TransformError
from hf_rebasin.models import rebuild
from hf_rebasin.strategies import AlignmentData, Pair, align
from hf_rebasin.symmetry import AxisMap, HeadMap, Space, SymmetryGraph, Transform, random_orthogonal
from hf_rebasin.verify import TOLERANCE, compare, example_inputs, outputs_of, verify_model

HEAD = "vision_model.head"
PROBE = f"{HEAD}.probe"
POST = "vision_model.post_layernorm"


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny.siglip(0)


def _gap(
    model: torch.nn.Module, graph: SymmetryGraph, sd: dict[str, torch.Tensor], transform: Transform | None = None
) -> float:
    """max |Δ| of every output of ``model`` rebuilt from ``sd`` (embeddings mapped by ``transform``)."""
    spec = get_adapter("siglip")
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before = outputs_of(model.eval(), spec, inputs)
    after = outputs_of(rebuild(model, sd), spec, inputs)
    return compare(spec, graph, transform if transform is not None else graph.identity(), before, after)


def _rotate(graph: SymmetryGraph, space: str, fix_ones: bool, seed: int = 3) -> Transform:
    """Identity everywhere but a random rotation of ``space`` (fixing the all-ones vector or not)."""
    t = graph.identity()
    n = graph.spaces[space].size
    t[space] = AxisMap(n, blocks=random_orthogonal(n, torch.Generator().manual_seed(seed), fix_ones=fix_ones)[None])
    return t


def _declared_orthogonal(model: torch.nn.Module, sd: dict[str, torch.Tensor], space: str, centered: bool):
    """The graph with ``space`` declared orthogonal (what the adapter does not claim)."""
    graph = graph_for(model.config, sd.keys())
    sp = graph.spaces[space]
    assert isinstance(sp, Space) and sp.max_class == "permutation"
    graph.spaces[space] = dataclasses.replace(sp, max_class="orthogonal", centered=centered, reason="")
    return graph


def _siglip_inputs(seed: int) -> dict[str, torch.Tensor]:
    """Three texts (one padded) and two images, drawn here rather than by the package."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0
    return {
        "input_ids": torch.randint(0, tiny.V, (3, 10), generator=g),
        "attention_mask": mask,
        "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
    }


# ------------------------------------------------------------------------------------------------
# what the adapter claims
# ------------------------------------------------------------------------------------------------


def test_classes_and_the_vision_fallback(model):
    report = verify_model(model, "orthogonal", seed=0)
    assert report.max_abs_diff <= TOLERANCE, report
    assert report.classes["text.res"] == "orthogonal (fixing 1)"
    assert report.classes["vision.res"] == "permutation"
    assert report.classes["joint"] == "permutation"
    assert report.classes["vision.pool.attn"] == "head-permutation + inner rotations"
    (note,) = report.fallbacks
    assert "'vision.res'" in note and "probe" in note


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_stock_forward_gives_the_same_logits_after_an_orthogonal_transform(model, seed):
    """Independent of the package's forward helpers: a fresh stock ``SiglipModel`` loaded (strict)
    with the original and with the transformed state dict gives the same ``logits_per_image``."""
    sd = model.state_dict()
    canon, graph, untied = canonicalize(graph_for(model.config, sd.keys()), sd)
    assert not untied
    transform = graph.random_transform("orthogonal", torch.Generator().manual_seed(seed))
    new = graph.apply(canon, transform)
    dense = transform["text.res"]
    assert isinstance(dense, AxisMap) and (dense.matrix().abs() > 1e-3).float().mean() > 0.5
    for name in ("vision.res", "joint", "vision.pool.mlp"):
        assert not transform[name].is_identity()
    pool = transform["vision.pool.attn"]
    assert isinstance(pool, HeadMap) and pool.qk.dtype != torch.long  # inner rotations of the pooling heads
    moved = [k for k in sd if sd[k].is_floating_point() and (new[k] - sd[k]).abs().max() > 1e-2]
    assert f"{HEAD}.attention.in_proj_weight" in moved and PROBE in moved and "text_model.head.weight" in moved

    inputs = _siglip_inputs(seed)
    logits = []
    for state in (sd, new):
        stock = T.SiglipModel(model.config).eval()
        stock.load_state_dict(state, strict=True)
        with torch.no_grad():
            logits.append(stock(**inputs).logits_per_image)
    assert logits[0].shape == (2, 3)
    assert (logits[1] - logits[0]).abs().max().item() <= TOLERANCE


def test_head_perm_aligns_siglip_from_activations(model):
    """Activation matching runs on both towers and the joint space; the pooling attention is an
    ``nn.MultiheadAttention`` whose projections are never called as modules (no hook sees them),
    so activations leave its heads where they are: still an allowed, function-preserving map."""
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sd_b = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(3)))
    spec = get_adapter("siglip")
    data = AlignmentData([example_inputs(spec, model.config, torch.Generator().manual_seed(i)) for i in range(4)])
    alignment = align("head-perm", Pair(graph, sd, sd_b, model, rebuild(model, sd_b), data), {"residual": "last"})
    assert alignment.exact and not alignment.notes
    aligned = alignment.aligned_b()
    pooling = {k for k in sd if k.startswith(f"{HEAD}.attention.")}
    for k in sd:
        if k not in pooling:
            torch.testing.assert_close(aligned[k], sd[k], atol=1e-6, rtol=0)
    assert _gap(model, graph, dict(aligned)) <= TOLERANCE


# ------------------------------------------------------------------------------------------------
# negative controls
# ------------------------------------------------------------------------------------------------


def test_text_rotation_must_fix_ones(model):
    canon, graph, _ = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    assert _gap(model, graph, graph.apply(canon, _rotate(graph, "text.res", True)), graph.identity()) <= TOLERANCE
    t = _rotate(graph, "text.res", False)
    assert _gap(model, graph, graph.apply(canon, t), t) > 1e-3


def test_vision_rotation_is_refused_and_moves_the_outputs(model):
    sd = model.state_dict()
    canon, graph, _ = canonicalize(graph_for(model.config, sd.keys()), sd)
    t = _rotate(graph, "vision.res", True)
    with pytest.raises(TransformError, match="only permutations"):
        graph.apply(canon, t)
    assert _gap(model, graph, graph.apply(canon, t, check=False), t) > 1e-3


def test_post_layernorm_and_probe_are_why_the_vision_residual_is_permutation_only(model):
    """Declared orthogonal, the vision residual's canonical form is wrong: folding post_layernorm
    into in_proj and centering the stream's writers also changes the probe's query. With
    post_layernorm neutral and the probe kept as stored, rotations fixing 1 are exact (and others
    not): the probe's path is the only obstacle."""
    sd = dict(model.state_dict())
    graph = _declared_orthogonal(model, sd, "vision.res", centered=True)
    canon, cgraph, _ = canonicalize(graph, sd)
    assert _gap(model, cgraph, canon) > 1e-3

    sd[f"{POST}.weight"], sd[f"{POST}.bias"] = torch.ones(32), torch.zeros(32)
    neutral = rebuild(model, sd)
    canon, cgraph, _ = canonicalize(_declared_orthogonal(neutral, sd, "vision.res", centered=True), sd)
    assert _gap(neutral, cgraph, canon) > 1e-3  # the probe was centered with the stream's writers
    canon[PROBE] = sd[PROBE]
    assert _gap(neutral, cgraph, canon) <= TOLERANCE
    t = _rotate(cgraph, "vision.res", True)
    assert _gap(neutral, cgraph, cgraph.apply(canon, t), t) <= TOLERANCE
    t = _rotate(cgraph, "vision.res", False)
    assert _gap(neutral, cgraph, cgraph.apply(canon, t), t) > 1e-3


def test_joint_rotations_must_fix_ones_and_its_writers_cannot_be_centered(model):
    """The joint space: head.layernorm reads it, so a rotation must fix 1 (once γ/β are folded
    into head.mlp.fc1, those rotations are exact); the pooled stream is the image embedding itself,
    so centering its writers, as a centered space's canonical form does, changes the logits."""
    sd = dict(model.state_dict())
    canon, cgraph, _ = canonicalize(_declared_orthogonal(model, sd, "joint", centered=True), sd)
    assert _gap(model, cgraph, canon) > 1e-3

    canon, cgraph, _ = canonicalize(_declared_orthogonal(model, sd, "joint", centered=False), sd)
    assert _gap(model, cgraph, canon) <= TOLERANCE  # γ/β folded, writers left alone
    t = _rotate(cgraph, "joint", True)
    assert _gap(model, cgraph, cgraph.apply(canon, t), t) <= TOLERANCE
    t = _rotate(cgraph, "joint", False)
    assert _gap(model, cgraph, cgraph.apply(canon, t), t) > 1e-3
    # and, as the adapter declares it, a rotation is refused
    graph = graph_for(model.config, sd.keys())
    with pytest.raises(TransformError, match="only permutations"):
        graph.apply(sd, _rotate(graph, "joint", True))


@pytest.mark.parametrize("side", ["text", "vision"])
def test_text_head_and_pooled_stream_share_one_space(model, side):
    """Permuting the joint space on one side only (the text head's rows, or the pooling head's
    writers and readers) changes the logits; on both it is exact."""
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = graph.identity()
    t["joint"] = AxisMap(32, index=torch.randperm(32, generator=torch.Generator().manual_seed(0)))
    both = graph.apply(sd, t)
    assert _gap(model, graph, both, t) <= TOLERANCE
    half = {k: (both[k] if k.startswith(f"{side}_model.") else v) for k, v in sd.items()}
    assert _gap(model, graph, half) > 1e-3


def test_probe_lives_in_the_vision_residual(model):
    """A vision-residual permutation that leaves the probe behind changes the image embeddings."""
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = graph.identity()
    t["vision.res"] = AxisMap(32, index=torch.randperm(32, generator=torch.Generator().manual_seed(0)))
    new = graph.apply(sd, t)
    assert _gap(model, graph, new) <= TOLERANCE
    assert _gap(model, graph, {**new, PROBE: sd[PROBE]}) > 1e-3


def test_mixing_pooling_heads_or_rotating_its_mlp_units_moves_the_outputs(model):
    sd = dict(model.state_dict())
    graph = graph_for(model.config, sd.keys())
    # swap feature 0 of pooling head 0 with feature 0 of head 1, in Q and K alike
    dh, d = 8, 32
    idx = torch.arange(3 * d)
    for base in (0, d):  # q rows, then k rows of in_proj
        idx[[base, base + dh]] = idx[[base + dh, base]]
    mixed = dict(sd)
    for name in ("in_proj_weight", "in_proj_bias"):
        key = f"{HEAD}.attention.{name}"
        mixed[key] = sd[key].index_select(0, idx)
    assert _gap(model, graph, mixed) > 1e-3
    # a rotation of the pooling MLP's units (GELU between fc1 and fc2), forced past the class check
    t = _rotate(graph, "vision.pool.mlp", False)
    with pytest.raises(TransformError, match="only permutations"):
        graph.apply(sd, t)
    assert _gap(model, graph, graph.apply(sd, t, check=False), t) > 1e-3
