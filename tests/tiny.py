"""Tiny random models of every supported architecture, built from configs (no Hub)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers as T

V = 64  # vocabulary of every tiny text model
# the tiny encoders' sizes (BERT's field names): 2 layers of width 32, 4 heads, 48 MLP units
ENCODER_SIZES = {
    "vocab_size": V,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
}
# the text of the character-level tests (its characters fit in V with room for <mask> and specials)
HAMLET = (
    "to be, or not to be, that is the question:\n"
    "whether 'tis nobler in the mind to suffer\n"
    "the slings and arrows of outrageous fortune,\n"
    "or to take arms against a sea of troubles\n"
    "and by opposing end them. to die, to sleep;\n"
)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)


def drifted(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """``model`` with a rank-2 change of every linear layer but the token tables and the head (in
    place): a fine-tune or a target trained apart a little, what a low-rank correction can undo."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "shared" not in name and "lm_head" not in name:
                a, b = torch.randn(p.shape[0], 2, generator=g), torch.randn(2, p.shape[1], generator=g)
                p.add_(scale * p.std() * (a @ b) / 2)
    return model


def bart_lora(base: str, std: float) -> torch.nn.Module:
    """A PEFT LoRA adapter (rank 4 on q, v and fc1) on the BART in folder ``base``, its B factors
    drawn with ``std`` (seeded) so that it changes the model."""
    import peft

    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "fc1"], task_type="SEQ_2_SEQ_LM")
    tuned = peft.get_peft_model(T.AutoModelForSeq2SeqLM.from_pretrained(base), config)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std, generator=torch.Generator().manual_seed(1))
    return tuned


def _randomize_norms(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fresh models have γ = 1, β = 0 and tiny weights (near-uniform attention), which would hide
    norm- and head-handling bugs: give every parameter an O(1) effect."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            low = name.lower()
            if any(s in low for s in ("norm", "ln_", "layernorm", "pre_layrnorm")):
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias") or p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model.eval()


def bert_mlm(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(
        T.BertForMaskedLM(
            T.BertConfig(
                **ENCODER_SIZES,
            )
        ),
        seed,
    )


def bert_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(
        T.BertForSequenceClassification(
            T.BertConfig(
                **ENCODER_SIZES,
                num_labels=3,
            )
        ),
        seed,
    )


def bert_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(
        T.BertModel(
            T.BertConfig(
                **ENCODER_SIZES,
            )
        ),
        seed,
    )


def _roberta_config(**kw: object) -> T.RobertaConfig:
    return T.RobertaConfig(
        **ENCODER_SIZES,
        **kw,
    )


def roberta_mlm(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.RobertaForMaskedLM(_roberta_config()), seed)


def roberta_mc(seed: int = 0) -> torch.nn.Module:
    """Multiple choice: RoBERTa's pooler (its sequence classifier has none) to one score."""
    _seed(seed)
    return _randomize_norms(T.RobertaForMultipleChoice(_roberta_config()), seed)


def roberta_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.RobertaForSequenceClassification(_roberta_config(num_labels=3)), seed)


def gpt2(seed: int = 0, tied: bool = True) -> torch.nn.Module:
    _seed(seed)
    cfg = T.GPT2Config(
        vocab_size=V,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _randomize_norms(T.GPT2LMHeadModel(cfg), seed)


def gpt2_untied(seed: int = 0) -> torch.nn.Module:
    return gpt2(seed, tied=False)


def gpt2_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(
        T.GPT2Model(
            T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
        ),
        seed,
    )


def vit(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    cfg = T.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        image_size=8,
        patch_size=4,
        num_channels=1,
        num_labels=5,
    )
    return _randomize_norms(T.ViTForImageClassification(cfg), seed)


def vit_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    cfg = T.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        image_size=8,
        patch_size=4,
        num_channels=3,
    )
    return _randomize_norms(T.ViTModel(cfg), seed)


def _llama_like(cls: type, cfg_cls: type, seed: int, tied: bool, **kw: object) -> torch.nn.Module:
    _seed(seed)
    cfg = cfg_cls(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        **kw,
    )
    return _randomize_norms(cls(cfg), seed)


def llama(seed: int = 0) -> torch.nn.Module:
    return _llama_like(T.LlamaForCausalLM, T.LlamaConfig, seed, tied=False)


def llama_tied_bias(seed: int = 0) -> torch.nn.Module:
    return _llama_like(T.LlamaForCausalLM, T.LlamaConfig, seed, tied=True, attention_bias=True, mlp_bias=True)


def llama_mha(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    cfg = T.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    return _randomize_norms(T.LlamaForCausalLM(cfg), seed)


def mistral(seed: int = 0) -> torch.nn.Module:
    return _llama_like(T.MistralForCausalLM, T.MistralConfig, seed, tied=False)


def qwen2(seed: int = 0) -> torch.nn.Module:
    return _llama_like(T.Qwen2ForCausalLM, T.Qwen2Config, seed, tied=True)


def qwen2_untied(seed: int = 0) -> torch.nn.Module:
    return _llama_like(T.Qwen2ForCausalLM, T.Qwen2Config, seed, tied=False)


def clip(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    cfg = T.CLIPConfig(
        text_config=dict(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=1,
        ),
        vision_config=dict(
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=3,
            intermediate_size=40,
            image_size=8,
            patch_size=4,
            num_channels=3,
        ),
        projection_dim=16,
    )
    return _randomize_norms(T.CLIPModel(cfg), seed)


# ---- encoders: XLM-RoBERTa, DistilBERT, ModernBERT ---------------------------------------------


def _xlm_roberta_config(**kw: object) -> T.XLMRobertaConfig:
    return T.XLMRobertaConfig(
        **ENCODER_SIZES,
        **kw,
    )


def xlm_roberta_mlm(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.XLMRobertaForMaskedLM(_xlm_roberta_config()), seed)


def xlm_roberta_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.XLMRobertaForSequenceClassification(_xlm_roberta_config(num_labels=3)), seed)


def _distilbert_config(**kw: object) -> T.DistilBertConfig:
    return T.DistilBertConfig(
        vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=64, pad_token_id=0, **kw
    )


def distilbert_mlm(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.DistilBertForMaskedLM(_distilbert_config()), seed)


def distilbert_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.DistilBertForSequenceClassification(_distilbert_config(num_labels=3)), seed)


def distilbert_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.DistilBertModel(_distilbert_config()), seed)


def _modernbert_config(**kw: object) -> T.ModernBertConfig:
    # layer 0 global, layer 1 sliding-window attention; a 4-token window so it bites on 12 tokens
    return T.ModernBertConfig(
        **ENCODER_SIZES,
        local_attention=4,
        pad_token_id=0,
        bos_token_id=1,
        cls_token_id=1,
        eos_token_id=2,
        sep_token_id=2,
        **kw,
    )


def modernbert_mlm(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.ModernBertForMaskedLM(_modernbert_config()), seed)


def modernbert_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.ModernBertForSequenceClassification(_modernbert_config(num_labels=3)), seed)


def modernbert_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.ModernBertModel(_modernbert_config()), seed)


def modernbert_bias(seed: int = 0) -> torch.nn.Module:
    """Every bias ModernBERT can have, on a mean-pooling sequence classifier."""
    _seed(seed)
    cfg = _modernbert_config(
        num_labels=3,
        attention_bias=True,
        mlp_bias=True,
        norm_bias=True,
        classifier_bias=True,
        classifier_pooling="mean",
    )
    return _randomize_norms(T.ModernBertForSequenceClassification(cfg), seed)


# ---- Gemma (RMSNorm x·(1 + w)) and DINOv2 (LayerScale) -------------------------------------


def gemma(seed: int = 0) -> torch.nn.Module:
    """GQA with an explicit head_dim (16, not 32 / 4); tied LM head; norm weights w random, so γ = 1 + w."""
    _seed(seed)
    cfg = T.GemmaConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    return _randomize_norms(T.GemmaForCausalLM(cfg), seed)


def _dinov2(cls: type, seed: int, **kw: object) -> torch.nn.Module:
    _seed(seed)
    cfg = T.Dinov2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
        image_size=8,
        patch_size=4,
        num_channels=3,
        **kw,
    )
    model = _randomize_norms(cls(cfg), seed)
    g = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():  # LayerScale λ of 1 (or 0.1·randn) would hide folding bugs: 0.5 + U(0, 1)
        for name, p in model.named_parameters():
            if name.endswith("lambda1"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


def dinov2_cls(seed: int = 0) -> torch.nn.Module:
    return _dinov2(T.Dinov2ForImageClassification, seed, num_labels=5)


def dinov2_base(seed: int = 0) -> torch.nn.Module:
    return _dinov2(T.Dinov2Model, seed)


# ---- decoders: Qwen3 (q/k norms), Phi-3 (fused qkv, partial rotary), GPT-NeoX (per-head qkv) ----


def qwen3_tied(seed: int = 0) -> torch.nn.Module:
    """Tied head, q/k/v/o biases and an explicit head_dim (16, not 32 / 4); q_norm / k_norm random."""
    return _llama_like(T.Qwen3ForCausalLM, T.Qwen3Config, seed, tied=True, head_dim=16, attention_bias=True)


def qwen3_untied(seed: int = 0) -> torch.nn.Module:
    return _llama_like(T.Qwen3ForCausalLM, T.Qwen3Config, seed, tied=False, head_dim=8)


def phi3(seed: int = 0, tied: bool = False, rotary: float = 0.5) -> torch.nn.Module:
    """GQA through the fused qkv_proj; half of each head rotates (Q/K fixed) unless ``rotary`` is 1."""
    return _llama_like(
        T.Phi3ForCausalLM,
        T.Phi3Config,
        seed,
        tied=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        partial_rotary_factor=rotary,
    )


def phi3_tied(seed: int = 0) -> torch.nn.Module:
    """Full rotary (Q/K rotary planes, like Phi-3-mini) and a tied head."""
    return phi3(seed, tied=True, rotary=1.0)


def gpt_neox(seed: int = 0, parallel: bool = True, tied: bool = False) -> torch.nn.Module:
    """Pythia's layout: parallel residual, rotary_pct 0.25 (2 of 8 features per head), biases."""
    _seed(seed)
    cfg = T.GPTNeoXConfig(
        **ENCODER_SIZES,
        use_parallel_residual=parallel,
        tie_word_embeddings=tied,
    )
    return _randomize_norms(T.GPTNeoXForCausalLM(cfg), seed)


def gpt_neox_sequential(seed: int = 0) -> torch.nn.Module:
    return gpt_neox(seed, parallel=False, tied=True)


def siglip(seed: int = 0) -> torch.nn.Module:
    """SigLIP: both towers 32 wide (the text head writes the pooled vision stream), MLP widths that
    differ per tower, 4 patches of a 16-pixel image pooled by the attention head."""
    _seed(seed)
    cfg = T.SiglipConfig(
        text_config=dict(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        ),
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=40,
            image_size=16,
            patch_size=8,
            num_channels=3,
        ),
    )
    return _randomize_norms(T.SiglipModel(cfg), seed)


def siglip_cls(seed: int = 0) -> torch.nn.Module:
    """``SiglipForImageClassification``: `siglip`'s vision tower (its attention-pooling head kept,
    unused by the logits) under a classifier of the mean token, 3 labels; no text weights."""
    _seed(seed)
    cfg = T.SiglipConfig(
        text_config=dict(
            vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
        ),
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=40,
            image_size=16,
            patch_size=8,
            num_channels=3,
        ),
        num_labels=3,
    )
    return _randomize_norms(T.SiglipForImageClassification(cfg), seed)


# ---- post-sublayer norms: Gemma 2 / 3 (sandwich), OLMo 2 (post only) -------------------------


def gemma2(seed: int = 0) -> torch.nn.Module:
    """Sandwich norms (γ = 1 + w, random), both soft-caps, a sliding window shorter than the inputs
    (local and global layers), tied head."""
    return _llama_like(
        T.Gemma2ForCausalLM,
        T.Gemma2Config,
        seed,
        tied=True,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    )


def gemma3_text(seed: int = 0) -> torch.nn.Module:
    """Gemma 2's layers plus per-head q/k norms; untied head; a sliding window of 4."""
    return _llama_like(
        T.Gemma3ForCausalLM, T.Gemma3TextConfig, seed, tied=False, head_dim=8, sliding_window=4, query_pre_attn_scalar=8
    )


def olmo2(seed: int = 0) -> torch.nn.Module:
    """Norms after each sublayer only; q/k norms over all heads; GQA; untied head."""
    return _llama_like(T.Olmo2ForCausalLM, T.Olmo2Config, seed, tied=False, eos_token_id=None, pad_token_id=None)


# ---- mixture of experts: 4 experts, top 2; routers and experts random like every other weight ----


def mixtral(seed: int = 0) -> torch.nn.Module:
    return _llama_like(
        T.MixtralForCausalLM, T.MixtralConfig, seed, tied=False, num_local_experts=4, num_experts_per_tok=2
    )


def qwen2_moe(seed: int = 0) -> torch.nn.Module:
    """A shared expert beside the routed ones, q/k/v biases, and layer 1 dense (``mlp_only_layers``)."""
    return _llama_like(
        T.Qwen2MoeForCausalLM,
        T.Qwen2MoeConfig,
        seed,
        tied=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[1],
    )


def qwen3_moe(seed: int = 0) -> torch.nn.Module:
    """q_norm / k_norm, top-k renormalised, an explicit head_dim."""
    return _llama_like(
        T.Qwen3MoeForCausalLM,
        T.Qwen3MoeConfig,
        seed,
        tied=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        head_dim=8,
        norm_topk_prob=True,
    )


_BART_SIZES: dict[str, int] = {
    "vocab_size": V,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 40,
    "max_position_embeddings": 64,
}


def _bart_config(**kw: object) -> T.BartConfig:
    return T.BartConfig(**_BART_SIZES, **kw)


def bart(seed: int = 0) -> torch.nn.Module:
    """Encoder and decoder with different head counts and MLP widths; the head tied to ``shared``."""
    _seed(seed)
    return _randomize_norms(T.BartForConditionalGeneration(_bart_config()), seed)


def bart_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.BartForSequenceClassification(_bart_config(num_labels=3)), seed)


def bart_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.BartModel(_bart_config()), seed)


def _t5_config(cls: type = T.T5Config, **kw: object) -> T.T5Config:
    """inner_dim = 4 heads × d_kv 4 = 16 ≠ d_model 32; the decoder one layer deeper than the encoder."""
    kw = {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, **kw}
    return cls(
        vocab_size=V,
        d_model=32,
        d_kv=4,
        num_heads=4,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=3,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,  # as every released T5 config.json says (T5 shifts labels after it)
        **kw,
    )


def _head_apart(model: torch.nn.Module) -> torch.nn.Module:
    """A v1.1 / Flan-T5 / mT5 checkpoint as transformers 5 loads it: ``lm_head`` stored apart from
    ``shared`` (other values), so not tied, while the stacks' ``embed_tokens`` stay tied to it; the
    config then says ``tie_word_embeddings: false``, as hf-rebasin's loader reads such a model."""
    model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    model.all_tied_weights_keys = {a: s for a, s in model.all_tied_weights_keys.items() if a != "lm_head.weight"}
    model.config.tie_word_embeddings = False
    return model


def t5(seed: int = 0) -> torch.nn.Module:
    """T5 v1.1: gated-GELU, the LM head apart from the embeddings, no rescale before it."""
    _seed(seed)
    return _randomize_norms(_head_apart(T.T5ForConditionalGeneration(_t5_config())), seed)


def t5_relu(seed: int = 0) -> torch.nn.Module:
    """The original T5: ReLU feed-forward, the head tied, scaled by d_model**-0.5."""
    _seed(seed)
    config = _t5_config(feed_forward_proj="relu", tie_word_embeddings=True)
    return _randomize_norms(T.T5ForConditionalGeneration(config), seed)


def t5_encoder(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.T5EncoderModel(_t5_config()), seed)


def t5_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.T5ForSequenceClassification(_t5_config(num_labels=3)), seed)


def mt5(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(_head_apart(T.MT5ForConditionalGeneration(_t5_config(T.MT5Config))), seed)


def _whisper_config(**kw: object) -> T.WhisperConfig:
    """Encoder and decoder with different head counts, MLP widths and depths; 16 mel bins, 32 input
    frames. The special ids lie inside the tiny vocabulary (Whisper's defaults, 50256 and up, do not)."""
    return T.WhisperConfig(
        vocab_size=V,
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=48,
        decoder_ffn_dim=40,
        num_mel_bins=16,
        max_source_positions=16,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=[],
        begin_suppress_tokens=[],
        classifier_proj_size=24,
        **kw,
    )


def whisper(seed: int = 0) -> torch.nn.Module:
    """The head (``proj_out``) tied to the decoder's ``embed_tokens``."""
    _seed(seed)
    return _randomize_norms(T.WhisperForConditionalGeneration(_whisper_config()), seed)


def whisper_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.WhisperModel(_whisper_config()), seed)


def whisper_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.WhisperForAudioClassification(_whisper_config(num_labels=3)), seed)


# ---- decoders mergekit merges: Granite (scalar multipliers), StarCoder2, StableLM, Phi ----

# Granite's four scalars, far from 1 so that a map that failed to commute with them would show
GRANITE_SCALARS = {
    "embedding_multiplier": 3.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.2,
    "logits_scaling": 4.0,
}


def granite(seed: int = 0, tied: bool = False, **kw: object) -> torch.nn.Module:
    """GQA, untied head, the four multipliers set (none is 1)."""
    return _llama_like(T.GraniteForCausalLM, T.GraniteConfig, seed, tied=tied, **GRANITE_SCALARS, **kw)


def granite_tied_bias(seed: int = 0) -> torch.nn.Module:
    """Tied head, attention and MLP biases."""
    return granite(seed, tied=True, attention_bias=True, mlp_bias=True)


def granite_base(seed: int = 0) -> torch.nn.Module:
    """``GraniteModel``: its final norm's output is the model's output."""
    return _llama_like(T.GraniteModel, T.GraniteConfig, seed, tied=False, **GRANITE_SCALARS)


def _starcoder2(cls: type, seed: int, tied: bool = True, **kw: object) -> torch.nn.Module:
    """GQA, rotary, LayerNorms with bias, every projection biased, a GELU MLP."""
    return _llama_like(cls, T.Starcoder2Config, seed, tied=tied, **kw)


def starcoder2(seed: int = 0) -> torch.nn.Module:
    return _starcoder2(T.Starcoder2ForCausalLM, seed)


def starcoder2_untied(seed: int = 0) -> torch.nn.Module:
    """Untied head and no biases (``use_bias: false``)."""
    return _starcoder2(T.Starcoder2ForCausalLM, seed, tied=False, use_bias=False)


def starcoder2_cls(seed: int = 0) -> torch.nn.Module:
    return _starcoder2(T.Starcoder2ForSequenceClassification, seed, num_labels=3, pad_token_id=0)


def _stablelm(cls: type, seed: int, tied: bool = False, **kw: object) -> torch.nn.Module:
    """GQA, LayerNorms with bias, partial rotary (0.25: 2 of 8 features per head rotate)."""
    return _llama_like(cls, T.StableLmConfig, seed, tied=tied, bos_token_id=1, eos_token_id=2, **kw)


def stablelm(seed: int = 0) -> torch.nn.Module:
    """StableLM-2-1.6B's layout: a sequential residual, q/k/v biases, untied head."""
    return _stablelm(T.StableLmForCausalLM, seed, use_qkv_bias=True)


def stablelm_parallel(seed: int = 0) -> torch.nn.Module:
    """A parallel residual (attention and MLP read one ``input_layernorm``), tied head, no biases."""
    return _stablelm(T.StableLmForCausalLM, seed, tied=True, use_parallel_residual=True)


def stablelm_cls(seed: int = 0) -> torch.nn.Module:
    return _stablelm(T.StableLmForSequenceClassification, seed, num_labels=3, pad_token_id=0, use_qkv_bias=True)


def _phi(cls: type, seed: int, tied: bool = False, **kw: object) -> torch.nn.Module:
    """Parallel attention and MLP from one LayerNorm, biases everywhere (``lm_head`` too), GQA."""
    return _llama_like(cls, T.PhiConfig, seed, tied=tied, bos_token_id=1, eos_token_id=2, **kw)


def phi(seed: int = 0) -> torch.nn.Module:
    """Phi-2's layout: half of each head rotates (Q/K fixed), an untied head with a bias."""
    return _phi(T.PhiForCausalLM, seed)


def phi_qk(seed: int = 0) -> torch.nn.Module:
    """``qk_layernorm`` with full rotary (the q/k norms alone fix Q/K), a tied head."""
    return _phi(T.PhiForCausalLM, seed, tied=True, qk_layernorm=True, partial_rotary_factor=1.0)


def phi_cls(seed: int = 0) -> torch.nn.Module:
    return _phi(T.PhiForSequenceClassification, seed, num_labels=3, pad_token_id=0)


def cohere(seed: int = 0) -> torch.nn.Module:
    """Parallel residual, LayerNorms without bias, interleaved rotary pairs, GQA, tied head, a
    ``logit_scale`` of 0.5 (the others 1: logits of O(1) keep the checks sharp)."""
    return _llama_like(
        T.CohereForCausalLM, T.CohereConfig, seed, tied=True, bos_token_id=1, eos_token_id=2, logit_scale=0.5
    )


def cohere_qk(seed: int = 0) -> torch.nn.Module:
    """``use_qk_norm`` (a γ per feature of every head), q/k/v/o biases, untied head."""
    return _llama_like(
        T.CohereForCausalLM, T.CohereConfig, seed, tied=False, bos_token_id=1, eos_token_id=2,
        use_qk_norm=True, attention_bias=True, logit_scale=1.0,
    )  # fmt: skip


def cohere2(seed: int = 0) -> torch.nn.Module:
    """A sliding-window layer (rotary) then a global one (no positions), the window shorter than the inputs."""
    return _llama_like(
        T.Cohere2ForCausalLM, T.Cohere2Config, seed, tied=True, bos_token_id=1, eos_token_id=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4, logit_scale=1.0,
    )  # fmt: skip


def _falcon(cls: type, seed: int, **kw: object) -> torch.nn.Module:
    _seed(seed)
    cfg = T.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=48,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, **kw,
    )  # fmt: skip
    return _randomize_norms(cls(cfg), seed)


def falcon(seed: int = 0) -> torch.nn.Module:
    """Falcon-40B's layout: new_decoder_architecture, 2 KV groups in the fused qkv, ln_attn / ln_mlp."""
    return _falcon(T.FalconForCausalLM, seed, new_decoder_architecture=True, num_kv_heads=2)


def falcon_mqa(seed: int = 0) -> torch.nn.Module:
    """Falcon-7B's layout: multi-query (one K/V head), parallel attention from one input_layernorm,
    biases, an untied head."""
    return _falcon(
        T.FalconForCausalLM, seed, multi_query=True, parallel_attn=True, bias=True, tie_word_embeddings=False
    )


def falcon_sequential(seed: int = 0) -> torch.nn.Module:
    """Multi-head attention (q | k | v per head), attention then MLP, rotary."""
    return _falcon(T.FalconForCausalLM, seed, multi_query=False, parallel_attn=False)


def falcon_cls(seed: int = 0) -> torch.nn.Module:
    return _falcon(
        T.FalconForSequenceClassification, seed, new_decoder_architecture=True, num_kv_heads=2, num_labels=3,
        pad_token_id=0,
    )  # fmt: skip


# ---- decoders mergekit merges, second set: GPT-BigCode ----------------------------------------


def _gpt_bigcode(cls: type, seed: int, **kw: object) -> torch.nn.Module:
    _seed(seed)
    cfg = T.GPTBigCodeConfig(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_inner=48, n_positions=64, bos_token_id=1, eos_token_id=2, **kw
    )
    return _randomize_norms(cls(cfg), seed)


def gpt_bigcode(seed: int = 0) -> torch.nn.Module:
    """StarCoder's layout: multi-query (``c_attn`` = q of 4 heads | one k | one v), tied head."""
    return _gpt_bigcode(T.GPTBigCodeForCausalLM, seed)


def gpt_bigcode_mha(seed: int = 0) -> torch.nn.Module:
    """``multi_query: false``: ``c_attn`` laid out per head (q | k | v of head 0, then head 1, …), untied head."""
    return _gpt_bigcode(T.GPTBigCodeForCausalLM, seed, multi_query=False, tie_word_embeddings=False)


def gpt_bigcode_cls(seed: int = 0) -> torch.nn.Module:
    return _gpt_bigcode(T.GPTBigCodeForSequenceClassification, seed, num_labels=3, pad_token_id=0)


# ---- GLM-4: norms after each sublayer, fused gate_up_proj, interleaved partial rotary ------------


def _glm4(cls: type, seed: int, tied: bool = False, **kw: object) -> torch.nn.Module:
    """GQA, head_dim 8 of which half rotates in interleaved pairs, four norms per layer (random γ)."""
    return _llama_like(
        cls, T.Glm4Config, seed, tied=tied, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw
    )


def glm4(seed: int = 0) -> torch.nn.Module:
    """GLM-4-9B-0414's layout: q/k/v biases, partial_rotary_factor 0.5, untied head."""
    return _glm4(T.Glm4ForCausalLM, seed)


def glm4_tied(seed: int = 0) -> torch.nn.Module:
    """Full rotary (still interleaved pairs), no biases, a tied head."""
    return _glm4(T.Glm4ForCausalLM, seed, tied=True, attention_bias=False, partial_rotary_factor=1.0)


def glm4_cls(seed: int = 0) -> torch.nn.Module:
    return _glm4(T.Glm4ForSequenceClassification, seed, num_labels=3)


# ---- Arcee: Llama with an ungated relu² MLP ------------------------------------------------------


def arcee(seed: int = 0) -> torch.nn.Module:
    """AFM-4.5B's layout: GQA, ``up_proj`` → relu² → ``down_proj`` (no gate), untied head."""
    return _llama_like(T.ArceeForCausalLM, T.ArceeConfig, seed, tied=False, bos_token_id=1, eos_token_id=2)


def arcee_tied_bias(seed: int = 0) -> torch.nn.Module:
    """Tied head, attention and MLP biases."""
    return _llama_like(
        T.ArceeForCausalLM,
        T.ArceeConfig,
        seed,
        tied=True,
        bos_token_id=1,
        eos_token_id=2,
        attention_bias=True,
        mlp_bias=True,
    )


def arcee_cls(seed: int = 0) -> torch.nn.Module:
    return _llama_like(
        T.ArceeForSequenceClassification, T.ArceeConfig, seed, tied=False, num_labels=3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip


# ---- EXAONE 4.0: OLMo 2's post-sublayer norms, Qwen3's per-head q/k norms, NoPE global layers ----


def _exaone4(cls: type, seed: int, tied: bool = False, head_dim: int = 8, **kw: object) -> torch.nn.Module:
    """By default a sliding-window layer (rotary) then a global one (no positions), the window
    shorter than the inputs."""
    window: dict[str, object] = {"sliding_window": 4, "sliding_window_pattern": 2}
    return _llama_like(
        cls, T.Exaone4Config, seed, tied=tied, head_dim=head_dim, bos_token_id=1, eos_token_id=2, **{**window, **kw}
    )


def exaone4(seed: int = 0) -> torch.nn.Module:
    return _exaone4(T.Exaone4ForCausalLM, seed)


def exaone4_tied(seed: int = 0) -> torch.nn.Module:
    """Tied head, head_dim 16, no sliding window (``sliding_window: null``): rotary in every layer."""
    full = ["full_attention", "full_attention"]
    return _exaone4(T.Exaone4ForCausalLM, seed, tied=True, head_dim=16, sliding_window=None, layer_types=full)


def exaone4_cls(seed: int = 0) -> torch.nn.Module:
    return _exaone4(T.Exaone4ForSequenceClassification, seed, num_labels=3, pad_token_id=0)


# ---- Apertus: Llama with q/k norms and an ungated xIELU MLP -------------------------------------


def _apertus(cls: type, seed: int, tied: bool = False, **kw: object) -> torch.nn.Module:
    """GQA, head_dim 8, q/k norms (random γ), xIELU with its learned α moved off their defaults."""
    # Apertus' llama3 rope scaling, its original context shorter than the tiny one
    rope = {"rope_type": "llama3", "rope_theta": 12e6, "factor": 8.0, "original_max_position_embeddings": 16}
    rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    model = _llama_like(
        cls, T.ApertusConfig, seed, tied=tied, head_dim=8, bos_token_id=1, eos_token_id=2, rope_parameters=rope, **kw
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("alpha_p", "alpha_n")):
                p.copy_(p + 0.5)
    return model


def apertus(seed: int = 0) -> torch.nn.Module:
    """Apertus-8B's layout: untied head, no biases."""
    return _apertus(T.ApertusForCausalLM, seed)


def apertus_tied_bias(seed: int = 0) -> torch.nn.Module:
    """Tied head, q/k/v/o biases (``attention_bias``)."""
    return _apertus(T.ApertusForCausalLM, seed, tied=True, attention_bias=True)


def apertus_base(seed: int = 0) -> torch.nn.Module:
    """``ApertusModel``: its final norm's output is the model's output."""
    return _apertus(T.ApertusModel, seed)


def _seq2seq_config(cls: type, **kw: object) -> T.PretrainedConfig:
    """`_bart_config`'s sizes for a BART relative, with special tokens inside the tiny vocabulary
    (Marian's default pad id, 58100, is not)."""
    ids = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 1}
    return cls(**{**_BART_SIZES, **ids, **kw})


def mbart(seed: int = 0) -> torch.nn.Module:
    """Pre-LN, ``layernorm_embedding`` on the path and a final norm per stack; the head tied to ``shared``."""
    _seed(seed)
    return _randomize_norms(T.MBartForConditionalGeneration(_seq2seq_config(T.MBartConfig)), seed)


def mbart_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.MBartForSequenceClassification(_seq2seq_config(T.MBartConfig, num_labels=3)), seed)


def mbart_base(seed: int = 0) -> torch.nn.Module:
    """``MBartModel``: both final norms' outputs are outputs."""
    _seed(seed)
    return _randomize_norms(T.MBartModel(_seq2seq_config(T.MBartConfig)), seed)


def _sinusoids_back(model: torch.nn.Module) -> torch.nn.Module:
    """Marian's position tables as ``from_pretrained`` makes them (``_randomize_norms`` drew them
    at random: they are parameters, though never saved)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, T.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding):
                module.weight.copy_(module.create_weight())
    return model


def marian(seed: int = 0, **kw: object) -> torch.nn.Module:
    """Post-LN, sinusoidal positions regenerated on load, ``scale_embedding``, a random ``final_logits_bias``."""
    _seed(seed)
    model = _randomize_norms(T.MarianMTModel(_seq2seq_config(T.MarianConfig, scale_embedding=True, **kw)), seed)
    return _sinusoids_back(model)


def marian_apart(seed: int = 0) -> torch.nn.Module:
    """``share_encoder_decoder_embeddings: false``: the encoder's table (V rows) and the decoder's
    (``decoder_vocab_size`` rows, tied to the head) apart, no ``shared``."""
    return marian(seed, share_encoder_decoder_embeddings=False, decoder_vocab_size=V - 16)


def marian_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _sinusoids_back(_randomize_norms(T.MarianModel(_seq2seq_config(T.MarianConfig)), seed))


def m2m100(seed: int = 0) -> torch.nn.Module:
    """Pre-LN, a final norm per stack, ``scale_embedding``, sinusoidal positions in a buffer."""
    _seed(seed)
    config = _seq2seq_config(T.M2M100Config, scale_embedding=True)
    return _randomize_norms(T.M2M100ForConditionalGeneration(config), seed)


def m2m100_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.M2M100Model(_seq2seq_config(T.M2M100Config, scale_embedding=True)), seed)


# ---- ELECTRA: embeddings of their own size, projected into the stream -------------------------


def _electra_config(embedding_size: int = 16, **kw: object) -> T.ElectraConfig:
    return T.ElectraConfig(
        vocab_size=V,
        embedding_size=embedding_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        **kw,
    )


def electra(seed: int = 0) -> torch.nn.Module:
    """The discriminator (replaced-token detection), embeddings projected 16 -> 32."""
    _seed(seed)
    return _randomize_norms(T.ElectraForPreTraining(_electra_config()), seed)


def electra_mlm(seed: int = 0) -> torch.nn.Module:
    """The generator: its MLM head writes the embedding space, read by the tied word embeddings."""
    _seed(seed)
    return _randomize_norms(T.ElectraForMaskedLM(_electra_config()), seed)


def electra_mlm_equal(seed: int = 0) -> torch.nn.Module:
    """embedding_size == hidden_size: no embeddings_project, the tables write the stream itself."""
    _seed(seed)
    return _randomize_norms(T.ElectraForMaskedLM(_electra_config(embedding_size=32)), seed)


def electra_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.ElectraForSequenceClassification(_electra_config(num_labels=3)), seed)


def electra_mc(seed: int = 0) -> torch.nn.Module:
    """Multiple choice: the first token through ``sequence_summary`` (linear, GELU) to one score."""
    _seed(seed)
    return _randomize_norms(T.ElectraForMultipleChoice(_electra_config()), seed)


def electra_cls_equal(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.ElectraForSequenceClassification(_electra_config(32, num_labels=3)), seed)


def electra_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.ElectraModel(_electra_config()), seed)


# ---- DeBERTa-v2/v3: disentangled attention over a shared relative-position table --------------


def _deberta_config(**kw: object) -> T.DebertaV2Config:
    """DeBERTa-v3's settings: relative attention with p2c and c2p through the layers' own q/k
    projections, log buckets (4 buckets, so the 12-token inputs reach the log range), the table
    LayerNorm'd, no absolute positions."""
    settings: dict[str, object] = {
        **ENCODER_SIZES,
        "relative_attention": True,
        "pos_att_type": ["p2c", "c2p"],
        "share_att_key": True,
        "position_buckets": 4,
        "max_relative_positions": 16,
        "norm_rel_ebd": "layer_norm",
        "position_biased_input": False,
        "type_vocab_size": 0,
    }
    return T.DebertaV2Config(**{**settings, **kw})


def deberta_v2_mlm(seed: int = 0) -> torch.nn.Module:
    """DeBERTa-v3-like, the legacy MLM head (``cls.predictions``, decoder tied to the word table)."""
    _seed(seed)
    return _randomize_norms(T.DebertaV2ForMaskedLM(_deberta_config()), seed)


def deberta_v2_mlm_head(seed: int = 0) -> torch.nn.Module:
    """``legacy: false``: ``lm_predictions.lm_head`` multiplies by the word embeddings itself. Its
    parameters draw what the legacy head's draw, in the same order: the same function, other names."""
    _seed(seed)
    return _randomize_norms(T.DebertaV2ForMaskedLM(_deberta_config(legacy=False)), seed)


def deberta_v2_mlm_emb(seed: int = 0) -> torch.nn.Module:
    """``embedding_size`` 16 < 32: ``embed_proj`` reads the tables, the legacy head writes them."""
    _seed(seed)
    return _randomize_norms(T.DebertaV2ForMaskedLM(_deberta_config(embedding_size=16)), seed)


def deberta_v2_cls(seed: int = 0) -> torch.nn.Module:
    """``share_att_key: false``: per-layer ``pos_query_proj``/``pos_key_proj``; ContextPooler head."""
    _seed(seed)
    config = _deberta_config(share_att_key=False, num_labels=3)
    return _randomize_norms(T.DebertaV2ForSequenceClassification(config), seed)


def deberta_v2_token(seed: int = 0) -> torch.nn.Module:
    """c2p only, no table LayerNorm, token types: the classifier reads the stream."""
    _seed(seed)
    config = _deberta_config(pos_att_type=["c2p"], norm_rel_ebd="none", type_vocab_size=2, num_labels=5)
    return _randomize_norms(T.DebertaV2ForTokenClassification(config), seed)


def deberta_v2_base(seed: int = 0) -> torch.nn.Module:
    """DeBERTa-v2-like embeddings: absolute positions and token types in a 16-wide space."""
    _seed(seed)
    config = _deberta_config(embedding_size=16, position_biased_input=True, type_vocab_size=2)
    return _randomize_norms(T.DebertaV2Model(config), seed)


# ---- ALBERT: one layer's weights run at every depth, embeddings of their own size -------------


def _albert_config(embedding_size: int = 16, layers: int = 3, **kw: object) -> T.AlbertConfig:
    """By default three steps through one shared layer (``num_hidden_groups = inner_group_num = 1``)."""
    return T.AlbertConfig(
        vocab_size=V,
        embedding_size=embedding_size,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        **kw,
    )


def albert(seed: int = 0) -> torch.nn.Module:
    """Pre-training heads: the MLM head writes the embedding space, the SOP head reads the pooler."""
    _seed(seed)
    return _randomize_norms(T.AlbertForPreTraining(_albert_config()), seed)


def albert_mlm(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.AlbertForMaskedLM(_albert_config()), seed)


def albert_mlm_equal(seed: int = 0) -> torch.nn.Module:
    """embedding_size == hidden_size: ``embedding_hidden_mapping_in`` is still there, so ``emb`` stays apart."""
    _seed(seed)
    return _randomize_norms(T.AlbertForMaskedLM(_albert_config(embedding_size=32)), seed)


def albert_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.AlbertForSequenceClassification(_albert_config(num_labels=3)), seed)


def albert_base(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.AlbertModel(_albert_config()), seed)


def albert_groups(seed: int = 0) -> torch.nn.Module:
    """Two groups of two layers, four steps: each group runs twice, four layer modules in all."""
    _seed(seed)
    config = _albert_config(layers=4, num_hidden_groups=2, inner_group_num=2)
    return _randomize_norms(T.AlbertForMaskedLM(config), seed)


# ---- MPNet: BERT's layers, one relative position bias for all of them ------------------------


def _mpnet_config(**kw: object) -> T.MPNetConfig:
    return T.MPNetConfig(
        **ENCODER_SIZES,
        **kw,
    )


def mpnet_mlm(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(T.MPNetForMaskedLM(_mpnet_config()), seed)


def mpnet_cls(seed: int = 0) -> torch.nn.Module:
    """MPNetClassificationHead: dense → tanh → out_proj on the first token's state."""
    _seed(seed)
    return _randomize_norms(T.MPNetForSequenceClassification(_mpnet_config(num_labels=3)), seed)


def mpnet_base(seed: int = 0) -> torch.nn.Module:
    """With the pooler, as sentence-transformers' all-mpnet-base-v2 is stored."""
    _seed(seed)
    return _randomize_norms(T.MPNetModel(_mpnet_config()), seed)


FACTORIES: dict[str, Callable[..., torch.nn.Module]] = {
    "bart": bart,
    "bart-cls": bart_cls,
    "bart-base": bart_base,
    "bert-mlm": bert_mlm,
    "bert-cls": bert_cls,
    "bert-base": bert_base,
    "roberta-mlm": roberta_mlm,
    "roberta-cls": roberta_cls,
    "roberta-mc": roberta_mc,
    "gpt2": gpt2,
    "gpt2-untied": gpt2_untied,
    "gpt2-base": gpt2_base,
    "vit": vit,
    "vit-base": vit_base,
    "llama-gqa": llama,
    "llama-tied-bias": llama_tied_bias,
    "llama-mha": llama_mha,
    "mistral": mistral,
    "qwen2-tied": qwen2,
    "qwen2-untied": qwen2_untied,
    "clip": clip,
    "xlm-roberta-mlm": xlm_roberta_mlm,
    "xlm-roberta-cls": xlm_roberta_cls,
    "distilbert-mlm": distilbert_mlm,
    "distilbert-cls": distilbert_cls,
    "distilbert-base": distilbert_base,
    "modernbert-mlm": modernbert_mlm,
    "modernbert-cls": modernbert_cls,
    "modernbert-base": modernbert_base,
    "modernbert-bias": modernbert_bias,
    "gemma": gemma,
    "dinov2-cls": dinov2_cls,
    "dinov2-base": dinov2_base,
    "qwen3-tied": qwen3_tied,
    "qwen3-untied": qwen3_untied,
    "phi3": phi3,
    "phi3-tied": phi3_tied,
    "gpt-neox": gpt_neox,
    "gpt-neox-sequential": gpt_neox_sequential,
    "siglip": siglip,
    "siglip-cls": siglip_cls,
    "gemma2": gemma2,
    "gemma3-text": gemma3_text,
    "olmo2": olmo2,
    "mixtral": mixtral,
    "qwen2-moe": qwen2_moe,
    "qwen3-moe": qwen3_moe,
    "t5": t5,
    "t5-relu": t5_relu,
    "t5-encoder": t5_encoder,
    "t5-cls": t5_cls,
    "mt5": mt5,
    "whisper": whisper,
    "whisper-base": whisper_base,
    "whisper-cls": whisper_cls,
    "granite": granite,
    "granite-tied-bias": granite_tied_bias,
    "granite-base": granite_base,
    "starcoder2": starcoder2,
    "starcoder2-untied": starcoder2_untied,
    "starcoder2-cls": starcoder2_cls,
    "stablelm": stablelm,
    "stablelm-parallel": stablelm_parallel,
    "stablelm-cls": stablelm_cls,
    "phi": phi,
    "phi-qk": phi_qk,
    "phi-cls": phi_cls,
    "cohere": cohere,
    "cohere-qk": cohere_qk,
    "cohere2": cohere2,
    "falcon": falcon,
    "falcon-mqa": falcon_mqa,
    "falcon-sequential": falcon_sequential,
    "falcon-cls": falcon_cls,
    "mbart": mbart,
    "mbart-cls": mbart_cls,
    "marian": marian,
    "marian-apart": marian_apart,
    "marian-base": marian_base,
    "m2m100": m2m100,
    "mbart-base": mbart_base,
    "m2m100-base": m2m100_base,
    "electra": electra,
    "electra-mlm": electra_mlm,
    "electra-mlm-equal": electra_mlm_equal,
    "electra-cls": electra_cls,
    "electra-mc": electra_mc,
    "electra-cls-equal": electra_cls_equal,
    "electra-base": electra_base,
    "deberta-v2-mlm": deberta_v2_mlm,
    "deberta-v2-mlm-head": deberta_v2_mlm_head,
    "deberta-v2-mlm-emb": deberta_v2_mlm_emb,
    "deberta-v2-cls": deberta_v2_cls,
    "deberta-v2-token": deberta_v2_token,
    "deberta-v2-base": deberta_v2_base,
    "albert": albert,
    "albert-mlm": albert_mlm,
    "albert-mlm-equal": albert_mlm_equal,
    "albert-cls": albert_cls,
    "albert-base": albert_base,
    "albert-groups": albert_groups,
    "mpnet-mlm": mpnet_mlm,
    "mpnet-cls": mpnet_cls,
    "mpnet-base": mpnet_base,
    "gpt-bigcode": gpt_bigcode,
    "gpt-bigcode-mha": gpt_bigcode_mha,
    "gpt-bigcode-cls": gpt_bigcode_cls,
    "glm4": glm4,
    "glm4-tied": glm4_tied,
    "glm4-cls": glm4_cls,
    "arcee": arcee,
    "arcee-tied-bias": arcee_tied_bias,
    "arcee-cls": arcee_cls,
    "exaone4": exaone4,
    "exaone4-tied": exaone4_tied,
    "exaone4-cls": exaone4_cls,
    "apertus": apertus,
    "apertus-tied-bias": apertus_tied_bias,
    "apertus-base": apertus_base,
}
