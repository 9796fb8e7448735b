"""Arcee (AFM-4.5B): Llama's layout (pre-RMSNorm, rotary embeddings, grouped-query attention,
optional biases) with an ungated MLP, ``down_proj(relu²(up_proj(x)))``. Its units permute with the
rows of ``up_proj`` and the columns of ``down_proj``; there is no gate, so Llama's per-unit GLU
scaling (up × s, down ÷ s) is not exact: relu² is homogeneous of degree 2 and not odd, so a unit's
scale would have to be positive and come back squared. The MLP space stays a plain permutation."""

from __future__ import annotations

import dataclasses

from hf_rebasin.symmetry.adapters.base import NormT, SublayerT
from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA
from hf_rebasin.symmetry.adapters.llama import L

QKV = tuple(f"{L}.self_attn.{p}_proj" for p in "qkv")
UP, DOWN = f"{L}.mlp.up_proj", f"{L}.mlp.down_proj"
# Llama's attention norm and final norm; the MLP's norm is read by up_proj alone
PRE_NORMS = (
    NormT(f"{L}.input_layernorm", "res", tuple(f"{q}.weight" for q in QKV), bias=False),
    NormT(f"{L}.post_attention_layernorm", "res", (f"{UP}.weight",), bias=False),
    LLAMA.norms[-1],
)

SPEC = dataclasses.replace(
    LLAMA,
    family="arcee",
    model_types=("arcee",),
    tensors={k: v for k, v in LLAMA.tensors.items() if ".mlp.gate_proj." not in k},
    norms=PRE_NORMS,
    sublayers=(
        SublayerT((f"{L}.input_layernorm", *QKV), (f"{L}.self_attn.o_proj",)),
        SublayerT((f"{L}.post_attention_layernorm", UP), (DOWN,)),
    ),
    glus=(),
)
