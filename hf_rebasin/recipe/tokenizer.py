"""The `tokenizer` section: which vocabulary the output has when the models' vocabularies differ.

mergekit's ``tokenizer_source`` under another key: ``base`` (the reference's tokens: A in a merge),
``union`` (every model's tokens, the reference's ids first), a model of the recipe (``models[1]``:
its tokens at its ids), and for a transport ``finetuned`` (the target's tokens plus the fine-tune's:
a chat fine-tune keeps its chat tokens and template) or ``target``. Rows are matched by token, so
models with the same vocabulary give the same output whatever the source.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from hf_rebasin.core.names import VocabularyChoice
from hf_rebasin.recipe.common import Section

__all__ = [
    "MAX_PAD_MULTIPLE",
    "MERGE_SOURCES",
    "TRANSPORT_SOURCES",
    "TokenizerSection",
    "merge_vocabulary",
    "model_index",
]

# rows are padded for the GPU's tiles and tensor-parallel splits: 8, 64 or 128 in practice, Megatron's
# 128 × 8 ranks = 1,024 at most seen; 4,096 adds at most 4,095 mean rows (2**40 would build a list
# of 2**40 rows, dry run included)
MAX_PAD_MULTIPLE = 4096
MERGE_SOURCES = ("base", "union")  # and models[i]
TRANSPORT_SOURCES = ("finetuned", "target", "union")
_MODEL = re.compile(r"models\[(\d+)\]")


def model_index(source: str) -> int | None:
    """``i`` of a ``models[i]`` source, None for a named one."""
    m = _MODEL.fullmatch(source)
    return int(m.group(1)) if m else None


def merge_vocabulary(source: str | None, pad_to: int | None) -> VocabularyChoice:
    """The output's vocabulary of a job on ``models:`` (merge, barrier, align: `Job.vocabulary`),
    from ``tokenizer.source`` and ``pad_to_multiple_of`` (None where the recipe has no section):
    ``base`` (default) the reference's, its tokenizer files written as they are where they fit;
    ``models[i]`` model i's own rows and files; ``union`` every model's tokens, the reference's ids
    first, the first model's files that fit them written as they are (else a tokenizer built)."""
    source = source or "base"
    i = model_index(source)
    if i is not None:
        return VocabularyChoice(source, "own", model=i, candidates=(i,), pad_to=pad_to)
    if source == "union":
        return VocabularyChoice(source, "union", candidates=None, pad_to=pad_to)
    return VocabularyChoice(source, "reference", candidates=(0,), pad_to=pad_to)


class TokenizerSection(Section):
    """The output's vocabulary (``source``) and its row count (``pad_to_multiple_of``)."""

    source: str | None = Field(
        None,
        description="whose tokens the output has: merge: base (the reference's, default), union, or models[i]; "
        "transport: finetuned (the target's tokens plus the fine-tune's, default), target, or union. A token one "
        "model lacks takes that model's row from the reference (else the mean of the models that have it) before "
        "averaging, as in mergekit, so a token only one model has keeps that model's row",
    )
    pad_to_multiple_of: int | None = Field(
        None,
        ge=1,
        le=MAX_PAD_MULTIPLE,
        strict=True,
        description=f"round the output's embedding rows up to a multiple of this (1 to {MAX_PAD_MULTIPLE:,}; new "
        "rows: the mean row)",
    )

    @field_validator("source")
    @classmethod
    def _known(cls, value: str | None) -> str | None:
        if value is None or value in (*MERGE_SOURCES, *TRANSPORT_SOURCES) or model_index(value) is not None:
            return value
        raise ValueError(
            f"unknown tokenizer source {value!r}: use base, union or models[i] (merge), finetuned, target or union "
            "(transport)"
        )
