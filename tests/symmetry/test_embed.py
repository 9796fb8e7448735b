"""A narrower model written into a wider shape of its family (`hf_rebasin.symmetry.embed`),
checked against the stock transformers classes. `embed_state` on a few families by hand (the wide
config's norm ε scaled by d/d′), then `embed_model` over a matrix of every tiny family × {hidden
size, MLP units, attention heads, all three}: each either computes the narrow model's outputs (max
|Δ| ≤ 1e-4 in float32) or is refused with its reason. A family whose attention computes head_dim
as hidden size / heads cannot grow one without the other; a post-norm LayerNorm stream (BERT's),
an embedding LayerNorm on the stream (ModernBERT, CLIP's vision ``pre_layrnorm``) and a LayerNorm
stream read raw (SigLIP's pooling head) cannot grow at all."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.alignment.verify import example_inputs, outputs_of
from hf_rebasin.alignment.widths import embed_model
from hf_rebasin.core.errors import IncompatibleModelsError
from hf_rebasin.io.offload import empty_model
from hf_rebasin.symmetry.adapters import REGISTRY, graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.embed import embed_state, residual_ratio

EPS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps")
WIDER = {  # hidden 32 → 48, units → 64, heads 4 → 6 (KV groups 2 → 3), head_dim kept
    "llama-gqa": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
    "qwen3-untied": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3),
    "phi3": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
    "mixtral": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
    "gpt-neox": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6),
    "gpt2": dict(n_embd=48, n_inner=160, n_head=6),
}
CANONICAL = {"gpt2", "gpt-neox"}  # LayerNorm streams: embedded from the canonical form (mean 0 over d)


def _widened(case: str, sizes: dict) -> float:
    model = tiny.FACTORIES[case](0).eval()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    narrow_config = copy.deepcopy(model.config)
    if case in CANONICAL:
        sd, graph, untied = canonicalize(graph, sd)
        narrow_config.tie_word_embeddings = not untied and narrow_config.tie_word_embeddings
    config = copy.deepcopy(narrow_config)
    for k, v in sizes.items():
        setattr(config, k, v)
    shapes = {k: tuple(t.shape) for k, t in empty_model(type(model), config).state_dict().items()}
    wide_graph = graph_for(config, shapes.keys())
    for ratio in residual_ratio(graph, wide_graph).values():
        for name in EPS:
            if isinstance(getattr(config, name, None), float):
                setattr(config, name, getattr(config, name) * ratio)
    small = type(model)(narrow_config).eval()
    small.load_state_dict(sd)
    wide = type(model)(config).eval()
    wide.load_state_dict(embed_state(graph, sd, wide_graph, shapes))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((small(ids).logits - wide(ids).logits).abs().max())


@pytest.mark.parametrize("case", sorted(WIDER))
def test_a_wider_stock_model_computes_the_narrow_ones_logits(case: str) -> None:
    assert _widened(case, WIDER[case]) <= 1e-4


@pytest.mark.parametrize(
    "sizes", [dict(intermediate_size=64), dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8)]
)
def test_units_and_heads_alone_embed_bit_exactly(sizes: dict) -> None:
    assert _widened("llama-gqa", sizes) == 0.0


@pytest.mark.parametrize(
    ("case", "sizes", "why"),
    [
        ("llama-gqa", dict(head_dim=12, num_attention_heads=4, num_key_value_heads=2), "rotary"),
        ("mixtral", dict(num_local_experts=6), "routing weight"),
        ("llama-gqa", dict(intermediate_size=16), "narrower"),
    ],
)
def test_what_cannot_be_embedded_is_refused_with_the_reason(case: str, sizes: dict, why: str) -> None:
    with pytest.raises(IncompatibleModelsError, match=why):
        _widened(case, sizes)


# ---- embed_model: every family × what grows -----------------------------------------------------

HIDDEN = ("hidden_size", "n_embd", "dim")
UNITS = ("intermediate_size", "n_inner", "hidden_dim", "moe_intermediate_size", "shared_expert_intermediate_size")
HEADS = ("num_attention_heads", "n_head", "n_heads")
CASES = ("hidden", "units", "heads", "all")
TWO_TOWERS = {"clip", "siglip"}  # only the text tower grows here (the vision stream's refusals: below)


def _first(config: Any, names: tuple[str, ...]) -> str:
    return next(n for n in names if isinstance(getattr(config, n, None), int))


def _grow(config: Any, case: str) -> None:
    """One (sub)config made wider in place: hidden + 16, units + 16, heads + 2 (whole KV groups),
    head_dim kept (written, so that a family that reads it keeps it; others compute hidden / heads)."""
    hidden, heads = _first(config, HIDDEN), _first(config, HEADS)
    head_dim = getattr(config, "head_dim", None) or getattr(config, hidden) // getattr(config, heads)
    if case in ("hidden", "all"):
        setattr(config, hidden, getattr(config, hidden) + 16)
    if case in ("units", "all"):
        for name in UNITS:
            if isinstance(getattr(config, name, None), int):
                setattr(config, name, getattr(config, name) + 16)
        if getattr(config, "n_inner", 0) is None:  # GPT-2: 4 · n_embd unless set
            config.n_inner = 4 * config.n_embd + 16
        if isinstance(getattr(config, "mlp_ratio", None), int):  # DINOv2: units = hidden · mlp_ratio
            config.mlp_ratio += 1
    if case in ("heads", "all"):
        kv = getattr(config, "num_key_value_heads", None)
        group = getattr(config, heads) // kv if isinstance(kv, int) else 1
        setattr(config, heads, getattr(config, heads) + 2)
        if isinstance(kv, int):
            config.num_key_value_heads = kv + 2 // group
    config.head_dim = head_dim


def _wider(config: Any, case: str, family: str) -> Any:
    like = copy.deepcopy(config)
    if family in TWO_TOWERS:
        _grow(like.text_config, case)
        if family == "clip" and case in ("hidden", "all"):
            like.projection_dim += 8  # the joint space may grow too (no norm reads it)
    else:
        _grow(like, case)
    return like


def _gap(model: Any, wide: Any) -> float:
    """Max |Δ| over the family's outputs; a hidden state compares its first d features, the rest
    must be zero."""
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before, after = outputs_of(model, spec, inputs), outputs_of(wide, spec, inputs)
    worst = 0.0
    for key, a in before.items():
        b = after[key]
        if b.shape[-1] > a.shape[-1]:
            worst = max(worst, float(b[..., a.shape[-1] :].abs().max()))
            b = b[..., : a.shape[-1]]
        worst = max(worst, float((a - b).abs().max()))
    return worst


HEAD_DIM = "head_dim 8 → (12|16|5|4)"  # hidden size / heads: neither grows alone
ROTARY = "head_dim 8 → (12|16) .*rotary"  # heads widen only without rotary embeddings
NARROWER = "head_dim 8 → (5|4) .*narrower head"  # more heads in the same width: each one narrower
POST_NORM = "not centred"
# family → case → the refusal's reason (absent: exact). Where head_dim = hidden size / heads, a wider
# stream widens the heads: exact without rotary embeddings (queries × √(head_dim′/head_dim))
REFUSED: dict[str, dict[str, str]] = {
    **{f: {"hidden": POST_NORM, "heads": NARROWER, "all": POST_NORM} for f in ("bert-cls", "roberta-mlm")},
    "distilbert-mlm": {"hidden": POST_NORM, "heads": NARROWER, "all": POST_NORM},
    "modernbert-mlm": {"hidden": ROTARY, "heads": HEAD_DIM, "all": "embeddings.norm"},
    **{f: {"heads": NARROWER} for f in ("gpt2", "gpt2-untied", "gpt2-base")},
    "gpt-neox": {"hidden": ROTARY, "heads": HEAD_DIM},
    **{f: {"heads": NARROWER} for f in TWO_TOWERS},
}
FAMILIES = (
    # one of each layout (Llama's MHA, Mistral and Qwen2 are llama-gqa's; xlm-roberta is roberta's)
    *("llama-gqa", "llama-tied-bias", "qwen3-tied", "phi3", "phi3-tied", "mixtral", "qwen2-moe", "qwen3-moe"),
    *("gemma", "gemma2", "gemma3-text", "olmo2", "gpt2", "gpt2-untied", "gpt2-base", "gpt-neox"),
    *("vit", "vit-base", "dinov2-cls", "clip", "siglip", "bert-cls", "roberta-mlm", "distilbert-mlm", "modernbert-mlm"),
)


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {}


def _model(models: dict[str, Any], family: str) -> Any:
    if family not in models:
        models[family] = tiny.FACTORIES[family](0).eval()
    return models[family]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_embed_model_is_exact_or_refused_with_the_reason(models: dict[str, Any], family: str, case: str) -> None:
    model = _model(models, family)
    like = _wider(model.config, case, family)
    why = REFUSED.get(family, {}).get(case)
    if why is not None:
        with pytest.raises(IncompatibleModelsError, match=why):
            embed_model(model, like)
        return
    wide, report = embed_model(model, like)
    assert report.grown, "nothing grew: the case tests nothing"
    assert _gap(model, wide) <= 1e-4


@pytest.mark.parametrize(
    ("family", "tower", "why"),
    [
        ("clip", "vision_config", "pre_layrnorm sits on the residual path"),
        ("siglip", "vision_config", "reads this LayerNorm stream without a norm"),  # the pooling head's stream
    ],
)
def test_a_vision_stream_that_cannot_be_centred_is_refused(
    models: dict[str, Any], family: str, tower: str, why: str
) -> None:
    model = _model(models, family)
    like = copy.deepcopy(model.config)
    _grow(getattr(like, tower), "all")
    with pytest.raises(IncompatibleModelsError, match=why):
        embed_model(model, like)


def test_the_wider_configs_epsilon_moves_the_function_a_little(models: dict[str, Any]) -> None:
    """exact_eps=False keeps the wide config's ε (a model merged into an existing wide one must):
    the function moves by O(ε / mean square), measurably but little."""
    model = _model(models, "llama-gqa")
    like = _wider(model.config, "hidden", "llama-gqa")
    wide, report = embed_model(model, like, exact_eps=False)
    gap = _gap(model, wide)
    assert 0.0 < gap <= 1e-3
    assert wide.config.rms_norm_eps == like.rms_norm_eps
    assert "off by" in " ".join(report.describe())


def test_gemmas_tied_head_takes_the_embedding_scale_back_in_its_final_norm(models: dict[str, Any]) -> None:
    """Gemma multiplies its embeddings by √hidden_size: they are scaled by √(d/d′), and the tied LM
    head's final norm by √(d′/d) on top of its √(d/d′): γ as it was, and the head stays tied."""
    model = _model(models, "gemma")
    wide, report = embed_model(model, _wider(model.config, "hidden", "gemma"))
    assert wide.config.tie_word_embeddings and not report.untied
    assert wide.lm_head.weight.data_ptr() == wide.model.embed_tokens.weight.data_ptr()
    d, d_wide = model.config.hidden_size, wide.config.hidden_size
    got = wide.model.embed_tokens.weight[:, :d]
    assert torch.allclose(got, model.model.embed_tokens.weight * math.sqrt(d / d_wide))
    assert torch.allclose(wide.model.norm.weight[:d], model.model.norm.weight)


def test_olmo2_heads_alone_keep_the_shared_epsilon(models: dict[str, Any]) -> None:
    """OLMo 2's q_norm / k_norm normalise every head's features and share `rms_norm_eps` with the
    residual norms: with heads alone the ε stays, and the projections they read scale instead."""
    model = _model(models, "olmo2")
    wide, report = embed_model(model, _wider(model.config, "heads", "olmo2"))
    assert wide.config.rms_norm_eps == model.config.rms_norm_eps and not report.eps
    assert _gap(model, wide) <= 1e-4


def test_the_reference_codes_pair_widens_each_head_exactly() -> None:
    """Theus et al.'s heterogeneous pair: GPT-2 of d = 128 and d = 192, both with 4 heads (head_dim
    32 → 48). Head h's feature j goes to h·48 + j, its queries × √(48/32): the stock wide model
    computes the narrow one's logits."""
    narrow = T.GPT2LMHeadModel(T.GPT2Config(n_embd=128, n_head=4, n_layer=2, vocab_size=64, n_positions=32)).eval()
    like = copy.deepcopy(narrow.config)
    like.n_embd = 192
    wide, report = embed_model(narrow, like)
    assert _gap(narrow, wide) <= 1e-4
    assert any("head_dim" in line and "32 → 48" in line for line in report.describe())
    c_attn_n = narrow.transformer.h[0].attn.c_attn.weight.detach()  # Conv1D: [in, q | k | v]
    c_attn_w = wide.transformer.h[0].attn.c_attn.weight.detach()
    q_n, q_w = c_attn_n[:, :128].reshape(128, 4, 32), c_attn_w[:, :192].reshape(192, 4, 48)
    k_n, k_w = c_attn_n[:, 128:256].reshape(128, 4, 32), c_attn_w[:, 192:384].reshape(192, 4, 48)
    # the narrow stream is in canonical form (LayerNorm folded) in the wide model: compare ratios of
    # queries to keys, which the fold scales alike, on the narrow features of each head
    scale = (q_w[:128, :, :32] / k_w[:128, :, :32]) / (q_n / k_n)
    finite = torch.isfinite(scale)
    assert torch.allclose(scale[finite], torch.full_like(scale[finite], math.sqrt(48 / 32)), rtol=1e-3)
    assert q_w[:, :, 32:].abs().max() == 0 and k_w[:, :, 32:].abs().max() == 0  # the added features read nothing


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-tied"])
def test_rotary_heads_do_not_widen(models: dict[str, Any], family: str) -> None:
    """RoPE's frequencies depend on head_dim: a wider head is refused, with the reason."""
    model = _model(models, family)
    like = copy.deepcopy(model.config)
    like.head_dim = model.config.head_dim * 2
    with pytest.raises(IncompatibleModelsError, match="rotary"):
        embed_model(model, like)


@pytest.mark.parametrize("family", ["t5", "mt5"])
def test_a_t5_without_a_rescale_before_its_head_grows_its_stream_exactly(models: dict[str, Any], family: str) -> None:
    """T5 v1.1 and mT5 (no d_model**-0.5 before the head): the stream and the feed-forward units grow,
    zeros in the new features and each RMSNorm's γ rescaled; the original T5 (below) is refused."""
    model = _model(models, family)
    like = copy.deepcopy(model.config)
    like.d_model, like.d_ff = like.d_model + 16, like.d_ff + 16
    wide, report = embed_model(model, like)
    assert wide.config.d_model == like.d_model and any("res" in k for k in report.grown)
    assert _gap(model, wide) <= 1e-4


@pytest.mark.parametrize("family", ["t5", "mt5", "t5-relu"])
def test_t5_heads_grow_in_number_and_width_exactly(models: dict[str, Any], family: str) -> None:
    """T5 divides its scores by nothing, so a wider head keeps its queries as they are (other families
    scale them by √(head_dim′/head_dim)); an added head's position-bias column is read by nothing, its
    output projection being zero. The original T5 (its tied head rescaled) takes both too."""
    model = _model(models, family)
    like = copy.deepcopy(model.config)
    like.d_kv, like.num_heads = like.d_kv + 8, like.num_heads + 2
    wide, _ = embed_model(model, like)
    assert (wide.config.d_kv, wide.config.num_heads) == (like.d_kv, like.num_heads)
    assert _gap(model, wide) <= 1e-4
    narrow_q = model.encoder.block[0].layer[0].SelfAttention.q.weight.detach()
    wide_q = wide.encoder.block[0].layer[0].SelfAttention.q.weight.detach()
    dh, heads = model.config.d_kv, model.config.num_heads
    kept = wide_q.reshape(like.num_heads, like.d_kv, -1)[:heads, :dh].reshape(heads * dh, -1)
    assert torch.equal(kept, narrow_q)  # the same queries, not rescaled
    assert wide_q.reshape(like.num_heads, like.d_kv, -1)[:, dh:].abs().max() == 0  # added features read nothing


def test_the_original_t5_stream_is_refused_by_name(models: dict[str, Any]) -> None:
    model = _model(models, "t5-relu")
    like = copy.deepcopy(model.config)
    like.d_model *= 2
    with pytest.raises(IncompatibleModelsError, match=r"`d_model` is .*d_model\*\*-0\.5 rescale"):
        embed_model(model, like)
