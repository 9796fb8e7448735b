"""``lineage.json``, typed, and what a verdict means for the user's next step (merge-readiness).

Torch-free: the CLI, the job and the card read it."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from hf_rebasin import __version__

__all__ = [
    "KIN",
    "LayerMap",
    "LayerMatch",
    "LineageRecord",
    "ModelRef",
    "PairRecord",
    "SpaceRecord",
    "describe_layers",
    "describe_stacks",
    "kin_words",
    "map_step",
    "moved_spaces",
    "next_step",
    "origin",
    "stacks_step",
]


KIN = ("same basis", "related up to symmetry")  # the verdicts whose layers descend


class SpaceRecord(BaseModel):
    """One space's evidence (a layer's heads, units or experts; ``embeddings``, ``positions``: the
    token and position tables, outside the layers' sum and tested on their own)."""

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


class LayerMatch(BaseModel):
    """Where one layer of the mapped model comes from."""

    layer: int
    parent: int = Field(description="the model it comes from (an index into `LineageRecord.models`)")
    source: int | None = Field(description="the parent's layer; None where no layer of it is kin")
    score: float = Field(description="the layers' circuits alike (cosine, symmetries inside a layer quotiented out)")
    similarity: float = Field(description="mean bulk similarity of the layer's spaces, aligned under the map")
    log10_p: float = Field(description="log10 p of 'kin' for this layer, Bonferroni over the candidate layers")


class LayerMap(BaseModel):
    """Which layer of model ``model`` descends from which layer of its parents (depth pruned, up-scaled,
    stacked from two parents, or reordered at one depth)."""

    model: int
    parents: list[int]
    kind: str
    layers: list[LayerMatch]
    increasing: bool = Field(description="whether the sources keep their order (pruning does)")
    mergekit: str = Field(
        description="a mergekit passthrough config that builds the parents' layers at its depth (empty for an "
        "encoder-decoder's stack: passthrough slices one stack of layers)"
    )
    stack: str | None = Field(
        default=None, description="an encoder-decoder's stack mapped: its module list (`model.decoder.layers`)"
    )


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
    shared: list[str] = Field(
        default_factory=list, description="the token and position tables kin beyond their null (embeddings, positions)"
    )
    origin: str = Field(default="", description="what the pair shares, in words")
    merge_as: str = Field(
        default="",
        description="the verdict that decides a merge: 'independent' for models sharing only embeddings, else the verdict",
    )
    moved: str | None = Field(default=None, description="spaces not in place and those in place, where both are")
    spaces: list[SpaceRecord]
    layer_map: LayerMap | None = Field(default=None, description="where depths differ, or layers moved at one depth")
    stack_maps: list[LayerMap] = Field(
        default_factory=list,
        description="encoder-decoders of other depths: one layer map per stack (encoder, decoder), in their order",
    )
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
    stacks: dict[str, int] | None = None  # an encoder-decoder's layers per stack, by module list


class LineageRecord(BaseModel):
    """Everything ``hf-rebasin lineage`` found: the models, the settings and one record per pair."""

    version: int = 1
    hf_rebasin_version: str = __version__
    models: list[ModelRef]
    settings: dict[str, float | int | str]
    pairs: list[PairRecord]
    layer_maps: list[LayerMap] = Field(default_factory=list, description="models stacked from two parents or more")
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
    apart = (
        "align before any merge (job: merge with generalized-orthogonal; `learned: true` with "
        "alignment data lowers the barrier most) and expect a barrier a plain average would not have between kin; "
        "transport of a task vector needs an alignment too"
    )
    if verdict == "shared embeddings":
        return (
            "one origin, no layer in common (siblings distilled from one teacher that kept other layers, or a model "
            f"trained anew on another's embeddings): for a merge they are independent models: {apart}; their "
            "provenance is not independent: credit the common ancestor (licence, attribution)"
        )
    return f"trained apart: {apart}"


def origin(verdict: str, shared: Sequence[str], layers: str | None = None) -> str:
    """What a pair shares, in words (``layers``: the kin layers, where not every layer is kin):
    ``embeddings and positions shared, no layer in common``, ``every layer kin``, or both."""
    tables = " and ".join(shared)
    if verdict not in KIN:
        return f"{tables} shared, no layer in common" if tables else "nothing shared: trained apart"
    kin = layers or "every layer kin"
    return f"{tables} shared; {kin}" if tables else kin


def map_step(verdict: str, lmap: LayerMap, given: list[str] | tuple[str, ...], step: str) -> str:
    """The next step for a model whose layers map onto its parents' other than one to one: what
    the map is, that merge and transport need one depth, and how to get there."""
    if verdict not in KIN:
        return step
    parents = " and ".join(given[p] for p in lmap.parents)
    where = describe_layers(lmap, given)
    how = f"shares layers with {parents}" if lmap.kind == "layers in common" else f"is {lmap.kind} from {parents}"
    return (
        f"{given[lmap.model]} {how} ({where}). `hf-rebasin merge` and `transport` take "
        "models of one depth and refuse others: build the parents' layers at its depth with mergekit's passthrough "
        "(the `mergekit` config of this layer map in lineage.json), then compare or merge that with it: " + step
    )


def stacks_step(verdict: str, maps: list[LayerMap], given: list[str] | tuple[str, ...], step: str) -> str:
    """The next step for an encoder-decoder whose stacks map onto its parent's other than one to
    one: the map of each stack, and that merge, align and transport need one depth in each."""
    if verdict not in KIN:
        return step
    kinds = sorted({m.kind for m in maps if m.kind != "identity"}) or ["identity"]
    return (
        f"{given[maps[0].model]} is {' and '.join(kinds)} from {given[maps[0].parents[0]]}, a layer map per stack "
        f"({describe_stacks(maps, given)}). `hf-rebasin merge`, `align` and `transport` take encoder-decoders of "
        "one depth in each stack and refuse others: copy the parent's layers named here into a model of the other's "
        "depths, then compare or merge that with it: " + step
    )


def describe_stacks(maps: list[LayerMap], given: list[str] | tuple[str, ...]) -> str:
    """``decoder: layers 0, 2, 4 of A are layers 0–2 of B; encoder: one depth, every layer kin``:
    each stack's map in words, the stacks whose layers moved first."""
    parts = []
    for m in sorted(maps, key=lambda m: m.kind == "identity"):
        label = m.stack.split(".")[-2] if m.stack and "." in m.stack else m.stack or "layers"  # encoder, decoder
        if m.kind == "identity" and all(x.source is not None for x in m.layers):
            parts.append(f"{label}: one depth, every layer kin")
            continue
        parts.append(f"{label}: {kin_words(m, given)}")
    return "; ".join(parts)


def kin_words(m: LayerMap, given: list[str] | tuple[str, ...]) -> str:
    """``layers 3, 7, 11 of A are layers 0–2 of B, layers 3–5 of B without a kin layer`` (one parent)."""
    kin = [x for x in m.layers if x.source is not None]
    none = [x.layer for x in m.layers if x.source is None]
    words = []
    if kin:
        words.append(
            f"layer{'s' * (len(kin) > 1)} {_listed([x.source for x in kin])} of {given[m.parents[0]]} "
            f"{'are' if len(kin) > 1 else 'is'} layer{'s' * (len(kin) > 1)} {_listed([x.layer for x in kin])} "
            f"of {given[m.model]}"
        )
    if none:
        words.append(f"layer{'s' * (len(none) > 1)} {_listed(none)} of {given[m.model]} without a kin layer")
    return ", ".join(words)


def _listed(xs: Sequence[int | None]) -> str:
    """``0–2`` for a run of consecutive layers, else ``0, 2, 4`` in order (repeats kept)."""
    known = [x for x in xs if x is not None]
    if len(known) > 1 and known == list(range(known[0], known[0] + len(known))):
        return f"{known[0]}–{known[-1]}"
    return ", ".join(str(x) for x in known)


def describe_layers(lmap: LayerMap, given: list[str] | tuple[str, ...]) -> str:
    """``layers 0–2 ← 1–3; layer 3 ← no kin layer``: runs of layers with consecutive sources (each
    source's model named where there are several parents)."""
    runs: list[tuple[int, int | None, list[int]]] = []  # parent, first source, layers
    for m in lmap.layers:
        last = runs[-1] if runs else None
        if last is not None and last[0] == m.parent and m.source is not None and last[1] is not None:
            if m.source == last[1] + len(last[2]) and m.layer == last[2][-1] + 1:
                last[2].append(m.layer)
                continue
        runs.append((m.parent, m.source, [m.layer]))
    parts = []
    for parent, source, layers in runs:
        mine = _ranges(list(layers))
        theirs = "no kin layer" if source is None else _ranges(list(range(source, source + len(layers))))
        word = "layers" if len(layers) > 1 else "layer"
        parts.append(f"{word} {mine} ← {theirs}" + (f" of {given[parent]}" if len(lmap.parents) > 1 else ""))
    return "; ".join(parts)


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
