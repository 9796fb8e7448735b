"""SigLIP beyond the proofs every adapter gets (tests/symmetry/test_adapters.py).

After canonical form every stream of SigLIP admits orthogonal maps fixing 1: the text residual, the
vision residual (the pooling probe bypasses ``post_layernorm``: it becomes (probe − β)/γ and is not
centered) and the joint space (the pooling head's own stream, which is the image embedding, shared
with the text head's rows: its writers keep their mean). The stock ``SiglipModel`` forward, loaded
from a transformed state dict, gives the same logits and embeddings (mapped), and a data-free
strategy recovers such a transform. Negative controls: a rotation that moves 1 on any stream, the
joint space rotated on one side only, the probe left behind, canonical form without the probe's
rewrite or with the joint writers centered, heads of the pooling attention mixed, an MLP unit space
rotated: each changes the outputs.

``SiglipForImageClassification`` (the vision tower under a classifier of the mean token, its unused
pooling head kept): every allowed class gives the same logits, the tower's ``pooler_output`` moves by
the joint map; a vision rotation moving 1, one without canonical form, or one that leaves the
classifier behind moves the logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.alignment.strategies import AlignmentData, Pair, align
from hf_rebasin.alignment.verify import TOLERANCE, compare, example_inputs, outputs_of, verify_model
from hf_rebasin.core.errors import TransformError
from hf_rebasin.io.models import load_model
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.canonical import BypassedNorm, RawStream, canonical_steps, canonical_tensor, canonicalize
from hf_rebasin.symmetry.graph import Norm, SymmetryGraph
from hf_rebasin.symmetry.spaces import Space
from hf_rebasin.symmetry.transforms import AxisMap, HeadMap, Transform, random_orthogonal

HEAD = "vision_model.head"
PROBE = f"{HEAD}.probe"
POST = "vision_model.post_layernorm"
STREAMS = ("text.res", "vision.res", "joint")
D = 32  # every stream of tiny.siglip is 32 wide


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


def _rotation(n: int, fix_ones: bool, seed: int = 3) -> AxisMap:
    return AxisMap(n, blocks=random_orthogonal(n, torch.Generator().manual_seed(seed), fix_ones=fix_ones)[None])


def _rotate(graph: SymmetryGraph, space: str, fix_ones: bool, seed: int = 3) -> Transform:
    """Identity everywhere but a random rotation of ``space`` (fixing the all-ones vector or not)."""
    t = graph.identity()
    t[space] = _rotation(graph.spaces[space].size, fix_ones, seed)
    return t


def _canonical(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], SymmetryGraph]:
    canon, graph, untied = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    assert not untied
    return canon, graph


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


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_every_stream_is_orthogonal_fixing_ones(model, seed):
    report = verify_model(model, "orthogonal", seed=seed)
    assert report.max_abs_diff <= TOLERANCE, report
    assert sorted(report.compared) == ["image_embeds", "logits_per_image", "text_embeds"]
    for name in STREAMS:
        assert report.classes[name] == "orthogonal (fixing 1)", name
    assert report.classes["vision.pool.attn"] == "head-permutation + inner rotations"
    assert report.classes["vision.pool.mlp"] == "permutation"
    assert report.fallbacks == [] and report.untied == []


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_stock_forward_gives_the_same_outputs_after_an_orthogonal_transform(seed):
    """Independent of the package's forward helpers: a fresh stock ``SiglipModel`` loaded (strict)
    with the original and with the transformed state dict (a tiny model of each seed) gives the same
    ``logits_per_image``, and embeddings moved by the joint rotation."""
    model = tiny.siglip(seed)
    sd = model.state_dict()
    canon, graph = _canonical(model)
    transform = graph.random_transform("orthogonal", torch.Generator().manual_seed(seed))
    new = graph.apply(canon, transform)
    ones = torch.ones(D, dtype=torch.float64)
    for name in STREAMS:
        dense = transform[name]
        assert isinstance(dense, AxisMap) and (dense.matrix().abs() > 1e-3).float().mean() > 0.5, name
        torch.testing.assert_close(dense.matrix() @ ones, ones)  # fixes 1
    pool = transform["vision.pool.attn"]
    assert isinstance(pool, HeadMap) and pool.qk.dtype != torch.long  # inner rotations of the pooling heads
    moved = [k for k in sd if sd[k].is_floating_point() and (new[k] - sd[k]).abs().max() > 1e-2]
    for k in (PROBE, f"{HEAD}.attention.in_proj_weight", f"{HEAD}.mlp.fc2.bias", "text_model.head.weight"):
        assert k in moved, k

    inputs = _siglip_inputs(seed)
    outs = []
    for state in (sd, new):
        stock = T.SiglipModel(model.config).eval()
        stock.load_state_dict(state, strict=True)
        with torch.no_grad():
            outs.append(stock(**inputs))
    assert outs[0].logits_per_image.shape == (2, 3)
    assert (outs[1].logits_per_image - outs[0].logits_per_image).abs().max().item() <= TOLERANCE
    joint = transform["joint"]
    assert isinstance(joint, AxisMap)
    for key in ("image_embeds", "text_embeds"):
        want = joint.apply(outs[0][key], 1)
        assert (outs[1][key] - want).abs().max().item() <= TOLERANCE, key
        assert (outs[1][key] - outs[0][key]).abs().max().item() > 1e-2, key  # really rotated


def test_a_text_tower_narrower_than_the_joint_space():
    """Text width 24, written by the text head into the 32-wide joint space, and a trained-like
    logit scale (exp 10): every stream still orthogonal, the sizes kept apart."""
    torch.manual_seed(0)
    text = dict(vocab_size=tiny.V, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40)
    vision = dict(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=16)
    cfg = T.SiglipConfig(
        text_config={**text, "max_position_embeddings": 16, "projection_size": D, "eos_token_id": 1},
        vision_config={**vision, "patch_size": 8, "num_channels": 3},
    )
    model = tiny._randomize_norms(T.SiglipModel(cfg), 0)
    with torch.no_grad():
        model.logit_scale.fill_(2.3)
    graph = graph_for(model.config, model.state_dict().keys())
    assert [graph.spaces[s].size for s in STREAMS] == [24, D, D]
    for seed in (0, 1):
        report = verify_model(model, "orthogonal", seed=seed)
        assert report.max_abs_diff <= TOLERANCE, report
        assert all(report.classes[s] == "orthogonal (fixing 1)" for s in STREAMS)


@pytest.mark.parametrize("space", STREAMS)
def test_each_stream_rotates_alone_and_only_fixing_ones(model, space):
    """A rotation of one stream alone, fixing 1, is exact; one that moves 1 is not (a LayerNorm reads
    every stream: the text and vision layers' norms, and the pooling head's ``layernorm`` on joint)."""
    canon, graph = _canonical(model)
    t = _rotate(graph, space, True)
    assert _gap(model, graph, graph.apply(canon, t), t) <= TOLERANCE
    t = _rotate(graph, space, False)
    assert _gap(model, graph, graph.apply(canon, t), t) > 1e-3


def test_canonical_form_rewrites_the_probe_and_leaves_the_joint_writers(model):
    """post_layernorm's γ/β fold into in_proj (all of its q | k | v rows), the probe becomes
    (probe − β)/γ and keeps its mean, the vision writers are centered, the joint writers are not."""
    sd = model.state_dict()
    canon, graph = _canonical(model)
    assert _gap(model, graph, canon) <= TOLERANCE
    (post,) = [n for n in graph.norms if n.weight == f"{POST}.weight"]
    assert isinstance(post, BypassedNorm) and post.bypass == (PROBE,)
    assert isinstance(graph.spaces["joint"], RawStream)
    for norm in (POST, f"{HEAD}.layernorm"):
        assert torch.equal(canon[f"{norm}.weight"], torch.ones(D)) and torch.equal(
            canon[f"{norm}.bias"], torch.zeros(D)
        )
    g, b = sd[f"{POST}.weight"].double(), sd[f"{POST}.bias"].double()
    want = (sd[PROBE].double() - b) / g
    torch.testing.assert_close(canon[PROBE].double(), want, atol=1e-6, rtol=0)
    assert canon[PROBE].mean().abs() > 1e-2  # not centered
    w = sd[f"{HEAD}.attention.in_proj_weight"].double()
    torch.testing.assert_close(canon[f"{HEAD}.attention.in_proj_weight"].double(), w * g, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        canon[f"{HEAD}.attention.in_proj_bias"].double(),
        sd[f"{HEAD}.attention.in_proj_bias"].double() + w @ b,
        atol=1e-6,
        rtol=0,
    )
    for writer, axis in (
        ("vision_model.embeddings.patch_embedding.weight", 0),
        ("vision_model.encoder.layers.1.mlp.fc2.bias", 0),
    ):
        assert canon[writer].double().mean(axis).abs().max() < 1e-6, writer
    for writer in (f"{HEAD}.attention.out_proj.weight", f"{HEAD}.attention.out_proj.bias", f"{HEAD}.mlp.fc2.weight"):
        assert torch.equal(canon[writer], sd[writer]), writer
    # the text head writes joint too: it takes final_layer_norm's β as a shift, and no centering
    head, final = "text_model.head", "text_model.final_layer_norm"
    want = sd[f"{head}.bias"].double() + sd[f"{head}.weight"].double() @ sd[f"{final}.bias"].double()
    torch.testing.assert_close(canon[f"{head}.bias"].double(), want, atol=1e-6, rtol=0)
    assert canon[f"{head}.bias"].mean().abs() > 1e-2


def test_the_probe_follows_a_fold_that_leaves_beta_in_the_norm(model):
    """Where a reader of post_layernorm has no bias (here: in_proj_bias hidden from the plan), β
    stays in the norm as β/γ and the probe becomes probe/γ: still the same function, and still
    exact under a vision rotation fixing 1."""
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    form = canonical_steps(graph, {k: v for k, v in sd.items() if k != f"{HEAD}.attention.in_proj_bias"})
    assert [s.kind for s in form.steps[PROBE]] == ["unscale"] and [s.kind for s in form.steps[f"{POST}.bias"]] == [
        "divide"
    ]
    canon = {name: canonical_tensor(form, name, sd) for name in sd}
    g = sd[f"{POST}.weight"].double()
    torch.testing.assert_close(canon[PROBE].double(), sd[PROBE].double() / g, atol=1e-6, rtol=0)
    assert torch.equal(canon[f"{HEAD}.attention.in_proj_bias"], sd[f"{HEAD}.attention.in_proj_bias"])
    assert _gap(model, form.graph, canon) <= TOLERANCE
    t = _rotate(form.graph, "vision.res", True)
    assert _gap(model, form.graph, form.graph.apply(canon, t), t) <= TOLERANCE


def test_streamed_canonical_form_is_the_in_memory_one(model, tmp_path):
    """A `LazyState` (a checkpoint read tensor by tensor) gets the same bits, the probe included."""
    model.save_pretrained(str(tmp_path))
    loaded = load_model(tmp_path, stream=True)
    assert loaded.source is not None
    lazy, lazy_graph, untied = canonicalize(loaded.graph, loaded.source)
    canon, _graph = _canonical(model)
    assert not untied and isinstance(lazy_graph.spaces["joint"], RawStream)
    assert torch.equal(lazy[PROBE], canon[PROBE]) and not torch.equal(canon[PROBE], model.state_dict()[PROBE])
    for name, t in canon.items():
        assert torch.equal(lazy[name], t), name


def test_generalized_orthogonal_recovers_a_rotated_siglip(model):
    """B is A (canonical) under a random allowed orthogonal transform: generalized-orthogonal brings
    B back onto A, each stream's map the inverse of the one applied."""
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    canon, cgraph = _canonical(model)
    applied = cgraph.random_transform("orthogonal", torch.Generator().manual_seed(5))
    sd_b = cgraph.apply(canon, applied)
    alignment = align("generalized-orthogonal", Pair(graph, sd, sd_b))
    assert alignment.exact
    aligned = alignment.aligned_b()
    assert max((aligned[k] - alignment.sd_a[k]).abs().max().item() for k in sd) < 1e-5
    for name in STREAMS:
        got, put = alignment.transform[name], applied[name]
        assert isinstance(got, AxisMap) and isinstance(put, AxisMap)
        torch.testing.assert_close(got.matrix() @ put.matrix(), torch.eye(D, dtype=torch.float64), atol=1e-5, rtol=0)


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


def test_the_probe_needs_its_rewrite_and_no_centering(model):
    """With post_layernorm a plain norm (no bypass) canonical form centers the probe and leaves it
    as stored while in_proj takes γ/β: the outputs move. So do each half of the rule alone: the
    probe left as stored, or rewritten and then centered."""
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    plain = [
        Norm(n.weight, n.bias, n.space, n.readers, n.offset) if isinstance(n, BypassedNorm) else n for n in graph.norms
    ]
    canon, cgraph, _ = canonicalize(dataclasses.replace(graph, norms=plain), sd)
    assert _gap(model, cgraph, canon) > 1e-3

    canon, cgraph = _canonical(model)
    assert _gap(model, cgraph, {**canon, PROBE: sd[PROBE]}) > 1e-3
    assert _gap(model, cgraph, {**canon, PROBE: canon[PROBE] - canon[PROBE].mean()}) > 1e-3


def test_the_joint_writers_must_keep_their_mean(model):
    """The pooled stream is the image embedding, read raw: canonical form of a joint space whose
    writers are centered (a plain centered space) changes the embeddings and the logits."""
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    joint = graph.spaces["joint"]
    spaces = {**graph.spaces, "joint": Space(joint.name, joint.size, "orthogonal", True, joint.kind)}
    canon, cgraph, _ = canonicalize(dataclasses.replace(graph, spaces=spaces), sd)
    assert _gap(model, cgraph, canon) > 1e-3


@pytest.mark.parametrize("side", ["text", "vision"])
def test_text_head_and_pooled_stream_share_one_space(model, side):
    """Rotating the joint space (fixing 1) on one side only (the text head's rows, or the pooling
    head's writers and readers) changes the logits; on both it is exact."""
    canon, graph = _canonical(model)
    t = _rotate(graph, "joint", True)
    both = graph.apply(canon, t)
    assert _gap(model, graph, both, t) <= TOLERANCE
    half = {k: (both[k] if k.startswith(f"{side}_model.") else v) for k, v in canon.items()}
    assert _gap(model, graph, half) > 1e-3


def test_probe_lives_in_the_vision_residual(model):
    """A vision-residual rotation that leaves the (rewritten) probe behind changes the image
    embeddings: the probe's axis is the basis in_proj's columns read."""
    canon, graph = _canonical(model)
    t = _rotate(graph, "vision.res", True)
    new = graph.apply(canon, t)
    assert _gap(model, graph, new, t) <= TOLERANCE
    assert _gap(model, graph, {**new, PROBE: canon[PROBE]}, t) > 1e-3


def test_vision_rotation_needs_canonical_form(model):
    """Before canonical form the norm scales on the vision residual are not uniform: a rotation is
    refused, and forced through it moves the outputs."""
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = _rotate(graph, "vision.res", True)
    with pytest.raises(TransformError, match="not uniform"):
        graph.apply(sd, t)
    assert _gap(model, graph, graph.apply(sd, t, check=False), t) > 1e-3


def test_mixing_pooling_heads_or_rotating_its_mlp_units_moves_the_outputs(model):
    sd = dict(model.state_dict())
    graph = graph_for(model.config, sd.keys())
    # swap feature 0 of pooling head 0 with feature 0 of head 1, in Q and K alike
    dh = 8
    idx = torch.arange(3 * D)
    for base in (0, D):  # q rows, then k rows of in_proj
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


# ------------------------------------------------------------------------------------------------
# SiglipForImageClassification: the vision tower under a classifier of the mean token
# ------------------------------------------------------------------------------------------------

VISION_STREAMS = ("vision.res", "joint")


@pytest.fixture(scope="module")
def classifier() -> torch.nn.Module:
    return tiny.siglip_cls(0)


def _logits_gap(model: torch.nn.Module, sd: dict[str, torch.Tensor], seed: int = 7) -> float:
    """max |Δ logits| of a stock ``SiglipForImageClassification`` loaded (strict) with ``sd``."""
    pixels = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    stock = T.SiglipForImageClassification(model.config).eval()
    stock.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return (stock(pixel_values=pixels).logits - model.eval()(pixel_values=pixels).logits).abs().max().item()


def test_the_classifier_is_described_without_a_text_tower(classifier):
    """Only vision tensors and the classifier; the norms' γ/β really are random (a γ of 1 would
    hide a fold into the wrong reader); the classifier reads post_layernorm, the probe bypasses it."""
    sd = classifier.state_dict()
    assert not any(k.startswith("text_model.") for k in sd) and f"{HEAD}.probe" in sd
    graph = graph_for(classifier.config, sd.keys())
    graph.check(sd, source="siglip-cls")
    assert set(graph.spaces) == {
        "vision.res",
        "joint",
        "vision.pool.attn",
        "vision.pool.mlp",
        *(f"vision.{i}.{s}" for i in (0, 1) for s in ("attn", "mlp")),
    }
    assert graph.bindings["classifier.weight"].axes == (None, "vision.res") and "classifier.bias" in graph.invariant
    (post,) = [n for n in graph.norms if n.weight == f"{POST}.weight"]
    assert isinstance(post, BypassedNorm) and "classifier.weight" in post.readers
    for name, p in sd.items():
        if "norm" in name and name.endswith("weight"):
            assert (p - 1).abs().max() > 0.1, name


@pytest.mark.parametrize("seed", (0, 1, 2))
@pytest.mark.parametrize("cls", ("permutation", "orthogonal"))
def test_classifier_random_allowed_transform_keeps_the_logits(classifier, cls, seed):
    """Every class the graph claims at once (head permutations and inner rotations, unit
    permutations, the vision stream and the pooling stream orthogonal fixing 1 after canonical
    form): the same logits, within 1e-4 in float32. Text inputs are not passed to the model."""
    report = verify_model(classifier, cls, seed=seed)
    assert report.compared == ["logits"]
    assert report.max_abs_diff <= TOLERANCE, report
    assert report.fallbacks == [] and report.untied == []
    if cls == "orthogonal":
        for name in VISION_STREAMS:
            assert report.classes[name] == "orthogonal (fixing 1)", name
        heads = "head-permutation + inner rotations"
        assert report.classes["vision.0.attn"] == report.classes["vision.pool.attn"] == heads
        assert report.classes["vision.0.mlp"] == "permutation"


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_classifier_stock_forward_after_an_orthogonal_transform(seed):
    """Independent of the package's forward helpers: a stock ``SiglipForImageClassification``
    loaded (strict) with the transformed state dict gives the same logits; its tower's
    ``pooler_output`` (the pooling head, unused by the logits) moves by the joint map exactly."""
    model = tiny.siglip_cls(seed)
    sd = model.state_dict()
    canon, graph = _canonical(model)
    transform = graph.random_transform("orthogonal", torch.Generator().manual_seed(seed))
    new = graph.apply(canon, transform)
    ones = torch.ones(D, dtype=torch.float64)
    for name in VISION_STREAMS:
        dense = transform[name]
        assert isinstance(dense, AxisMap) and (dense.matrix().abs() > 1e-3).float().mean() > 0.5, name
        torch.testing.assert_close(dense.matrix() @ ones, ones)
    for k in ("classifier.weight", PROBE, f"{HEAD}.mlp.fc2.weight", "vision_model.embeddings.patch_embedding.weight"):
        assert (new[k] - sd[k]).abs().max() > 1e-2, k  # really moved
    # β of post_layernorm folds into the bias (the mean of the tokens sees it whole); no map moves it
    w, beta = sd["classifier.weight"].double(), sd[f"{POST}.bias"].double()
    torch.testing.assert_close(canon["classifier.bias"].double(), sd["classifier.bias"].double() + w @ beta)
    assert torch.equal(new["classifier.bias"], canon["classifier.bias"])
    assert _logits_gap(model, new, seed) <= TOLERANCE

    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    stock = T.SiglipForImageClassification(model.config).eval()
    stock.load_state_dict(new, strict=True)
    with torch.no_grad():
        before = model.vision_model(pixel_values=pixels).pooler_output
        after = stock.vision_model(pixel_values=pixels).pooler_output
    joint = transform["joint"]
    assert isinstance(joint, AxisMap)
    assert (after - joint.apply(before, 1)).abs().max().item() <= TOLERANCE
    assert (after - before).abs().max().item() > 1e-2


def test_classifier_without_the_pooling_head():
    """``vision_use_head: false``: no probe, no joint space; the classifier alone reads
    post_layernorm, and the vision stream is still orthogonal fixing 1."""
    torch.manual_seed(0)
    cfg = T.SiglipConfig(
        vision_config=dict(
            hidden_size=D, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, image_size=16,
            patch_size=8, num_channels=3, vision_use_head=False,
        ),
        num_labels=3,
    )  # fmt: skip
    model = tiny._randomize_norms(T.SiglipForImageClassification(cfg), 0)
    graph = graph_for(model.config, model.state_dict().keys())
    assert "joint" not in graph.spaces and not any(k.startswith(f"{HEAD}.") for k in model.state_dict())
    (post,) = [n for n in graph.norms if n.weight == f"{POST}.weight"]
    assert not isinstance(post, BypassedNorm) and post.readers == ("classifier.weight",)
    for seed in (0, 1):
        report = verify_model(model, "orthogonal", seed=seed)
        assert report.max_abs_diff <= TOLERANCE and report.classes["vision.res"] == "orthogonal (fixing 1)", report


def test_classifier_forbidden_transforms_move_the_logits(classifier):
    """Negative controls on the logits: a vision rotation that moves 1 (after canonical form), one
    fixing 1 without canonical form (refused; forced through), and one that leaves the classifier
    behind: each moves the logits far beyond the tolerance. The allowed one beside them does not."""
    sd = classifier.state_dict()
    canon, graph = _canonical(classifier)
    allowed = _rotate(graph, "vision.res", True)
    assert _logits_gap(classifier, graph.apply(canon, allowed)) <= TOLERANCE

    moves_ones = _rotate(graph, "vision.res", False)
    assert _logits_gap(classifier, graph.apply(canon, moves_ones)) > 0.1

    raw = graph_for(classifier.config, sd.keys())
    with pytest.raises(TransformError, match="not uniform"):
        raw.apply(sd, allowed)
    assert _logits_gap(classifier, raw.apply(sd, allowed, check=False)) > 0.1

    rotated = graph.apply(canon, allowed)
    assert _logits_gap(classifier, {**rotated, "classifier.weight": canon["classifier.weight"]}) > 0.1
