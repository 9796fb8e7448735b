"""Phi-3 (and Phi-4-mini): the Llama layout with fused projections. ``qkv_proj`` rows are
q | k | v (fewer K/V heads under grouped-query attention), ``gate_up_proj`` rows gate | up (both the
MLP's units). With ``partial_rotary_factor`` < 1 only the first features of each head rotate, so the
Q/K inner maps are fixed; a full rotary model keeps its rotary-plane rotations."""

from __future__ import annotations

from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, GluT, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.spaces import Fused

ATTN = "layers.{i}.attn"
MLP = "layers.{i}.mlp"
L = "{base}layers.{i}"
QKV = Fused((f"{ATTN}:q", f"{ATTN}:k", f"{ATTN}:v"))
GATE_UP = f"{L}.mlp.gate_up_proj.weight"


def rotary_dim(config: Any, head_dim: int) -> int:
    """How many features of each head rotate: transformers rotates ``int(head_dim · factor)``,
    rounded up to whole planes (its frequencies step by 2)."""
    rope = getattr(config, "rope_parameters", None)
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    return 2 * len(range(0, int(head_dim * factor), 2))


def _dims(c: Any) -> dict[str, int]:
    d, heads = c.hidden_size, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or d // heads
    return {
        "d": d,
        "layers": c.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "rotary_dim": rotary_dim(c, head_dim),
        "ff": c.intermediate_size,
    }


SPEC = ArchitectureSpec(
    family="phi3",
    model_types=("phi3",),
    base_prefix="model.",
    dims=_dims,
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", "orthogonal", kind="residual"),
        HeadsT(ATTN, kv_heads="kv_heads", rotary=True, rotary_dim="rotary_dim"),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        "{base}embed_tokens.weight": (None, "res"),
        f"{L}.self_attn.qkv_proj.weight": (QKV, "res"),
        f"{L}.self_attn.qkv_proj.bias": (QKV,),
        f"{L}.self_attn.o_proj.weight": ("res", f"{ATTN}:o"),
        f"{L}.self_attn.o_proj.bias": ("res",),
        f"{L}.mlp.gate_up_proj.weight": (Fused((MLP, MLP)), "res"),
        f"{L}.mlp.gate_up_proj.bias": (Fused((MLP, MLP)),),
        f"{L}.mlp.down_proj.weight": ("res", MLP),
        f"{L}.mlp.down_proj.bias": ("res",),
        "lm_head.weight": (None, "res"),
        "score.weight": (None, "res"),
    },
    norms=(
        NormT(f"{L}.input_layernorm", "res", (f"{L}.self_attn.qkv_proj.weight",), bias=False),
        NormT(f"{L}.post_attention_layernorm", "res", (f"{L}.mlp.gate_up_proj.weight",), bias=False),
        NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), bias=False, final=True),
    ),
    ties={"lm_head.weight": "{base}embed_tokens.weight"},
    invariant=("score.bias",),
    sublayers=(
        SublayerT((f"{L}.input_layernorm", f"{L}.self_attn.qkv_proj"), (f"{L}.self_attn.o_proj",)),
        SublayerT((f"{L}.post_attention_layernorm", f"{L}.mlp.gate_up_proj"), (f"{L}.mlp.down_proj",)),
    ),
    embeddings=("{base}embed_tokens",),
    last_hidden={"res": "{base}norm"},
    norm_type="rmsnorm",
    outputs={"logits": None, "last_hidden_state": "res"},
    # gate_up_proj rows: gate | up (transformers: ``up * act(gate)``)
    glus=(GluT(MLP, (GATE_UP, 0), (GATE_UP, 1), f"{L}.mlp.down_proj.weight"),),
)
