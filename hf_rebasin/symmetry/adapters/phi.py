"""Phi (Phi-1, Phi-1.5, Phi-2): a parallel residual, attention (``q/k/v_proj`` → ``dense``) and a GELU
MLP (``fc1`` → ``fc2``) both read one ``input_layernorm`` of the stream entering the layer, so each
layer is one sublayer. LayerNorms with bias (``final_layernorm`` too): the stream rotates fixing the
all-ones vector, and canonical form folds the final β into ``lm_head.bias``, which is per token.
Partial rotary embeddings (``partial_rotary_factor``, 0.5 by default) fix the Q/K inner maps, and so
does ``qk_layernorm`` (one LayerNorm over each head's features, shared by all heads: head
permutations leave it be); V/O stay free."""

from __future__ import annotations

from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.adapters.llama import ATTN, MLP, L
from hf_rebasin.symmetry.adapters.starcoder2 import rotary_dims

QKV = tuple(f"{L}.self_attn.{p}_proj" for p in "qkv")
QK_NORMS = tuple(f"{L}.self_attn.{p}_layernorm.{t}" for p in "qk" for t in ("weight", "bias"))
RES = SpaceT("res", "d", "orthogonal", centered=True, kind="residual")


def _configured(c: Any) -> dict[str, Any]:
    """``qk_layernorm`` fixes Q/K even where every feature of a head rotates."""
    if not getattr(c, "qk_layernorm", False):
        return {}
    reason = "q_layernorm/k_layernorm normalise each head's features"
    heads = HeadsT(ATTN, kv_heads="kv_heads", rotary=True, rotary_dim="rotary_dim", qk="fixed", reason=reason)
    return {"spaces": (RES, heads, SpaceT(MLP, "ff", kind="mlp"))}


SPEC = ArchitectureSpec(
    family="phi",
    model_types=("phi",),
    base_prefix="model.",
    dims=rotary_dims,
    loops={"i": "layers"},
    spaces=(
        RES,
        HeadsT(ATTN, kv_heads="kv_heads", rotary=True, rotary_dim="rotary_dim"),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        "{base}embed_tokens.weight": (None, "res"),
        **{f"{L}.self_attn.{p}_proj.weight": (f"{ATTN}:{p}", "res") for p in "qkv"},
        **{f"{L}.self_attn.{p}_proj.bias": (f"{ATTN}:{p}",) for p in "qkv"},
        f"{L}.self_attn.dense.weight": ("res", f"{ATTN}:o"),
        f"{L}.self_attn.dense.bias": ("res",),
        f"{L}.mlp.fc1.weight": (MLP, "res"),
        f"{L}.mlp.fc1.bias": (MLP,),
        f"{L}.mlp.fc2.weight": ("res", MLP),
        f"{L}.mlp.fc2.bias": ("res",),
        "lm_head.weight": (None, "res"),
        "score.weight": (None, "res"),
    },
    norms=(
        NormT(f"{L}.input_layernorm", "res", (*(f"{m}.weight" for m in QKV), f"{L}.mlp.fc1.weight")),
        NormT("{base}final_layernorm", "res", ("lm_head.weight", "score.weight"), final=True),
    ),
    ties={"lm_head.weight": "{base}embed_tokens.weight"},
    invariant=("lm_head.bias", "score.bias", *QK_NORMS),
    sublayers=(SublayerT((f"{L}.input_layernorm", *QKV, f"{L}.mlp.fc1"), (f"{L}.self_attn.dense", f"{L}.mlp.fc2")),),
    configured=_configured,
    embeddings=("{base}embed_tokens",),
    last_hidden={"res": "{base}final_layernorm"},
    outputs={"logits": None, "last_hidden_state": "res"},
)
