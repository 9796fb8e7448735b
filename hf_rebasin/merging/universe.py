"""Universe merging of M models: align every model to an evolving mean, average, repeat.

Aligning every model to the first (the reference merge) matches each model against A alone, so
A's quirks decide every matching and the merge lives in A's basis. The universe merge looks for one
basis in which *all* models sit close together. It starts from the reference merge and then, round
after round, aligns every original model (A included) to the current mean with the pairwise
strategy and averages again, until the mean stops moving.

What a model is aligned to: by default the weighted mean of the *other* aligned models, updated
model after model (leave-one-out, as in git re-basin's MergeMany). With Σwᵢ = 1 the spread
J = Σᵢ wᵢ‖Tᵢθᵢ − θ̄‖² depends on model i only through ‖Tᵢθᵢ − θ̄₋ᵢ‖, so each step is exact
coordinate descent on J. The full mean contains model i's own previous copy (weight wᵢ), which pulls
the matching back to the map it already has: weight matching then returns that map unchanged.
``leave_one_out=False`` aligns to the full mean all the same (every model to one fixed mean, then
average). Either way a new map is taken only if it brings the model closer to its target, so the
spread never grows.

Every map is an allowed transform of one model, so each aligned model computes what that model
computes. Orthogonal strategies work in canonical form (norm scales folded, a tied head untied):
means of canonical models are canonical, and the strategy's own canonicalization of the target is
a no-op up to rounding (tested, not assumed). Activation-based strategies stream data through a
model rebuilt from the target. Pure tensor code and strategy calls: no files, no network.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.alignment.experts import fit_router_shifts, softmax_routers
from hf_rebasin.alignment.strategies import (
    Alignment,
    AlignmentData,
    Options,
    Pair,
    Progress,
    Strategy,
    UniverseMaps,
    get_strategy,
)
from hf_rebasin.core.names import DEFAULT_ITERATIONS, DEFAULT_TOL
from hf_rebasin.merging.interpolate import merge_state_dicts
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.transforms import ExpertMap, Transform

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["DEFAULT_ITERATIONS", "DEFAULT_TOL", "UniverseResult", "universe_merge"]


# the rows each aligned model lacks, filled in the merge's basis (`merging.vocabulary.fill.fill_merge`)
Fill = Callable[[Sequence[Mapping[str, Tensor]]], list[Mapping[str, Tensor]]]


@dataclass
class UniverseResult:
    """The universe merge and how it got there.

    ``alignments[i]`` maps original model i into the basis of ``merged`` (its ``sd_a`` is the final
    mean). Round r = 1…``rounds`` moves the mean from θ̄ᵣ₋₁ to θ̄ᵣ, θ̄₀ being ``reference`` (every
    model aligned to model 0): ``change[r-1]`` = ‖θ̄ᵣ − θ̄ᵣ₋₁‖ / ‖θ̄ᵣ₋₁‖, and ``spread[r]`` is the
    weighted RMS distance of the aligned models to θ̄ᵣ relative to ‖θ̄ᵣ‖ (``spread[0]``: the reference).
    """

    merged: dict[str, Tensor]
    alignments: list[Alignment]
    rounds: int
    change: list[float]
    spread: list[float]
    converged: bool
    reference: dict[str, Tensor]
    canonical: bool = False
    untied: list[str] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # per round: models whose previous map was closer
    notes: list[str] = field(default_factory=list)
    learned: dict[str, Any] | None = None  # the Dirichlet refinement's held-out curve (learned matching)

    def record(self) -> dict[str, Any]:
        """The ``universe`` entry of ``rebasin.json`` (numbers only)."""
        return {
            "rounds": self.rounds,
            "change": list(self.change),
            "spread": list(self.spread),
            "kept": list(self.kept),
            "converged": self.converged,
        }


def _floats(sd: Mapping[str, Tensor]) -> list[str]:
    return [k for k, v in sd.items() if v.is_floating_point()]


def _sq_norm(sd: Mapping[str, Tensor]) -> float:
    return sum(float(sd[k].double().pow(2).sum()) for k in _floats(sd))


def _sq_dist(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    return sum(float((a[k].double() - b[k].to(a[k].device).double()).pow(2).sum()) for k in _floats(a))


def _spread(mean: Mapping[str, Tensor], aligned: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> float:
    """sqrt(Σ wᵢ‖θ̄ − xᵢ‖² / ‖θ̄‖²): how far apart the aligned models still are."""
    norm = _sq_norm(mean)
    total = sum(w * _sq_dist(mean, x) for w, x in zip(weights, aligned, strict=True))
    return math.sqrt(total / norm) if norm else 0.0


def _others(aligned: Sequence[Mapping[str, Tensor]], weights: Sequence[float], i: int) -> dict[str, Tensor]:
    """The weighted mean of every aligned model but model i (equal weights if theirs are all 0)."""
    rest = [x for j, x in enumerate(aligned) if j != i]
    w = [x for j, x in enumerate(weights) if j != i]
    total = sum(w)
    w = [x / total for x in w] if total > 0 else [1.0 / len(rest)] * len(rest)
    return merge_state_dicts(rest, w)


def _identity_of(reference: Alignment) -> Alignment:
    """Model 0 in its own basis (in the reference alignment's form): the start of its universe map."""
    return dataclasses.replace(
        reference, sd_b=reference.sd_a, transform=reference.graph.identity(), notes=[], timings={}
    )


def _target_model(template: PreTrainedModel, mean: Mapping[str, Tensor], untie: bool) -> PreTrainedModel:
    """A live model holding the mean, on the template's device (activation-based strategies stream data through it)."""
    from hf_rebasin.io.rebuild import rebuild

    model = rebuild(template, dict(mean), untie=untie)
    model.to(next(template.parameters()).device)  # type: ignore[arg-type]  # transformers wraps .to
    return model


def _check_call(
    n: int,
    weights: Sequence[float],
    models: Sequence[PreTrainedModel] | None,
    initial: Sequence[Alignment] | None,
    iterations: int,
    tol: float,
) -> None:
    """Refuse a universe merge whose arguments do not fit together (a programming error: ValueError)."""
    if n < 2:
        raise ValueError(f"a universe merge needs at least two models, got {n}")
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} models: give one weight per model")
    if models is not None and len(models) != n:
        raise ValueError(f"{len(models)} models for {n} state dicts: give one live model per state dict")
    if initial is not None and len(initial) != n - 1:
        raise ValueError(f"{len(initial)} initial alignments for {n - 1} models after the reference")
    if iterations < 0 or not tol >= 0:
        raise ValueError(f"iterations must be ≥ 0 and tol ≥ 0, got {iterations} and {tol}")


@dataclass
class _Aligner:
    """What stays fixed while a universe merge aligns model after model: the strategy and its
    options, the models (live ones only where the strategy streams data through them), the data."""

    strategy: Strategy
    options: Options
    graph: SymmetryGraph
    state_dicts: Sequence[Mapping[str, Tensor]]
    live: list[PreTrainedModel] | None
    data: AlignmentData | None
    progress: Progress | None
    fill: Fill | None = None  # rows a model lacks (vocabularies that differ), filled before any mean

    def pool(self, aligned: Sequence[Mapping[str, Tensor]]) -> Sequence[Mapping[str, Tensor]]:
        """The aligned models as their means read them: with the rows each lacks filled."""
        return self.fill(aligned) if self.fill is not None else aligned

    def report(self, stage: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(stage, done, total)

    def align(self, i: int, target: Mapping[str, Tensor], target_model: PreTrainedModel | None) -> Alignment:
        """Model ``i`` aligned to ``target`` (held by ``target_model`` where the strategy needs a live one)."""
        model_b = self.live[i] if self.live is not None else None
        pair = Pair(self.graph, target, self.state_dicts[i], target_model, model_b, self.data)
        return self.strategy.run(pair, self.options, self.progress)

    def reference(self) -> list[Alignment]:
        """Round 0, the reference merge: every model aligned to model 0."""
        stage, n = "universe: reference alignment", len(self.state_dicts)
        template = self.live[0] if self.live is not None else None
        aligned_to_0: list[Alignment] = []
        self.report(stage, 0, n - 1)
        for i in range(1, n):
            aligned_to_0.append(self.align(i, self.state_dicts[0], template))
            self.report(stage, i, n - 1)
        return aligned_to_0

    def round(
        self,
        r: int,
        alignments: list[Alignment],
        aligned: list[dict[str, Tensor]],
        weights: Sequence[float],
        mean: Mapping[str, Tensor],
        leave_one_out: bool,
        untie: bool,
    ) -> int:
        """Round ``r``: every model realigned to its target, in place; how many kept their previous map."""
        stage, n = f"universe: round {r}", len(alignments)
        self.report(stage, 0, n)
        keep = 0
        for i in range(n):
            target = _others(self.pool(aligned), weights, i) if leave_one_out else mean
            target_model = _target_model(self.live[0], target, untie) if self.live is not None else None
            new = self.align(i, target, target_model)
            candidate = new.aligned_b()
            # a map that does not bring the model closer to its target is not taken: the spread never grows
            if _sq_dist(target, candidate) <= _sq_dist(target, aligned[i]):
                alignments[i], aligned[i] = new, candidate
            else:
                alignments[i] = dataclasses.replace(alignments[i], sd_a=new.sd_a)
                keep += 1
            self.report(stage, i + 1, n)
        return keep


def shared_router_gauge(
    graph: SymmetryGraph,
    state_dicts: Sequence[Mapping[str, Tensor]],
    transforms: Sequence[Transform],
    weights: Sequence[float],
) -> list[Transform]:
    """The transforms with every softmax router's shift refitted so that all models' mapped routers
    have one mean row: the weighted mean of their mapped mean rows before any shift. A softmax
    ignores the mean row (the router's gauge), so each model computes what it did; averaging then
    adds like to like. The pairwise alignments fit each shift to the target's gauge; a refinement
    that changes the residual maps afterwards (learned matching across models) needs this again."""
    routers = softmax_routers(graph)
    if not routers:
        return list(transforms)
    total = sum(weights) or 1.0
    anchor: dict[str, Tensor] = {}
    for router, space in routers.items():
        rows = []
        for sd, t in zip(state_dicts, transforms, strict=True):
            m = t.get(space)
            plain = {**t, space: dataclasses.replace(m, shift=None)} if isinstance(m, ExpertMap) else t
            rows.append(graph.map_tensor(router, sd[router], plain).double().mean(0))
        mean = torch.stack([w * r for w, r in zip(weights, rows, strict=True)]).sum(0) / total
        anchor[router] = mean[None]
    return [fit_router_shifts(graph, anchor, sd, t) for sd, t in zip(state_dicts, transforms, strict=True)]


def _relative_change(before: Mapping[str, Tensor], after: Mapping[str, Tensor]) -> float:
    norm = _sq_norm(before)
    return math.sqrt(_sq_dist(before, after) / norm) if norm else 0.0


def _closing_notes(alignments: Sequence[Alignment], notes: list[str], change: Sequence[float], tol: float) -> None:
    """The alignments' notes (each once), then how the rounds ended, appended to ``notes``."""
    for al in alignments:
        notes.extend(note for note in al.notes if note not in notes)
    rounds = len(change)
    if rounds == 0:
        notes.append("universe: no rounds (iterations: 0); this is the reference merge")
    elif change[-1] < tol:
        notes.append(f"universe: the mean converged after {rounds} round{'s' if rounds != 1 else ''}")
    else:
        notes.append(
            f"universe: stopped after {rounds} round{'s' if rounds != 1 else ''} with the mean still moving "
            f"({change[-1]:.2g} relative, tolerance {tol:g}); raise `merge.universe.iterations` to go on"
        )


def _rounds(
    aligner: _Aligner,
    alignments: list[Alignment],
    w: Sequence[float],
    iterations: int,
    tol: float,
    leave_one_out: bool,
    untie: bool,
) -> tuple[dict[str, Tensor], dict[str, Tensor], list[float], list[float], list[int]]:
    """The rounds of `universe_merge` from the reference merge (the mean of ``alignments`` as they
    come): every model realigned in place, then averaged again, until ``iterations`` or a relative
    move below ``tol``. Returns (the reference merge, the final mean, the spread before and after
    each round, each round's change, how many models kept their map in each round)."""
    aligned = [al.aligned_b() for al in alignments]
    mean = reference = merge_state_dicts(aligner.pool(aligned), w)
    spread = [_spread(mean, aligned, w)]
    change: list[float] = []
    kept: list[int] = []
    for r in range(1, iterations + 1):
        kept.append(aligner.round(r, alignments, aligned, w, mean, leave_one_out, untie))
        new_mean = merge_state_dicts(aligner.pool(aligned), w)
        change.append(_relative_change(mean, new_mean))
        mean = new_mean
        spread.append(_spread(mean, aligned, w))
        if change[-1] < tol:
            break
    return reference, mean, spread, change, kept


def _refine_together(
    strategy: Strategy,
    opts: Options,
    model_0: PreTrainedModel,
    alignments: list[Alignment],
    w: Sequence[float],
    untied: list[str],
    data: AlignmentData,
    progress: Progress | None,
    fill: Fill | None = None,
) -> tuple[list[Alignment], dict[str, Tensor], list[str], dict[str, Any] | None]:
    """The strategy's `universe_refinement` of every map at once after the rounds, the routers'
    shifts then refitted to one gauge (`shared_router_gauge`): (the alignments with the refined
    transforms, their mean, the refinement's notes, its history)."""
    sds, transforms = [al.sd_b for al in alignments], [al.transform for al in alignments]
    maps = UniverseMaps(model_0, alignments[0].graph, sds, transforms, w, untied, data)
    refined = strategy.refine_universe(maps, opts, progress)
    gauged = shared_router_gauge(alignments[0].graph, sds, refined.transforms, w)
    alignments = [dataclasses.replace(al, transform=t) for al, t in zip(alignments, gauged, strict=True)]
    aligned = [al.aligned_b() for al in alignments]
    mean = merge_state_dicts(fill(aligned) if fill is not None else aligned, w)
    return alignments, mean, [f"universe: {note}" for note in refined.notes], refined.history


def universe_merge(
    name: str,
    options: Mapping[str, Any] | Options | None,
    graph: SymmetryGraph,
    state_dicts: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    *,
    models: Sequence[PreTrainedModel] | None = None,
    data: AlignmentData | None = None,
    iterations: int = DEFAULT_ITERATIONS,
    tol: float = DEFAULT_TOL,
    initial: Sequence[Alignment] | None = None,
    leave_one_out: bool = True,
    progress: Progress | None = None,
    fill: Fill | None = None,
) -> UniverseResult:
    """Merge ``state_dicts`` (model 0 first) in a basis shared by all, with strategy ``name``.

    ``graph``: the models' symmetry graph (original form). ``models``: the live models, which
    activation-based strategies need with ``data``. ``initial``: alignments of models 1.. to model 0
    (the reference merge), computed when None.
    Each round aligns every model to the mean of the others (``leave_one_out``) or of all, for
    ``iterations`` rounds or until the mean moves by less than ``tol`` (relative); a strategy's
    `universe_refinement` then refines every map together (3+ models, with data). ``fill`` settles
    the rows a model lacks (vocabularies that differ) before every mean."""
    strategy = get_strategy(name)
    opts = strategy.parse(options)
    n = len(state_dicts)
    _check_call(n, weights, models, initial, iterations, tol)
    w = [float(x) for x in weights]
    live = list(models) if models is not None and strategy.needs_data(opts) else None
    aligner = _Aligner(strategy, opts, graph, state_dicts, live, data, progress, fill)
    alignments = list(initial) if initial is not None else aligner.reference()
    alignments = [_identity_of(alignments[0]), *alignments]
    canonical, untied = alignments[0].canonical, list(alignments[0].untied)
    reference, mean, spread, change, kept = _rounds(
        aligner, alignments, w, iterations, tol, leave_one_out, bool(untied)
    )
    notes: list[str] = []
    learned: dict[str, Any] | None = None
    if strategy.universe_refinement(opts) and n >= 3 and models is not None and data is not None:
        alignments, mean, notes, learned = _refine_together(
            strategy, opts, models[0], alignments, w, untied, data, progress, fill
        )
    alignments = [dataclasses.replace(al, sd_a=mean) for al in alignments]
    _closing_notes(alignments, notes, change, tol)
    return UniverseResult(
        merged=mean,
        alignments=alignments,
        rounds=len(change),
        change=change,
        spread=spread,
        converged=bool(change) and change[-1] < tol,
        reference=reference,
        canonical=canonical,
        untied=untied,
        kept=kept,
        notes=notes,
        learned=learned,
    )
