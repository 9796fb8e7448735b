"""``lineage.json``, typed, and what a verdict means for the user's next step (merge-readiness).

Torch-free: the CLI, the job and the card read it."""

from __future__ import annotations

from pydantic import BaseModel, Field

from hf_rebasin import __version__

__all__ = ["LineageRecord", "ModelRef", "PairRecord", "SpaceRecord", "moved_spaces", "next_step"]


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
    gap_z: float = 0.0  # (aligned − as stored) similarity in units of 1/√entries: what the map gained
    in_place: bool = True  # kin as stored and nothing gained by moving it (`lineage.compare._in_place`)


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
    moved: str | None = Field(default=None, description="spaces not in place and those in place, where both are")
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


def next_step(verdict: str, maps: list[str], moved: str | None = None) -> str:
    """What to do with such a pair before merging it or moving a task vector between them
    (``moved``: `moved_spaces`, where some spaces are in place and others not)."""
    if verdict == "same basis":
        return (
            "no alignment needed: every space is in place, so a plain average (mergekit's linear or SLERP) "
            "or a naive task vector (B + (fine-tune − base)) is right"
        )
    if verdict == "related up to symmetry":
        if moved:
            what = f"not every space is in place ({moved}); a plain average would mix unrelated features there"
        else:
            found = sorted({m for m in maps if m != "identity"})
            what = "; ".join(found[:3]) + ("; …" if len(found) > 3 else "") if found else "moved"
            what = f"B is A's kin in another basis ({what})"
        return (
            f"align first, then merge or transport: {what}; data-free generalized-orthogonal recovers the maps "
            "(`hf-rebasin align A B --strategy generalized-orthogonal`), after which a plain average or naive "
            "transport is right"
        )
    return (
        "trained apart: align before any merge (job: merge with generalized-orthogonal; `learned: true` with "
        "alignment data lowers the barrier most) and expect a barrier a plain average would not have between kin; "
        "transport of a task vector needs an alignment too"
    )


_KINDS = {"attn": "heads", "attention": "heads", "mlp": "MLP units", "moe": "experts", "experts": "experts"}


def moved_spaces(spaces: list[SpaceRecord]) -> str | None:
    """The counted spaces that are not in place and those that are, by kind and layers ("MLP units
    moved in layers 0–3; heads in place"); None where all are in place or none is."""
    counted = [e for e in spaces if e.counted]
    moved = [e for e in counted if not e.in_place]
    if not moved or len(moved) == len(counted):
        return None

    def grouped(records: list[SpaceRecord]) -> dict[str, list[int | None]]:
        out: dict[str, list[int | None]] = {}
        for e in records:
            kind = e.space.rsplit(".", 1)[-1] if "." in e.space else e.space
            out.setdefault(_KINDS.get(kind, kind), []).append(e.layer)
        return out

    def words(groups: dict[str, list[int | None]], state: str) -> list[str]:
        return [f"{kind} {state} in layer{'s' * (len(ls) > 1)} {_ranges(ls)}" for kind, ls in groups.items()]

    return "; ".join(words(grouped(moved), "moved") + words(grouped([e for e in counted if e.in_place]), "in place"))


def _ranges(layers: list[int | None]) -> str:
    """``[0, 1, 2, 3, 6]`` as ``0–3, 6``."""
    runs: list[list[int]] = []
    for x in sorted({x for x in layers if x is not None}):
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "?"
