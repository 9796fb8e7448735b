"""Signed permutations of the residual stream (post-sublayer norms: Gemma 2 / 3, OLMo 2) and the
gated-MLP unit scaling: exact, refused where they are not, and recovered by every strategy."""

from __future__ import annotations

import pytest
import torch

import tiny
from hf_rebasin.alignment.strategies import AlignmentData, Pair, align
from hf_rebasin.alignment.verify import example_inputs, outputs_of, verify_model
from hf_rebasin.core.errors import TransformError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.canonical import canonicalize, gamma
from hf_rebasin.symmetry.transforms import AxisMap, random_orthogonal

SIGNED = ["gemma2", "gemma3-text", "olmo2", "glm4", "exaone4"]
DATA_FREE = ["weight-matching", "transfusion", "generalized-orthogonal"]


def _logits(model: torch.nn.Module, sd: dict[str, torch.Tensor], seed: int = 3) -> torch.Tensor:
    """Logits of the stock transformers class holding ``sd`` (an independent forward pass)."""
    spec = get_adapter(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(seed))
    return outputs_of(rebuild(model, sd), spec, inputs)["logits"]


def _max_diff(a, b) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _signed(size: int, seed: int) -> AxisMap:
    g = torch.Generator().manual_seed(seed)
    return AxisMap.signed(torch.randperm(size, generator=g), (torch.randint(0, 2, (size,), generator=g) * 2 - 1))


@pytest.mark.parametrize("case", SIGNED)
def test_the_residual_of_post_sublayer_norm_families_is_signed(case):
    report = verify_model(tiny.FACTORIES[case](0), "orthogonal", seed=0)
    assert report.classes["res"] == "signed-permutation"
    assert any("'res'" in n and "signed permutations" in n for n in report.fallbacks)
    assert report.max_abs_diff <= 1e-4


@pytest.mark.parametrize("case", SIGNED)
def test_signs_are_exact_but_rotations_and_signed_norm_scales_are_not(case):
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    before = _logits(model, sd)
    signed = _signed(graph.spaces["res"].size, 1)
    assert signed.blocks is not None and bool((signed.blocks < 0).any())
    after = _logits(model, graph.apply(sd, {"res": signed}))
    assert (after - before).abs().max().item() <= 1e-4
    # negative control 1: a rotation is refused, and forced through it moves the logits
    rotation = AxisMap(
        graph.spaces["res"].size, blocks=random_orthogonal(graph.spaces["res"].size, torch.Generator())[None]
    )
    with pytest.raises(TransformError, match="only signed permutations"):
        graph.apply(sd, {"res": rotation})
    csd, cgraph, _ = canonicalize(graph, sd)
    forced = _logits(model, cgraph.apply(csd, {"res": rotation}, check=False))
    assert (forced - before).abs().max().item() > 1e-3
    # negative control 2: a norm scale γ only permutes; giving it the signs too breaks the model
    wrong = graph.apply(sd, {"res": signed})
    signs = signed.blocks.reshape(-1)
    for norm in graph.norms:
        if norm.space == "res":
            g = gamma(norm, wrong[norm.weight]) * signs
            wrong[norm.weight] = (g - norm.offset).to(wrong[norm.weight].dtype)
    assert (_logits(model, wrong) - before).abs().max().item() > 1e-3


def test_a_bare_rmsnorm_base_model_keeps_signed_permutations():
    """LlamaModel's final norm has no reader: no rotation, but signs pass the RMSNorm."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48)
    model = tiny._randomize_norms(T.LlamaModel(cfg), 0)
    report = verify_model(model, "orthogonal", seed=0)
    assert report.classes["res"] == "signed-permutation"
    assert report.max_abs_diff <= 1e-4


def test_layernorm_streams_refuse_signs():
    model = tiny.FACTORIES["gpt2"](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    csd, cgraph, _ = canonicalize(graph, sd)
    with pytest.raises(TransformError, match="fixing the all-ones vector"):
        cgraph.apply(csd, {"res": _signed(cgraph.spaces["res"].size, 0)})


@pytest.mark.parametrize("strategy", DATA_FREE)
@pytest.mark.parametrize("case", SIGNED)
def test_data_free_strategies_recover_a_signed_permutation(case, strategy):
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    cls = "orthogonal" if strategy == "generalized-orthogonal" else "signed-permutation"  # residual: signed
    transform = graph.random_transform(cls, torch.Generator().manual_seed(4))
    assert bool((transform["res"].blocks < 0).any())
    sd_b = graph.apply(sd, transform)
    alignment = align(strategy, Pair(graph, sd, sd_b))
    assert alignment.transform["res"].is_signed_permutation
    assert _max_diff(alignment.aligned_b(), alignment.sd_a) < 1e-5


@pytest.mark.parametrize("case", ["llama-gqa", "gemma2", "phi3"])
def test_unit_scales_and_signs_are_undone_by_balancing(case):
    """B = A with its MLP units permuted, scaled and sign-flipped (and a signed residual where the
    family's residual is signed; weight matching keeps Llama's orthogonal-capable residual to
    permutations): matching balanced units brings B back onto A exactly, weight by weight."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    g = torch.Generator().manual_seed(5)
    scales = {
        u.space: (torch.rand(graph.spaces[u.space].size, generator=g, dtype=torch.float64) * 4.8 + 0.2)
        * (torch.randint(0, 2, (graph.spaces[u.space].size,), generator=g) * 2 - 1)
        for u in graph.glus
    }
    signed = graph.spaces["res"].max_class == "signed-permutation"
    transform = graph.random_transform("signed-permutation" if signed else "permutation", g)
    sd_b = graph.apply(glu.apply_unit_scales(graph, sd, scales), transform)
    assert (_logits(model, sd_b) - _logits(model, sd)).abs().max().item() <= 1e-4
    balanced = align("weight-matching", Pair(graph, sd, sd_b), {"glu": "balance"})
    assert balanced.glu_matched
    assert _max_diff(balanced.aligned_b(), sd) < 1e-4
    assert (_logits(model, balanced.sd_b) - _logits(model, sd_b)).abs().max().item() <= 1e-4  # B' is B
    kept = align("weight-matching", Pair(graph, sd, sd_b))  # the default: units matched as stored
    assert not kept.glu_matched and _max_diff(kept.aligned_b(), sd) > 1e-2


def _data(model: torch.nn.Module) -> AlignmentData:
    """Token batches with labels (learned matching trains on the model's own loss)."""
    spec = get_adapter(model.config.model_type)
    batches = [dict(example_inputs(spec, model.config, torch.Generator().manual_seed(i))) for i in range(4)]
    return AlignmentData([{**b, "labels": b["input_ids"]} for b in batches])


@pytest.mark.parametrize("case", ["gemma2", "olmo2"])
def test_head_perm_recovers_a_signed_residual_from_activations(case):
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sd_b = graph.apply(sd, graph.random_transform("signed-permutation", torch.Generator().manual_seed(6)))
    pair = Pair(graph, sd, sd_b, model, rebuild(model, sd_b), _data(model))
    alignment = align("head-perm", pair, {"residual": "all"})
    assert alignment.transform["res"].is_signed_permutation
    assert _max_diff(alignment.aligned_b(), sd) < 1e-5


def test_learned_matching_keeps_a_signed_residual_signed_and_exact():
    a, b = tiny.FACTORIES["gemma2"](0), tiny.FACTORIES["gemma2"](1)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    pair = Pair(graph_for(a.config, sd_a.keys()), sd_a, sd_b, a, b, _data(a))
    alignment = align("generalized-orthogonal", pair, {"learned": True, "steps": 6, "lr": 0.05, "eval_every": 3})
    assert alignment.graph.spaces["res"].max_class == "signed-permutation" and not alignment.untied
    assert alignment.transform["res"].is_signed_permutation
    # aligned B (only exact maps pass graph.apply's checks) computes B's function in the stock class
    assert (_logits(b, alignment.aligned_b()) - _logits(b, sd_b)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("strategy", ["weight-matching", "generalized-orthogonal"])
def test_a_cached_alignment_rebuilds_b_in_a_unit_scaling(strategy, tmp_path):
    """The cache stores maps only: B's rescaled units (and the signed residual) come back the same."""
    from hf_rebasin.alignment import cache

    a, b = tiny.FACTORIES["gemma2"](0), tiny.FACTORIES["gemma2"](1)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    pair = Pair(graph_for(a.config, sd_a.keys()), sd_a, sd_b)
    alignment = align(strategy, pair, {"glu": "balance"})
    assert alignment.glu_matched
    assert cache.save_alignment("k" * 64, alignment, pair, root=tmp_path) is not None
    back = cache.read_alignment("k" * 64, pair, strategy, root=tmp_path)
    assert back.glu_matched and back.transform["res"].is_signed_permutation
    assert _max_diff(back.aligned_b(), alignment.aligned_b()) == 0.0
