"""Norms that are not plain γ·x̂ + β: Gemma's RMSNorm x̂·(1 + w) (a norm offset of 1) and DINOv2's
LayerScale (a per-feature scale λ on what a sublayer writes to the residual stream).

Canonical form must fold γ = w + offset (leaving w = 0) and λ (leaving λ = 1, the writer then
centered) before any rotation of the residual stream; the negative controls show that each of
these is needed (each mistake moves the outputs by far more than 1e-3)."""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

import pytest
import torch
import transformers as T
import yaml

import tiny
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.alignment.verify import TOLERANCE, example_inputs, outputs_of, verify_model
from hf_rebasin.cli import main
from hf_rebasin.core.errors import TransformError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import REGISTRY, graph_for
from hf_rebasin.symmetry.canonical import WriterScale, canonicalize, is_canonical
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.sublayers import per_sublayer
from hf_rebasin.symmetry.transforms import AxisMap, random_orthogonal
from streamed import safetensors_of

CASES = ("gemma", "dinov2-cls", "dinov2-base")
BROKEN = 1e-3  # a negative control must move the outputs by more than this


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {case: tiny.FACTORIES[case](0) for case in CASES}


def _outputs(model: torch.nn.Module, sd: dict[str, torch.Tensor] | None = None, untie: bool = False) -> dict:
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    target = model if sd is None else rebuild(model, sd, untie=untie)
    return outputs_of(target, spec, inputs)


def _delta(model: torch.nn.Module, sd: dict[str, torch.Tensor], untie: bool = False, key: str | None = None) -> float:
    """max |Δ| of the outputs (all of them, or ``key``) of ``model`` rebuilt from ``sd``, in the same basis."""
    before, after = _outputs(model), _outputs(model, sd, untie)
    return max((after[k] - before[k]).abs().max().item() for k in before if key is None or k == key)


def _rotation(graph: SymmetryGraph, seed: int = 0) -> dict:
    """The identity everywhere but a dense rotation of the residual stream (fixing 1 when centered)."""
    t = graph.identity()
    space = graph.spaces["res"]
    fix = getattr(space, "centered", False)
    t["res"] = AxisMap(space.size, blocks=random_orthogonal(space.size, torch.Generator().manual_seed(seed), fix)[None])
    return t


# ---------------------------------------------------------------------------------------------
# the declarations


def test_gemma_norms_have_offset_one_and_dinov2_declares_its_layer_scales(models):
    gemma = models["gemma"]
    graph = graph_for(gemma.config, gemma.state_dict().keys())
    assert len(graph.norms) == 2 * gemma.config.num_hidden_layers + 1
    assert all(n.offset == 1.0 and not isinstance(n, WriterScale) for n in graph.norms)
    assert graph.spaces["res"].max_class == "orthogonal"
    dino = models["dinov2-cls"]
    dgraph = graph_for(dino.config, dino.state_dict().keys())
    scales = [n for n in dgraph.norms if isinstance(n, WriterScale)]
    assert {n.weight.rsplit(".", 2)[-2] for n in scales} == {"layer_scale1", "layer_scale2"}
    assert len(scales) == 2 * dino.config.num_hidden_layers
    for n in scales:
        assert n.bias is None and n.offset == 0.0 and len(n.readers) == 2  # the writer's weight and bias
        assert dgraph.bindings[n.weight].norm_scale  # a diagonal: permuted, never rotated
    assert all(n.offset == 0.0 for n in dgraph.norms)
    # the classifier reads [CLS, mean of patch tokens]: two copies of the stream
    assert dgraph.bindings["classifier.weight"].axes[1].parts == ("res", "res")


def test_dinov2_swiglu_and_mask_token_are_described():
    """The SwiGLU MLP (giant checkpoints) and the mask token: described, and exact under both classes."""
    model = tiny._dinov2(T.Dinov2ForImageClassification, 0, num_labels=3, use_swiglu_ffn=True)
    graph = graph_for(model.config, model.state_dict().keys())
    graph.check(model.state_dict())
    assert "dinov2.embeddings.mask_token" in graph.bindings
    assert any("down_proj" in r for n in graph.norms for r in n.readers)
    for cls in ("permutation", "orthogonal"):
        report = verify_model(model, cls, seed=1)
        assert report.max_abs_diff <= TOLERANCE, report


def test_dinov2_interpolated_position_embeddings_commute_with_the_residual_map(models):
    """A larger image than the config's: transformers interpolates the position embeddings
    bicubically over the patch grid, channel by channel, so a map of the channels still commutes."""
    model = models["dinov2-cls"]
    spec = REGISTRY.get(model.config.model_type)
    pixels = {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))}
    sd = model.state_dict()
    canon, cgraph, _ = canonicalize(graph_for(model.config, sd.keys()), sd)
    moved = cgraph.apply(canon, cgraph.random_transform("orthogonal", torch.Generator().manual_seed(4)))
    before, after = outputs_of(model, spec, pixels), outputs_of(rebuild(model, moved), spec, pixels)
    assert before["logits"].shape == (2, 5)
    assert (after["logits"] - before["logits"]).abs().max().item() <= TOLERANCE


# ---------------------------------------------------------------------------------------------
# canonical form


def test_gemma_canonical_form_leaves_the_norm_weights_at_zero(models):
    model = models["gemma"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    assert not is_canonical(graph, sd)
    canon, cgraph, untied = canonicalize(graph, sd)
    assert untied == ["lm_head.weight"]  # the final norm folds into the LM head, not the embeddings
    for norm in cgraph.norms:
        assert torch.equal(canon[norm.weight], torch.zeros_like(canon[norm.weight])), norm.weight
    assert is_canonical(cgraph, canon)
    assert _delta(model, canon, untie=True) <= TOLERANCE
    assert torch.equal(canon["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])  # √d: a scalar


def test_dinov2_canonical_form_folds_layer_scale_into_the_writer(models):
    model = models["dinov2-cls"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    canon, cgraph, _ = canonicalize(graph, sd)
    assert is_canonical(cgraph, canon)
    for i in range(model.config.num_hidden_layers):
        prefix = f"dinov2.encoder.layer.{i}"
        for scale, writer in (("layer_scale1", "attention.o_proj"), ("layer_scale2", "mlp.fc2")):
            lam = sd[f"{prefix}.{scale}.lambda1"].double()
            assert torch.equal(canon[f"{prefix}.{scale}.lambda1"], torch.ones_like(lam, dtype=torch.float32))
            w, b = sd[f"{prefix}.{writer}.weight"].double(), sd[f"{prefix}.{writer}.bias"].double()
            want_w, want_b = lam[:, None] * w, lam * b
            want_w, want_b = want_w - want_w.mean(0, keepdim=True), want_b - want_b.mean()  # then centered
            torch.testing.assert_close(canon[f"{prefix}.{writer}.weight"].double(), want_w, atol=1e-6, rtol=0)
            torch.testing.assert_close(canon[f"{prefix}.{writer}.bias"].double(), want_b, atol=1e-6, rtol=0)
    assert _delta(model, canon) <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_streamed_canonical_form_is_the_in_memory_one(models, case, tmp_path):
    """A `LazyState` (a checkpoint read tensor by tensor) gets the same bits."""
    from hf_rebasin.io.models import load_model

    model = models[case]
    model.save_pretrained(str(tmp_path))
    loaded = load_model(tmp_path, stream=True)
    assert loaded.source is not None
    lazy, _, untied_lazy = canonicalize(loaded.graph, loaded.source)
    sd, _, untied = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    assert untied_lazy == untied
    for name, t in sd.items():
        assert torch.equal(lazy[name], t), name


# ---------------------------------------------------------------------------------------------
# negative controls


def test_gemma_canonical_form_with_weight_one_moves_the_logits(models):
    """Writing w = 1 (Llama's neutral weight) doubles every norm's scale; ignoring the offset folds w
    instead of 1 + w. Both change the logits."""
    model = models["gemma"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    canon, cgraph, _ = canonicalize(graph, sd)
    ones = {k: torch.ones_like(v) if any(k == n.weight for n in cgraph.norms) else v for k, v in canon.items()}
    assert _delta(model, ones, untie=True) > BROKEN
    no_offset = dataclasses.replace(graph, norms=[dataclasses.replace(n, offset=0.0) for n in graph.norms])
    wrong, _, _ = canonicalize(no_offset, sd)
    assert _delta(model, wrong, untie=True) > BROKEN


def test_gemma_rotation_without_canonical_form_is_refused_and_wrong(models):
    model = models["gemma"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = _rotation(graph)
    with pytest.raises(TransformError, match="canonical form"):
        graph.apply(sd, t)
    # basis-free logits only (the hidden states are in the rotated basis)
    assert _delta(model, graph.apply(sd, t, check=False), key="logits") > BROKEN
    # …and after canonical form the same rotation is exact
    canon, cgraph, untied = canonicalize(graph, sd)
    assert _delta(model, cgraph.apply(canon, t), untie=bool(untied), key="logits") <= TOLERANCE


def test_dinov2_rotation_without_folding_layer_scale_moves_the_logits(models):
    model = models["dinov2-cls"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = _rotation(graph)
    norms_only = dataclasses.replace(graph, norms=[n for n in graph.norms if not isinstance(n, WriterScale)])
    canon, cgraph, _ = canonicalize(norms_only, sd)  # γ and β folded, λ left as it is
    full = dataclasses.replace(graph, ties=cgraph.ties)
    with pytest.raises(TransformError, match="canonical form"):
        full.apply(canon, t)  # λ is not uniform: refused
    assert _delta(model, full.apply(canon, t, check=False), key="logits") > BROKEN
    canon_all, cgraph_all, _ = canonicalize(graph, sd)
    assert _delta(model, cgraph_all.apply(canon_all, t), key="logits") <= TOLERANCE


# ---------------------------------------------------------------------------------------------
# alignment


@pytest.mark.parametrize("strategy", ["weight-matching", "generalized-orthogonal"])
@pytest.mark.parametrize("case", CASES)
def test_a_known_transform_is_recovered(models, case, strategy):
    """B = A under a random allowed transform (orthogonal in canonical form for generalized-orthogonal):
    aligned to A, B computes what A computes."""
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    g = torch.Generator().manual_seed(9)
    if strategy == "generalized-orthogonal":
        canon, cgraph, _ = canonicalize(graph, sd)
        sd_b = cgraph.apply(canon, cgraph.random_transform("orthogonal", g))
    else:
        sd_b = graph.apply(sd, graph.random_transform("permutation", g))
    assert max((sd_b[k] - sd[k]).abs().max().item() for k in sd) > 1e-2  # B really is in another basis
    alignment = align(strategy, Pair(graph, sd, sd_b))
    assert alignment.exact
    assert _delta(model, alignment.aligned_b(), untie=bool(alignment.untied)) <= TOLERANCE


def test_per_sublayer_streams_rename_the_fused_classifier_axis(models):
    model = models["dinov2-cls"]
    split = per_sublayer(graph_for(model.config, model.state_dict().keys()))
    last = max(int(n.split("#")[1]) for n in split.spaces if n.startswith("res#"))
    assert split.bindings["classifier.weight"].axes[1].parts == (f"res#{last}", f"res#{last}")
    lam = "dinov2.encoder.layer.0.layer_scale1.lambda1"  # joins what its writer writes: stream 1
    assert split.bindings[lam].axes == ("res#1",)
    split.check(model.state_dict())


# ---------------------------------------------------------------------------------------------
# the command line and a streamed merge


@pytest.mark.parametrize("cls", ["permutation", "orthogonal"])
@pytest.mark.parametrize("case", CASES)
def test_verify_command(models, case, cls, tmp_path, capsys):
    models[case].save_pretrained(str(tmp_path))
    capsys.readouterr()
    code = main(["verify", str(tmp_path), "--class", cls])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert "max |Δ| = " in out and "OK" in out
    if cls == "orthogonal" and case != "dinov2-base":
        assert "orthogonal" in out and "fall back" not in out
    if case == "dinov2-base" and cls == "orthogonal":  # its final norm is its output: nothing to fold into
        assert "fall back to permutation" in out and "layernorm.weight" in out


STOCK = {"gemma": T.GemmaForCausalLM, "dinov2-cls": T.Dinov2ForImageClassification, "dinov2-base": T.Dinov2Model}


@pytest.mark.parametrize("case", CASES)
def test_generalized_orthogonal_merge_streams(case, tmp_path, capsys, monkeypatch: Any):
    """A `job: merge` recipe (generalized-orthogonal, no evaluation) of two saved tiny models, run
    in memory and streamed: the same tensors, loaded by the stock class, in canonical form."""
    folders = []
    for seed in (0, 1):
        folder = tmp_path / f"{case}-{seed}"
        tiny.FACTORIES[case](seed).save_pretrained(str(folder))
        folders.append(folder)
    outputs = []
    for stream in (False, True):
        monkeypatch.setattr(
            importlib.import_module("hf_rebasin.run.plan"), "streamed", lambda _recipe, _models, s=stream: s
        )
        out = tmp_path / ("streamed" if stream else "memory")
        recipe = tmp_path / f"{out.name}.yaml"
        body = {
            "job": "merge",
            "models": [str(f) for f in folders],
            "strategy": {"name": "generalized-orthogonal"},
            "output": {"dir": str(out)},
            "cache": False,
        }
        recipe.write_text(yaml.safe_dump(body), encoding="utf-8")
        capsys.readouterr()
        code = main([str(recipe)])
        assert code == 0, capsys.readouterr().err
        record = json.loads((out / "rebasin.json").read_text())
        assert record["function_preserved"]["max_abs_diff"] <= record["function_preserved"]["tolerance"]
        outputs.append(out)
    memory, streamed = safetensors_of(outputs[0]), safetensors_of(outputs[1])
    assert memory.keys() == streamed.keys()
    for k, t in memory.items():
        assert torch.equal(streamed[k], t), k
    loaded = STOCK[case].from_pretrained(str(outputs[1])).eval()
    sd = loaded.state_dict()
    graph = graph_for(loaded.config, sd.keys())
    if graph.spaces["res"].max_class == "orthogonal":  # merged in canonical form: w = 0 (Gemma), λ = 1
        assert is_canonical(graph, sd)
    spec = REGISTRY.get(loaded.config.model_type)
    out = outputs_of(loaded, spec, example_inputs(spec, loaded.config, torch.Generator().manual_seed(0)))
    assert all(torch.isfinite(v).all() for v in out.values())


# ---------------------------------------------------------------------------------------------
# LoRA adapters moved through the canonical form

LORA_TARGETS = {
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "dinov2-cls": ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"],
}


def _stored_with_scales(graph: SymmetryGraph, canonical: dict[str, torch.Tensor], seed: int) -> dict:
    """A model as stored whose canonical form is ``canonical``: random γ (Gemma: w = γ − 1) and β put
    back into every norm, and a random λ into every LayerScale (its writers divided by it), except
    the norm of the [CLS, mean] classifier."""
    from hf_rebasin.symmetry.canonical import bias_of
    from hf_rebasin.symmetry.spaces import Fused

    g = torch.Generator().manual_seed(seed)
    sd = dict(canonical)
    for norm in graph.norms:
        axes = {r: graph.bindings[r].axes for r in norm.readers}
        if not norm.readers or any(isinstance(a, Fused) for ax in axes.values() for a in ax):
            continue
        gamma = 0.5 + torch.rand(sd[norm.weight].shape, generator=g, dtype=torch.float64)
        fold_beta = norm.bias is not None and all(bias_of(r, sd) for r in norm.readers)
        beta = 0.3 * torch.randn(gamma.shape, generator=g, dtype=torch.float64)
        for reader in norm.readers:
            axis = axes[reader].index(norm.space)
            shape = [1] * sd[reader].dim()
            shape[axis] = -1
            w = sd[reader].double() / gamma.reshape(shape)
            if fold_beta:
                bias = bias_of(reader, sd)
                assert bias is not None
                sd[bias] = (sd[bias].double() - torch.tensordot(w, beta, dims=([axis], [0]))).float()
            sd[reader] = w.float()
        sd[norm.weight] = (gamma - norm.offset).float()
        if fold_beta:
            assert norm.bias is not None
            sd[norm.bias] = beta.float()
    return sd


@pytest.mark.parametrize("case", ["gemma", "dinov2-cls"])
def test_generalized_orthogonal_moves_a_lora_adapter_through_the_canonical_form(case, tmp_path):
    """B = A with a rotated residual stream, stored with other norm scales (Gemma: weights w = γ − 1)
    and other LayerScales: the moved adapter, loaded by PEFT on B as stored, computes what the
    adapter computes on A."""
    import copy

    peft = pytest.importorskip("peft")
    from hf_rebasin.merging.lora import apply_adapter, canonical_blocker, read_adapter, save_adapter, transport_adapter

    model = tiny.FACTORIES[case](0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    torch.manual_seed(5)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[case], init_lora_weights=False)
    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)
    wrapped.save_pretrained(str(tmp_path / "lora"))
    adapter = read_adapter(tmp_path / "lora", model)
    assert canonical_blocker(adapter, graph, base) is None
    canon, cgraph, untied = canonicalize(graph, base)
    rotated = cgraph.apply(canon, cgraph.random_transform("orthogonal", torch.Generator().manual_seed(1)))
    target = _stored_with_scales(cgraph, rotated, seed=2)
    assert _delta(model, target, untie=bool(untied), key="logits") <= TOLERANCE  # the same function
    alignment = align("generalized-orthogonal", Pair(graph, target, base))
    moved, whole = transport_adapter(adapter, graph, alignment.transform, base, target, canonical_graph=alignment.graph)
    out = tmp_path / "moved"
    out.mkdir()
    save_adapter(adapter, moved, out, base_model="b", target=target, whole=whole)
    want = _outputs(model, apply_adapter(adapter, base))["logits"]
    assert (want - _outputs(model)["logits"]).abs().max().item() > 0.1  # the adapter does something
    on_b = peft.PeftModel.from_pretrained(rebuild(model, target, untie=bool(untied)), str(out)).eval()
    spec = REGISTRY.get(model.config.model_type)
    got = outputs_of(on_b, spec, example_inputs(spec, model.config, torch.Generator().manual_seed(7)))["logits"]
    assert (got - want).abs().max().item() <= TOLERANCE
