"""Decoders mergekit merges (Granite, StarCoder2, StableLM, Phi, Cohere, Falcon, GPT-BigCode,
GLM-4, Arcee, Apertus) and EXAONE 4: what is particular to each family. `test_adapters` proves every allowed transform on their tiny models; here the
family's own constraints are shown to be real (a forbidden map moves the logits) and its extras to
be active."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.alignment.verify import TOLERANCE, example_inputs, outputs_of, verify_model
from hf_rebasin.cli import main
from hf_rebasin.core.errors import TransformError, UnsupportedArchitectureError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import REGISTRY, graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import Binding, Fused, HeadSpace
from hf_rebasin.symmetry.transforms import AxisMap, HeadMap, Transform, random_orthogonal


def _logits(model: torch.nn.Module, seed: int = 7) -> torch.Tensor:
    spec = REGISTRY.get(model.config.model_type)
    return outputs_of(model, spec, example_inputs(spec, model.config, torch.Generator().manual_seed(seed)))["logits"]


def _gap(model: torch.nn.Module, sd: dict[str, torch.Tensor], untie: bool = False) -> float:
    """max |Δ logits| of ``model`` rewritten with ``sd``."""
    return float((_logits(rebuild(model, sd, untie=untie)) - _logits(model)).abs().max())


def _rotate_stream(model: torch.nn.Module, fix_ones: bool, seed: int = 1) -> float:
    """max |Δ logits| after a random rotation of the canonical stream (fixing 1 or not)."""
    sd, graph, untied = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    t = graph.identity()
    size = graph.spaces["res"].size
    blocks = random_orthogonal(size, torch.Generator().manual_seed(seed), fix_ones=fix_ones)[None]
    t["res"] = AxisMap(size, blocks=blocks)
    return _gap(model, graph.apply(sd, t, check=False), untie=bool(untied))


# ---------------------------------------------------------------------------------------------
# Granite: four scalar multipliers


def test_granite_multipliers_are_active_and_commute_with_rotations():
    """The tiny Granite's multipliers change its function (the same weights with all four at 1 give
    other logits), and a random orthogonal transform of it keeps the logits all the same."""
    model = tiny.FACTORIES["granite"](0)
    assert all(getattr(model.config, k) == v != 1.0 for k, v in tiny.GRANITE_SCALARS.items())
    plain_cfg = T.GraniteConfig(**{**model.config.to_dict(), **dict.fromkeys(tiny.GRANITE_SCALARS, 1.0)})
    plain = T.GraniteForCausalLM(plain_cfg).eval()
    plain.load_state_dict(model.state_dict())
    assert float((_logits(plain) - _logits(model)).abs().max()) > 1e-2
    report = verify_model(model, "orthogonal", seed=3)
    assert report.classes["res"] == "orthogonal"
    assert report.compared and report.max_abs_diff <= TOLERANCE


# ---------------------------------------------------------------------------------------------
# LayerNorm with bias on the stream: only rotations that fix the all-ones vector


@pytest.mark.parametrize(
    "case", ["starcoder2", "starcoder2-cls", "stablelm-parallel", "phi", "cohere", "gpt-bigcode", "gpt-bigcode-mha"]
)
def test_layernorm_stream_rotations_must_fix_ones(case):
    """Negative control: on the canonical form a rotation fixing 1 keeps the logits, a generic one
    (which LayerNorm's mean subtraction does not commute with) moves them. Cohere's LayerNorm has no
    β but subtracts the mean all the same."""
    model = tiny.FACTORIES[case](0)
    graph = graph_for(model.config, model.state_dict().keys())
    assert graph.spaces["res"].max_class == "orthogonal" and graph.spaces["res"].centered
    assert _rotate_stream(model, fix_ones=True) <= TOLERANCE
    assert _rotate_stream(model, fix_ones=False) > 1e-3


# ---------------------------------------------------------------------------------------------
# StableLM: per-head q/k LayerNorms are refused, and why


def test_stablelm_qk_layernorm_is_refused_because_heads_own_their_norms():
    """Each head's query/key LayerNorm is a module of its own: permuting heads without moving them
    (all a binding could do) moves the logits, so such a model is refused, naming the option."""
    torch.manual_seed(0)
    cfg = T.StableLmConfig(
        vocab_size=tiny.V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64, qk_layernorm=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = tiny._randomize_norms(T.StableLmForCausalLM(cfg), 0)
    sd = model.state_dict()
    with pytest.raises(UnsupportedArchitectureError, match="qk_layernorm"):
        graph_for(model.config, sd.keys())
    norms = {k: v for k, v in sd.items() if "_layernorm.norms." in k}
    plain = T.StableLmConfig(**{**cfg.to_dict(), "qk_layernorm": False})
    graph = graph_for(plain, [k for k in sd if k not in norms])
    t = graph.identity()
    ident = t["layers.0.attn"]
    assert isinstance(ident, HeadMap)
    t["layers.0.attn"] = HeadMap(torch.tensor([1, 0]), ident.q_perm, ident.qk, ident.vo)  # swap the KV groups
    moved = graph.apply({k: v for k, v in sd.items() if k not in norms}, t)
    assert _gap(model, {**moved, **norms}) > 1e-3


# ---------------------------------------------------------------------------------------------
# Phi: qk_layernorm fixes Q/K even under full rotary


def _plane_rotation(dh: int, i: int, j: int, angle: float = 1.0) -> torch.Tensor:
    """A ``[dh, dh]`` rotation of the plane of features (i, j)."""
    m = torch.eye(dh, dtype=torch.float64)
    c, s = math.cos(angle), math.sin(angle)
    m[i, i], m[j, j], m[i, j], m[j, i] = c, c, -s, s
    return m


@pytest.mark.parametrize("case, norm", [("phi-qk", "q_layernorm"), ("exaone4", "q_norm"), ("apertus", "q_norm")])
def test_qk_norms_fix_qk_under_full_rotary(case, norm):
    """Negative control: with every feature rotating, a rotation of one rotary plane (j, j + dh/2)
    is what RoPE allows, yet Phi's q_layernorm/k_layernorm (γ and β per feature, a mean over the
    head) or EXAONE 4's and Apertus' q_norm/k_norm (an RMSNorm's γ per feature) make it change the
    logits; the same rotation of V/O is exact and allowed."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    space = graph.spaces["layers.0.attn"]
    assert isinstance(space, HeadSpace) and space.qk == "fixed" and norm in space.reason
    rot = _plane_rotation(space.head_dim, 0, space.head_dim // 2).expand(space.num_kv_heads, -1, -1).clone()
    t = graph.identity()
    ident = t["layers.0.attn"]
    assert isinstance(ident, HeadMap)
    t["layers.0.attn"] = HeadMap(ident.kv_perm, ident.q_perm, rot, ident.vo)
    with pytest.raises(TransformError, match="fixes its Q/K"):
        graph.apply(sd, t)
    assert _gap(model, graph.apply(sd, t, check=False)) > 1e-3
    t["layers.0.attn"] = HeadMap(ident.kv_perm, ident.q_perm, ident.qk, rot)
    assert _gap(model, graph.apply(sd, t)) <= TOLERANCE


# ---------------------------------------------------------------------------------------------
# Cohere: interleaved rotary pairs, per-head q/k norms


def _with_inner(
    graph: SymmetryGraph,
    qk: torch.Tensor | None = None,
    kv_perm: torch.Tensor | None = None,
    head: str = "layers.0.attn",
) -> Transform:
    """The identity transform but for the heads of space ``head``: Q/K inner map ``qk`` in every KV
    head, KV heads in the order ``kv_perm``."""
    t = graph.identity()
    ident = t[head]
    assert isinstance(ident, HeadMap)
    inner = ident.qk if qk is None else qk.expand(ident.kv_perm.numel(), -1, -1).clone()
    t[head] = HeadMap(ident.kv_perm if kv_perm is None else kv_perm, ident.q_perm, inner, ident.vo)
    return t


@pytest.mark.parametrize("case", ["cohere", "cohere2"])
def test_cohere_rotary_pairs_are_interleaved(case):
    """Cohere rotates feature pairs (2j, 2j + 1): rotating Llama's plane (0, head_dim/2) in Q and K
    moves the logits (and is refused: Q/K are fixed), rotating the interleaved pair (0, 1) is exact,
    the freedom the fixed rule gives up."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    space = graph.spaces["layers.0.attn"]
    assert isinstance(space, HeadSpace) and space.qk == "fixed" and "interleaved" in space.reason
    dh = space.head_dim
    llama_plane = _with_inner(graph, _plane_rotation(dh, 0, dh // 2))
    with pytest.raises(TransformError, match="fixes its Q/K"):
        graph.apply(sd, llama_plane)
    assert _gap(model, graph.apply(sd, llama_plane, check=False)) > 1e-3
    assert _gap(model, graph.apply(sd, _with_inner(graph, _plane_rotation(dh, 0, 1)), check=False)) <= TOLERANCE


def test_cohere_qk_norms_follow_their_heads():
    """``q_norm`` / ``k_norm`` hold a γ per feature of every head (``[heads, head_dim]``): swapping the
    KV groups moves their rows with the heads (exact); the same swap with the norms left in place
    moves the logits."""
    model = tiny.FACTORIES["cohere-qk"](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = _with_inner(graph, kv_perm=torch.tensor([1, 0]))
    moved = graph.apply(sd, t)
    q_norm = "model.layers.0.self_attn.q_norm.weight"
    torch.testing.assert_close(moved[q_norm], sd[q_norm][[2, 3, 0, 1]])
    assert _gap(model, moved) <= TOLERANCE
    norms = {k: sd[k] for k in sd if k.endswith(("q_norm.weight", "k_norm.weight"))}
    assert _gap(model, {**moved, **norms}) > 1e-3


# ---------------------------------------------------------------------------------------------
# Falcon: query_key_value per KV group; ALiBi refused


@pytest.mark.parametrize("case, kv_heads", [("falcon", 2), ("falcon-sequential", 4), ("gpt-bigcode-mha", 4)])
def test_fused_qkv_is_laid_out_per_kv_group(case, kv_heads):
    """A KV-head permutation on Falcon's ``query_key_value`` (GPT-BigCode's ``c_attn`` without
    multi-query) read per KV group (its query heads | k | v) is exact; the same transform with the
    axis read as three blocks q | k | v moves the logits."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    space = graph.spaces["h.0.attn"]
    assert isinstance(space, HeadSpace) and space.num_kv_heads == kv_heads
    t = _with_inner(graph, kv_perm=torch.arange(space.num_kv_heads).flip(0), head="h.0.attn")
    assert _gap(model, graph.apply(sd, t)) <= TOLERANCE
    blocks = {
        k: Binding(k, tuple(Fused(a.parts) if isinstance(a, Fused) else a for a in b.axes), b.norm_scale)
        for k, b in graph.bindings.items()
    }
    assert _gap(model, dataclasses.replace(graph, bindings=blocks).apply(sd, t)) > 1e-3


def test_falcon_alibi_is_refused_because_slopes_pin_the_heads():
    """ALiBi's slope belongs to a head position: permuting heads (exact under rotary) moves the logits
    of an ALiBi model, so one is refused, naming the option."""
    torch.manual_seed(0)
    cfg = T.FalconConfig(
        vocab_size=tiny.V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=48,
        alibi=True, multi_query=False, parallel_attn=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = tiny._randomize_norms(T.FalconForCausalLM(cfg), 0)
    sd = model.state_dict()
    with pytest.raises(UnsupportedArchitectureError, match="alibi"):
        graph_for(model.config, sd.keys())
    graph = graph_for(T.FalconConfig(**{**cfg.to_dict(), "alibi": False}), sd.keys())
    t = _with_inner(graph, kv_perm=torch.tensor([1, 0, 3, 2]), head="h.0.attn")
    assert _gap(model, graph.apply(sd, t)) > 1e-3


# ---------------------------------------------------------------------------------------------
# GPT-BigCode: multi-query attention's one key and value serve every query head


def _rotate_c_attn(
    sd: dict[str, torch.Tensor], rot: torch.Tensor, q_heads: list[int], hd: int, d: int
) -> dict[str, torch.Tensor]:
    """Layer 0's ``c_attn`` (rows: q of every head | the one k | the one v) with ``rot`` applied to
    the one key and to the queries of ``q_heads`` (weight rows and bias)."""
    out = dict(sd)
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"):
        t = sd[name].clone().double()
        for start in [h * hd for h in q_heads] + [d]:
            t[start : start + hd] = rot @ t[start : start + hd]
        out[name] = t.to(sd[name].dtype)
    return out


def test_gpt_bigcode_multi_query_shares_one_key_across_query_heads():
    """Negative control: the graph has one K/V head; a Q/K inner rotation of it, applied to the key
    and every query head, keeps the logits (what the one K/V group's inner map is), while the same
    rotation of the key and of query head 0 alone moves them: the other heads read that key too."""
    model = tiny.FACTORIES["gpt-bigcode"](0)
    sd = model.state_dict()
    space = graph_for(model.config, sd.keys()).spaces["h.0.attn"]
    assert isinstance(space, HeadSpace) and (space.num_heads, space.num_kv_heads) == (4, 1)
    d, hd = model.config.n_embd, space.head_dim
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (d + 2 * hd, d)
    rot = random_orthogonal(hd, torch.Generator().manual_seed(2))
    assert _gap(model, _rotate_c_attn(sd, rot, [0, 1, 2, 3], hd, d)) <= TOLERANCE
    assert _gap(model, _rotate_c_attn(sd, rot, [0], hd, d)) > 1e-3


def test_gpt_bigcode_cross_attention_is_refused():
    """``add_cross_attention`` adds layers that read an encoder's stream: refused, naming the option."""
    cfg = T.GPTBigCodeConfig(
        vocab_size=tiny.V, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=False, add_cross_attention=True
    )
    model = T.GPTBigCodeForCausalLM(cfg)
    assert any("crossattention" in k for k in model.state_dict())
    with pytest.raises(UnsupportedArchitectureError, match="add_cross_attention"):
        graph_for(model.config, model.state_dict().keys())


# ---------------------------------------------------------------------------------------------
# GLM-4: interleaved rotary pairs over part of each head (norms after each sublayer: test_signed)


@pytest.mark.parametrize(
    "case, moves, exact",
    [
        # head_dim 8, features 0-3 rotate in pairs (0, 1), (2, 3); 4-7 pass through
        ("glm4", [(0, 2), (0, 4), (1, 6)], [(0, 1), (2, 3), (4, 5), (5, 7)]),
        # every feature rotates, in pairs (2j, 2j + 1)
        ("glm4-tied", [(0, 4), (1, 2)], [(0, 1), (6, 7)]),
    ],
)
def test_glm4_rotary_pairs_are_interleaved_and_partial(case, moves, exact):
    """Negative controls: a Q/K rotation of Llama's plane (j, j + rotary_dim/2), of a pair across two
    rotary pairs or across rotating and passing features moves the logits (and the fixed rule
    refuses it); an interleaved pair (2j, 2j + 1) or two passing features rotate exactly: freedoms
    the fixed rule gives up, which shows the layout is what the docstring says."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    space = graph.spaces["layers.0.attn"]
    assert isinstance(space, HeadSpace) and space.qk == "fixed" and "interleaved" in space.reason
    for i, j in moves:
        t = _with_inner(graph, _plane_rotation(space.head_dim, i, j))
        with pytest.raises(TransformError, match="fixes its Q/K"):
            graph.apply(sd, t)
        assert _gap(model, graph.apply(sd, t, check=False)) > 1e-3, (i, j)
    for i, j in exact:
        assert (
            _gap(model, graph.apply(sd, _with_inner(graph, _plane_rotation(space.head_dim, i, j)), check=False))
            <= TOLERANCE
        )


# ---------------------------------------------------------------------------------------------
# Arcee: an ungated relu² MLP, whose units only permute


def _scale_unit(sd: dict[str, torch.Tensor], prefix: str, unit: int, up: float, down: float) -> dict[str, torch.Tensor]:
    """``sd`` with unit ``unit`` of the MLP at ``prefix``: its ``up_proj`` row (and bias) × ``up``, its
    ``down_proj`` column × ``down``."""
    out = dict(sd)
    for name in (f"{prefix}.up_proj.weight", f"{prefix}.up_proj.bias"):
        if name in sd:
            out[name] = sd[name].clone()
            out[name][unit] *= up
    out[f"{prefix}.down_proj.weight"] = sd[f"{prefix}.down_proj.weight"].clone()
    out[f"{prefix}.down_proj.weight"][:, unit] *= down
    return out


@pytest.mark.parametrize("case", ["arcee", "arcee-tied-bias"])
def test_arcee_relu2_units_take_no_glu_scaling(case):
    """Negative controls: Llama's GLU freedom (up row × s, down column ÷ s) and a sign flip (× -1
    both) move the logits of relu² units; relu² is homogeneous of degree 2, so × s and ÷ s² is
    exact, which shows the units really pass through relu². The adapter declares no GLU."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    assert not graph_for(model.config, sd.keys()).glus
    mlp = "model.layers.0.mlp"
    assert _gap(model, _scale_unit(sd, mlp, 3, 2.5, 1 / 2.5)) > 1e-3
    assert _gap(model, _scale_unit(sd, mlp, 3, -1.0, -1.0)) > 1e-3
    assert _gap(model, _scale_unit(sd, mlp, 3, 2.5, 1 / 2.5**2)) <= TOLERANCE


@pytest.mark.parametrize("case", ["apertus", "apertus-tied-bias"])
def test_apertus_xielu_units_only_permute(case):
    """Negative controls: xIELU is neither odd nor homogeneous, so a unit's scale (up row × s, down
    column ÷ s or ÷ s²) or sign moves the logits; its learned scalars are active (changing one
    layer's ``alpha_p`` moves them too), so the exact unit permutations are not exact by accident."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    assert not graph_for(model.config, sd.keys()).glus
    mlp = "model.layers.0.mlp"
    for up, down in ((2.5, 1 / 2.5), (2.5, 1 / 2.5**2), (-1.0, -1.0)):
        assert _gap(model, _scale_unit(sd, mlp, 3, up, down)) > 1e-3, (up, down)
    alpha = f"{mlp}.act_fn.alpha_p"
    assert _gap(model, {**sd, alpha: sd[alpha] + 1.0}) > 1e-3


# ---------------------------------------------------------------------------------------------
# The CLI verifies saved models of each family added for mergekit's second set

# factory -> what `verify --class orthogonal` reports for the residual stream
SECOND_SET = {
    "gpt-bigcode": "orthogonal (fixing 1)",
    "gpt-bigcode-mha": "orthogonal (fixing 1)",
    "glm4": "signed-permutation",
    "arcee": "orthogonal",
    "exaone4": "signed-permutation",
    "apertus": "orthogonal",
}


@pytest.mark.parametrize("case", sorted(SECOND_SET))
def test_cli_verifies_a_saved_model(case: str, saved_model: Any, capsys: Any) -> None:
    folder: Path = saved_model(case)
    for cls in ("permutation", "orthogonal"):
        capsys.readouterr()
        assert main(["verify", str(folder), "--class", cls]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "OK: outputs unchanged" in out, out
    assert SECOND_SET[case] in out, out
