"""ALBERT: BERT's post-LayerNorm encoder whose layers share their weights.

``encoder.albert_layer_groups`` holds ``num_hidden_groups`` groups of ``inner_group_num`` layers;
the forward runs ``num_hidden_layers`` steps, each through one whole group (usually one group of
one layer, run at every depth). A module's weights are the same tensors at every step it runs,
so its heads and MLP units are one space each (``group.{g}.{k}.attn``, ``group.{g}.{k}.mlp``),
never one per depth: a map that differed per application cannot be written into shared weights.
The residual stream is one space for the whole depth and, the LayerNorms sitting on it, admits
permutations only. No sublayers are declared: a residual map per sublayer would give one shared
tensor a different map at each of its runs, so per-sublayer transports are refused.

The word, position and token-type tables and ``embeddings.LayerNorm`` have ``embedding_size``
features, an embedding space ``emb`` of their own (permutation-only: that LayerNorm normalizes it)
projected into the stream by ``encoder.embedding_hidden_mapping_in`` (present even at equal sizes,
so ``emb`` is always its own space). The MLM head (``predictions.dense`` → activation →
``predictions.LayerNorm`` → ``predictions.decoder``, tied to the word embeddings) writes ``emb``
back from the stream. ``AlbertModel.pooler`` is one linear layer (no ``.dense``)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT
from hf_rebasin.symmetry.adapters.bert import POST_NORM
from hf_rebasin.symmetry.adapters.electra import EMB_NORM
from hf_rebasin.symmetry.spaces import AxisRef

ATTN = "group.{g}.{k}.attn"  # one space per layer module, whatever the number of steps it runs
MLP = "group.{g}.{k}.mlp"
L = "{base}encoder.albert_layer_groups.{g}.albert_layers.{k}"

_TENSORS: dict[str, tuple[AxisRef, ...]] = {
    "{base}embeddings.word_embeddings.weight": (None, "emb"),
    "{base}embeddings.position_embeddings.weight": (None, "emb"),
    "{base}embeddings.token_type_embeddings.weight": (None, "emb"),
    "{base}encoder.embedding_hidden_mapping_in.weight": ("res", "emb"),
    "{base}encoder.embedding_hidden_mapping_in.bias": ("res",),
    f"{L}.attention.query.weight": (f"{ATTN}:q", "res"),
    f"{L}.attention.query.bias": (f"{ATTN}:q",),
    f"{L}.attention.key.weight": (f"{ATTN}:k", "res"),
    f"{L}.attention.key.bias": (f"{ATTN}:k",),
    f"{L}.attention.value.weight": (f"{ATTN}:v", "res"),
    f"{L}.attention.value.bias": (f"{ATTN}:v",),
    f"{L}.attention.dense.weight": ("res", f"{ATTN}:o"),
    f"{L}.attention.dense.bias": ("res",),
    f"{L}.ffn.weight": (MLP, "res"),
    f"{L}.ffn.bias": (MLP,),
    f"{L}.ffn_output.weight": ("res", MLP),
    f"{L}.ffn_output.bias": ("res",),
    "{base}pooler.weight": ("pooler", "res"),
    "{base}pooler.bias": ("pooler",),
    # the MLM head: stream -> embedding space -> the tied vocabulary
    "predictions.dense.weight": ("emb", "res"),
    "predictions.dense.bias": ("emb",),
    "predictions.decoder.weight": (None, "emb"),
    "sop_classifier.classifier.weight": (None, "pooler"),
    "qa_outputs.weight": (None, "res"),
}


def _dims(c: Any) -> dict[str, int]:
    return {
        "d": c.hidden_size,
        "e": c.embedding_size,
        "groups": c.num_hidden_groups,
        "inner": c.inner_group_num,
        "heads": c.num_attention_heads,
        "head_dim": c.hidden_size // c.num_attention_heads,
        "ff": c.intermediate_size,
    }


def _classifier(keys: Collection[str]) -> dict[str, tuple[AxisRef, ...]]:
    """Sequence classification and multiple choice read the pooler; token classification (no
    pooler) reads the stream."""
    pooled = any(k.endswith("pooler.weight") for k in keys)
    return {"classifier.weight": (None, "pooler" if pooled else "res")}


SPEC = ArchitectureSpec(
    family="albert",
    model_types=("albert",),
    base_prefix="albert.",
    dims=_dims,
    loops={"g": "groups", "k": "inner"},
    spaces=(
        SpaceT("res", "d", kind="residual", reason=POST_NORM),
        SpaceT("emb", "e", reason=EMB_NORM),
        HeadsT(ATTN),
        SpaceT(MLP, "ff", kind="mlp"),
        SpaceT("pooler", "d", kind="pooler"),
    ),
    tensors=_TENSORS,
    norms=(
        NormT("{base}embeddings.LayerNorm", "emb"),
        NormT(f"{L}.attention.LayerNorm", "res"),
        NormT(f"{L}.full_layer_layer_norm", "res"),
        NormT("predictions.LayerNorm", "emb"),
    ),
    ties={"predictions.decoder.weight": "{base}embeddings.word_embeddings.weight"},
    invariant=(
        "predictions.bias",
        "predictions.decoder.bias",
        "sop_classifier.classifier.bias",
        "classifier.bias",
        "qa_outputs.bias",
    ),
    outputs={
        "logits": None,
        "prediction_logits": None,
        "sop_logits": None,
        "start_logits": None,
        "end_logits": None,
        "last_hidden_state": "res",
        "pooler_output": "pooler",
    },
    embeddings=("{base}embeddings", "{base}encoder.embedding_hidden_mapping_in"),
    last_hidden={"res": "{base}encoder"},
    alternatives=_classifier,
)
