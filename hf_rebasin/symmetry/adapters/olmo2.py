"""OLMo 2: a Llama-like decoder with norms after each sublayer only and q/k norms over all heads.

Each layer computes ``h + post_attention_layernorm(attn(h))`` and ``h + post_feedforward_layernorm(
mlp(h))``: the projections read the raw stream and every norm but the last writes γ ⊙ x / rms(x)
into it, so no γ folds away and no rotation of the stream is exact; a signed permutation is (writers
and readers take the signs, γ only the permutation). ``q_norm`` / ``k_norm`` are RMSNorms over the
whole query / key projection (every head at once): a head permutation permutes their γ with the
heads, but no inner Q/K map commutes with γ, so Q/K are fixed; V/O stay free.
"""

from __future__ import annotations

import dataclasses

from hf_rebasin.symmetry.adapters.base import HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.adapters.llama import ATTN, MLP, L
from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA

SPEC = dataclasses.replace(
    LLAMA,
    family="olmo2",
    model_types=("olmo2",),
    spaces=(
        SpaceT("res", "d", "signed-permutation", kind="residual", reason="post-sublayer norms write γ ⊙ x / rms(x)"),
        HeadsT(ATTN, kv_heads="kv_heads", rotary=True, qk="fixed", reason="q_norm/k_norm scale each query/key feature"),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        **LLAMA.tensors,
        f"{L}.self_attn.q_norm.weight": (f"{ATTN}:q",),  # one γ per query feature of every head
        f"{L}.self_attn.k_norm.weight": (f"{ATTN}:k",),
    },
    # RMSNorms over every head's features: more heads, a smaller rms (`hf_rebasin.symmetry.embed`)
    role_norms=(
        NormT(f"{L}.self_attn.q_norm", f"{ATTN}:q", bias=False),
        NormT(f"{L}.self_attn.k_norm", f"{ATTN}:k", bias=False),
    ),
    norms=(
        NormT(f"{L}.post_attention_layernorm", "res", bias=False),
        NormT(f"{L}.post_feedforward_layernorm", "res", bias=False),
        NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), bias=False, final=True),
    ),
    sublayers=(
        SublayerT(
            tuple(f"{L}.self_attn.{p}_proj" for p in "qkv"),
            (f"{L}.self_attn.o_proj", f"{L}.post_attention_layernorm"),
        ),
        SublayerT(
            (f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj"), (f"{L}.mlp.down_proj", f"{L}.post_feedforward_layernorm")
        ),
    ),
)
