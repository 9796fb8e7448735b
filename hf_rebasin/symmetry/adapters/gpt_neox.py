"""GPT-NeoX (Pythia): pre-LayerNorm decoder with partial rotary embeddings (``rotary_pct``, 0.25 by
default: Q/K inner maps fixed). ``query_key_value`` rows are laid out per head,
``[head 0: q | k | v, head 1: …]``, an interleaved fused axis. With ``use_parallel_residual`` (the
default) attention and MLP both read the stream that enters the layer and both write the next one:
one sublayer per layer. The LM head (``embed_out`` in old checkpoints) is untied unless the config ties it."""

from __future__ import annotations

from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.adapters.phi3 import rotary_dim
from hf_rebasin.symmetry.spaces import Fused

ATTN = "layers.{i}.attn"
MLP = "layers.{i}.mlp"
L = "{base}layers.{i}"
QKV = Fused((f"{ATTN}:q", f"{ATTN}:k", f"{ATTN}:v"), interleaved=True)
ATTN_IN, ATTN_OUT = (f"{L}.input_layernorm", f"{L}.attention.query_key_value"), (f"{L}.attention.dense",)
MLP_IN, MLP_OUT = (f"{L}.post_attention_layernorm", f"{L}.mlp.dense_h_to_4h"), (f"{L}.mlp.dense_4h_to_h",)


def _dims(c: Any) -> dict[str, int]:
    d, heads = c.hidden_size, c.num_attention_heads
    return {
        "d": d,
        "layers": c.num_hidden_layers,
        "heads": heads,
        "head_dim": d // heads,
        "rotary_dim": rotary_dim(c, d // heads),
        "ff": c.intermediate_size,
    }


def _configured(c: Any) -> dict[str, Any]:
    """A sequential residual (``use_parallel_residual: false``): attention, then the MLP reads its sum."""
    if getattr(c, "use_parallel_residual", True):
        return {}
    return {"sublayers": (SublayerT(ATTN_IN, ATTN_OUT), SublayerT(MLP_IN, MLP_OUT))}


SPEC = ArchitectureSpec(
    family="gpt_neox",
    model_types=("gpt_neox",),
    base_prefix="gpt_neox.",
    dims=_dims,
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", "orthogonal", centered=True, kind="residual"),
        HeadsT(ATTN, rotary=True, rotary_dim="rotary_dim"),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        "{base}embed_in.weight": (None, "res"),
        f"{L}.attention.query_key_value.weight": (QKV, "res"),
        f"{L}.attention.query_key_value.bias": (QKV,),
        f"{L}.attention.dense.weight": ("res", f"{ATTN}:o"),
        f"{L}.attention.dense.bias": ("res",),
        f"{L}.mlp.dense_h_to_4h.weight": (MLP, "res"),
        f"{L}.mlp.dense_h_to_4h.bias": (MLP,),
        f"{L}.mlp.dense_4h_to_h.weight": ("res", MLP),
        f"{L}.mlp.dense_4h_to_h.bias": ("res",),
        "lm_head.weight": (None, "res"),
        "score.weight": (None, "res"),
    },
    norms=(
        NormT(f"{L}.input_layernorm", "res", (f"{L}.attention.query_key_value.weight",)),
        NormT(f"{L}.post_attention_layernorm", "res", (f"{L}.mlp.dense_h_to_4h.weight",)),
        NormT("{base}final_layer_norm", "res", ("lm_head.weight", "score.weight"), final=True),
    ),
    ties={"lm_head.weight": "{base}embed_in.weight"},
    # causal-mask buffers of old checkpoints: never transform them
    invariant=(f"{L}.attention.bias", f"{L}.attention.masked_bias", "score.bias"),
    sublayers=(SublayerT((*ATTN_IN, *MLP_IN), (*ATTN_OUT, *MLP_OUT)),),
    configured=_configured,
    embeddings=("{base}embed_in",),
    last_hidden={"res": "{base}final_layer_norm"},
    outputs={"logits": None, "last_hidden_state": "res"},
)
