"""StableLM (StableLM-3B-4E1T, StableLM 2): Llama's layout (grouped-query attention, SwiGLU MLP,
optional q/k/v biases) with LayerNorms (weight and bias: the stream rotates fixing the all-ones
vector) and partial rotary embeddings (``partial_rotary_factor``, 0.25 by default: Q/K inner maps
fixed). With ``use_parallel_residual`` attention and MLP both read ``input_layernorm``'s output of
the stream entering the layer (no ``post_attention_layernorm``): one sublayer per layer.
``qk_layernorm`` (StableLM 2 12B) is refused: it holds one LayerNorm module per head
(``q_layernorm.norms.{h}``), so a head permutation would move whole tensors between modules, which
no binding describes."""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.symmetry.adapters.base import GluT, NormT, SublayerT
from hf_rebasin.symmetry.adapters.llama import MLP, L
from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA
from hf_rebasin.symmetry.adapters.starcoder2 import ROTARY_LAYERNORM_SPACES, rotary_dims

QKV = tuple(f"{L}.self_attn.{p}_proj" for p in "qkv")
GATE_UP = (f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj")
ATTN_IN, ATTN_OUT = (f"{L}.input_layernorm", *QKV), (f"{L}.self_attn.o_proj",)
MLP_IN, MLP_OUT = (f"{L}.post_attention_layernorm", *GATE_UP), (f"{L}.mlp.down_proj",)
FINAL = NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), final=True)


def _configured(c: Any) -> dict[str, Any]:
    """A parallel residual: the MLP reads ``input_layernorm`` too. Per-head q/k norms: refused."""
    if getattr(c, "qk_layernorm", False):
        raise UnsupportedArchitectureError(
            "StableLM with qk_layernorm: true is not supported: its q/k LayerNorms are one module per head "
            "(self_attn.q_layernorm.norms.0, .1, …), so permuting heads would move whole tensors between "
            "modules, which hf-rebasin does not describe yet (StableLM 2 12B has them); StableLM models with "
            "qk_layernorm: false (StableLM-3B-4E1T, StableLM 2 1.6B) are supported"
        )
    if not getattr(c, "use_parallel_residual", False):
        return {}
    readers = tuple(f"{m}.weight" for m in (*QKV, *GATE_UP))
    return {
        "norms": (NormT(f"{L}.input_layernorm", "res", readers), FINAL),
        "sublayers": (SublayerT((*ATTN_IN, *GATE_UP), (*ATTN_OUT, *MLP_OUT)),),
    }


SPEC = dataclasses.replace(
    LLAMA,
    family="stablelm",
    model_types=("stablelm",),
    dims=rotary_dims,
    spaces=ROTARY_LAYERNORM_SPACES,
    norms=(
        NormT(f"{L}.input_layernorm", "res", tuple(f"{m}.weight" for m in QKV)),
        NormT(f"{L}.post_attention_layernorm", "res", tuple(f"{m}.weight" for m in GATE_UP)),
        FINAL,
    ),
    sublayers=(SublayerT(ATTN_IN, ATTN_OUT), SublayerT(MLP_IN, MLP_OUT)),
    configured=_configured,
    norm_type="layernorm",
    glus=(GluT(MLP, f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight", f"{L}.mlp.down_proj.weight"),),
)
