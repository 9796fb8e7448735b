"""DeBERTa-v2 and DeBERTa-v3 (``model_type: deberta-v2``): BERT's post-LayerNorm encoder with
disentangled attention. The LayerNorms sit on the residual path, so the stream admits permutations
only.

Disentangled attention adds two score terms per head to ``q·k``: content→position ``q·K_r`` and
position→content ``k·Q_r``, where ``Q_r``/``K_r`` project the relative-position table
``encoder.rel_embeddings`` (after ``encoder.LayerNorm`` where ``norm_rel_ebd`` says ``layer_norm``).
The table is shared by all layers and read by every layer's projections, so its columns and that
LayerNorm are on the residual stream's map, while each layer's heads stay free on their own. With
``share_att_key`` the table goes through the layer's own ``query_proj``/``key_proj``; without, through
``pos_query_proj``/``pos_key_proj``, whose rows are on the query and key roles. Either way ``K_r``
moves as ``k`` and ``Q_r`` as ``q``, so every term keeps its value under any Q/K inner map ``M`` on
``q`` with ``M⁻ᵀ`` on ``k`` (the ``sqrt(head_dim · scale_factor)`` scale is a constant): Q/K is free.

With ``embedding_size != hidden_size`` the tables live in an embedding space ``emb`` projected into
the stream by ``embeddings.embed_proj`` (no bias; the embeddings' LayerNorm normalizes the *stream*
after it). The legacy MLM head writes ``emb`` (dense → activation → LayerNorm) for the decoder tied to
the word embeddings, so ``emb`` admits permutations only (a class without that head could rotate
it, which the adapter, reading the config alone, does not tell apart). The non-legacy head (``legacy: false``,
``lm_predictions.lm_head``) multiplies by the word embeddings itself (no decoder tensor to tie).

Per-sublayer residual maps (transports) put the shared table and its LayerNorm on stream 0, with the
embeddings: every later layer reads them in its own stream's basis, which no single map matches.

Refused: ``conv_kernel_size > 0`` (DeBERTa-v2 xlarge/xxlarge): its ``ConvLayer`` reads the embeddings'
output and adds into the first layer's output, a branch across layer 0 that the sublayer description
(one reader and writer per stream step) does not express yet.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.spaces import AxisRef

ATTN = "layer.{i}.attn"
MLP = "layer.{i}.mlp"
L = "{base}encoder.layer.{i}"
SELF = f"{L}.attention.self"
POST_NORM = "post-norm: LayerNorm sits on the residual path"
EMB_HEAD = "the legacy MLM head writes it through an activation and a LayerNorm"

_SPACES = (
    SpaceT("res", "d", kind="residual", reason=POST_NORM),
    HeadsT(ATTN),
    SpaceT(MLP, "ff", kind="mlp"),
    SpaceT("pooler", "d", kind="pooler"),
    SpaceT("emb", "e", reason=EMB_HEAD),
)

# the per-layer Q/K/V projections and, without share_att_key, the position projections
_ATTENTION: dict[str, tuple[AxisRef, ...]] = {
    f"{SELF}.{proj}.{p}": ((f"{ATTN}:{role}", "res") if p == "weight" else (f"{ATTN}:{role}",))
    for proj, role in (
        ("query_proj", "q"),
        ("key_proj", "k"),
        ("value_proj", "v"),
        ("pos_query_proj", "q"),
        ("pos_key_proj", "k"),
    )
    for p in ("weight", "bias")
}

_ENCODER: dict[str, tuple[AxisRef, ...]] = {
    **_ATTENTION,
    f"{L}.attention.output.dense.weight": ("res", f"{ATTN}:o"),
    f"{L}.attention.output.dense.bias": ("res",),
    f"{L}.intermediate.dense.weight": (MLP, "res"),
    f"{L}.intermediate.dense.bias": (MLP,),
    f"{L}.output.dense.weight": ("res", MLP),
    f"{L}.output.dense.bias": ("res",),
    # the relative-position table, read by every layer's q/k (or pos_q/pos_k) projections
    "{base}encoder.rel_embeddings.weight": (None, "res"),
    "pooler.dense.weight": ("pooler", "res"),
    "pooler.dense.bias": ("pooler",),
    "qa_outputs.weight": (None, "res"),
}


def _emb_tensors(e: str) -> dict[str, tuple[AxisRef, ...]]:
    """The tensors on the embedding space ``e`` (``emb``, or ``res`` when nothing projects)."""
    return {
        "{base}embeddings.word_embeddings.weight": (None, e),
        "{base}embeddings.position_embeddings.weight": (None, e),
        "{base}embeddings.token_type_embeddings.weight": (None, e),
        "{base}embeddings.embed_proj.weight": ("res", e),
        # the legacy MLM head: stream -> embedding space -> the tied decoder
        "cls.predictions.transform.dense.weight": (e, "res"),
        "cls.predictions.transform.dense.bias": (e,),
        "cls.predictions.decoder.weight": (None, e),
        # the non-legacy head: its output is multiplied by the word embeddings (sizes must be equal)
        "lm_predictions.lm_head.dense.weight": (e, "res"),
        "lm_predictions.lm_head.dense.bias": (e,),
    }


def _fields(e: str) -> dict[str, Any]:
    """The spec's tensors and norms with the embedding space named ``e``."""
    return {
        "tensors": {**_ENCODER, **_emb_tensors(e)},
        "norms": (
            NormT("{base}embeddings.LayerNorm", "res"),
            NormT(f"{L}.attention.output.LayerNorm", "res"),
            NormT(f"{L}.output.LayerNorm", "res"),
            # norm_rel_ebd: layer_norm normalizes the table before each layer projects it
            NormT("{base}encoder.LayerNorm", "res"),
            NormT("cls.predictions.transform.LayerNorm", e),
            NormT("lm_predictions.lm_head.LayerNorm", e),
        ),
    }


def _dims(c: Any) -> dict[str, int]:
    heads = c.num_attention_heads
    return {
        "d": c.hidden_size,
        "e": getattr(c, "embedding_size", c.hidden_size),
        "layers": c.num_hidden_layers,
        "heads": heads,
        "head_dim": getattr(c, "attention_head_size", c.hidden_size // heads),
        "ff": c.intermediate_size,
    }


def _configured(c: Any) -> dict[str, Any]:
    """A ConvLayer: refused. The embedding space is its own only where ``embed_proj`` exists."""
    if getattr(c, "conv_kernel_size", 0) > 0:
        raise UnsupportedArchitectureError(
            f"DeBERTa-v2 with conv_kernel_size: {c.conv_kernel_size} is not supported: its encoder.conv "
            "(ConvLayer) reads the embeddings' output and adds into the first layer's output, a branch across "
            "layer 0 that hf-rebasin's sublayer description does not express yet (DeBERTa-v2 xlarge/xxlarge "
            "have one); DeBERTa-v3 and other models with conv_kernel_size: 0 are supported"
        )
    e = "emb" if getattr(c, "embedding_size", c.hidden_size) != c.hidden_size else "res"
    return _fields(e)


def _classifier(keys: Collection[str]) -> dict[str, tuple[AxisRef, ...]]:
    """Sequence classification reads the ContextPooler; token classification reads the stream."""
    return {"classifier.weight": (None, "pooler" if "pooler.dense.weight" in keys else "res")}


SPEC = ArchitectureSpec(
    family="deberta-v2",
    model_types=("deberta-v2",),
    base_prefix="deberta.",
    dims=_dims,
    loops={"i": "layers"},
    spaces=_SPACES,
    **_fields("res"),
    ties={"cls.predictions.decoder.weight": "{base}embeddings.word_embeddings.weight"},
    invariant=(
        "cls.predictions.bias",
        "cls.predictions.decoder.bias",
        "lm_predictions.lm_head.bias",
        "classifier.bias",
        "qa_outputs.bias",
    ),
    outputs={"logits": None, "last_hidden_state": "res"},
    # post-norm: a sublayer's LayerNorm normalizes the stream it writes, so it joins the writers
    sublayers=(
        SublayerT((SELF,), (f"{L}.attention.output",)),
        SublayerT((f"{L}.intermediate",), (f"{L}.output",)),
    ),
    # the shared relative-position table and its LayerNorm run before layer 0 (see the docstring)
    embeddings=("{base}embeddings", "{base}encoder.rel_embeddings", "{base}encoder.LayerNorm"),
    last_hidden={"res": "{base}encoder"},
    alternatives=_classifier,
    configured=_configured,
)
