"""Apertus (swiss-ai): Llama's pre-RMSNorm layer, its norms named ``attention_layernorm`` and
``feedforward_layernorm``, with Qwen3's per-head ``q_norm`` / ``k_norm`` (one γ over head_dim shared
by the heads: head permutations exact, Q/K inner maps fixed, V/O free) and an ungated MLP,
``down_proj(xielu(up_proj(x)))``. xIELU acts on each unit alone with learned scalars (``alpha_p``,
``alpha_n``, buffers ``beta``, ``eps``) shared by every unit, so units permute; it is neither odd nor
homogeneous, so no per-unit scale or sign is exact (no GLU is declared)."""

from __future__ import annotations

import dataclasses

from hf_rebasin.symmetry.adapters.base import NormT, SublayerT
from hf_rebasin.symmetry.adapters.llama import QWEN3, L
from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA

QKV = tuple(f"{L}.self_attn.{p}_proj" for p in "qkv")
UP, DOWN = f"{L}.mlp.up_proj", f"{L}.mlp.down_proj"
ACT = f"{L}.mlp.act_fn"

SPEC = dataclasses.replace(
    QWEN3,
    family="apertus",
    model_types=("apertus",),
    tensors={k: v for k, v in LLAMA.tensors.items() if ".mlp.gate_proj." not in k},
    norms=(
        NormT(f"{L}.attention_layernorm", "res", tuple(f"{q}.weight" for q in QKV), bias=False),
        NormT(f"{L}.feedforward_layernorm", "res", (f"{UP}.weight",), bias=False),
        LLAMA.norms[-1],
    ),
    sublayers=(
        SublayerT((f"{L}.attention_layernorm", *QKV), (f"{L}.self_attn.o_proj",)),
        SublayerT((f"{L}.feedforward_layernorm", UP), (DOWN,)),
    ),
    # xIELU's scalars, one of each per layer, the same for every unit
    invariant=(*QWEN3.invariant, *(f"{ACT}.{p}" for p in ("alpha_p", "alpha_n", "beta", "eps"))),
    glus=(),
)
