"""Qwen3, Phi-3, GPT-NeoX, StableLM, Phi and Cohere: head spaces whose Q/K inner maps are fixed (q/k
norms, partial or interleaved rotary), fused projections (q | k | v with fewer K/V heads, gate | up,
q | k | v per head) and a parallel residual. `test_adapters` proves every allowed transform; here the
forbidden ones really move the outputs, every strategy keeps Q/K inner maps the identity, and the
CLI verifies and merges them."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml

import tiny
from hf_rebasin.alignment.strategies import AlignmentData, Pair, align
from hf_rebasin.alignment.strategies.engines.invertible import invertible_inner
from hf_rebasin.alignment.strategies.engines.maps import LearnedMaps, LearnedSettings
from hf_rebasin.alignment.verify import TOLERANCE, example_inputs, outputs_of
from hf_rebasin.cli import main
from hf_rebasin.core.errors import StrategyOptionError, TransformError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import REGISTRY, graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import Binding, Fused, HeadSpace
from hf_rebasin.symmetry.sublayers import is_per_sublayer, per_sublayer, stream_of
from hf_rebasin.symmetry.transforms import (
    HeadMap,
    Transform,
    is_identity_inner,
    random_head_map,
    random_invertible_head_map,
    rotary_plane_rotations,
)

FAMILIES = ["qwen3-tied", "phi3", "gpt-neox", "stablelm", "phi", "cohere-qk"]
# one sublayer per layer: attention and MLP read one stream
PARALLEL = {"gpt-neox", "stablelm-parallel", "phi", "cohere", "cohere-qk", "falcon", "falcon-mqa"}
DATA_FREE = ["weight-matching", "transfusion", "generalized-orthogonal"]
ATTN = "layers.0.attn"
_MODELS: dict[str, torch.nn.Module] = {}


def _model(case: str) -> torch.nn.Module:
    if case not in _MODELS:
        _MODELS[case] = tiny.FACTORIES[case](0).eval()
    return _MODELS[case]


def _logits_gap(model: torch.nn.Module, sd: dict[str, torch.Tensor], untie: bool = False) -> float:
    """max |Δ logits| of ``model`` rewritten with ``sd`` (same basis for the logits)."""
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before = outputs_of(model, spec, inputs)["logits"]
    after = outputs_of(rebuild(model, sd, untie=untie), spec, inputs)["logits"]
    return float((after - before).abs().max())


def _with_qk(graph: SymmetryGraph, qk: torch.Tensor, vo: torch.Tensor | None = None) -> Transform:
    """The identity transform but for layer 0's inner maps: ``qk`` in every KV head (and ``vo``)."""
    t = graph.identity()
    ident = t[ATTN]
    assert isinstance(ident, HeadMap)
    g = ident.kv_perm.numel()
    inner = ident.vo if vo is None else vo.expand(g, *vo.shape).clone()
    t[ATTN] = HeadMap(ident.kv_perm, ident.q_perm, qk.expand(g, *qk.shape).clone(), inner)
    return t


def _plane(dh: int, i: int, j: int, angle: float = math.pi / 3) -> torch.Tensor:
    """A ``[dh, dh]`` rotation of the plane of features (i, j)."""
    m = torch.eye(dh, dtype=torch.float64)
    c, s = math.cos(angle), math.sin(angle)
    m[i, i], m[j, j], m[i, j], m[j, i] = c, c, -s, s
    return m


# ---------------------------------------------------------------------------------------------
# The graphs


def test_qk_rule_per_family():
    want = {
        "qwen3-tied": ("fixed", "q_norm"),
        "qwen3-untied": ("fixed", "q_norm"),
        "phi3": ("fixed", "4 of 8"),
        "phi3-tied": ("planes", ""),  # full rotary: the rotary planes stay free
        "gpt-neox": ("fixed", "2 of 8"),
        "gpt-neox-sequential": ("fixed", "2 of 8"),
        "stablelm": ("fixed", "2 of 8"),
        "stablelm-parallel": ("fixed", "2 of 8"),
        "phi": ("fixed", "4 of 8"),
        "phi-qk": ("fixed", "q_layernorm"),  # full rotary: the q/k norms fix Q/K
        "cohere": ("fixed", "interleaved"),  # rotary pairs (2j, 2j + 1), not (j, j + head_dim/2)
        "cohere2": ("fixed", "interleaved"),
    }
    for case, (mode, reason) in want.items():
        model = _model(case)
        graph = graph_for(model.config, model.state_dict().keys())
        space = graph.spaces[ATTN]
        assert isinstance(space, HeadSpace) and space.rotary and space.qk == mode, case
        assert reason in space.reason, case
    qwen3 = graph_for(_model("qwen3-tied").config, _model("qwen3-tied").state_dict().keys())
    assert qwen3.spaces[ATTN].head_dim == 16  # from the config, not hidden / heads
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3.invariant  # per head, never on the stream
    assert qwen3.spaces["res"].max_class == "orthogonal"  # the q/k norms do not limit the stream
    assert HeadSpace("a", 4, 2, 8, rotary=True).qk == "planes" and HeadSpace("a", 4, 2, 8).qk == "free"


def test_fused_qkv_with_fewer_kv_heads_and_gate_up_share_one_space():
    model = _model("phi3")
    graph = graph_for(model.config, model.state_dict().keys())
    space = graph.spaces[ATTN]
    assert space.num_kv_heads == 2 and space.num_heads == 4
    qkv = graph.bindings["model.layers.0.self_attn.qkv_proj.weight"].axes[0]
    assert isinstance(qkv, Fused) and graph.axis_size(qkv) == 32 + 16 + 16
    uses = [(a, off) for t, a, _r, off in graph.users("layers.0.mlp") if t.endswith("gate_up_proj.weight")]
    assert uses == [(0, 0), (0, 48)]  # gate rows, then up rows: both the MLP's units


# ---------------------------------------------------------------------------------------------
# Negative controls: forbidden transforms move the outputs


def test_qwen3_qk_plane_rotation_is_refused_and_wrong():
    """q/k norms scale each feature of a head: even a rotation of one rotary plane (exact under RoPE
    alone, as Llama proves) changes the scores; the same rotation on V/O is exact."""
    model = _model("qwen3-untied")
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    dh = graph.spaces[ATTN].head_dim
    rot = _plane(dh, 0, dh // 2)
    bad = _with_qk(graph, rot)
    with pytest.raises(TransformError, match="fixes its Q/K"):
        graph.apply(sd, bad)
    assert _logits_gap(model, graph.apply(sd, bad, check=False)) > 1e-3
    assert _logits_gap(model, graph.apply(sd, _with_qk(graph, torch.arange(dh), rot))) <= TOLERANCE
    # the very same map is allowed without q/k norms (Llama)
    llama = _model("llama-gqa")
    lgraph = graph_for(llama.config, llama.state_dict().keys())
    assert _logits_gap(llama, lgraph.apply(llama.state_dict(), _with_qk(lgraph, rot))) <= TOLERANCE


@pytest.mark.parametrize("case", ["phi3", "gpt-neox", "stablelm", "phi"])
def test_partial_rotary_refuses_rotations_that_mix_rotated_and_pass_through_features(case):
    """Partial rotary: the full-head rotary pairing (j, j + head_dim/2) puts a rotated feature and a
    pass-through one in a "plane": rotating it (what `planes` would allow) changes the scores, and
    so does a permutation that swaps a rotated feature with a pass-through one. Rotating a true
    rotary plane and permuting only pass-through features (in Q and K alike) is exact: the
    conservative `fixed` rule gives that freedom up."""
    model = _model(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    dh = graph.spaces[ATTN].head_dim
    rd = REGISTRY.get(model.config.model_type).dims(model.config)["rotary_dim"]
    assert 0 < rd < dh
    whole_head = rotary_plane_rotations(torch.full((1, dh // 2), math.pi / 3, dtype=torch.float64))[0]
    with pytest.raises(TransformError, match="partial rotary"):
        graph.apply(sd, _with_qk(graph, whole_head))
    assert _logits_gap(model, graph.apply(sd, _with_qk(graph, whole_head), check=False)) > 1e-3
    swap = torch.arange(dh)
    swap[[0, rd]] = swap[[rd, 0]]  # a rotated feature for a pass-through one
    assert _logits_gap(model, graph.apply(sd, _with_qk(graph, swap), check=False)) > 1e-3
    # exact, though refused: a true rotary plane (0, rd/2) rotated, pass-through features permuted
    keep = (
        _plane(dh, 0, rd // 2)
        @ torch.eye(dh, dtype=torch.float64)[torch.cat([torch.arange(rd), dh - 1 - torch.arange(dh - rd)])]
    )
    assert _logits_gap(model, graph.apply(sd, _with_qk(graph, keep), check=False)) <= TOLERANCE


def test_gpt_neox_qkv_layout_is_per_head():
    """A head permutation on `query_key_value` read as per-head q | k | v is exact; the same
    transform with the axis read as three blocks q | k | v (GPT-2's layout) breaks the model."""
    model = _model("gpt-neox")
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    g = torch.Generator().manual_seed(3)
    t = graph.identity()
    t[ATTN] = random_head_map(graph.spaces[ATTN], "permutation", g)  # type: ignore[arg-type]
    assert not t[ATTN].is_identity()
    assert _logits_gap(model, graph.apply(sd, t)) <= TOLERANCE
    blocks = {
        k: Binding(k, tuple(Fused(a.parts) if isinstance(a, Fused) else a for a in b.axes), b.norm_scale)
        for k, b in graph.bindings.items()
    }
    wrong = dataclasses.replace(graph, bindings=blocks)
    assert _logits_gap(model, wrong.apply(sd, t)) > 1e-3


def test_interleaved_parts_are_read_per_head():
    """`SymmetryGraph.part` gathers one role of a per-head fused axis in its usual layout."""
    model = _model("gpt-neox")
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    name = "gpt_neox.layers.0.attention.query_key_value.weight"
    w = sd[name]
    per_head = w.reshape(4, 3, 8, -1)  # [head, q/k/v, feature, in]
    for i, (_t, axis, role, offset) in enumerate(u for u in graph.users(ATTN) if u[0] == name):
        assert role == "qkv"[i]
        torch.testing.assert_close(graph.part(name, w, axis, offset, 32), per_head[:, i].reshape(32, -1))


# ---------------------------------------------------------------------------------------------
# Strategies keep Q/K inner maps the identity


def _transformed(case: str, strategy: str, seed: int = 0):
    """(model, graph, A, A in the strategy's form, B = a random allowed transform of it)."""
    model = _model(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    g = torch.Generator().manual_seed(seed)
    if strategy == "generalized-orthogonal":
        ref, cgraph, _ = canonicalize(graph, sd)
        return model, graph, sd, ref, cgraph.apply(ref, cgraph.random_transform("orthogonal", g))
    return model, graph, sd, sd, graph.apply(sd, graph.random_transform("permutation", g))


def _fixed_heads(graph: SymmetryGraph) -> list[str]:
    return [n for n, s in graph.spaces.items() if isinstance(s, HeadSpace) and s.qk == "fixed"]


@pytest.mark.parametrize("strategy", DATA_FREE)
@pytest.mark.parametrize("case", FAMILIES)
def test_data_free_strategies_recover_a_transform_with_fixed_qk(case, strategy):
    model, graph, sd, ref, sd_b = _transformed(case, strategy)
    assert max(float((sd_b[k] - ref[k]).abs().max()) for k in ref) > 1e-2
    alignment = align(strategy, Pair(graph, sd, sd_b))
    assert alignment.exact
    heads = _fixed_heads(alignment.graph)
    assert heads
    for name in heads:
        m = alignment.transform[name]
        assert isinstance(m, HeadMap) and is_identity_inner(m.qk), name
    aligned = dict(alignment.aligned_b())  # applied with the class checks on
    assert max(float((aligned[k] - alignment.sd_a[k]).abs().max()) for k in aligned) < 1e-5
    assert _logits_gap(model, aligned, untie=bool(alignment.untied)) <= TOLERANCE


@pytest.mark.parametrize("case", FAMILIES)
def test_unrelated_models_align_with_fixed_qk_and_keep_b_function(case):
    """Two different seeds: nothing to recover, but every Q/K inner map stays the identity and B's
    function is kept (orthogonal maps, invertible V/O maps)."""
    a, b = _model(case), tiny.FACTORIES[case](1).eval()
    graph = graph_for(a.config, a.state_dict().keys())
    for strategy, options in (
        ("generalized-orthogonal", {"iterations": 2}),
        ("generalized-orthogonal", {"inner": "invertible", "iterations": 2}),
    ):
        alignment = align(strategy, Pair(graph, a.state_dict(), b.state_dict()), options)
        for name in _fixed_heads(alignment.graph):
            assert is_identity_inner(alignment.transform[name].qk), (strategy, options, name)  # type: ignore[union-attr]
        spec = REGISTRY.get(a.config.model_type)
        inputs = example_inputs(spec, a.config, torch.Generator().manual_seed(2))
        got = outputs_of(rebuild(a, dict(alignment.aligned_b()), untie=bool(alignment.untied)), spec, inputs)
        assert float((got["logits"] - outputs_of(b, spec, inputs)["logits"]).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("case", FAMILIES)
def test_head_perm_and_learned_maps_keep_qk_fixed(case):
    """Activation matching reads q / k from the fused outputs (per head for GPT-NeoX) and keeps Q/K
    the identity; invertible refinement and learned matching leave them alone."""
    model = _model(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sd_b = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(4)))
    spec = REGISTRY.get(model.config.model_type)
    data = AlignmentData([example_inputs(spec, model.config, torch.Generator().manual_seed(i)) for i in range(3)])
    for qk in ("separate", "shared"):
        alignment = align(
            "head-perm", Pair(graph, sd, sd_b, model, rebuild(model, sd_b), data), {"qk": qk, "residual": "last"}
        )
        assert alignment.exact
        assert max(float((alignment.aligned_b()[k] - sd[k]).abs().max()) for k in sd) < 1e-6
        assert all(is_identity_inner(alignment.transform[n].qk) for n in _fixed_heads(graph))  # type: ignore[union-attr]
    ref, cgraph, _ = canonicalize(graph, sd)
    g = torch.Generator().manual_seed(5)
    shear = cgraph.identity()
    for name in _fixed_heads(cgraph):
        shear[name] = random_invertible_head_map(cgraph.spaces[name], g)  # type: ignore[arg-type]
        assert is_identity_inner(shear[name].qk)  # type: ignore[union-attr]
    fixed = invertible_inner(cgraph, ref, cgraph.apply(ref, shear), cgraph.identity())
    for name in _fixed_heads(cgraph):
        assert fixed[name].invertible and is_identity_inner(fixed[name].qk)  # type: ignore[union-attr]
    settings = LearnedSettings(steps=1, lr=0.1, sinkhorn=False, temperature=1.0, seed=0)
    for invertible in (False, True):
        maps = LearnedMaps(
            cgraph, cgraph.random_transform("orthogonal", g), dataclasses.replace(settings, invertible=invertible)
        )
        learnable = set(maps.orth) | set(maps.free)
        key = maps.keys[ATTN]
        assert f"{key}_vo" in learnable and not {f"{key}_qk", f"{key}_planes"} & learnable
        assert is_identity_inner(maps.final()[ATTN].qk)  # type: ignore[union-attr]


def test_ignore_heads_is_refused_for_per_head_qkv():
    model = _model("gpt-neox")
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    spec = REGISTRY.get(model.config.model_type)
    data = AlignmentData([example_inputs(spec, model.config, torch.Generator().manual_seed(0))])
    with pytest.raises(StrategyOptionError, match="per head"):
        align("head-perm", Pair(graph, sd, sd, model, model, data), {"heads": "ignore-heads"})


# ---------------------------------------------------------------------------------------------
# Parallel residual: both sublayers read the stream that enters the layer


@pytest.mark.parametrize(
    "case",
    [
        "gpt-neox",
        "gpt-neox-sequential",
        "llama-gqa",
        "stablelm",
        "stablelm-parallel",
        "phi",
        "cohere-qk",
        "falcon",
        "falcon-mqa",
        "falcon-sequential",
    ],
)
def test_streams_follow_the_data_flow(case):
    """Whatever order the modules run in, the stream a norm reads is the embeddings plus the outputs
    of every writer on an earlier stream: with a parallel residual the MLP's norm reads the stream
    the attention reads, not the one the attention writes."""
    model = _model(case)
    graph = graph_for(model.config, model.state_dict().keys())
    streams = stream_of(graph, "res")
    module = {t.rsplit(".", 1)[0]: s for t, s in streams.items()}
    norms = {n.weight.rsplit(".", 1)[0] for n in graph.norms}
    writers = set(graph.embeddings) | {w for sub in graph.sublayers for w in sub.writes}
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str, reads: bool):
        def run(_m: Any, args: tuple[Any, ...], out: Any) -> None:
            seen[name] = (args[0] if reads else out[0] if isinstance(out, tuple) else out).detach().double()

        return run

    handles = [m.register_forward_hook(hook(n, n in norms)) for n, m in model.named_modules() if n in norms | writers]
    spec = REGISTRY.get(model.config.model_type)
    with torch.no_grad():
        model(**example_inputs(spec, model.config, torch.Generator().manual_seed(0)))
    for h in handles:
        h.remove()
    for norm in norms:
        want = sum(seen[w] for w in writers if module[w] <= module[norm])
        torch.testing.assert_close(seen[norm], want, atol=1e-5, rtol=1e-5, msg=norm)
    parallel = case in PARALLEL
    assert max(streams.values()) == (1 if parallel else 2) * model.config.num_hidden_layers
    ln2 = "gpt_neox.layers.1.post_attention_layernorm.weight"
    if case.startswith("gpt-neox"):
        assert streams[ln2] == (1 if parallel else 3)


@pytest.mark.parametrize(
    "case",
    [
        "gpt-neox",
        "gpt-neox-sequential",
        "phi3",
        "stablelm",
        "stablelm-parallel",
        "phi",
        "cohere",
        "falcon",
        "falcon-sequential",
    ],
)
def test_matching_recovers_a_permutation_per_stream(case):
    """Residual maps per sublayer (transport): one permutation per stream, per-head q | k | v and
    fused gate | up included, is recovered exactly."""
    model = _model(case)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    split = per_sublayer(graph)
    assert len([n for n in split.spaces if "#" in n]) == (3 if case in PARALLEL else 5)
    target = split.apply(base, split.random_transform("permutation", torch.Generator().manual_seed(1)))
    alignment = align("weight-matching", Pair(graph, target, base), {"residual_maps": "per-sublayer"})
    assert is_per_sublayer(alignment.graph)
    assert max(float((alignment.aligned_b()[k] - target[k]).abs().max()) for k in target) < 1e-6


# ---------------------------------------------------------------------------------------------
# The CLI: verify a saved model, merge two saved models streamed


@pytest.mark.parametrize("case", FAMILIES)
def test_cli_verifies_and_streams_a_merge(case, saved_model, tmp_path: Path, capsys: Any):
    folder = saved_model(case)
    for cls in ("permutation", "orthogonal"):
        capsys.readouterr()
        assert main(["verify", str(folder), "--class", cls]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "OK: outputs unchanged" in out and "Q/K" in out and "fixed" in out, out
    recipe = tmp_path / "merge.yaml"
    body = {
        "job": "merge",
        "models": [str(folder), str(saved_model(case, seed=1))],
        "strategy": {"name": "weight-matching"},
        "output": {"dir": str(tmp_path / "out")},
        "cache": False,
    }
    recipe.write_text(yaml.safe_dump(body), encoding="utf-8")
    capsys.readouterr()
    assert main([str(recipe)]) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text())
    assert any("weights streamed" in n for n in record["notes"]), record["notes"]
    assert record["function_preserved"]["max_abs_diff"] <= record["function_preserved"]["tolerance"]
    merged = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(merged) is type(_model(case))
    ids = torch.randint(0, tiny.V, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(merged(input_ids=ids).logits).all()
