"""The gated-MLP unit scaling (`hf_rebasin.symmetry.glu`), against independent computation: a random unit
scaling (signs included) keeps the function, scaling the gate instead does not, the canonical
scaling undoes a known scaling, lets weight matching see through it, and streams from disk."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import tiny
from hf_rebasin.alignment.strategies.weight_matching import weight_matching
from hf_rebasin.alignment.verify import TOLERANCE, example_inputs, outputs_of
from hf_rebasin.core.lazy import LazyState
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.adapters import REGISTRY, graph_for
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.transforms import AxisMap

BROKEN = 1e-3
GLU_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "olmo",
    "phi3",
    "modernbert",
    "mixtral",
    "granite",
    "stablelm",
    "cohere",
    "glm4",
    "exaone4",
)
T5_GATED_CASES = ("t5", "t5-encoder", "t5-cls", "mt5")  # "t5-relu" has a plain ReLU feed-forward
GLU_CASES = sorted(c for c in tiny.FACTORIES if c.startswith(GLU_FAMILIES) or c in T5_GATED_CASES)
STREAM_CASES = [c for c in ("llama-tied-bias", "qwen3-tied", "gemma", "phi3", "modernbert-bias") if c in tiny.FACTORIES]
# a gated MLP's gate weight, by its name in each family (independent of the adapters)
GATED = re.compile(r"layers\.(\d+)\.mlp\.(gate_proj|gate_up_proj|Wi)\.weight$")
# a MoE layer's experts (transformers 5: [E, 2f, d], each expert's gate rows then its up rows) and
# Qwen2-MoE's shared expert
EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.gate_up_proj$")
SHARED = re.compile(r"layers\.(\d+)\.mlp\.shared_expert\.gate_proj\.weight$")
# T5 v1.1 / mT5: wo(act(wi_0 x) * wi_1 x), per stack
T5_GATE = re.compile(r"(encoder|decoder)\.block\.(\d+)\.layer\.\d\.DenseReluDense\.wi_0\.weight$")

_MODELS: dict[str, torch.nn.Module] = {}


def model_of(case: str) -> torch.nn.Module:
    if case not in _MODELS:
        _MODELS[case] = tiny.FACTORIES[case](0)
    return _MODELS[case]


def random_scales(graph: SymmetryGraph, seed: int) -> dict[str, torch.Tensor]:
    """|s| log-uniform in [0.2, 5], random signs, per unit of every gated MLP."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for unit in graph.glus:
        n = graph.ref_size(unit.space)
        mag = torch.exp(math.log(0.2) + torch.rand(n, generator=g, dtype=torch.float64) * math.log(25.0))
        out[unit.space] = mag * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    return out


def delta(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> float:
    """Max |Δ| of every output between ``model`` and a fresh stock model holding ``sd``."""
    spec = REGISTRY.get(model.config.model_type)
    fresh = type(model)(model.config).eval()
    fresh.load_state_dict(sd, strict=True)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    with torch.no_grad():
        before, after = outputs_of(model, spec, inputs), outputs_of(fresh, spec, inputs)
    assert before
    return max((after[k] - before[k]).abs().max().item() for k in before)


def mlp_parts(sd: dict[str, torch.Tensor]) -> dict[str, tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer, read by name as transformers computes it: (family kind, gate, up, down) in float64."""
    out = {}
    for name, w in sd.items():
        m = GATED.search(name)
        if m is None:
            continue
        prefix = name[: -len(f"{m.group(2)}.weight")]
        w = w.double()
        if m.group(2) == "gate_proj":  # down(act(gate x) * up x)
            out[m.group(1)] = (
                "split",
                w,
                sd[prefix + "up_proj.weight"].double(),
                sd[prefix + "down_proj.weight"].double(),
            )
        elif m.group(2) == "gate_up_proj":  # Phi-3: gate, up = chunk(2); up * act(gate)
            gate, up = w.chunk(2, 0)
            out[m.group(1)] = ("fused", gate, up, sd[prefix + "down_proj.weight"].double())
        else:  # ModernBERT: input, gate = Wi(x).chunk(2); Wo(act(input) * gate)
            act_in, lin = w.chunk(2, 0)
            out[m.group(1)] = ("fused", act_in, lin, sd[prefix + "Wo.weight"].double())
    for name, w in sd.items():
        if t5 := T5_GATE.search(name):
            prefix = name[: -len("wi_0.weight")]
            up, down = sd[prefix + "wi_1.weight"].double(), sd[prefix + "wo.weight"].double()
            out[f"{t5.group(1)}.{t5.group(2)}"] = ("split", w.double(), up, down)
        m = SHARED.search(name)
        if m is not None:
            prefix = name[: -len("gate_proj.weight")]
            out[f"{m.group(1)}.shared"] = (
                "split",
                w.double(),
                sd[prefix + "up_proj.weight"].double(),
                sd[prefix + "down_proj.weight"].double(),
            )
        m = EXPERTS.search(name)
        if m is None:
            continue
        down = sd[name[: -len("gate_up_proj")] + "down_proj"].double()  # [E, d, f]
        for e in range(w.shape[0]):  # expert e: down[e] @ (act(x·gate[e]ᵀ) * (x·up[e]ᵀ))
            gate, up = w[e].double().chunk(2, 0)
            out[f"{m.group(1)}.expert{e}"] = ("experts", gate, up, down[e])
    return out


def unit_layers(sd: dict[str, torch.Tensor], config: object) -> dict[str, int]:
    """Every gated MLP of a state dict, by name, with its units (read from the config, not the graph)."""
    out = {}
    for name in sd:
        if m := GATED.search(name):
            out[f"{m.group(1)}.dense"] = config.intermediate_size
        elif m := T5_GATE.search(name):
            out[f"{m.group(1)}.{m.group(2)}"] = config.d_ff
        elif m := EXPERTS.search(name):
            experts = getattr(config, "num_local_experts", None) or config.num_experts
            out[f"{m.group(1)}.experts"] = experts * (
                getattr(config, "moe_intermediate_size", None) or config.intermediate_size
            )
        elif m := SHARED.search(name):
            out[f"{m.group(1)}.shared"] = config.shared_expert_intermediate_size
    return out


# ---------------------------------------------------------------------------------------------
# the adapters declare every gated MLP


@pytest.mark.parametrize("case", sorted(tiny.FACTORIES))
def test_gated_mlp_is_declared(case):
    model = model_of(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    layers = unit_layers(sd, model.config)
    assert len(graph.glus) == len(layers), [g.space for g in graph.glus]
    assert sorted(graph.ref_size(unit.space) for unit in graph.glus) == sorted(layers.values())
    if layers:
        assert case in GLU_CASES


# ---------------------------------------------------------------------------------------------
# function preservation, and a negative control


@pytest.mark.parametrize("case", GLU_CASES)
def test_random_unit_scaling_and_balance_preserve_outputs(case):
    model = model_of(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    assert graph.glus
    scales = random_scales(graph, 3)
    scaled = glu.apply_unit_scales(graph, sd, scales)
    changed = max((scaled[k] - sd[k]).abs().max().item() for k in sd)
    assert changed > 0.1  # it really moved the weights
    assert delta(model, scaled) <= TOLERANCE
    balanced = glu.balance(graph, sd)
    assert max((balanced[k] - sd[k]).abs().max().item() for k in sd) > 0.01
    assert delta(model, balanced) <= TOLERANCE


@pytest.mark.parametrize("case", GLU_CASES)
def test_scaling_the_gate_instead_of_up_moves_the_outputs(case):
    model = model_of(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    swapped = dataclasses.replace(graph, glus=tuple(dataclasses.replace(u, gate=u.up, up=u.gate) for u in graph.glus))
    wrong = glu.apply_unit_scales(swapped, sd, random_scales(graph, 3))
    assert delta(model, wrong) > BROKEN


# ---------------------------------------------------------------------------------------------
# canonical scaling: independent check, recovery of a known scaling, idempotence


@pytest.mark.parametrize("case", GLU_CASES)
def test_balance_matches_the_formula(case):
    model = model_of(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    balanced = glu.balance(graph, sd)
    before, after = mlp_parts(sd), mlp_parts(balanced)
    assert before
    for layer, (_kind, gate, up, down) in before.items():
        s = (down.norm(dim=0) / up.norm(dim=1)).sqrt() * torch.where((up * gate).sum(1) < 0, -1.0, 1.0)
        _, gate2, up2, down2 = after[layer]
        torch.testing.assert_close(gate2, gate, atol=0, rtol=0)  # the gate is left alone
        torch.testing.assert_close(up2, s[:, None] * up, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(down2, down / s[None, :], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(up2.norm(dim=1), down2.norm(dim=0), atol=1e-5, rtol=1e-5)
        assert bool(((up2 * gate2).sum(1) >= 0).all())
    for name in sd:  # biases: the up bias follows its rows, nothing else moves
        if name.endswith(".bias"):
            m = re.search(r"layers\.(\d+)\.mlp\.(up_proj|gate_up_proj|Wi)\.bias$", name)
            if m is None:
                torch.testing.assert_close(balanced[name], sd[name], atol=0, rtol=0)
                continue
            _, gate, up, down = before[m.group(1)]
            s = ((down.norm(dim=0) / up.norm(dim=1)).sqrt() * torch.where((up * gate).sum(1) < 0, -1.0, 1.0)).float()
            b, b2 = sd[name], balanced[name]
            if m.group(2) == "up_proj":
                torch.testing.assert_close(b2, s * b, atol=1e-6, rtol=1e-6)
            else:  # fused: [gate-like | up-like] halves
                g_b, u_b = b.chunk(2)
                torch.testing.assert_close(b2, torch.cat([g_b, s * u_b]), atol=1e-6, rtol=1e-6)
    assert glu.is_balanced(graph, balanced)
    assert not glu.is_balanced(graph, sd)


@pytest.mark.parametrize("case", GLU_CASES)
def test_canonical_scaling_recovers_a_known_scaling(case):
    """A model and its randomly scaled copy (signs included) have one canonical form; the canonical
    scales differ by exactly the known scaling."""
    model = model_of(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    known = random_scales(graph, 5)
    scaled = glu.apply_unit_scales(graph, sd, known)
    a, b = glu.balance(graph, sd), glu.balance(graph, scaled)
    for k in sd:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=0)
    s_a, s_b = glu.unit_scales(graph, sd), glu.unit_scales(graph, scaled)
    for space, s in known.items():
        torch.testing.assert_close(s_b[space] * s, s_a[space], atol=1e-5, rtol=1e-5)
    again = glu.balance(graph, a)  # idempotent
    for k in sd:
        torch.testing.assert_close(again[k], a[k], atol=1e-6, rtol=0)


def test_zero_llama_units_keep_their_scale_and_bad_scales_are_refused():
    model = model_of("llama-gqa")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    graph = graph_for(model.config, sd.keys())
    sd["model.layers.0.mlp.up_proj.weight"][3] = 0
    sd["model.layers.1.mlp.down_proj.weight"][:, 5] = 0
    s = glu.unit_scales(graph, sd)
    assert s["layers.0.mlp"][3] == 1 and s["layers.1.mlp"][5] == 1
    assert bool(torch.isfinite(glu.balance(graph, sd)["model.layers.0.mlp.down_proj.weight"]).all())
    from hf_rebasin.core.errors import TransformError

    bad = random_scales(graph, 0)
    bad["layers.0.mlp"][0] = 0
    with pytest.raises(TransformError, match="nonzero"):
        glu.apply_unit_scales(graph, sd, bad)
    with pytest.raises(TransformError, match="not a gated MLP"):
        glu.apply_unit_scales(graph, sd, {"res": torch.ones(32)})


# ---------------------------------------------------------------------------------------------
# weight matching sees through the scaling once both models are balanced


def _unit_permutation(graph: SymmetryGraph, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = graph.identity()
    for unit in graph.glus:
        t[unit.space] = AxisMap(
            graph.ref_size(unit.space), index=torch.randperm(graph.ref_size(unit.space), generator=g)
        )
    return t


def _recovered(graph: SymmetryGraph, a: dict, b: dict) -> bool:
    back = graph.apply(b, weight_matching(graph, a, b, "permutation"))
    return all(torch.allclose(back[k], a[k], atol=1e-5, rtol=0) for k in a)


@pytest.mark.parametrize("seed", [0, 1])
def test_weight_matching_recovers_scaled_permuted_llama_units_when_balanced(seed):
    model = model_of("llama-gqa")
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    permuted = graph.apply(sd, _unit_permutation(graph, 11 + seed))
    scaled = glu.apply_unit_scales(graph, permuted, random_scales(graph, 21 + seed))
    assert delta(model, scaled) <= TOLERANCE  # the same function
    assert _recovered(graph, glu.balance(graph, sd), glu.balance(graph, scaled))
    # without balancing, the scaled units look unlike their originals: matching misses the permutation
    assert not _recovered(graph, sd, scaled)


# ---------------------------------------------------------------------------------------------
# streamed: a checkpoint read tensor by tensor


@pytest.mark.parametrize("case", STREAM_CASES)
def test_streamed_balance_is_the_in_memory_one(case, tmp_path):
    from hf_rebasin.io.models import load_model

    model = model_of(case)
    model.save_pretrained(str(tmp_path))
    loaded = load_model(tmp_path, stream=True)
    assert loaded.source is not None
    reads: list[str] = []

    def counted_read(name: str) -> torch.Tensor:
        reads.append(name)
        return loaded.source[name]

    source = loaded.source.derive(counted_read)
    lazy = glu.balance(loaded.graph, source)
    assert isinstance(lazy, LazyState) and reads == []  # nothing read until a tensor is asked for
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    want = glu.balance(graph, sd)

    unit = loaded.graph.glus[-1]
    mlp = {unit.gate[0], unit.up[0], unit.down[0]}
    assert torch.equal(lazy[unit.down[0]], want[unit.down[0]])
    assert set(reads) == mlp  # one layer's gated MLP, not the model
    reads.clear()
    assert torch.equal(lazy[unit.up[0]], want[unit.up[0]])
    assert reads == [unit.up[0]]  # its scales are kept
    for name in sd:
        if name in lazy:
            assert torch.equal(lazy[name], want[name]), name
    scales = random_scales(graph, 4)
    lazy_scaled, mem_scaled = (
        glu.apply_unit_scales(loaded.graph, loaded.source, scales),
        glu.apply_unit_scales(graph, sd, scales),
    )
    assert isinstance(lazy_scaled, LazyState)
    for name in sd:
        if name in lazy_scaled:
            assert torch.equal(lazy_scaled[name], mem_scaled[name]), name
