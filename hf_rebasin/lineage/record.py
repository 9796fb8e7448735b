"""``lineage.json``, typed, and what a verdict means for the user's next step (merge-readiness).

Torch-free: the CLI, the job and the card read it."""

from __future__ import annotations

from pydantic import BaseModel, Field

from hf_rebasin import __version__

__all__ = ["LineageRecord", "ModelRef", "PairRecord", "SpaceRecord", "next_step"]


class SpaceRecord(BaseModel):
    """One space's evidence (a layer's heads, units or experts; ``embeddings``: not counted)."""

    space: str
    layer: int | None
    similarity: float  # bulk cosine after alignment
    raw_similarity: float  # bulk cosine as stored
    entries: int
    z: float
    raw_z: float
    moved: float  # how far the alignment's map is from the identity (0–1)
    map: str
    counted: bool


class PairRecord(BaseModel):
    """The verdict on models ``a`` and ``b`` (indices into `LineageRecord.models`)."""

    a: int
    b: int
    verdict: str
    statistic: float = Field(description="median bulk similarity of the layers' spaces, aligned")
    raw_statistic: float = Field(description="the same, as stored (no alignment)")
    z: float
    log10_p: float = Field(description="log10 of the p-value of 'related up to symmetry' under the null")
    raw_z: float
    raw_log10_p: float = Field(description="log10 of the p-value of 'same basis' under the null")
    next_step: str
    spaces: list[SpaceRecord]
    seconds: dict[str, float] = Field(default_factory=dict)
    passes: dict[str, int] = Field(
        default_factory=dict, description="passes of the alignment of the signals: permutations, rotations"
    )


class ModelRef(BaseModel):
    given: str  # as the user named it
    folder: str  # where it was read
    model_type: str
    layers: int
    embedded: str | None = None  # narrower than the widest model: written into its shape (what grew)


class LineageRecord(BaseModel):
    """Everything ``hf-rebasin lineage`` found: the models, the settings and one record per pair."""

    version: int = 1
    hf_rebasin_version: str = __version__
    models: list[ModelRef]
    settings: dict[str, float | int | str]
    pairs: list[PairRecord]
    seconds: dict[str, float] = Field(default_factory=dict)


def next_step(verdict: str, maps: list[str]) -> str:
    """What to do with such a pair before merging it or moving a task vector between them."""
    if verdict == "same basis":
        return (
            "no alignment needed: the models share a basis, so a plain average (mergekit's linear or SLERP) "
            "or a naive task vector (B + (fine-tune − base)) is right"
        )
    if verdict == "related up to symmetry":
        moved = sorted({m for m in maps if m != "identity"})
        what = "; ".join(moved[:3]) + ("; …" if len(moved) > 3 else "") if moved else "moved"
        return (
            f"align first, then merge or transport: B is A's kin in another basis ({what}); data-free "
            "generalized-orthogonal recovers the maps (`hf-rebasin align A B --strategy generalized-orthogonal`), "
            "after which a plain average or naive transport is right"
        )
    return (
        "trained apart: align before any merge (job: merge with generalized-orthogonal; `learned: true` with "
        "alignment data lowers the barrier most) and expect a barrier a plain average would not have between kin; "
        "transport of a task vector needs an alignment too"
    )
