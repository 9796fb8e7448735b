"""Mixture-of-experts symmetry (Mixtral, Qwen2-MoE with a shared expert and a dense layer,
Qwen3-MoE), against the stock models: experts move with their router rows, units permute inside each
expert, a vector added to every softmax router row changes nothing; experts moved without their
router rows, units moved across experts, or a shift under a sigmoid router do change the model.
The 3-D expert tensors are read as matrices through a view, checked here against plain slicing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import transformers as T
import yaml

import tiny
from helpers import sparse_bf16_safetensors
from hf_rebasin.alignment.experts import center_routers, fit_router_shifts
from hf_rebasin.alignment.verify import example_inputs, outputs_of
from hf_rebasin.cli import main
from hf_rebasin.core.errors import TransformError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import REGISTRY, graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.glu import balance
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import ExpertSpace
from hf_rebasin.symmetry.transforms import AxisMap, ExpertMap

FAMILIES = ["mixtral", "qwen2-moe", "qwen3-moe"]
RELATIVE = 1e-5  # fp32: max |Δ logits| / max |logits|
MOVED = 1e-2
_MODELS: dict[str, torch.nn.Module] = {}


def _model(case: str) -> torch.nn.Module:
    if case not in _MODELS:
        _MODELS[case] = tiny.FACTORIES[case](0).eval()
    return _MODELS[case]


def _relative_gap(model: torch.nn.Module, sd: dict[str, torch.Tensor], untie: bool = False) -> float:
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = outputs_of(model, spec, inputs)["logits"]
        after = outputs_of(rebuild(model, sd, untie=untie), spec, inputs)["logits"]
    return float((after - before).abs().max() / before.abs().max())


def _experts(graph: SymmetryGraph) -> dict[str, ExpertSpace]:
    return {n: s for n, s in graph.spaces.items() if isinstance(s, ExpertSpace)}


@pytest.mark.parametrize("case", FAMILIES)
def test_every_sparse_layer_has_an_expert_space_and_dense_layers_stay_dense(case):
    model = _model(case)
    graph = graph_for(model.config, model.state_dict().keys())
    sparse = {k.split(".")[2] for k in model.state_dict() if k.endswith("mlp.experts.gate_up_proj")}
    assert {n.split(".")[1] for n in _experts(graph)} == sparse
    c = model.config
    for space in _experts(graph).values():
        assert space.num_experts == (getattr(c, "num_local_experts", None) or c.num_experts)
        assert space.units == (getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
        assert space.router == "softmax"
    dense = {k.split(".")[2] for k in model.state_dict() if k.endswith("mlp.gate_proj.weight")}
    assert dense == ({"1"} if case == "qwen2-moe" else set())
    assert all(f"layers.{i}.mlp" in graph.spaces for i in dense)
    if case == "qwen2-moe":
        assert graph.spaces["layers.0.shared"].size == c.shared_expert_intermediate_size


def test_decoder_sparse_step_keeps_the_other_layers_dense():
    """Qwen2-MoE with ``decoder_sparse_step: 2``: layer 0 is a dense MLP, layer 1 a MoE layer; a
    random transform of every space keeps the logits."""
    model = tiny._llama_like(
        T.Qwen2MoeForCausalLM,
        T.Qwen2MoeConfig,
        0,
        tied=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=2,
    ).eval()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    assert "layers.0.mlp" in graph.spaces and "layers.0.moe" not in graph.spaces
    assert isinstance(graph.spaces["layers.1.moe"], ExpertSpace) and "layers.1.mlp" not in graph.spaces
    moved = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(2)))
    assert _relative_gap(model, moved) <= RELATIVE


@pytest.mark.parametrize("case", FAMILIES)
def test_the_views_read_the_stacked_experts_as_transformers_splits_them(case):
    """Unit u of expert e: gate row e·f + u, up row E·f + e·f + u, down column e·f + u (transformers:
    ``gate, up = (x @ gate_up_proj[e].T).chunk(2)``, ``down_proj[e] @ h``)."""
    model = _model(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    name = "model.layers.0.mlp.experts."
    gate_up, down = sd[name + "gate_up_proj"], sd[name + "down_proj"]
    E, two_f, _ = gate_up.shape
    f = two_f // 2
    rows = graph.logical(name + "gate_up_proj", gate_up)
    cols = graph.logical(name + "down_proj", down)
    for e in range(E):
        gate, up = gate_up[e].chunk(2, 0)
        assert torch.equal(rows[e * f : (e + 1) * f], gate)
        assert torch.equal(rows[E * f + e * f : E * f + (e + 1) * f], up)
        assert torch.equal(cols[:, e * f : (e + 1) * f], down[e])
    assert torch.equal(graph.stored(name + "gate_up_proj", rows), gate_up)
    assert torch.equal(graph.stored(name + "down_proj", cols), down)


@pytest.mark.parametrize("case", FAMILIES)
def test_an_expert_map_moves_experts_as_transformers_indexes_them(case):
    """New expert e is old expert perm[e], its unit i old unit inner[e, i]; router row e old row perm[e]."""
    model = _model(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    transform = graph.identity()
    space = _experts(graph)["layers.0.moe"]
    m = ExpertMap(torch.tensor([2, 0, 3, 1]), torch.stack([torch.randperm(space.units) for _ in range(4)]))
    transform["layers.0.moe"] = m
    out = graph.apply(sd, transform)
    name = "model.layers.0.mlp."
    f = space.units
    for e in range(4):
        old = int(m.perm[e])
        gate, up = sd[name + "experts.gate_up_proj"][old].chunk(2, 0)
        new_gate, new_up = out[name + "experts.gate_up_proj"][e].chunk(2, 0)
        assert torch.equal(new_gate, gate[m.inner[e]]) and torch.equal(new_up, up[m.inner[e]])
        assert torch.equal(out[name + "experts.down_proj"][e], sd[name + "experts.down_proj"][old][:, m.inner[e]])
        assert torch.equal(out[name + "gate.weight"][e], sd[name + "gate.weight"][old])
    assert f == m.inner.shape[1]


@pytest.mark.parametrize("cls", ["permutation", "orthogonal"])
@pytest.mark.parametrize("case", FAMILIES)
def test_experts_units_and_a_router_shift_keep_the_logits(case, cls):
    """Every space at random (experts, units, heads, residual; a random shift of every router),
    rotations of the residual in canonical form, gated units balanced: logits within 1e-5 relative."""
    model = _model(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    untie = False
    if cls == "orthogonal":
        sd, graph, untied = canonicalize(graph, sd)
        sd, untie = balance(graph, sd), bool(untied)
    transform = graph.random_transform(cls, torch.Generator().manual_seed(3))
    for name in _experts(graph):
        m = transform[name]
        assert isinstance(m, ExpertMap) and m.shift is not None and float(m.shift.abs().max()) > 0.1
        assert not torch.equal(m.perm, torch.arange(len(m.perm)))
    moved = graph.apply(sd, transform)
    router = "model.layers.0.mlp.gate.weight"
    assert float((moved[router] - sd[router]).abs().max()) > 0.1
    assert _relative_gap(model, moved, untie) <= RELATIVE


@pytest.mark.parametrize("case", FAMILIES)
def test_experts_moved_without_their_router_rows_change_the_model(case):
    model = _model(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    transform = graph.identity()
    for name, space in _experts(graph).items():
        transform[name] = ExpertMap(torch.roll(torch.arange(space.num_experts), 1), transform[name].inner)
    moved = graph.apply(sd, transform)
    for name in _experts(graph):
        for router in graph.routers(name):
            moved[router] = sd[router]  # the router rows stay behind
    assert _relative_gap(model, moved) > MOVED


@pytest.mark.parametrize("case", FAMILIES)
def test_units_moved_across_experts_change_the_model(case):
    """The experts' units as one plain axis (a dense-MLP view of the layer): an AxisMap for an
    expert space is refused, and a swap of unit 0 of expert 0 with unit 0 of expert 1 (gate, up and
    down alike, as a dense MLP would allow) moves the logits."""
    model = _model(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    name, space = next(iter(_experts(graph).items()))
    n = space.num_experts * space.units
    with pytest.raises(TransformError, match="needs a ExpertMap"):
        graph.apply(sd, {name: AxisMap(n, index=torch.randperm(n))})
    swap = torch.arange(n)
    swap[[0, space.units]] = swap[[space.units, 0]]
    mixed = dict(sd)
    for tensor, axis, role, offset in graph.users(name):
        if role != "units":
            continue
        t = graph.logical(tensor, sd[tensor]).clone()
        part = t.narrow(axis, offset, n)
        part.copy_(part.index_select(axis, swap))
        mixed[tensor] = graph.stored(tensor, t)
    assert _relative_gap(model, mixed) > MOVED


def test_a_shift_of_a_sigmoid_router_is_refused_and_would_change_it():
    model = _model("mixtral")
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sigmoid = dataclasses.replace(
        graph,
        spaces={
            n: dataclasses.replace(s, router="sigmoid") if isinstance(s, ExpertSpace) else s
            for n, s in graph.spaces.items()
        },
    )
    transform = sigmoid.random_transform("permutation", torch.Generator().manual_seed(1))
    assert all(transform[n].shift is None for n in _experts(sigmoid))  # no gauge drawn
    space = "layers.0.moe"
    shifted = {space: dataclasses.replace(transform[space], shift=torch.ones(model.config.hidden_size))}
    with pytest.raises(TransformError, match="sigmoid router"):
        sigmoid.apply(sd, shifted)
    assert center_routers(sigmoid, sd) is sd  # no gauge: routers compared as stored


@pytest.mark.parametrize("case", FAMILIES)
def test_centring_and_refitting_the_routers_is_exact_and_gives_back_a_mean_row(case):
    model = _model(case)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    centred = center_routers(graph, sd)
    router = "model.layers.0.mlp.gate.weight"
    assert float(centred[router].mean(0).abs().max()) < 1e-6
    assert float(sd[router].mean(0).abs().max()) > 0.05
    assert _relative_gap(model, dict(centred)) <= RELATIVE
    # B = A in another gauge (its routers centred): the fitted shift gives A's routers back exactly
    fitted = fit_router_shifts(graph, sd, centred, graph.identity())
    back = graph.apply(centred, fitted)
    for name in _experts(graph):
        for r in graph.routers(name):
            torch.testing.assert_close(back[r], sd[r], atol=1e-6, rtol=0)


def _sparse_mixtral(folder: Path) -> None:
    """A Mixtral-8x7B-shape checkpoint as its files' headers state it (transformers' default
    MixtralConfig, per-expert tensors as save_pretrained writes them), the data left sparse: what the
    dry run reads, without 87 GiB on disk."""
    folder.mkdir(parents=True)
    c = T.MixtralConfig()
    c.save_pretrained(str(folder))
    d, f, E, V = c.hidden_size, c.intermediate_size, c.num_local_experts, c.vocab_size
    kv = c.num_key_value_heads * (d // c.num_attention_heads)
    shapes: dict[str, list[int]] = {
        "model.embed_tokens.weight": [V, d],
        "lm_head.weight": [V, d],
        "model.norm.weight": [d],
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + f"self_attn.{x}_proj.weight": [d if x in "qo" else kv, d] for x in "qkvo"}
        shapes |= {p + "input_layernorm.weight": [d], p + "post_attention_layernorm.weight": [d]}
        shapes[p + "block_sparse_moe.gate.weight"] = [E, d]
        for j in range(E):
            q = p + f"block_sparse_moe.experts.{j}."
            shapes |= {q + "w1.weight": [f, d], q + "w3.weight": [f, d], q + "w2.weight": [d, f]}
    sparse_bf16_safetensors(folder / "model.safetensors", shapes)


def test_a_mixtral_8x7b_plan_states_its_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Streamed weight matching of two Mixtral-8x7B: each stacked [8, 28672, 4096] expert tensor is
    held in float32 copies (the factors of the experts' unit view among them), and one layer's
    8 × 14336 expert units are paired one f×f block at a time (the whole view would be 98 GiB):
    the dry run says so."""
    for name in ("a", "b"):
        _sparse_mixtral(tmp_path / name)
    recipe = tmp_path / "r.yaml"
    body = {"job": "merge", "models": [str(tmp_path / "a"), str(tmp_path / "b")], "strategy": "weight-matching"}
    recipe.write_text(yaml.safe_dump({**body, "output": {"dir": str(tmp_path / "out")}}), encoding="utf-8")
    assert main([str(recipe), "--dry-run", "--no-memory-check"]) == 0
    text = capsys.readouterr().out
    assert "46,702.8M parameters" in text
    match = re.search(r"estimated peak ([\d.]+) GiB", text)
    assert match is not None
    blocks = 3 * 8 * 14336**2 / 2**30  # one expert pair's f×f block being solved, float64
    stacked = 6 * 4 * 8 * 2 * 14336 * 4096 / 2**30  # float32 copies of one stacked expert tensor
    assert blocks + stacked < float(match.group(1)) < blocks + stacked + 1.5  # and the interpreter
    assert "the 8×14336 expert units of one layer paired one 14336×14336 block at a time" in text


def test_the_unit_view_of_an_expert_space_is_its_blocks_as_the_weights_give_them():
    """`ExpertBlocks` (the unit view kept as factors) against the products of the stacked tensors:
    block (a, b) is Σ over gate, up and down of A's expert a units against B's expert b units."""
    from hf_rebasin.alignment.features import WeightViews
    from hf_rebasin.alignment.features.weights import ExpertBlocks

    sd_a, sd_b = tiny.mixtral(0).state_dict(), tiny.mixtral(1).state_dict()
    graph = graph_for(_model("mixtral").config, sd_a.keys())
    views = WeightViews(graph, sd_a, sd_b)(graph.identity(), "layers.0.moe")
    blocks = views["units"]
    assert isinstance(blocks, ExpertBlocks)
    name = "model.layers.0.mlp.experts."
    ga, ua = sd_a[name + "gate_up_proj"].double().chunk(2, 1)
    gb, ub = sd_b[name + "gate_up_proj"].double().chunk(2, 1)
    da, db = sd_a[name + "down_proj"].double(), sd_b[name + "down_proj"].double()
    for a in range(4):
        for b in range(4):
            want = ga[a] @ gb[b].T + ua[a] @ ub[b].T + da[a].T @ db[b]
            torch.testing.assert_close(blocks.block(a, b), want, rtol=1e-5, atol=1e-5)
    router = (
        sd_a[name[: -len("experts.")] + "gate.weight"].double()
        @ sd_b[name[: -len("experts.")] + "gate.weight"].double().T
    )
    torch.testing.assert_close(views["experts"], router, rtol=1e-5, atol=1e-5)
    f = ga.shape[1]
    m = ExpertMap(torch.tensor([1, 3, 0, 2]), torch.stack([torch.randperm(f) for _ in range(4)]))
    want_value = sum(
        float(
            (ga[a] @ gb[int(m.perm[a])].T + ua[a] @ ub[int(m.perm[a])].T + da[a].T @ db[int(m.perm[a])])[
                torch.arange(f), m.inner[a]
            ].sum()
        )
        for a in range(4)
    )
    assert blocks.value(m) == pytest.approx(want_value, rel=1e-6)
