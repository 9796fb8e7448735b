"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE (the Llama layout with a sparse MLP).

Each MoE layer has a router (``mlp.gate.weight`` ``[E, d]``: one row per expert, a softmax over
experts, then the top k) and E gated experts, which transformers 5 holds as two 3-D tensors:
``mlp.experts.gate_up_proj`` ``[E, 2f, d]`` (each expert's gate rows, then its up rows) and
``mlp.experts.down_proj`` ``[E, d, f]``. Their checkpoints store every expert's matrices apart
(Mixtral ``block_sparse_moe.experts.{j}.w1/w3/w2``, the Qwen MoEs ``mlp.experts.{j}.gate_proj/
up_proj/down_proj``): transformers stacks them while loading and splits them again when it saves.

The symmetry: experts may be put in any order, each with its router row; inside an expert its units
permute (and scale, being gated) as in a dense MLP; a vector added to every router row changes no
softmax. The residual stream reads and writes as in Llama. Qwen2-MoE adds a dense *shared expert*
(a gated MLP of its own, ``mlp.shared_expert``) whose output a sigmoid gate of the stream scales
(``mlp.shared_expert_gate.weight`` ``[1, d]``); Qwen MoEs may keep some layers dense
(``mlp_only_layers``, ``decoder_sparse_step``), which bind as Llama's MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_rebasin.symmetry.adapters.base import (
    ArchitectureSpec,
    ExpertsT,
    GluT,
    HeadsT,
    NormT,
    SpaceT,
    SublayerT,
    stacked_readers,
    stacked_writer,
)
from hf_rebasin.symmetry.adapters.llama import QWEN3, llama_dims
from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA
from hf_rebasin.symmetry.spaces import Fused

ATTN = "layers.{i}.attn"
MLP = "layers.{i}.mlp"  # a dense layer's units
MOE = "layers.{i}.moe"  # a sparse layer's experts
SHARED = "layers.{i}.shared"  # Qwen2-MoE's shared expert
L = "{base}layers.{i}"
UNITS = f"{MOE}:units"
GATE_UP = f"{L}.mlp.experts.gate_up_proj"
DOWN = f"{L}.mlp.experts.down_proj"


def moe_dims(c: Any) -> dict[str, int]:
    """Llama's sizes plus the experts': how many (Mixtral ``num_local_experts``, Qwen ``num_experts``)
    and the units of each (Mixtral ``intermediate_size``, Qwen ``moe_intermediate_size``)."""
    dims = llama_dims(c)
    dims["experts"] = getattr(c, "num_local_experts", None) or c.num_experts
    dims["expert_ff"] = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    dims["shared_ff"] = getattr(c, "shared_expert_intermediate_size", None) or 0
    return dims


_ATTENTION = {k: v for k, v in LLAMA.tensors.items() if ".self_attn." in k or "embed_tokens" in k or "lm_head" in k}

SPEC = ArchitectureSpec(
    family="mixtral",
    model_types=("mixtral",),
    base_prefix="model.",
    dims=moe_dims,
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", "orthogonal", kind="residual"),
        HeadsT(ATTN, kv_heads="kv_heads", rotary=True),
        ExpertsT(MOE),
    ),
    tensors={
        **_ATTENTION,
        "score.weight": (None, "res"),
        f"{L}.mlp.gate.weight": (f"{MOE}:experts", "res"),
        GATE_UP: (Fused((UNITS, UNITS)), "res"),
        DOWN: ("res", UNITS),
    },
    views={GATE_UP: stacked_readers("experts", "expert_ff", "d"), DOWN: stacked_writer("experts", "expert_ff", "d")},
    norms=(
        NormT(f"{L}.input_layernorm", "res", tuple(f"{L}.self_attn.{p}_proj.weight" for p in "qkv"), bias=False),
        NormT(f"{L}.post_attention_layernorm", "res", (f"{L}.mlp.gate.weight", GATE_UP), bias=False),
        NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), bias=False, final=True),
    ),
    ties=LLAMA.ties,
    invariant=LLAMA.invariant,
    sublayers=(
        LLAMA.sublayers[0],
        SublayerT((f"{L}.post_attention_layernorm", f"{L}.mlp.gate", GATE_UP), (DOWN,)),
    ),
    embeddings=LLAMA.embeddings,
    last_hidden=LLAMA.last_hidden,
    norm_type="rmsnorm",
    outputs=LLAMA.outputs,
    glus=(GluT(UNITS, (GATE_UP, 0), (GATE_UP, 1), DOWN),),
)

_DENSE = {k: v for k, v in LLAMA.tensors.items() if ".mlp." in k}
_SHARED_TENSORS = {
    f"{L}.mlp.shared_expert.gate_proj.weight": (SHARED, "res"),
    f"{L}.mlp.shared_expert.up_proj.weight": (SHARED, "res"),
    f"{L}.mlp.shared_expert.down_proj.weight": ("res", SHARED),
    f"{L}.mlp.shared_expert_gate.weight": (None, "res"),
}
_MLP_READERS = (
    f"{L}.mlp.gate.weight",
    GATE_UP,
    f"{L}.mlp.shared_expert.gate_proj.weight",
    f"{L}.mlp.shared_expert.up_proj.weight",
    f"{L}.mlp.shared_expert_gate.weight",
    f"{L}.mlp.gate_proj.weight",
    f"{L}.mlp.up_proj.weight",
)

# Qwen2-MoE: q/k/v biases (as Qwen2), a shared expert beside the routed ones, dense layers where
# the config keeps them.
QWEN2_MOE = dataclasses.replace(
    SPEC,
    family="qwen2_moe",
    model_types=("qwen2_moe",),
    spaces=(*SPEC.spaces, SpaceT(SHARED, "shared_ff", kind="mlp"), SpaceT(MLP, "ff", kind="mlp")),
    tensors={**SPEC.tensors, **_DENSE, **_SHARED_TENSORS},
    norms=(SPEC.norms[0], NormT(f"{L}.post_attention_layernorm", "res", _MLP_READERS, bias=False), SPEC.norms[2]),
    sublayers=(
        LLAMA.sublayers[0],
        SublayerT(  # what reads the norm's output, as modules (the stacked experts: their tensor)
            (f"{L}.post_attention_layernorm", *(r.removesuffix(".weight") for r in _MLP_READERS)),
            (DOWN, f"{L}.mlp.shared_expert.down_proj", f"{L}.mlp.down_proj"),
        ),
    ),
    glus=(
        *SPEC.glus,
        GluT(
            SHARED,
            f"{L}.mlp.shared_expert.gate_proj.weight",
            f"{L}.mlp.shared_expert.up_proj.weight",
            f"{L}.mlp.shared_expert.down_proj.weight",
        ),
        *LLAMA.glus,
    ),
)

# Qwen3-MoE: Qwen3's attention (q_norm / k_norm fix each head's Q/K features), no shared expert.
QWEN3_MOE = dataclasses.replace(
    QWEN2_MOE,
    family="qwen3_moe",
    model_types=("qwen3_moe",),
    spaces=(
        SPEC.spaces[0],
        QWEN3.spaces[1],  # Qwen3's heads: Q/K inner maps fixed by q_norm / k_norm
        ExpertsT(MOE),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    invariant=(*LLAMA.invariant, f"{L}.self_attn.q_norm.weight", f"{L}.self_attn.k_norm.weight"),
)
