"""StarCoder2: Llama's attention (rotary embeddings, grouped-query attention, q/k/v/o biases) with
GPT-2's LayerNorms (weight and bias) and a plain GELU MLP (``c_fc`` → ``c_proj``, biases). LayerNorm
subtracts the mean, so a rotation of the stream must fix the all-ones vector (canonical form centres
the writers and folds γ/β into the readers). The LM head is tied to the embeddings by default."""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_rebasin.symmetry.adapters.base import HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.adapters.llama import ATTN, MLP, L, llama_dims
from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA
from hf_rebasin.symmetry.adapters.phi3 import rotary_dim

QKV = tuple(f"{L}.self_attn.{p}_proj.weight" for p in "qkv")


def rotary_dims(c: Any) -> dict[str, int]:
    """Llama's sizes plus the features per head that rotate (a partial rotary factor fixes Q/K)."""
    dims = llama_dims(c)
    return {**dims, "rotary_dim": rotary_dim(c, dims["head_dim"])}


# a LayerNorm stream (rotations fixing the ones vector), rotary heads (partial where `rotary_dim` < head_dim),
# one MLP space per layer: StarCoder2's and StableLM's
ROTARY_LAYERNORM_SPACES = (
    SpaceT("res", "d", "orthogonal", centered=True, kind="residual"),
    HeadsT(ATTN, kv_heads="kv_heads", rotary=True, rotary_dim="rotary_dim"),
    SpaceT(MLP, "ff", kind="mlp"),
)

# Llama's attention and head templates; the MLP and norms are GPT-2's
_ATTENTION = {k: v for k, v in LLAMA.tensors.items() if ".mlp." not in k}

SPEC = dataclasses.replace(
    LLAMA,
    family="starcoder2",
    model_types=("starcoder2",),
    dims=rotary_dims,
    spaces=ROTARY_LAYERNORM_SPACES,
    tensors={
        **_ATTENTION,
        f"{L}.mlp.c_fc.weight": (MLP, "res"),
        f"{L}.mlp.c_fc.bias": (MLP,),
        f"{L}.mlp.c_proj.weight": ("res", MLP),
        f"{L}.mlp.c_proj.bias": ("res",),
    },
    norms=(
        NormT(f"{L}.input_layernorm", "res", QKV),
        NormT(f"{L}.post_attention_layernorm", "res", (f"{L}.mlp.c_fc.weight",)),
        NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), final=True),
    ),
    sublayers=(
        SublayerT((f"{L}.input_layernorm", *(f"{L}.self_attn.{p}_proj" for p in "qkv")), (f"{L}.self_attn.o_proj",)),
        SublayerT((f"{L}.post_attention_layernorm", f"{L}.mlp.c_fc"), (f"{L}.mlp.c_proj",)),
    ),
    norm_type="layernorm",
    glus=(),
)
