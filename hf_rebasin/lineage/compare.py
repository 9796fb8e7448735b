"""One pair of models: are they related, up to every symmetry their family has?

Both models are brought to canonical form (norm scales folded into the next weights), their
routers centred and their gated units put in canonical scaling, so that the maps left are
orthogonal or permutations. Each weight matrix is split into signal and bulk (`stats.signals`: the
signal kept as low-rank factors); generalized-orthogonal matching aligns B's signal to A's,
data-free, under the family's whole symmetry graph (heads, units, experts with their router rows,
the residual stream rotated or signed-permuted), its weight views computed from the factors
(`features.lowrank`); the alignment then carries B's bulk into A's basis, and each space's bulk
similarity is read twice: aligned (related up to symmetry) and as stored (same basis). Models read
from their files are compared tensor by tensor: a pass to split, a pass to compare the bulks. With
data, the alignment starts from maps fitted on both models' activations (`datamaps`) instead of
permutations of the signals, then refines every space on the signals as without.

The test: under the null, B was trained apart from A, and a space's bulk similarity is at most
`NULL_SIMILARITY` (models trained apart on the same data share far less bulk than that: see the
docs' lineage page for the testbed it was read from). Each space gives a z-score against that level
in units of the spread of the cosine of two independent bulks (1/√entries); Stouffer's sum over the
layers' spaces is the pair's statistic, and its normal tail the p-value. The token and position
tables are tested apart, each against `SHARED_NULL`: models trained apart on one tokenizer and one
text share more of them than of any layer, and a pair whose tables pass while no layer does
shares an origin without a layer in common (students of one teacher that kept other layers).
"""

from __future__ import annotations

import contextlib
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from scipy.stats import norm
from torch import Tensor

from hf_rebasin.alignment.experts import center_routers
from hf_rebasin.alignment.features.lowrank import LowRankViews
from hf_rebasin.alignment.features.weights import spaces_of
from hf_rebasin.alignment.solvers import lap_sparse
from hf_rebasin.alignment.strategies.engines.descent import view_graph
from hf_rebasin.alignment.strategies.engines.orthogonal import permutation_start, rotate, space_order
from hf_rebasin.core.lazy import LazyState, shape_of
from hf_rebasin.lineage.datamaps import LineageData, data_maps
from hf_rebasin.lineage.record import KIN, SpaceRecord
from hf_rebasin.lineage.stats import (
    SHARED_ORIGIN,
    SIGNAL_CAP,
    SIGNAL_SHARE,
    Signals,
    SpaceSums,
    add_sums,
    combined_z,
    log10_sf,
    signals,
    space_of,
    z_score,
)
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import Space
from hf_rebasin.symmetry.transforms import AxisMap, ExpertMap, HeadMap, SpaceMap, Transform

__all__ = [
    "ALPHA",
    "KIN",
    "NULL_SIMILARITY",
    "SHARED_NULL",
    "PairLineage",
    "Side",
    "Verdict",
    "compare",
    "describe_map",
    "judge",
    "prepare_side",
    "shared_tables",
    "threads_for",
]

Verdict = Literal["same basis", "related up to symmetry", "shared embeddings", "independent"]
NULL_SIMILARITY = 0.2  # a space's bulk similarity the null allows (trained apart: ≤ 0.057 on the testbed)
# the token and position tables' bulk similarity the null allows: models trained apart on one
# tokenizer and one text agree up to 0.26 there on the zoo, layers never past 0.06 (docs: lineage)
SHARED_NULL = 0.5
ALPHA = 1e-3  # a pair is related when its p-value is below this
# the alignment stops a stage once a pass adds less than 0.1 % of what its passes added, and after
# 4 passes at most: the bulk similarity needs the maps, not their last digits. On the testbed every
# related pair's rotations settled within 3 rounds; unrelated signals keep creeping up to the cap,
# and a 7B model's pass costs minutes (its 14,336-unit assignment problems)
MATCHING_TOL = 1e-3
MATCHING_ROUNDS = 4
NEAR = 0.05  # a map this close to the identity (0–1 scale) is described as the identity
# a space keeps the stored order when it matches the signals within this share of what the solver's
# map does: a map fitted to rounding gains up to 1.4e-5 of it (a bf16 copy of a random GPT-2), 3.6e-6
# (noise of 0.1 % of each weight's RMS), float32 views of an exact copy 6e-8; a moved space far more
KEEP_IDENTITY = 1e-4
# a view's singular values at most this share of its largest count as zero: the signals' views are
# exactly low rank but computed in float32 (their null singular values: 1e-10–1e-9 of the largest),
# and on their null spaces the rotation nearest the identity is taken (all match the signals alike)
NULL_RTOL = 1e-6


@dataclass
class PairLineage:
    """The verdict on one pair, its statistics and the evidence per space."""

    verdict: Verdict
    statistic: float  # the median bulk similarity of the counted spaces, aligned
    raw_statistic: float  # the same, as stored
    z: float
    log10_p: float
    raw_z: float
    raw_log10_p: float
    spaces: list[SpaceRecord]  # the evidence per space, as lineage.json holds it
    seconds: dict[str, float] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)  # of the alignment: permutations, rotations
    tokens: int = 0  # read by both models to start the alignment (0: data-free)
    transform: Transform | None = None  # B into A's basis (not recorded: a layer map reads its residual map)
    shared: tuple[str, ...] = ()  # the token and position tables kin beyond `SHARED_NULL` (embeddings, positions)

    @property
    def p_value(self) -> float:
        return 10.0**self.log10_p

    @property
    def raw_p_value(self) -> float:
        return 10.0**self.raw_log10_p


def _layer(space: str) -> int | None:
    found = re.search(r"(\d+)", space)
    return int(found.group(1)) if found else None


def describe_map(m: SpaceMap | None) -> tuple[float, str]:
    """How far a space's map is from the identity (0–1) and the map in words."""
    if m is None:
        return 0.0, "identity"
    if isinstance(m, ExpertMap):
        moved = _moved(m.perm)
        return moved, "identity" if moved == 0 else f"experts permuted ({100 * moved:.0f} % moved)"
    if isinstance(m, HeadMap):
        moved = _moved(m.kv_perm)
        inner = m.qk.dtype != torch.long or m.vo.dtype != torch.long
        words = "heads in place" if moved == 0 else f"heads permuted ({100 * moved:.0f} % moved)"
        return moved, words + (", rotated inside the heads" if inner and not _near_identity_inner(m) else "")
    assert isinstance(m, AxisMap)
    if m.is_permutation:
        moved = _moved(m.index) if m.index is not None else 0.0
        return moved, "identity" if moved == 0 else f"permuted ({100 * moved:.0f} % moved)"
    moved = _distance(m.matrix(torch.float64))
    if m.is_signed_permutation:
        return moved, "identity" if moved == 0 else "signed permutation"
    return moved, "identity" if moved < NEAR else f"rotated ({moved:.2f} from the identity)"


def _moved(index: Tensor) -> float:
    """The share of features (heads, experts) a permutation moves."""
    return float((index != torch.arange(len(index))).double().mean())


def _distance(dense: Tensor) -> float:
    """‖M − I‖_F / √(2n) over a matrix or a stack of n-wide matrices, capped at 1: a permutation
    moving a share s of the features is at √s."""
    eye = torch.eye(dense.shape[-1], dtype=dense.dtype)
    return min(1.0, float(torch.linalg.vector_norm(dense - eye)) / (2 * dense[..., 0].numel()) ** 0.5)


def _near_identity_inner(m: HeadMap) -> bool:
    for inner in (m.qk, m.vo):
        if inner.dtype == torch.long:
            if not bool((inner == torch.arange(inner.shape[-1])).all()):
                return False
        elif _distance(inner.to(torch.float64)) >= NEAR:
            return False
    return True


def prepared(
    graph: SymmetryGraph, state: Mapping[str, Tensor]
) -> tuple[Mapping[str, Tensor], SymmetryGraph, bool, Mapping[str, Tensor]]:
    """Canonical form, routers centred, then canonical unit scaling of gated MLPs: what is left is
    orthogonal. A lazy state (a model read from its files) stays lazy. Also: whether a tied head
    came apart (the form's model class must store it apart), and the unit scales applied (computed
    as the gated MLPs are read), so that a comparison as stored can undo them."""
    canonical, cgraph, untied = canonicalize(graph, state)
    centered = center_routers(cgraph, canonical)
    scales = glu.lazy_unit_scales(cgraph, centered)
    return glu.apply_unit_scales(cgraph, centered, scales), cgraph, bool(untied), scales


def compare(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    *,
    share: float = SIGNAL_SHARE,
    cap: int = SIGNAL_CAP,
    null: float = NULL_SIMILARITY,
    progress: Callable[[str], None] | None = None,
    data: LineageData | None = None,
) -> PairLineage:
    """The lineage of B with respect to A (one family, one shape); see the module docstring. Lazy
    states (`LazyState`) are read tensor by tensor, twice each: memory holds both models'
    signals as factors and a few tensors, not the models. With ``data``, the alignment starts from
    maps fitted on the two models' activations (`datamaps`) instead of permutations of the signals."""
    with threads_for(sd_a):
        start = time.perf_counter()
        say = progress or (lambda _stage: None)
        side_a = prepare_side(graph, sd_a, "A", say, share=share, cap=cap)
        side_b = prepare_side(graph, sd_b, "B", say, share=share, cap=cap)
        result = judge(side_a, side_b, null=null, say=say, data=data, split=time.perf_counter() - start)
        result.seconds["total"] = time.perf_counter() - start
        return result


@dataclass
class Side:
    """One model made ready for comparing: its balanced canonical form (lazy where it was read
    from files), the graph of that form, whether its tied head came apart, the unit scales applied
    and its learned signal."""

    state: Mapping[str, Tensor]
    graph: SymmetryGraph
    untie: bool
    scales: Mapping[str, Tensor]
    signal: Signals


def prepare_side(
    graph: SymmetryGraph,
    state: Mapping[str, Tensor],
    which: str,
    say: Callable[[str], None],
    *,
    share: float = SIGNAL_SHARE,
    cap: int = SIGNAL_CAP,
) -> Side:
    """`prepared`, then the split into signal and bulk (one pass over the tensors)."""
    form, cgraph, untie, scales = prepared(graph, state)
    found = signals(form, cgraph.ties, share=share, cap=cap, progress=_counting(say, f"signal of {which}"))
    return Side(form, cgraph, untie, scales, found)


def judge(
    a: Side,
    b: Side,
    *,
    null: float = NULL_SIMILARITY,
    say: Callable[[str], None] = lambda _stage: None,
    data: LineageData | None = None,
    split: float = 0.0,
) -> PairLineage:
    """The alignment of B's signal to A's (from the data's maps where given), each space's bulk
    similarity aligned and as stored, and the verdict; B's graph describes both."""
    clock: dict[str, float] = {"split": split}
    t = time.perf_counter()
    fitted: Transform | None = None
    tokens = 0
    cgraph = b.graph
    if data is not None:
        fitted, tokens = data_maps(cgraph, a.state, b.state, a.untie, data, say)
        clock["activations"] = time.perf_counter() - t
        t = time.perf_counter()
    transform, passes = align_signals(cgraph, a.signal, b.signal, say, fitted=fitted)
    clock["align"] = time.perf_counter() - t
    t = time.perf_counter()
    stored = _as_stored(cgraph, a.scales), _as_stored(cgraph, b.scales)
    progress = _counting(say, "bulk similarity")
    aligned, raw = _bulk_sums(cgraph, a.state, b.state, a.signal, b.signal, transform, stored, progress)
    aligned, kept = _stored_where_better(cgraph, transform, aligned, raw, list(a.signal.ranks))
    clock["evidence"] = time.perf_counter() - t
    described = {name: m for name, m in transform.items() if name not in kept}  # a kept space: the identity
    result = _verdict(_evidence(cgraph, described, aligned, raw, null))
    result.seconds, result.passes, result.tokens, result.transform = clock, passes, tokens, transform
    return result


SMALL_WORK = 1 << 22  # entries of a model's largest matrix up to which its comparison runs on one thread


@contextlib.contextmanager
def threads_for(state: Mapping[str, Tensor]) -> Iterator[None]:
    """One torch thread for a model whose matrices are small. Its factorizations are many short
    LAPACK calls, each ending at a barrier of torch's thread pool: beside two busy processes on two
    cores a 4-layer d 128 pair's split went from 0.2 s to 8–13 s waiting on threads the scheduler
    had not run, and on one thread it takes 0.2–0.3 s busy or idle. Large matrices keep the pool
    (their calls are long enough to share)."""
    largest = max((math.prod(shape_of(state, n)) for n in state), default=0)
    before = torch.get_num_threads()
    if largest > SMALL_WORK or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _counting(say: Callable[[str], None], stage: str) -> Callable[[int, int], None]:
    return lambda done, total: say(f"{stage} ({done}/{total})")


def align_signals(
    graph: SymmetryGraph,
    sig_a: Signals,
    sig_b: Signals,
    say: Callable[[str], None] | None = None,
    fitted: Transform | None = None,
) -> tuple[Transform, dict[str, int]]:
    """B's signal aligned to A's by data-free generalized-orthogonal matching under the whole graph
    (permutations first, then rotations), its weight views computed from the factors; the passes
    each stage took. With ``fitted`` maps (from data), those are the start instead of the
    permutations' (a space they lack starts at the identity). A space keeps the identity where it
    matches within `KEEP_IDENTITY` of the solver's map (`keeping_identity`), and a rotation is the
    one nearest the identity where the low-rank signals leave it undetermined (`NULL_RTOL`)."""
    vgraph = view_graph(graph, "orthogonal")
    views = LowRankViews(vgraph, _dense(sig_a), _dense(sig_b), sig_a.factors, sig_b.factors)

    def report(stage: str, done: int, total: int) -> None:
        if say is not None:
            say(f"{stage} ({done}/{total})")

    first, stage = 0, "alignment of the signals from the data's maps"
    if fitted is not None:  # the data's maps as the start, every space refined on the signals
        start = {**graph.identity(), **fitted}
    else:
        start, first = permutation_start(
            graph,
            views,
            seed=0,
            progress=report,
            stage="alignment of the signals",
            assign=lap_sparse,
            max_iter=MATCHING_ROUNDS,
            tol=MATCHING_TOL,
            keep=KEEP_IDENTITY,
        )
        stage = "alignment of the signals: rotations"
    transform, rounds = rotate(
        graph,
        views,
        start,
        space_order(graph),
        iterations=MATCHING_ROUNDS,
        tol=MATCHING_TOL,
        progress=report,
        stage=stage,
        assign=lap_sparse,
        keep=KEEP_IDENTITY,
        null_rtol=NULL_RTOL,
    )
    return transform, {"permutations": first, "rotations": rounds}


def _dense(sig: Signals) -> LazyState:
    """The signal as a state whose matrices are computed from their factors when read."""
    names = [*sig.factors, *sig.whole]
    shapes = {n: tuple(sig.factors[n].shape if n in sig.factors else sig.whole[n].shape) for n in names}
    dtypes = {n: sig.factors[n].left.dtype if n in sig.factors else sig.whole[n].dtype for n in names}
    return LazyState(shapes, dtypes, sig.dense)


def _bulk_sums(
    graph: SymmetryGraph,
    a: Mapping[str, Tensor],
    b: Mapping[str, Tensor],
    sig_a: Signals,
    sig_b: Signals,
    transform: Transform,
    stored: tuple[Callable[[str, Tensor], Tensor], Callable[[str, Tensor], Tensor]],
    progress: Callable[[int, int], None],
) -> tuple[dict[str, SpaceSums], dict[str, SpaceSums]]:
    """Each space's bulk sums, B aligned and B as stored (each model's gated units in their own
    scaling again: ``stored``), one matrix at a time."""
    last: dict[str, Tensor] = {}

    def bulk_b(name: str) -> Tensor:  # read once for both sums: the aligned one reads it first
        if name not in last:
            last.clear()
            last[name] = b[name] - sig_b.dense(name)
        return last[name]

    names = [n for n in sig_a.ranks if n not in graph.invariant]  # a fixed table (sinusoids) tells no origin
    shapes = {n: tuple(sig_b.factors[n].shape) for n in names}
    moved = graph.apply(LazyState(shapes, {n: torch.float32 for n in names}, bulk_b), transform)
    aligned: dict[str, SpaceSums] = {}
    raw: dict[str, SpaceSums] = {}
    for i, name in enumerate(names):
        bulk_a = a[name] - sig_a.dense(name)
        space, rank = space_of(graph, name), sig_a.ranks[name]
        add_sums(aligned.setdefault(space, SpaceSums()), bulk_a, moved[name], rank)
        add_sums(raw.setdefault(space, SpaceSums()), stored[0](name, bulk_a), stored[1](name, bulk_b(name)), rank)
        del bulk_a
        last.clear()
        progress(i + 1, len(names))
    return aligned, raw


def _stored_where_better(
    graph: SymmetryGraph,
    transform: Transform,
    aligned: dict[str, SpaceSums],
    raw: dict[str, SpaceSums],
    names: list[str],
) -> tuple[dict[str, SpaceSums], set[str]]:
    """A gated space whose streams no map moves reads aligned the better of its units as aligned
    and as stored (the stored order in the stored scaling: one of the maps the symmetry allows,
    which the solver, matching canonical forms, cannot express). Canonical scaling takes each
    model's scales from its own weights, and the sign of a unit from up·gate, arbitrary where that
    is near 0: a bf16 copy's unit can come out negated, and the unit map then pays for it. Returns
    the sums and the spaces read as stored; other spaces, or where the streams moved, as aligned."""
    if not graph.glus:
        return aligned, set()
    moved = set()
    for n in names:
        own = space_of(graph, n)
        if n not in graph.bindings or any(s != own and not _is_identity(transform.get(s)) for s in spaces_of(graph, n)):
            moved.add(own)
    gated = {unit.space for unit in graph.glus} & set(aligned)
    kept = {s for s in gated - moved if raw[s].similarity > aligned[s].similarity}
    return {s: raw[s] if s in kept else sums for s, sums in aligned.items()}, kept


def _is_identity(m: SpaceMap | None) -> bool:
    return m is None or m.is_identity()


def _as_stored(graph: SymmetryGraph, scales: Mapping[str, Tensor]) -> Callable[[str, Tensor], Tensor]:
    """A tensor of the balanced form with its gated units scaled back as the model stores them:
    two models whose units differ by scales (signs included) are equal once balanced, not as
    stored, and a plain average of them mixes a unit with its rescaled or negated twin."""
    if not graph.glus:
        return lambda _name, t: t
    inverse = {space: 1.0 / scales[space] for space in scales}  # every scale is known after the split

    def undo(name: str, t: Tensor) -> Tensor:
        return glu.apply_unit_scales(graph, {name: t}, inverse)[name]

    return undo


def _evidence(
    graph: SymmetryGraph,
    transform: Mapping[str, SpaceMap],
    aligned: Mapping[str, SpaceSums],
    raw: Mapping[str, SpaceSums],
    null: float,
) -> list[SpaceRecord]:
    out = []
    stream = next((n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual"), None)
    for space, sums in aligned.items():
        if sums.norm_a == 0 or sums.norm_b == 0:  # nothing to compare (a pooler its files lacked): no evidence
            continue
        counted = space not in SHARED_ORIGIN
        level = null if counted else SHARED_NULL
        m = transform.get(space) if counted else (transform.get(stream) if stream is not None else None)
        moved, words = describe_map(m)
        out.append(
            SpaceRecord(
                space=space,
                layer=_layer(space) if counted else None,
                similarity=sums.similarity,
                raw_similarity=raw[space].similarity,
                entries=int(sums.dof),
                z=z_score(sums.similarity, sums.dof, level),
                raw_z=z_score(raw[space].similarity, sums.dof, level),
                moved=moved,
                map=words,
                counted=counted,
                gap_z=(sums.similarity - raw[space].similarity) * math.sqrt(max(sums.dof, 1.0)),
            )
        )
    out.sort(key=lambda e: (e.layer is not None, e.layer or 0, e.space))
    return _in_place(out)


def _verdict(spaces: list[SpaceRecord]) -> PairLineage:
    """Related when Stouffer's sum over the counted spaces passes (aligned, or as stored); *same
    basis* only when every counted space is in place on its own test (`_in_place`): a claim about
    every space is an intersection-union test, each space tested at ``ALPHA``, so the claim's
    error rate is at most ``ALPHA`` without a correction for their number. Where no layer is kin,
    *shared embeddings* when a token or position table passes its own test (`shared_tables`)."""
    counted = [e for e in spaces if e.counted] or spaces
    z = combined_z([e.z for e in counted])
    raw_z = combined_z([e.raw_z for e in counted])
    log10_p, raw_log10_p = log10_sf(z), log10_sf(raw_z)
    alpha = math.log10(ALPHA)
    shared = shared_tables(spaces)
    verdict: Verdict = "shared embeddings" if shared else "independent"
    if raw_log10_p < alpha or log10_p < alpha:
        verdict = "same basis" if all(e.in_place for e in counted) else "related up to symmetry"
    return PairLineage(
        verdict=verdict,
        statistic=statistics.median(e.similarity for e in counted),
        raw_statistic=statistics.median(e.raw_similarity for e in counted),
        z=z,
        log10_p=log10_p,
        raw_z=raw_z,
        raw_log10_p=raw_log10_p,
        spaces=spaces,
        shared=shared,
    )


def shared_tables(spaces: Sequence[SpaceRecord]) -> tuple[str, ...]:
    """The token and position tables whose bulks are kin beyond `SHARED_NULL`, aligned or as
    stored, each tested at ``ALPHA`` over the tables compared (Bonferroni)."""
    tables = [e for e in spaces if e.space in SHARED_ORIGIN and not e.counted]
    alpha = math.log10(ALPHA / max(len(tables), 1))
    return tuple(e.space for e in tables if min(log10_sf(e.z), log10_sf(e.raw_z)) < alpha)


def _in_place(records: list[SpaceRecord]) -> list[SpaceRecord]:
    """Each counted space tested on its own: in place when it is kin as stored (its raw z passes
    at ``ALPHA``) and its map gains nothing (the aligned similarity does not exceed the stored one
    by more than chance: the gap's z below the one-sided Bonferroni bound at ``ALPHA`` over the
    counted spaces, so that naming a space *moved* errs with probability at most ``ALPHA`` for the
    pair). A share s of a space's features moved loses about s of its stored similarity."""
    counted = sum(e.counted for e in records)
    limit = float(norm.isf(ALPHA / max(counted, 1)))
    alpha = math.log10(ALPHA)
    return [
        e.model_copy(update={"in_place": log10_sf(e.raw_z) < alpha and e.gap_z < limit}) if e.counted else e
        for e in records
    ]
