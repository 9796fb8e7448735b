"""Tiny random models of every supported architecture, built from configs (no Hub)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers as T

V = 64  # vocabulary of every tiny text model


def _seed(seed: int) -> None:
    torch.manual_seed(seed)


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
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=64,
            )
        ),
        seed,
    )


def bert_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(
        T.BertForSequenceClassification(
            T.BertConfig(
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=64,
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
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=64,
            )
        ),
        seed,
    )


def roberta_mlm(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(
        T.RobertaForMaskedLM(
            T.RobertaConfig(
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=64,
            )
        ),
        seed,
    )


def roberta_cls(seed: int = 0) -> torch.nn.Module:
    _seed(seed)
    return _randomize_norms(
        T.RobertaForSequenceClassification(
            T.RobertaConfig(
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=64,
                num_labels=3,
            )
        ),
        seed,
    )


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


FACTORIES: dict[str, Callable[..., torch.nn.Module]] = {
    "bert-mlm": bert_mlm,
    "bert-cls": bert_cls,
    "bert-base": bert_base,
    "roberta-mlm": roberta_mlm,
    "roberta-cls": roberta_cls,
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
}
