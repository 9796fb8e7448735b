"""GPT-BigCode (StarCoder 1, SantaCoder): GPT-2's layer (pre-LayerNorm with weight and bias, learned
absolute positions, a GELU MLP ``c_fc`` → ``c_proj``, an LM head tied to ``wte``) stored as
``nn.Linear`` ([out, in], not GPT-2's Conv1D), with multi-query attention. ``c_attn``'s rows are
``[q of every head | the one k | the one v]`` under ``multi_query: true`` (the default) and
``[head 0: q | k | v, head 1: …]`` under ``multi_query: false``: both are the fused axis laid out per
KV group (one group of every query head, or one group per head). No rotary embeddings, so Q/K and
V/O inner maps are free, one of each per K/V head: every query head shares the multi-query model's
one key. ``add_cross_attention`` (decoder layers that attend to an encoder) is refused."""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.symmetry.adapters.base import HeadsT, SpaceT
from hf_rebasin.symmetry.adapters.gpt2 import ATTN, MLP
from hf_rebasin.symmetry.adapters.gpt2 import SPEC as GPT2
from hf_rebasin.symmetry.spaces import Fused

L = "{base}h.{i}"
QKV = Fused((f"{ATTN}:q", f"{ATTN}:k", f"{ATTN}:v"), interleaved=True)


def _dims(c: Any) -> dict[str, int]:
    d, heads = c.n_embd, c.n_head
    return {
        "d": d,
        "layers": c.n_layer,
        "heads": heads,
        "kv_heads": 1 if c.multi_query else heads,
        "head_dim": d // heads,
        "ff": c.n_inner or 4 * d,
    }


def _configured(c: Any) -> dict[str, Any]:
    """Cross-attention layers read an encoder's stream this spec does not describe: refused."""
    if getattr(c, "add_cross_attention", False):
        raise UnsupportedArchitectureError(
            "GPT-BigCode with add_cross_attention: true is not supported: its crossattention / ln_cross_attn "
            "layers read an encoder's hidden states, a stream of its own that this adapter does not describe; "
            "decoder-only GPT-BigCode models (StarCoder, SantaCoder) are supported"
        )
    return {}


SPEC = dataclasses.replace(
    GPT2,
    family="gpt_bigcode",
    model_types=("gpt_bigcode",),
    dims=_dims,
    spaces=(
        SpaceT("res", "d", "orthogonal", centered=True, kind="residual"),
        HeadsT(ATTN, kv_heads="kv_heads"),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    # GPT-2's templates with nn.Linear's [out, in] weights and the per-group fused c_attn
    tensors={
        "{base}wte.weight": (None, "res"),
        "{base}wpe.weight": (None, "res"),
        f"{L}.attn.c_attn.weight": (QKV, "res"),
        f"{L}.attn.c_attn.bias": (QKV,),
        f"{L}.attn.c_proj.weight": ("res", f"{ATTN}:o"),
        f"{L}.attn.c_proj.bias": ("res",),
        f"{L}.mlp.c_fc.weight": (MLP, "res"),
        f"{L}.mlp.c_fc.bias": (MLP,),
        f"{L}.mlp.c_proj.weight": ("res", MLP),
        f"{L}.mlp.c_proj.bias": ("res",),
        "lm_head.weight": (None, "res"),
        "score.weight": (None, "res"),
    },
    # the causal-mask buffer (not saved by transformers 5, present in some old checkpoints)
    invariant=("{base}bias", f"{L}.attn.bias", f"{L}.attn.masked_bias", "score.bias"),
    configured=_configured,
)
