"""ELECTRA: BERT's post-LayerNorm encoder, whose embeddings may live in a smaller space of their own.

With ``embedding_size != hidden_size`` the word, position and token-type tables and
``embeddings.LayerNorm`` have ``embedding_size`` features, projected into the residual stream by
``embeddings_project``. That LayerNorm normalizes the sum of the tables, so the embedding space
``emb`` admits permutations only, as the stream does. Its readers are ``embeddings_project``'s
columns and, in the generator (``ElectraForMaskedLM``), the LM head tied to the word embeddings:
``generator_predictions`` writes ``emb`` from the stream. With equal sizes there is no projection
and every ``emb`` tensor is on the stream ``res`` itself."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, NormT, SpaceT
from hf_rebasin.symmetry.adapters.bert import _ENCODER, _NORMS, _OUTPUTS, _SPACES, _SUBLAYERS
from hf_rebasin.symmetry.adapters.bert import _dims as _bert_dims
from hf_rebasin.symmetry.spaces import AxisRef

EMB_NORM = "post-norm: embeddings.LayerNorm normalizes the embedding space"


def _dims(c: Any) -> dict[str, int]:
    return {**_bert_dims(c), "e": c.embedding_size}


def _emb_tensors(e: str) -> dict[str, tuple[AxisRef, ...]]:
    """The tensors on the embedding space ``e`` (``emb``, or ``res`` when nothing projects)."""
    return {
        "{base}embeddings.word_embeddings.weight": (None, e),
        "{base}embeddings.position_embeddings.weight": (None, e),
        "{base}embeddings.token_type_embeddings.weight": (None, e),
        "{base}embeddings_project.weight": ("res", e),
        "{base}embeddings_project.bias": ("res",),
        # the generator's MLM head: stream -> embedding space -> the tied vocabulary
        "generator_predictions.dense.weight": (e, "res"),
        "generator_predictions.dense.bias": (e,),
        "generator_lm_head.weight": (None, e),
    }


def _heads() -> dict[str, tuple[AxisRef, ...]]:
    """The discriminator's and the sequence classifier's dense → activation → out heads."""
    return {
        "discriminator_predictions.dense.weight": ("head", "res"),
        "discriminator_predictions.dense.bias": ("head",),
        "discriminator_predictions.dense_prediction.weight": (None, "head"),
        "classifier.dense.weight": ("head", "res"),
        "classifier.dense.bias": ("head",),
        "classifier.out_proj.weight": (None, "head"),
    }


def _summary(keys: Collection[str]) -> dict[str, tuple[AxisRef, ...]]:
    """Multiple choice reads the first token through ``sequence_summary`` (a linear layer and GELU,
    ``summary_use_proj``) into a one-score ``classifier``; without the projection, from the stream."""
    if "sequence_summary.summary.weight" in keys:
        return {
            "sequence_summary.summary.weight": ("head", "res"),
            "sequence_summary.summary.bias": ("head",),
            "classifier.weight": (None, "head"),
        }
    return {"classifier.weight": (None, "res")} if "classifier.weight" in keys else {}


def _fields(e: str) -> dict[str, Any]:
    """The spec's tensors and norms with the embedding space named ``e``."""
    return {
        "tensors": {**_ENCODER, **_heads(), **_emb_tensors(e)},
        "norms": (
            NormT("{base}embeddings.LayerNorm", e),
            *_NORMS[1:],
            NormT("generator_predictions.LayerNorm", e),
        ),
    }


def _configured(config: Any) -> dict[str, Any]:
    """The embedding space is its own only where ``embeddings_project`` exists (sizes differ)."""
    return _fields("emb" if config.embedding_size != config.hidden_size else "res")


SPEC = ArchitectureSpec(
    family="electra",
    model_types=("electra",),
    base_prefix="electra.",
    dims=_dims,
    loops={"i": "layers"},
    spaces=(*_SPACES, SpaceT("emb", "e", reason=EMB_NORM)),
    **_fields("res"),
    ties={"generator_lm_head.weight": "{base}embeddings.word_embeddings.weight"},
    invariant=(
        "generator_lm_head.bias",
        "discriminator_predictions.dense_prediction.bias",
        "classifier.out_proj.bias",
        "classifier.bias",
    ),
    outputs=_OUTPUTS,
    sublayers=_SUBLAYERS,
    embeddings=("{base}embeddings", "{base}embeddings_project"),
    last_hidden={"res": "{base}encoder"},
    configured=_configured,
    alternatives=_summary,
)
