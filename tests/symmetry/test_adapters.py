"""Every adapter is proven by function preservation on tiny random models of the installed
transformers version: a random allowed transform leaves the outputs unchanged (≤ 1e-4, float32),
a forbidden one changes them, and the result round-trips through save_pretrained."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.alignment.strategies.weight_matching import weight_matching
from hf_rebasin.alignment.verify import TOLERANCE, compare, example_inputs, outputs_of, transformed_model, verify_model
from hf_rebasin.core.errors import TransformError, UnsupportedArchitectureError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import REGISTRY, graph_for
from hf_rebasin.symmetry.canonical import canonicalize, is_canonical
from hf_rebasin.symmetry.spaces import TRANSFORM_CLASSES, HeadSpace
from hf_rebasin.symmetry.transforms import (
    AxisMap,
    HeadMap,
    is_plane_scaling,
    random_invertible_head_map,
    random_orthogonal,
)

CASES = sorted(tiny.FACTORIES)
# seed 0 in the fast suite, the other draws with the slow tests (and in the preservation matrix,
# `benchmarks/symmetry/preservation_matrix.py`, every model and class under 3 seeds)
SEEDS = (0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow))
# the round trip through save_pretrained in the fast suite with the orthogonal class, which changes
# the most tensors (and unties what canonical form makes apart); the others with the slow tests
ROUND_TRIP_CLASSES = tuple(
    cls if cls == "orthogonal" else pytest.param(cls, marks=pytest.mark.slow) for cls in TRANSFORM_CLASSES
)


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {name: tiny.FACTORIES[name](0) for name in CASES}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cls", TRANSFORM_CLASSES)
@pytest.mark.parametrize("case", CASES)
def test_random_allowed_transform_preserves_outputs(models, case, cls, seed):
    report = verify_model(models[case], cls, seed=seed)
    assert report.compared, "nothing was compared"
    assert report.max_abs_diff <= TOLERANCE, report


def test_orthogonal_really_rotates_where_exact(models):
    """The orthogonal class is not secretly a permutation: the residual map is dense."""
    for case in ("gpt2", "vit", "llama-gqa", "qwen2-tied", "clip"):
        model = models[case]
        _new, _graph, transform, _ = transformed_model(model, "orthogonal", seed=0)
        res = "text.res" if case == "clip" else "res"
        m = transform[res]
        assert isinstance(m, AxisMap) and m.blocks is not None
        assert (m.matrix().abs() > 1e-3).float().mean() > 0.5


def test_post_norm_residual_falls_back_to_permutation(models):
    report = verify_model(models["bert-mlm"], "orthogonal", seed=0)
    assert any("'res'" in note and "permutation" in note for note in report.fallbacks)
    assert report.classes["res"] == "permutation"
    clip_report = verify_model(models["clip"], "orthogonal", seed=0)
    assert clip_report.classes["vision.res"] == "permutation"
    assert clip_report.classes["text.res"].startswith("orthogonal")
    assert clip_report.classes["joint"] == "orthogonal"


def _max_diff(model: torch.nn.Module, sd: dict[str, torch.Tensor], untie: bool = False) -> float:
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before = outputs_of(model, spec, inputs)
    after = outputs_of(rebuild(model, sd, untie=untie), spec, inputs)
    # callers change no basis (no transform, or one meant to break): every output must match
    return max((after[k] - before[k]).abs().max().item() for k in before)


def test_mixing_heads_breaks_the_function(models):
    """Negative control: the same permutation of Q and K features across two heads is not a symmetry."""
    for case, q, k in (
        ("bert-mlm", "bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.key"),
        ("llama-mha", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"),
    ):
        model = models[case]
        sd = dict(model.state_dict())
        n = sd[f"{q}.weight"].shape[0]
        dh = n // model.config.num_attention_heads
        idx = torch.arange(n)
        idx[[0, dh]] = idx[[dh, 0]]  # swap feature 0 of head 0 with feature 0 of head 1
        mix = AxisMap(n, index=idx)
        for name in (q, k):
            sd[f"{name}.weight"] = mix.apply(sd[f"{name}.weight"], 0)
            if f"{name}.bias" in sd:
                sd[f"{name}.bias"] = mix.apply(sd[f"{name}.bias"], 0)
        assert _max_diff(model, sd) > 1e-2


def test_qk_inner_permutation_under_rope_breaks_the_function(models):
    """Negative control: under RoPE even a Q/K inner permutation shared by Q and K changes the scores."""
    model = models["llama-gqa"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = graph.identity()
    space = graph.spaces["layers.0.attn"]
    g, dh = space.num_kv_heads, space.head_dim
    ident = t["layers.0.attn"]
    assert isinstance(ident, HeadMap)
    swap_pairs = torch.arange(dh)
    swap_pairs[[0, 1, dh // 2, dh // 2 + 1]] = swap_pairs[[1, 0, dh // 2 + 1, dh // 2]]  # move whole rotary pairs
    t["layers.0.attn"] = HeadMap(ident.kv_perm, ident.q_perm, swap_pairs.expand(g, dh).clone(), ident.vo)
    assert _max_diff(model, graph.apply(sd, t, check=False)) > 1e-3
    with pytest.raises(TransformError, match="Q/K inner permutation"):  # and the class check refuses it
        graph.apply(sd, t)
    # …while the same permutation on the V/O side is exact
    t["layers.0.attn"] = HeadMap(ident.kv_perm, ident.q_perm, ident.qk, swap_pairs.expand(g, dh).clone())
    assert _max_diff(model, graph.apply(sd, t)) <= TOLERANCE


def test_orthogonal_residual_without_canonical_form_is_refused_and_wrong(models):
    model = models["gpt2"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = graph.identity()
    t["res"] = AxisMap(
        graph.spaces["res"].size,
        blocks=random_orthogonal(graph.spaces["res"].size, torch.Generator(), fix_ones=True)[None],
    )
    with pytest.raises(TransformError, match="canonical form"):
        graph.apply(sd, t)
    # and a rotation of BERT's post-norm residual is refused outright
    bert = models["bert-mlm"]
    bgraph = graph_for(bert.config, bert.state_dict().keys())
    bt = bgraph.identity()
    bt["res"] = AxisMap(
        bgraph.spaces["res"].size, blocks=random_orthogonal(bgraph.spaces["res"].size, torch.Generator())[None]
    )
    with pytest.raises(TransformError, match="only permutations"):
        bgraph.apply(bert.state_dict(), bt)


def test_rotation_without_fixing_ones_breaks_layernorm(models):
    """Negative control for the 1⊥ constraint: a generic rotation of a LayerNorm residual is wrong."""
    model = models["gpt2"]
    sd, graph, untied = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    t = graph.identity()
    size = graph.spaces["res"].size
    t["res"] = AxisMap(size, blocks=random_orthogonal(size, torch.Generator().manual_seed(1))[None])
    assert _max_diff(model, graph.apply(sd, t), untie=bool(untied)) > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_canonical_form_is_exact_and_idempotent(models, case):
    model = models[case]
    graph = graph_for(model.config, model.state_dict().keys())
    sd, graph2, untied = canonicalize(graph, model.state_dict())
    assert is_canonical(graph2, sd)
    assert _max_diff(model, sd, untie=bool(untied)) <= TOLERANCE
    sd2, _, untied2 = canonicalize(graph2, sd)
    assert not untied2
    for k in sd:
        torch.testing.assert_close(sd2[k], sd[k])


@pytest.mark.parametrize("cls", ROUND_TRIP_CLASSES)
@pytest.mark.parametrize("case", CASES)
def test_transformed_model_round_trips_through_save_pretrained(models, case, cls, tmp_path):
    model = models[case]
    new, _graph, _t, untied = transformed_model(model, cls, seed=5)
    new.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    # what canonical form untied loads apart (T5's config forces tie_word_embeddings: true, and
    # transformers reads the head apart by its values)
    params = dict(reloaded.named_parameters(remove_duplicate=False))
    for alias in untied:
        source = model.all_tied_weights_keys[alias]
        assert params[alias] is not params[source], alias
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(11))
    before = outputs_of(model, spec, inputs)
    after_new = outputs_of(new, spec, inputs)
    after = outputs_of(reloaded, spec, inputs)
    for k in before:
        torch.testing.assert_close(after[k], after_new[k], atol=1e-6, rtol=0)
        if spec.outputs[k] is None:
            assert (after[k] - before[k]).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("cls", TRANSFORM_CLASSES)
@pytest.mark.parametrize("case", CASES)
def test_aligning_a_model_to_itself_is_the_identity(models, case, cls):
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    if cls == "orthogonal":
        sd, graph, _ = canonicalize(graph, sd)
    transform = weight_matching(graph, sd, sd, cls)
    assert all(m.is_identity() for m in transform.values())


@pytest.mark.parametrize("cls", ["permutation", "signed-permutation"])
@pytest.mark.parametrize("case", CASES)
def test_permutation_is_recovered_exactly(models, case, cls):
    """Weight matching undoes a random (signed, where the residual allows signs) permutation."""
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sd_b = graph.apply(sd, graph.random_transform(cls, torch.Generator().manual_seed(9)))
    back = graph.apply(sd_b, weight_matching(graph, sd, sd_b, cls))
    for k in sd:
        torch.testing.assert_close(back[k], sd[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_declared_ties_match_transformers(models, case):
    """Every tie transformers makes is declared (or joins two tensors with no hidden axis)."""
    model = models[case]
    graph = graph_for(model.config, model.state_dict().keys())
    for alias, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if graph.ties.get(alias) == source:
            continue
        assert alias in graph.invariant and source in graph.invariant, (alias, source)
    for alias, source in graph.ties.items():
        assert model.state_dict()[alias].data_ptr() == model.state_dict()[source].data_ptr()


def test_every_tensor_is_described(models):
    for case in CASES:
        model = models[case]
        graph = graph_for(model.config, model.state_dict().keys())
        graph.check(model.state_dict(), source=case)  # raises on an unknown or misshapen tensor


def test_unsupported_model_type_lists_supported():
    cfg = T.MambaConfig()  # a state-space model: no attention heads
    with pytest.raises(UnsupportedArchitectureError, match="gpt2") as e:
        graph_for(cfg, [])
    assert "'mamba'" in str(e.value) and "distilbert" in str(e.value) and "modernbert" in str(e.value)


def test_registry_refuses_duplicates():
    from hf_rebasin.symmetry.adapters import AdapterRegistry
    from hf_rebasin.symmetry.adapters.gpt2 import SPEC

    reg = AdapterRegistry()
    reg.register(SPEC)
    with pytest.raises(ValueError, match="twice"):
        reg.register(SPEC)


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("case", CASES)
def test_random_invertible_head_maps_preserve_outputs(models, case, seed):
    """The invertible class inside heads: Q·M with K·M⁻ᵀ, V·N with O·N⁻¹ (rotary: scaled plane
    rotations for Q/K), on top of a random orthogonal transform of everything else."""
    model = models[case].eval()
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(seed + 1))
    before = outputs_of(model, spec, inputs)
    sd, graph, untied = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    g = torch.Generator().manual_seed(seed)
    transform = graph.random_transform("orthogonal", g)
    heads = [name for name, sp in graph.spaces.items() if isinstance(sp, HeadSpace)]
    assert heads, f"{case} has no attention"
    for name in heads:
        transform[name] = random_invertible_head_map(graph.spaces[name], g, spread=1.0)
        assert transform[name].invertible
        inner = transform[name].vo
        assert float(torch.linalg.svdvals(inner).max() / torch.linalg.svdvals(inner).min()) > 1.2  # not orthogonal
    after = outputs_of(rebuild(model, graph.apply(sd, transform), untie=bool(untied)), spec, inputs)
    assert compare(spec, graph, transform, before, after) <= TOLERANCE


def test_invertible_maps_under_rope_must_scale_rotary_planes(models):
    """Negative control: a general invertible Q/K map is refused under rotary embeddings (it would
    change the scores), and, forced through, really changes the outputs."""
    model = models["llama-mha"].eval()
    spec = REGISTRY.get(model.config.model_type)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    name = next(n for n, sp in graph.spaces.items() if isinstance(sp, HeadSpace))
    space = graph.spaces[name]
    assert space.rotary
    g = torch.Generator().manual_seed(0)
    ok = random_invertible_head_map(space, g)
    assert is_plane_scaling(ok.qk)
    general = random_orthogonal(space.head_dim, g, batch=space.num_kv_heads) * 1.5
    bad = HeadMap(ok.kv_perm, ok.q_perm, general, ok.vo, invertible=True)
    transform = {name: bad}
    with pytest.raises(TransformError, match="rotary"):
        graph.apply(sd, transform)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(1))
    before = outputs_of(model, spec, inputs)
    after = outputs_of(rebuild(model, graph.apply(sd, transform, check=False)), spec, inputs)
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-3
