"""Falcon: a pre-LayerNorm decoder (weight and bias: the stream rotates fixing the all-ones vector)
with one fused ``query_key_value``. Its rows are laid out per KV head in every variant,
``[KV head 0: its query heads | key | value, KV head 1: …]``, an interleaved fused axis: the
``new_decoder_architecture`` (Falcon-40B/180B, ``num_kv_heads`` groups), multi-query attention
(Falcon-7B: one K/V head, so all queries | k | v) and plain multi-head attention (q | k | v per head).
Rotary embeddings over the whole head: Q/K rotate rotary planes, V/O free. With ``parallel_attn``
(and always in the new architecture) attention and MLP read the stream entering the layer, through
one ``input_layernorm`` or two (``ln_attn`` / ``ln_mlp``): one sublayer per layer. ALiBi (the
Falcon-RW models) adds a fixed slope per head position to the scores, which pins the head order:
refused."""

from __future__ import annotations

from typing import Any

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.adapters.phi3 import rotary_dim
from hf_rebasin.symmetry.spaces import Fused

ATTN = "h.{i}.attn"
MLP = "h.{i}.mlp"
L = "{base}h.{i}"
QKV = Fused((f"{ATTN}:q", f"{ATTN}:k", f"{ATTN}:v"), interleaved=True)
FUSED, H_TO_4H = f"{L}.self_attention.query_key_value", f"{L}.mlp.dense_h_to_4h"
WRITERS = (f"{L}.self_attention.dense", f"{L}.mlp.dense_4h_to_h")
FINAL = NormT("{base}ln_f", "res", ("lm_head.weight", "score.weight"), final=True)


def _dims(c: Any) -> dict[str, int]:
    d, heads = c.hidden_size, c.num_attention_heads
    if c.new_decoder_architecture:
        kv = c.num_kv_heads
    else:
        kv = 1 if c.multi_query else heads
    return {
        "d": d,
        "layers": c.num_hidden_layers,
        "heads": heads,
        "kv_heads": kv,
        "head_dim": d // heads,
        "rotary_dim": rotary_dim(c, d // heads),
        "ff": c.ffn_hidden_size or 4 * d,
    }


def _configured(c: Any) -> dict[str, Any]:
    """ALiBi: refused. A sequential layer (no ``parallel_attn``, old architecture): two sublayers."""
    if getattr(c, "alibi", False):
        raise UnsupportedArchitectureError(
            "Falcon with alibi: true (the Falcon-RW models) is not supported: ALiBi adds a fixed slope per head "
            "position to the attention scores, so the heads cannot be permuted; Falcon models with rotary "
            "embeddings (alibi: false) are supported"
        )
    if c.new_decoder_architecture or c.parallel_attn:
        return {}
    return {
        "norms": (
            NormT(f"{L}.input_layernorm", "res", (f"{FUSED}.weight",)),
            NormT(f"{L}.post_attention_layernorm", "res", (f"{H_TO_4H}.weight",)),
            FINAL,
        ),
        "sublayers": (
            SublayerT((f"{L}.input_layernorm", FUSED), WRITERS[:1]),
            SublayerT((f"{L}.post_attention_layernorm", H_TO_4H), WRITERS[1:]),
        ),
    }


SPEC = ArchitectureSpec(
    family="falcon",
    model_types=("falcon",),
    base_prefix="transformer.",
    dims=_dims,
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", "orthogonal", centered=True, kind="residual"),
        HeadsT(ATTN, kv_heads="kv_heads", rotary=True, rotary_dim="rotary_dim"),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        "{base}word_embeddings.weight": (None, "res"),
        f"{FUSED}.weight": (QKV, "res"),
        f"{FUSED}.bias": (QKV,),
        f"{WRITERS[0]}.weight": ("res", f"{ATTN}:o"),
        f"{WRITERS[0]}.bias": ("res",),
        f"{H_TO_4H}.weight": (MLP, "res"),
        f"{H_TO_4H}.bias": (MLP,),
        f"{WRITERS[1]}.weight": ("res", MLP),
        f"{WRITERS[1]}.bias": ("res",),
        "lm_head.weight": (None, "res"),
        "score.weight": (None, "res"),
    },
    # a parallel layer: one input_layernorm read by both, or ln_attn / ln_mlp (a model has one kind)
    norms=(
        NormT(f"{L}.input_layernorm", "res", (f"{FUSED}.weight", f"{H_TO_4H}.weight")),
        NormT(f"{L}.ln_attn", "res", (f"{FUSED}.weight",)),
        NormT(f"{L}.ln_mlp", "res", (f"{H_TO_4H}.weight",)),
        FINAL,
    ),
    ties={"lm_head.weight": "{base}word_embeddings.weight"},
    invariant=("score.bias",),
    sublayers=(SublayerT((f"{L}.input_layernorm", f"{L}.ln_attn", f"{L}.ln_mlp", FUSED, H_TO_4H), WRITERS),),
    configured=_configured,
    embeddings=("{base}word_embeddings",),
    last_hidden={"res": "{base}ln_f"},
    outputs={"logits": None, "last_hidden_state": "res"},
)
