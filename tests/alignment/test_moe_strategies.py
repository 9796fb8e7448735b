"""Every strategy on mixture-of-experts models: B is A with its experts (and every other space)
moved, and each strategy must find them and keep B's function; the expert statistics against a
direct computation; a universe merge of three Mixtrals."""

from __future__ import annotations

import pytest
import torch

from hf_rebasin.alignment.experts import softmax_routers
from hf_rebasin.alignment.features import activation_stats
from hf_rebasin.alignment.features.lockstep import lockstep_plan, lockstep_stats
from hf_rebasin.alignment.features.moments import ExpertMoments
from hf_rebasin.alignment.strategies import REGISTRY, AlignmentData, Pair, align
from hf_rebasin.alignment.verify import example_inputs
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.universe import universe_merge
from hf_rebasin.symmetry.adapters import REGISTRY as ADAPTERS
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.spaces import ExpertSpace
from hf_rebasin.symmetry.transforms import ExpertMap
from tiny import FACTORIES

MOE = ("mixtral", "qwen2-moe", "qwen3-moe")
# gated-unit scales off: they are a separate symmetry (tests/alignment/test_learned_glu.py), and on an exact
# start their first steps move B by a rescaling that keeps its function but not its weights
LEARNED = {"learned": True, "steps": 2, "eval_every": 1, "learn_glu_scales": False}
# every registered strategy, and generalized-orthogonal's learned matching too
CASES = [(name, None) for name in REGISTRY.names] + [("generalized-orthogonal", LEARNED)]
TOLERANCE = 1e-4


def _setup(family: str, seed: int = 0):
    model = FACTORIES[family](seed).eval()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    planted = graph.random_transform("permutation", torch.Generator().manual_seed(3))
    sd_b = graph.apply(sd, planted)
    return model, sd, graph, planted, sd_b


def _data(model, n: int = 4) -> AlignmentData:
    spec = ADAPTERS.get(model.config.model_type)
    batches = [example_inputs(spec, model.config, torch.Generator().manual_seed(i)) for i in range(n)]
    return AlignmentData([{**b, "labels": b["input_ids"]} for b in batches])


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}{'-learned' if o else ''}" for n, o in CASES])
@pytest.mark.parametrize("family", MOE)
def test_strategy_recovers_planted_experts(family, name, options):
    model, sd, graph, planted, sd_b = _setup(family)
    data = _data(model)
    alignment = align(name, Pair(graph, sd, sd_b, model, rebuild(model, sd_b), data), options)
    aligned = rebuild(model, dict(alignment.aligned_b()), untie=bool(alignment.untied))
    for batch in data.batches[:2]:
        assert float((_logits(aligned, batch) - _logits(model, batch)).abs().max()) <= TOLERANCE
    experts = [n for n, s in graph.spaces.items() if isinstance(s, ExpertSpace)]
    assert experts
    if REGISTRY.get(name).identity:
        return
    back = alignment.aligned_b()
    for space in experts:
        found, moved = alignment.transform[space], planted[space]
        assert isinstance(found, ExpertMap) and isinstance(moved, ExpertMap)
        assert torch.equal(found.perm, torch.argsort(moved.perm))
    expert_tensors = [t for t in sd if ".mlp.experts." in t or t in softmax_routers(graph)]
    for t in expert_tensors:  # units inside each expert and the router rows (with the gauge) too
        assert float((back[t].double() - alignment.sd_a[t].double()).abs().max()) < 1e-5, t
    if options is not None:
        assert any("mixture-of-experts" in note for note in alignment.notes)


def test_experts_without_their_router_rows_change_the_function():
    """The negative control: the symmetry is experts *with* their router rows."""
    model, sd, _graph, _, _ = _setup("mixtral")
    batch = _data(model, 1).batches[0]
    perm = torch.tensor([2, 0, 3, 1])
    moved, both = dict(sd), dict(sd)
    for t in sd:
        if ".mlp.experts." in t:
            moved[t] = both[t] = sd[t][perm]
        elif t.endswith(".mlp.gate.weight"):
            both[t] = sd[t][perm]
    reference = _logits(model, batch)
    assert float((_logits(rebuild(model, both), batch) - reference).abs().max()) <= TOLERANCE
    assert float((_logits(rebuild(model, moved), batch) - reference).abs().max()) > 1e-2


def test_expert_moments_match_a_direct_weighted_correlation():
    g = torch.Generator().manual_seed(0)
    E, f, n = 3, 4, 50
    x, y = torch.randn(n, E * f, generator=g), torch.randn(n, E * f, generator=g)
    ra, rb = torch.rand(n, E, generator=g), torch.rand(n, E, generator=g)
    ra[ra < 0.4] = 0.0  # unrouted tokens
    moments = ExpertMoments.zeros(E, f)
    moments.update(x[:20], ra[:20], y[:20], rb[:20])  # in two batches
    moments.update(x[20:], ra[20:], y[20:], rb[20:])
    corr = moments.correlation()
    x64, y64 = x.double(), y.double()
    for a in range(E):
        for b in range(E):
            w = (ra[:, a] * rb[:, b]).double()
            xa, yb = x64[:, a * f : (a + 1) * f], y64[:, b * f : (b + 1) * f]
            mx, my = (w[:, None] * xa).sum(0) / w.sum(), (w[:, None] * yb).sum(0) / w.sum()
            cov = ((xa - mx) * w[:, None]).T @ (yb - my) / w.sum()
            sx = ((w[:, None] * (xa - mx) ** 2).sum(0) / w.sum()).sqrt()
            sy = ((w[:, None] * (yb - my) ** 2).sum(0) / w.sum()).sqrt()
            want = cov / torch.outer(sx, sy)
            assert torch.allclose(corr[a * f : (a + 1) * f, b * f : (b + 1) * f], want, atol=1e-10)


def _layer_inputs(model, batch, layer: int) -> torch.Tensor:
    """The stream the MoE block of ``layer`` reads (after post_attention_layernorm), [n, d]."""
    seen: list[torch.Tensor] = []
    norm = model.model.layers[layer].post_attention_layernorm
    handle = norm.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    try:
        _logits(model, batch)
    finally:
        handle.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


def _units_and_routing(model, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: every expert's units (act(gate x)·(up x), from the 3-D weights), the top-k
    routing weights (Mixtral: softmax, top 2, renormalised) and the routing probabilities."""
    moe = model.model.layers[layer].mlp
    w = moe.experts.gate_up_proj.detach()  # [E, 2f, d]
    f = w.shape[1] // 2
    units = torch.cat([torch.nn.functional.silu(x @ w[e, :f].T) * (x @ w[e, f:].T) for e in range(w.shape[0])], 1)
    probs = torch.softmax(x @ moe.gate.weight.detach().T, dim=-1)
    top, index = probs.topk(2, dim=-1)
    routing = torch.zeros_like(probs).scatter(1, index, top / top.sum(-1, keepdim=True))
    return units, routing, probs


def test_expert_statistics_match_a_direct_computation_and_skip_padding():
    model, _sd, graph, _, sd_b = _setup("mixtral")
    model_b = rebuild(model, sd_b)
    batch = dict(_data(model, 1).batches[0])
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -3:] = 0  # padded positions must not count
    batch["attention_mask"] = mask
    stats = activation_stats(model, model_b, graph, [batch], spaces=["layers.0.moe"], residual="none")
    keep = mask.reshape(-1).bool()
    ua, ra, pa = (t[keep] for t in _units_and_routing(model, _layer_inputs(model, batch, 0), 0))
    ub, rb, pb = (t[keep] for t in _units_and_routing(model_b, _layer_inputs(model_b, batch, 0), 0))
    want = ExpertMoments.zeros(4, ua.shape[1] // 4)
    want.update(ua, ra, ub, rb)
    got = stats.moments["layers.0.moe:units"]
    assert isinstance(got, ExpertMoments)
    assert float(got.count.sum()) == pytest.approx(int(keep.sum()))  # renormalised top-k: 1 per token
    assert torch.allclose(got.correlation(), want.correlation(), atol=1e-5)
    probs = stats.moments["layers.0.moe:experts"].correlation()
    direct = torch.corrcoef(torch.cat([pa, pb], 1).T.double())[:4, 4:]
    assert torch.allclose(probs, direct, atol=1e-5)


def test_layer_by_layer_expert_statistics_equal_whole_forwards():
    model, sd, graph, _, sd_b = _setup("qwen2-moe")
    model_b = rebuild(model, sd_b)
    batches = _data(model, 2).batches
    spaces = [n for n in graph.spaces if n != "res"]
    whole = activation_stats(model, model_b, graph, batches, spaces=spaces, residual="none")
    plan = lockstep_plan(graph, model, spaces)
    assert not isinstance(plan, str) and "layers.0.moe" in plan.spaces[0]
    seen = set()
    for layer in lockstep_stats(model, model_b, sd, sd_b, graph, plan, batches):
        for key, m in layer.stats.moments.items():
            assert torch.allclose(m.correlation(), whole.moments[key].correlation(), atol=1e-10), key
            seen.add(key)
    assert {"layers.0.moe:units", "layers.0.moe:experts"} <= seen


@pytest.mark.parametrize("name", ["weight-matching", "head-perm"])
def test_universe_merge_of_three_mixtrals(name):
    models = [FACTORIES["mixtral"](seed).eval() for seed in range(3)]
    sds = [m.state_dict() for m in models]
    graph = graph_for(models[0].config, sds[0].keys())
    data = _data(models[0])
    result = universe_merge(name, None, graph, sds, [1 / 3] * 3, models=models, data=data, iterations=2)
    batch = data.batches[0]
    for model, alignment in zip(models, result.alignments, strict=True):
        aligned = rebuild(models[0], dict(alignment.aligned_b()), untie=bool(alignment.untied))
        assert float((_logits(aligned, batch) - _logits(model, batch)).abs().max()) <= TOLERANCE
    for router in softmax_routers(graph):  # one gauge: every aligned router has the same mean row
        rows = [al.aligned_b()[router].double().mean(0) for al in result.alignments]
        assert all(torch.allclose(rows[0], r, atol=1e-6) for r in rows)
    merged = rebuild(models[0], dict(result.merged), untie=bool(result.untied))
    assert torch.isfinite(_logits(merged, batch)).all()


@pytest.mark.slow
def test_learned_universe_merge_of_three_mixtrals_keeps_one_router_gauge():
    models = [FACTORIES["mixtral"](seed).eval() for seed in range(3)]
    sds = [m.state_dict() for m in models]
    graph = graph_for(models[0].config, sds[0].keys())
    data = _data(models[0])
    result = universe_merge(
        "generalized-orthogonal", LEARNED, graph, sds, [1 / 3] * 3, models=models, data=data, iterations=1
    )
    assert any("mixture-of-experts" in note for note in result.notes)
    batch = data.batches[0]
    for model, alignment in zip(models, result.alignments, strict=True):
        aligned = rebuild(models[0], dict(alignment.aligned_b()), untie=bool(alignment.untied))
        assert float((_logits(aligned, batch) - _logits(model, batch)).abs().max()) <= TOLERANCE
    for router in softmax_routers(graph):
        rows = [al.aligned_b()[router].double().mean(0) for al in result.alignments]
        assert all(torch.allclose(rows[0], r, atol=1e-6) for r in rows)
