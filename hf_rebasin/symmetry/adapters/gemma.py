"""Gemma 1, 2 and 3 (text): Llama-like decoders whose RMSNorm computes x·(1 + w).

Gemma (1) is Llama's layout (rotary embeddings, multi-/grouped-query attention with an explicit
``head_dim``, GeGLU MLP, LM head tied to the embeddings by default) with every norm's offset 1, so
γ = 1 + w and canonical form leaves w = 0. The embeddings are multiplied by √d (a non-persistent
buffer, from the config): a scalar, which commutes with every map of the residual stream, and which a
wider config changes (``embedding_scales``).

Gemma 2 and 3 add a norm after each sublayer (``post_attention_layernorm``,
``post_feedforward_layernorm``) whose output is added to the stream: γ ⊙ x / rms(x) is written into
the residual, and no linear layer reads it, so γ cannot be folded and no rotation of the stream is
exact. An RMSNorm is blind to signs, so what is exact is a signed permutation: writers and readers
take the signs, every γ only the permutation. Gemma 3 adds q_norm / k_norm (one γ per head
feature, shared by the heads, as Qwen3): Q/K inner maps are fixed. Logit soft-capping (tanh of the
scores and of the logits) and ``query_pre_attn_scalar`` act on basis-free values.
"""

from __future__ import annotations

import dataclasses

from hf_rebasin.symmetry.adapters.base import NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.adapters.llama import ATTN, MLP, QWEN3, L
from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA

# Llama's layout (Gemma has no MLP biases: templates of tensors a model lacks bind nothing), with
# every norm multiplying by 1 + w
SPEC = dataclasses.replace(
    LLAMA,
    family="gemma",
    model_types=("gemma",),
    norms=tuple(dataclasses.replace(norm, offset=1.0) for norm in LLAMA.norms),
    embedding_scales={"{base}embed_tokens.weight": 0.5},  # times √hidden_size, from the config
)

SANDWICH = "post-sublayer norms write γ ⊙ x / rms(x) into the stream: γ cannot be folded"
_QKV = tuple(f"{L}.self_attn.{p}_proj.weight" for p in "qkv")

GEMMA2 = dataclasses.replace(
    SPEC,
    family="gemma2",
    model_types=("gemma2",),
    spaces=(SpaceT("res", "d", "signed-permutation", kind="residual", reason=SANDWICH), *LLAMA.spaces[1:]),
    norms=(
        NormT(f"{L}.input_layernorm", "res", _QKV, bias=False, offset=1.0),
        NormT(f"{L}.post_attention_layernorm", "res", bias=False, offset=1.0),
        NormT(
            f"{L}.pre_feedforward_layernorm",
            "res",
            (f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"),
            bias=False,
            offset=1.0,
        ),
        NormT(f"{L}.post_feedforward_layernorm", "res", bias=False, offset=1.0),
        NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), bias=False, final=True, offset=1.0),
    ),
    sublayers=(
        SublayerT(
            (f"{L}.input_layernorm", *(f"{L}.self_attn.{p}_proj" for p in "qkv")),
            (f"{L}.self_attn.o_proj", f"{L}.post_attention_layernorm"),
        ),
        SublayerT(
            (f"{L}.pre_feedforward_layernorm", f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj"),
            (f"{L}.mlp.down_proj", f"{L}.post_feedforward_layernorm"),
        ),
    ),
)

# Gemma 3's text model: Gemma 2's layers plus Qwen3's per-head q/k norms (Q/K fixed)
GEMMA3 = dataclasses.replace(
    GEMMA2,
    family="gemma3_text",
    model_types=("gemma3_text",),
    spaces=(GEMMA2.spaces[0], *QWEN3.spaces[1:]),
    invariant=QWEN3.invariant,
)

__all__ = ["ATTN", "GEMMA2", "GEMMA3", "MLP", "SPEC"]
