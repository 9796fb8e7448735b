"""Llama family (Llama, Mistral, Qwen2): pre-RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP. Qwen2 adds q/k/v biases; any of them may tie the LM head to the embeddings. Qwen3 adds
per-head q/k norms (`QWEN3`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, GluT, HeadsT, NormT, SpaceT, SublayerT

ATTN = "layers.{i}.attn"
MLP = "layers.{i}.mlp"
L = "{base}layers.{i}"


def llama_dims(c: Any) -> dict[str, int]:
    """Sizes of a Llama-layout config (Gemma and Qwen3 read theirs the same way)."""
    d, heads = c.hidden_size, c.num_attention_heads
    return {
        "d": d,
        "layers": c.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or d // heads,
        "ff": c.intermediate_size,
    }


SPEC = ArchitectureSpec(
    family="llama",
    model_types=("llama", "mistral", "qwen2"),
    base_prefix="model.",
    dims=llama_dims,
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", "orthogonal", kind="residual"),
        HeadsT(ATTN, kv_heads="kv_heads", rotary=True),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        "{base}embed_tokens.weight": (None, "res"),
        **{f"{L}.self_attn.{p}_proj.weight": (f"{ATTN}:{p}", "res") for p in "qkv"},
        **{f"{L}.self_attn.{p}_proj.bias": (f"{ATTN}:{p}",) for p in "qkv"},
        f"{L}.self_attn.o_proj.weight": ("res", f"{ATTN}:o"),
        f"{L}.self_attn.o_proj.bias": ("res",),
        f"{L}.mlp.gate_proj.weight": (MLP, "res"),
        f"{L}.mlp.gate_proj.bias": (MLP,),
        f"{L}.mlp.up_proj.weight": (MLP, "res"),
        f"{L}.mlp.up_proj.bias": (MLP,),
        f"{L}.mlp.down_proj.weight": ("res", MLP),
        f"{L}.mlp.down_proj.bias": ("res",),
        "lm_head.weight": (None, "res"),
        "score.weight": (None, "res"),
    },
    norms=(
        NormT(f"{L}.input_layernorm", "res", tuple(f"{L}.self_attn.{p}_proj.weight" for p in "qkv"), bias=False),
        NormT(
            f"{L}.post_attention_layernorm", "res", (f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"), bias=False
        ),
        NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), bias=False, final=True),
    ),
    ties={"lm_head.weight": "{base}embed_tokens.weight"},
    invariant=("score.bias",),
    sublayers=(
        SublayerT((f"{L}.input_layernorm", *(f"{L}.self_attn.{p}_proj" for p in "qkv")), (f"{L}.self_attn.o_proj",)),
        SublayerT((f"{L}.post_attention_layernorm", f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj"), (f"{L}.mlp.down_proj",)),
    ),
    embeddings=("{base}embed_tokens",),
    last_hidden={"res": "{base}norm"},
    norm_type="rmsnorm",
    outputs={"logits": None, "last_hidden_state": "res"},
    glus=(GluT(MLP, f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight", f"{L}.mlp.down_proj.weight"),),
)


# Qwen3: Llama's layout plus q_norm / k_norm, an RMSNorm over each head's features (one γ shared by
# all heads) between the Q/K projections and RoPE. A head permutation leaves them be, but no Q/K
# inner map commutes with γ: Q/K are fixed, V/O stay free. They never touch the residual stream.
QWEN3 = dataclasses.replace(
    SPEC,
    family="qwen3",
    model_types=("qwen3",),
    spaces=(
        SpaceT("res", "d", "orthogonal", kind="residual"),
        HeadsT(ATTN, kv_heads="kv_heads", rotary=True, qk="fixed", reason="q_norm/k_norm scale each feature of a head"),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    invariant=(*SPEC.invariant, f"{L}.self_attn.q_norm.weight", f"{L}.self_attn.k_norm.weight"),
)
