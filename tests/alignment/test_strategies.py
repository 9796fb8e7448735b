"""Every function-preserving strategy recovers a known transform, exactly and under noise."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import tiny
from hf_rebasin.alignment.features import activation_stats
from hf_rebasin.alignment.solvers import lap
from hf_rebasin.alignment.strategies import REGISTRY, AlignmentData, Pair, align, get_strategy
from hf_rebasin.alignment.strategies.base import Strategy, StrategyRegistry
from hf_rebasin.alignment.strategies.engines.invertible import invertible_inner
from hf_rebasin.alignment.strategies.vanilla import VanillaOptions
from hf_rebasin.alignment.verify import example_inputs
from hf_rebasin.core.errors import IncompatibleModelsError, MissingDataError, StrategyOptionError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.spaces import HeadSpace
from hf_rebasin.symmetry.transforms import HeadMap, random_invertible_head_map

CASES = ["gpt2", "bert-mlm", "roberta-cls", "vit", "llama-gqa", "qwen2-tied", "mistral", "clip"]
DATA_FREE = ["weight-matching", "transfusion", "generalized-orthogonal"]


def _setup(case: str, strategy: str, seed: int = 0):
    """(model, graph, A's state dict in the strategy's form, B = a random allowed transform of it)."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    g = torch.Generator().manual_seed(seed)
    if strategy == "generalized-orthogonal":
        ref, cgraph, _ = canonicalize(graph, sd)
        return model, graph, sd, ref, cgraph.apply(ref, cgraph.random_transform("orthogonal", g))
    return model, graph, sd, sd, graph.apply(sd, graph.random_transform("permutation", g))


def _noisy(sd: dict[str, torch.Tensor], scale: float, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.numel() > 1 else v
        for k, v in sd.items()
    }


def _max_diff(a, b) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _rel_dist(a, b) -> float:
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a if a[k].is_floating_point())
    den = sum(float((a[k].double() ** 2).sum()) for k in a if a[k].is_floating_point())
    return (num / den) ** 0.5


@pytest.mark.parametrize("strategy", DATA_FREE)
@pytest.mark.parametrize("case", CASES)
def test_data_free_strategy_recovers_a_random_transform(case, strategy):
    _model, graph, sd, ref, sd_b = _setup(case, strategy)
    assert _max_diff(sd_b, ref) > 1e-2  # the transform really moved B
    alignment = align(strategy, Pair(graph, sd, sd_b))  # GO brings A to canonical form itself
    assert alignment.exact
    assert _max_diff(alignment.aligned_b(), alignment.sd_a) < 1e-5
    assert _max_diff(alignment.sd_a, ref) < 1e-6


@pytest.mark.parametrize("strategy", DATA_FREE)
@pytest.mark.parametrize("case", ["gpt2", "bert-mlm", "llama-gqa", "vit"])
def test_recovery_survives_noise(case, strategy):
    model, graph, sd, _ref, sd_b = _setup(case, strategy, seed=4)
    noisy = _noisy(sd_b, 1e-3)
    noise = _rel_dist(noisy, sd_b)
    alignment = align(strategy, Pair(graph, sd, noisy))
    aligned = alignment.aligned_b()
    # within a small multiple of the noise itself: the transform was found, not merely approached
    assert _rel_dist(aligned, alignment.sd_a) < 3 * noise
    # and the midpoint of A and aligned B computes what A computes (barrier ~ 0)
    mid = {k: (v + aligned[k]) / 2 if v.is_floating_point() else v for k, v in alignment.sd_a.items()}
    a_model = rebuild(model, dict(alignment.sd_a), untie=bool(alignment.untied))
    m_model = rebuild(model, mid, untie=bool(alignment.untied))
    inputs = example_inputs(get_adapter(model.config.model_type), model.config, torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lm = a_model(**inputs).logits, m_model(**inputs).logits
    assert (la - lm).abs().max().item() < 0.05 * la.abs().max().item()


@pytest.mark.parametrize("strategy", DATA_FREE)
def test_aligning_a_model_to_itself_is_the_identity(strategy):
    model = tiny.FACTORIES["gpt2"](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    alignment = align(strategy, Pair(graph, sd, sd))
    for name, m in alignment.transform.items():
        assert m.is_identity() or (
            hasattr(m, "matrix") and torch.allclose(m.matrix(), torch.eye(m.size, dtype=torch.float64), atol=1e-6)
        ), name


def test_vanilla_is_the_identity_and_reports_timings():
    model = tiny.FACTORIES["bert-mlm"](0)
    sd = model.state_dict()
    other = tiny.FACTORIES["bert-mlm"](1).state_dict()
    alignment = align("vanilla", Pair(graph_for(model.config, sd.keys()), sd, other))
    assert all(m.is_identity() for m in alignment.transform.values())
    assert _max_diff(alignment.aligned_b(), other) == 0
    assert {"total", "solver"} <= set(alignment.timings)


def test_generalized_orthogonal_beats_permutations_on_a_rotated_model():
    # B is A rotated (not permuted): permutation strategies cannot undo it, the orthogonal one can.
    _model, graph, sd, ref, sd_b = _setup("gpt2", "generalized-orthogonal", seed=7)
    go = align("generalized-orthogonal", Pair(graph, sd, sd_b))
    wm = align("weight-matching", Pair(graph, ref, sd_b))
    assert _rel_dist(go.aligned_b(), go.sd_a) < 1e-6
    assert _rel_dist(wm.aligned_b(), ref) > 0.3


def test_generalized_orthogonal_notes_post_norm_fallback():
    model = tiny.FACTORIES["bert-mlm"](0)
    sd = model.state_dict()
    alignment = align("generalized-orthogonal", Pair(graph_for(model.config, sd.keys()), sd, sd))
    assert any("admits only permutations" in n for n in alignment.notes)


def _text_data(n: int = 3, seed: int = 0) -> AlignmentData:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, tiny.V, (4, 12), generator=g)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return AlignmentData(batches)


@pytest.mark.parametrize("sinkhorn", [False, True])
def test_learned_refinement_lowers_the_midpoint_loss(sinkhorn):
    a, b = tiny.FACTORIES["gpt2"](0), tiny.FACTORIES["gpt2"](1)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    pair = Pair(graph_for(a.config, sd_a.keys()), sd_a, sd_b, a, b, _text_data())
    options = {"learned": True, "steps": 12, "lr": 0.05, "sinkhorn": sinkhorn}
    alignment = align("generalized-orthogonal", pair, options)
    note = next(n for n in alignment.notes if n.startswith("learned matching"))
    assert "→" in note
    # whatever was kept is a valid transform: orthogonal residual, permutations elsewhere
    res = alignment.transform["res"].matrix()
    torch.testing.assert_close(res @ res.T, torch.eye(res.shape[0], dtype=torch.float64), atol=1e-6, rtol=0)
    assert alignment.transform["h.0.mlp"].is_permutation


def test_learned_without_data_is_a_user_error():
    model = tiny.FACTORIES["gpt2"](0)
    sd = model.state_dict()
    with pytest.raises(MissingDataError, match="data:"):
        align("generalized-orthogonal", Pair(graph_for(model.config, sd.keys()), sd, sd), {"learned": True})


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("generalized-orthogonal", {"sinkhorn": True}, "only apply with `learned: true`"),
        ("generalized-orthogonal", {"iterations": 0}, r"strategy\.iterations"),
        ("weight-matching", {"residual": "all"}, r"strategy\.residual: Extra inputs"),
        ("nonsense", {}, "choose one of: vanilla, weight-matching"),
    ],
)
def test_bad_options_are_user_errors_naming_the_field(name, options, match):
    model = tiny.FACTORIES["gpt2"](0)
    sd = model.state_dict()
    with pytest.raises(StrategyOptionError, match=match):
        align(name, Pair(graph_for(model.config, sd.keys()), sd, sd), options)


def test_models_of_different_shapes_name_the_first_differing_tensor():
    small = tiny.FACTORIES["gpt2"](0)
    sd = small.state_dict()
    import transformers as T

    cfg = T.GPT2Config(**{**small.config.to_dict(), "n_inner": 40})
    other = T.GPT2LMHeadModel(cfg).state_dict()
    with pytest.raises(
        IncompatibleModelsError,
        match=r"'transformer\.h\.0\.mlp\.c_fc\.weight' has shape \(32, 128\) in model A but \(32, 40\)",
    ):
        Pair(graph_for(small.config, sd.keys()), sd, other)


def test_registry_lists_every_strategy_and_refuses_duplicates():
    assert {"vanilla", "weight-matching", "transfusion", "generalized-orthogonal", "head-perm"} <= set(REGISTRY.names)
    reg = StrategyRegistry()
    reg.register(get_strategy("vanilla"))
    with pytest.raises(ValueError, match="twice"):
        reg.register(get_strategy("vanilla"))
    with pytest.raises(ValueError, match="bad strategy name"):
        reg.register(Strategy("Bad Name", "", VanillaOptions, "vanilla"))


def _transformed_pair(case: str, seed: int = 3, noise: float = 0.0):
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sd_b = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(seed)))
    if noise:
        sd_b = _noisy(sd_b, noise)
    spec = get_adapter(model.config.model_type)
    batches = [example_inputs(spec, model.config, torch.Generator().manual_seed(i)) for i in range(4)]
    return model, graph, sd, sd_b, rebuild(model, sd_b), AlignmentData(batches, frozenset({0}))


@pytest.mark.parametrize("residual", ["all", "first", "last"])
@pytest.mark.parametrize("case", ["gpt2", "bert-mlm", "llama-gqa", "vit", "clip", "bart", "t5", "whisper", "marian"])
def test_head_perm_recovers_a_random_permutation(case, residual):
    model, graph, sd, sd_b, model_b, data = _transformed_pair(case)
    alignment = align("head-perm", Pair(graph, sd, sd_b, model, model_b, data), {"residual": residual})
    assert alignment.exact and not alignment.notes
    assert _max_diff(alignment.aligned_b(), sd) < 1e-6


@pytest.mark.parametrize("case", ["t5", "llama-gqa", "gpt2"])
def test_head_perm_in_canonical_form_recovers_a_permutation_and_keeps_the_function(case):
    """`form: canonical`: the same matching, in the form with the norms folded into their readers;
    A's canonical form run with the stock class (the head untied where the fold untied it) gives A's
    logits, and B mapped into it equals it."""
    model, graph, sd, sd_b, model_b, data = _transformed_pair(case)
    alignment = align("head-perm", Pair(graph, sd, sd_b, model, model_b, data), {"form": "canonical"})
    assert alignment.canonical and alignment.exact
    assert _max_diff(alignment.aligned_b(), alignment.sd_a) < 1e-5
    norms = [n.weight for n in graph.norms if n.weight is not None]
    assert norms and all(torch.equal(alignment.sd_a[w], torch.ones_like(alignment.sd_a[w])) for w in norms)
    spec = get_adapter(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(9))
    folded = rebuild(model, dict(alignment.sd_a), untie=bool(alignment.untied)).eval()
    with torch.no_grad():
        assert (folded(**inputs).logits - model.eval()(**inputs).logits).abs().max() < 1e-4


def test_head_perm_in_canonical_form_refuses_the_options_that_change_the_function():
    model, graph, sd, sd_b, model_b, data = _transformed_pair("gpt2")
    with pytest.raises(StrategyOptionError, match="form: canonical"):
        align("head-perm", Pair(graph, sd, sd_b, model, model_b, data), {"form": "canonical", "residual": "separate"})


def test_head_perm_under_noise_and_without_special_tokens():
    model, graph, sd, sd_b, model_b, data = _transformed_pair("gpt2", noise=1e-3)
    alignment = align(
        "head-perm", Pair(graph, sd, sd_b, model, model_b, data), {"residual": "all", "special_tokens": False}
    )
    assert _rel_dist(alignment.aligned_b(), sd) < 3 * _rel_dist(sd_b, _transformed_pair("gpt2")[3])


def test_head_perm_components_and_residual_identity_leave_other_spaces_alone():
    model, graph, sd, sd_b, model_b, data = _transformed_pair("bert-mlm")
    pair = Pair(graph, sd, sd_b, model, model_b, data)
    only_ff = align("head-perm", pair, {"components": ["ff"], "residual": "all"})
    assert only_ff.transform["res"].is_identity() and only_ff.transform["layer.0.attn"].is_identity()
    assert not only_ff.transform["layer.0.mlp"].is_identity()
    identity_res = align("head-perm", pair, {"residual": "identity"})
    assert identity_res.transform["res"].is_identity()
    monotonic = align("head-perm", pair, {"heads": "monotonic", "residual": "all"})
    hm = monotonic.transform["layer.0.attn"]
    assert torch.equal(hm.kv_perm, torch.arange(hm.kv_perm.numel()))


def _shared_qk(graph, transform):
    """``transform`` with every non-rotary head's Q/K permutation set to its V/O one: the transforms
    `qk: shared` assumes (and the only ones it can recover)."""
    out = dict(transform)
    for name, space in graph.spaces.items():
        if isinstance(space, HeadSpace) and not space.rotary:
            m = transform[name]
            out[name] = HeadMap(m.kv_perm, m.q_perm, m.vo.clone(), m.vo)
    return out


@pytest.mark.parametrize("case", ["gpt2", "bert-mlm", "llama-gqa", "vit", "clip"])
def test_head_perm_shared_qk_recovers_and_preserves(case):
    """`qk: shared` recovers a transform whose Q/K permutation is its head's V/O one (rotary heads
    keep their own), and on two unrelated models leaves B's function as it was."""
    model, graph, sd, _sd_b, _model_b, data = _transformed_pair(case)
    transform = _shared_qk(graph, graph.random_transform("permutation", torch.Generator().manual_seed(7)))
    sd_b = graph.apply(sd, transform)
    options = {"qk": "shared", "residual": "last"}
    alignment = align("head-perm", Pair(graph, sd, sd_b, model, rebuild(model, sd_b), data), options)
    assert alignment.exact and _max_diff(alignment.aligned_b(), sd) < 1e-6
    other = tiny.FACTORIES[case](1)
    moved = align("head-perm", Pair(graph, sd, other.state_dict(), model, other, data), options)
    for name, space in graph.spaces.items():
        if isinstance(space, HeadSpace) and not space.rotary:
            hm = moved.transform[name]
            assert torch.equal(hm.qk, hm.vo)
    aligned = rebuild(model, dict(moved.aligned_b()))
    with torch.no_grad():
        for batch in data.batches:
            got, want = aligned(**batch), other(**batch)
            key = "logits" if "logits" in want else "logits_per_image"
            assert (got[key] - want[key]).abs().max().item() < 1e-4


def test_ignore_heads_permutes_by_the_attention_output_only():
    """Table 1's ignore-heads: one permutation of all attention features, the LAP of the attention
    output's correlation alone; on a transform that moves Q/K like V/O it is the transform itself."""
    model, graph, sd, _sd_b, _model_b, data = _transformed_pair("gpt2")
    sd_b = graph.apply(sd, _shared_qk(graph, graph.random_transform("permutation", torch.Generator().manual_seed(2))))
    pair = Pair(graph, sd, sd_b, model, rebuild(model, sd_b), data)
    flat = align("head-perm", pair, {"heads": "ignore-heads", "residual": "last"})
    assert _max_diff(flat.aligned_b(), sd) < 1e-6
    other = tiny.FACTORIES["gpt2"](1)
    pair = Pair(graph, sd, other.state_dict(), model, other, data)
    flat = align("head-perm", pair, {"heads": "ignore-heads", "residual": "identity", "components": ["attn"]})
    stats = activation_stats(model, other, graph, data.batches, spaces=["h.0.attn"], residual="none")
    assert torch.equal(flat.transform["h.0.attn"].index, lap(stats.moments["h.0.attn:o"].correlation())[0])


@pytest.mark.parametrize("option", [{"heads": "ignore-heads"}, {"residual": "separate"}])
def test_experimental_head_perm_options_are_flagged(option):
    model, graph, sd, sd_b, model_b, data = _transformed_pair("gpt2")
    alignment = align("head-perm", Pair(graph, sd, sd_b, model, model_b, data), option)
    assert not alignment.exact
    assert any("different function" in n for n in alignment.notes)
    assert not get_strategy("head-perm").exact(get_strategy("head-perm").parse(option))
    alignment.aligned_b()  # still applies (to the rewritten graph)


def test_head_perm_needs_data_and_checks_applicability():
    model = tiny.FACTORIES["gpt2"](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    with pytest.raises(MissingDataError, match="head-perm"):
        align("head-perm", Pair(graph, sd, sd))
    llama, graph_l, sd_l, sd_lb, llama_b, data = _transformed_pair("llama-gqa")
    with pytest.raises(StrategyOptionError, match="grouped-query"):
        align("head-perm", Pair(graph_l, sd_l, sd_lb, llama, llama_b, data), {"heads": "ignore-heads"})
    vit, graph_v, sd_v, sd_vb, vit_b, data_v = _transformed_pair("vit")
    with pytest.raises(StrategyOptionError, match="special_tokens"):
        align("head-perm", Pair(graph_v, sd_v, sd_vb, vit, vit_b, data_v), {"special_tokens": False})
    with pytest.raises(StrategyOptionError, match="at most once"):
        align("head-perm", Pair(graph, sd, sd), {"components": ["ff", "ff"]})


def _sheared(case: str, seed: int = 5, transform_class: str = "permutation"):
    """(graph, A's state dict, its canonical form, B = canonical A under a random transform of
    ``transform_class`` whose heads also carry random invertible inner maps)."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    ref, cgraph, _ = canonicalize(graph, sd)
    g = torch.Generator().manual_seed(seed)
    transform = cgraph.random_transform(transform_class, g)
    for name, sp in cgraph.spaces.items():
        if isinstance(sp, HeadSpace):
            transform[name] = random_invertible_head_map(sp, g, spread=1.0)
    return graph, sd, ref, cgraph, cgraph.apply(ref, transform)


@pytest.mark.parametrize("case", ["gpt2", "vit", "llama-gqa", "bert-mlm"])
def test_invertible_inner_maps_are_recovered_in_closed_form(case):
    """Known transform: heads of B sheared and scaled by random invertible maps (rotary: scaled
    plane rotations), nothing else moved; the least squares on the circuits undo them exactly."""
    model = tiny.FACTORIES[case](0)
    ref, cgraph, _ = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    start = cgraph.identity()
    g = torch.Generator().manual_seed(11)
    shear = cgraph.identity()
    for name, sp in cgraph.spaces.items():
        if isinstance(sp, HeadSpace):
            m = random_invertible_head_map(sp, g)
            shear[name] = HeadMap(start[name].kv_perm, start[name].q_perm, m.qk, m.vo, invertible=True)
    b = cgraph.apply(ref, shear)
    assert _max_diff(b, ref) > 1e-2
    fixed = invertible_inner(cgraph, ref, b, start)
    assert all(fixed[n].invertible for n, sp in cgraph.spaces.items() if isinstance(sp, HeadSpace))
    assert _max_diff(cgraph.apply(b, fixed), ref) < 1e-6


@pytest.mark.parametrize("case", ["gpt2", "vit", "llama-gqa"])
def test_generalized_orthogonal_with_invertible_inner_maps_recovers_sheared_heads(case):
    """End to end: B is A under random permutations with sheared heads; generalized-orthogonal with
    `inner: invertible` brings it back onto A, where orthogonal inner maps cannot."""
    graph, sd, ref, _cgraph, sd_b = _sheared(case)
    orthogonal = align("generalized-orthogonal", Pair(graph, sd, sd_b))
    invertible = align("generalized-orthogonal", Pair(graph, sd, sd_b), {"inner": "invertible"})
    assert _rel_dist(orthogonal.aligned_b(), ref) > 1e-2
    assert _rel_dist(invertible.aligned_b(), ref) < 1e-5


def _fitted(case: str, data: AlignmentData, steps: int = 150) -> torch.nn.Module:
    """A tiny model trained on ``data`` until it fits it: at a random init the midpoint of two
    models can score better than either, so a loss-driven search has nothing to find."""
    model = tiny.FACTORIES[case](0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for step in range(steps):
        loss = model(**data.batches[step % len(data.batches)]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _learned_pair(case: str = "gpt2", n: int = 4):
    """A fitted tiny model A and B = A with three heads of every layer cycled, everything else as
    is: a known transform only a learned head pairing can find from an identity start. Fitted once
    per test process (the fit is seeded, so every call would fit the same model); each caller gets
    its own copy, and the global RNG as the fit leaves it (for what the caller draws next)."""
    pair, rng = _learned_pair_once(case, n)
    torch.set_rng_state(rng)
    return copy.deepcopy(pair)


@functools.cache
def _learned_pair_once(case: str, n: int):
    data = _text_data(n)
    a = _fitted(case, data)
    sd = a.state_dict()
    graph = graph_for(a.config, sd.keys())
    cref, cgraph, untied = canonicalize(graph, sd)
    swap = cgraph.identity()
    for name, sp in cgraph.spaces.items():
        if isinstance(sp, HeadSpace):
            m = swap[name]
            kv = m.kv_perm.clone()
            kv[[0, 1, 2]] = kv[[1, 2, 0]]  # a cycle: a swap is a saddle (both slots average the same two heads)
            swap[name] = HeadMap(kv, m.q_perm, m.qk, m.vo)
    cb = cgraph.apply(cref, swap)
    model_b = rebuild(a, cb, untie=bool(untied))
    return (a, model_b, cgraph, cref, cb, untied, data), torch.get_rng_state()


def _refine(options: dict, case: str = "gpt2"):
    from hf_rebasin.alignment.strategies.engines.learned import LearnedSettings, refine

    a, model_b, cgraph, cref, cb, untied, data = _learned_pair(case)
    settings = LearnedSettings(
        **{"steps": 40, "lr": 0.2, "sinkhorn": False, "temperature": 0.05, "seed": 0, "eval_every": 10, **options}
    )
    pair = Pair(cgraph, cref, cb, a, model_b, data)
    heads = {n: m for n, m in cgraph.identity().items() if isinstance(m, HeadMap)}  # learn the heads only
    return refine(pair, cgraph, cref, cb, heads, untied, settings, None), cgraph, cref, cb


def test_learned_matching_finds_a_cycled_head_pairing():
    """From the identity (three heads cycled), the learned head pairing finds the cycle: B under the
    learned maps is A again and the barrier vanishes. With `heads` off the pairing cannot move."""
    result, cgraph, cref, cb = _refine({"patience": 0})
    heads = [n for n, sp in cgraph.spaces.items() if isinstance(sp, HeadSpace)]
    for name in heads:
        assert result.transform[name].kv_perm.tolist() == [2, 0, 1, 3], result.notes
    assert _max_diff(cgraph.apply(cb, result.transform), cref) < 1e-5
    assert result.history["best"] < 1e-3 < result.history["barrier"][0]
    frozen, *_ = _refine({"patience": 0, "heads": False})
    assert all(frozen.transform[n].kv_perm.tolist() == [0, 1, 2, 3] for n in heads)


def test_learned_budget_patience_and_soft_permutations():
    # a budget in tokens sets the steps: 4 batches of 4 × 12 tokens, one held out → 48 tokens a step
    budgeted, *_ = _refine({"budget": 48 * 7, "patience": 0, "eval_every": 100})
    assert budgeted.history["steps"] == [0, 7] and budgeted.history["tokens"] == [0, 48 * 7]
    # patience: stop after 2 scores without a better one; the kept maps are the best scored
    stopped, *_ = _refine({"steps": 400, "eval_every": 5, "patience": 2})
    assert stopped.history["steps"][-1] < 400
    assert stopped.history["best"] == min(stopped.history["barrier"])
    # soft permutations: both curves are recorded and both end barriers reported
    soft, *_ = _refine({"sinkhorn": True, "lr": 0.05, "temperature": 0.5, "patience": 0})
    assert len(soft.history["soft_barrier"]) == len(soft.history["barrier"])
    assert any("soft maps" in n for n in soft.notes) or any("did not lower" in n for n in soft.notes)


def test_learned_permutation_only_ablation_keeps_every_map_a_permutation():
    a, model_b, *_, data = _learned_pair()
    graph = graph_for(a.config, a.state_dict().keys())
    options = {"learned": True, "maps": "permutations", "steps": 8, "eval_every": 4}
    alignment = align(
        "generalized-orthogonal", Pair(graph, a.state_dict(), model_b.state_dict(), a, model_b, data), options
    )
    assert alignment.transform["res"].is_permutation
    assert any("permutations only" in n for n in alignment.notes)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"learned": True, "sampler": "uniform(0.6, 0.4)"}, "strategy.sampler"),
        ({"learned": True, "sampler": "gaussian(0.5)"}, "uniform\\(a, b\\)"),
        ({"learned": True, "sampler": "fixed(0.5, 0.6)"}, "`fixed` one"),
        ({"learned": True, "steps": 10, "budget": 1000}, "not both"),
        ({"budget": 1000}, "only apply with `learned: true`"),
        ({"learned": True, "maps": "permutations", "inner": "invertible"}, "maps: permutations"),
    ],
)
def test_learned_options_are_checked_before_anything_runs(options, match):
    with pytest.raises(StrategyOptionError, match=match):
        get_strategy("generalized-orthogonal").parse(options)
    assert get_strategy("generalized-orthogonal").parse({"learned": True, "sampler": " fixed( 0.5 ) "})


@pytest.mark.slow  # 4.2 s; learned matching's fast tests cover the engine
def test_multi_model_learned_matching_with_dirichlet_weights_finds_a_common_head_order():
    """Three copies of one fitted model with their heads in three different orders, every map
    starting at the identity: refined together on merges with Dirichlet(0.1) weights, the three
    end in one basis (the merged weights equal each model's), and the curve is recorded."""
    from hf_rebasin.alignment.strategies.engines.learned import LearnedSettings, refine_many

    a, _model_b, cgraph, cref, cb, untied, data = _learned_pair()
    other = cgraph.identity()
    for name, sp in cgraph.spaces.items():
        if isinstance(sp, HeadSpace):
            m = other[name]
            other[name] = HeadMap(torch.tensor([3, 2, 1, 0]), m.q_perm, m.qk, m.vo)
    cc = cgraph.apply(cref, other)
    heads = {n: m for n, m in cgraph.identity().items() if isinstance(m, HeadMap)}
    settings = LearnedSettings(steps=30, lr=0.1, sinkhorn=False, temperature=0.05, seed=0, eval_every=10, patience=0)
    sds = [cref, cb, cc]
    transforms, notes, history = refine_many(
        a, cgraph, sds, [dict(heads)] * 3, [1 / 3] * 3, untied, data.batches, settings, 0.1, None
    )
    mapped = [cgraph.apply(sd, t) for sd, t in zip(sds, transforms, strict=True)]
    assert _max_diff(mapped[0], mapped[1]) < 1e-5 and _max_diff(mapped[0], mapped[2]) < 1e-5, notes
    assert "Dirichlet(0.1)" in history["measure"] and history["models"] == 3
    assert history["best"] < 1e-3 < history["barrier"][0]


def _image_data(n: int = 3, seed: int = 0) -> AlignmentData:
    g = torch.Generator().manual_seed(seed)
    return AlignmentData(
        [{"pixel_values": torch.randn(4, 1, 8, 8, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}] * n
    )


@pytest.mark.parametrize(
    ("kind", "data", "rate", "reads"), [("gpt2", _text_data, 0.01, "text"), ("vit", _image_data, 0.03, "images")]
)
def test_an_unset_learned_rate_is_chosen_by_what_the_model_reads(kind, data, rate, reads):
    """Unset, learned matching runs at 0.01 on text and 0.03 on images (the benchmark zoo's GPT-2
    and ViT each prefer theirs on every seed pair): the same maps as with that rate given, and the
    choice is recorded and said."""
    a, b = tiny.FACTORIES[kind](0), tiny.FACTORIES[kind](1)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    pair = Pair(graph_for(a.config, sd_a.keys()), sd_a, sd_b, a, b, data())
    base = {"learned": True, "steps": 4, "eval_every": 2, "patience": 0, "iterations": 1}
    unset = align("generalized-orthogonal", pair, base)
    given = align("generalized-orthogonal", pair, {**base, "lr": rate})
    other = align("generalized-orthogonal", pair, {**base, "lr": 0.04 - rate})  # the other kind's rate
    assert unset.resolved == {"lr": rate} and given.resolved == {}
    assert f"lr: {rate:g} (unset in the recipe; the model reads {reads})" in unset.notes
    mapped, same, moved = unset.aligned_b(), given.aligned_b(), other.aligned_b()
    for name, tensor in mapped.items():
        torch.testing.assert_close(tensor, same[name], atol=0, rtol=0)
    assert any(not torch.equal(t, moved[n]) for n, t in mapped.items())  # the rate matters at all here
