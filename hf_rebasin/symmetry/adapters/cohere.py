"""Cohere (Command R, ``cohere``) and Cohere 2 (Command R7B, ``cohere2``): Llama's projections
(grouped-query attention, SwiGLU MLP, optional q/k/v/o biases) in a parallel residual: attention and
MLP both read one ``input_layernorm`` of the stream entering the layer, so each layer is one
sublayer. The norms are LayerNorms without bias (mean subtracted, γ only): the stream rotates fixing
the all-ones vector. ``logit_scale`` multiplies the logits: a scalar on a basis-free output.

Their rotary embeddings rotate interleaved pairs of features, (2j, 2j + 1), not Llama's
(j, j + head_dim/2), which is the pairing the rotary-plane maps of a head space assume; so Q/K inner
maps are fixed, V/O stay free. Cohere 2's global (``full_attention``) layers have no position
embeddings at all: their Q/K inner maps are free. Cohere's optional ``use_qk_norm`` LayerNorms hold one γ
per feature of every head, ``[heads, head_dim]``: read as one vector over the query (key) features,
they permute with the heads; they fix Q/K too."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hf_rebasin.symmetry.adapters.base import Dims, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.adapters.llama import ATTN, MLP, L
from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA
from hf_rebasin.symmetry.spaces import View

QKV = tuple(f"{L}.self_attn.{p}_proj" for p in "qkv")
GATE_UP = (f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj")
INTERLEAVED = "rotary embeddings rotate interleaved feature pairs (2j, 2j + 1)"


def per_head(heads: str) -> Callable[[Dims], View]:
    """A ``[heads, head_dim]`` tensor (one γ per feature of every head) read as one vector."""

    def view(dims: Dims) -> View:
        shape = (dims[heads], dims["head_dim"])
        return View(shape, shape, (0, 1), (shape[0] * shape[1],))

    return view


SPEC = dataclasses.replace(
    LLAMA,
    family="cohere",
    model_types=("cohere",),
    spaces=(
        SpaceT("res", "d", "orthogonal", centered=True, kind="residual"),
        HeadsT(ATTN, kv_heads="kv_heads", rotary=True, qk="fixed", reason=INTERLEAVED),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        **LLAMA.tensors,
        f"{L}.self_attn.q_norm.weight": (f"{ATTN}:q",),
        f"{L}.self_attn.k_norm.weight": (f"{ATTN}:k",),
    },
    views={f"{L}.self_attn.q_norm.weight": per_head("heads"), f"{L}.self_attn.k_norm.weight": per_head("kv_heads")},
    norms=(
        NormT(f"{L}.input_layernorm", "res", tuple(f"{m}.weight" for m in (*QKV, *GATE_UP)), bias=False),
        NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), bias=False, final=True),
    ),
    sublayers=(SublayerT((f"{L}.input_layernorm", *QKV, *GATE_UP), (f"{L}.self_attn.o_proj", f"{L}.mlp.down_proj")),),
    norm_type="layernorm",
)


def _cohere2_layers(c: Any) -> dict[str, Any]:
    """One head space per layer: rotary (interleaved: Q/K fixed) in sliding-window layers, none in
    global ones (Q/K free)."""
    types = getattr(c, "layer_types", None) or ["sliding_attention"] * c.num_hidden_layers
    heads = tuple(
        HeadsT(ATTN.format(i=i), kv_heads="kv_heads", rotary=True, qk="fixed", reason=INTERLEAVED)
        if kind == "sliding_attention"
        else HeadsT(ATTN.format(i=i), kv_heads="kv_heads")
        for i, kind in enumerate(types)
    )
    return {"spaces": (SPEC.spaces[0], *heads, SPEC.spaces[2])}


# Cohere 2: the same tensors (no q/k norms); sliding-window layers with rotary embeddings, global
# layers without
COHERE2 = dataclasses.replace(SPEC, family="cohere2", model_types=("cohere2",), configured=_cohere2_layers)
