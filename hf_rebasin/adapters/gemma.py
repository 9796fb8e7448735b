"""Gemma (1): Llama-like pre-RMSNorm decoder (rotary embeddings, multi-/grouped-query attention
with an explicit ``head_dim``, GeGLU MLP, LM head tied to the embeddings by default), but its
RMSNorm computes x·(1 + w): every norm has offset 1, so γ = 1 + w and canonical form leaves w = 0.
The embeddings are multiplied by √d (a non-persistent buffer): a scalar, which commutes with every
map of the residual stream."""

from __future__ import annotations

from .base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from .llama import llama_dims

ATTN = "layers.{i}.attn"
MLP = "layers.{i}.mlp"
L = "{base}layers.{i}"


SPEC = ArchitectureSpec(
    family="gemma",
    model_types=("gemma",),
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
        f"{L}.mlp.up_proj.weight": (MLP, "res"),
        f"{L}.mlp.down_proj.weight": ("res", MLP),
        "lm_head.weight": (None, "res"),
        "score.weight": (None, "res"),
    },
    norms=(
        NormT(
            f"{L}.input_layernorm",
            "res",
            tuple(f"{L}.self_attn.{p}_proj.weight" for p in "qkv"),
            bias=False,
            offset=1.0,
        ),
        NormT(
            f"{L}.post_attention_layernorm",
            "res",
            (f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"),
            bias=False,
            offset=1.0,
        ),
        NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), bias=False, final=True, offset=1.0),
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
)
