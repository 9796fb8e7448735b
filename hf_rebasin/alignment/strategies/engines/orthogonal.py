"""Generalized-orthogonal's data-free descent on weight views: permutations first, then rotations.

Shared by the strategy (views of two canonical models) and lineage (views of two models' learned
signals, kept as low-rank factors): both give it their `WeightViews`, nothing here reads a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_rebasin.alignment.features import WeightViews
from hf_rebasin.alignment.solvers import lap
from hf_rebasin.alignment.strategies.base import Progress
from hf_rebasin.alignment.strategies.engines.descent import (
    Assign,
    SpaceSolver,
    Views,
    anchor_init,
    descend,
    map_value,
    space_solver,
)
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import HeadSpace, Space, is_pinned
from hf_rebasin.symmetry.transforms import SpaceMap, Transform

__all__ = ["keeping_identity", "permutation_start", "rotate", "space_order"]


def space_order(graph: SymmetryGraph) -> list[str]:
    """The residual stream first, then heads, then the rest: the order rotations are solved in. A
    pinned stream is left out: it keeps the identity."""
    residual = [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual"]
    heads = [n for n, s in graph.spaces.items() if isinstance(s, HeadSpace)]
    rest = [n for n in graph.spaces if n not in residual and n not in heads]
    return [n for n in residual + heads + rest if not is_pinned(graph.spaces[n])]


def keeping_identity(graph: SymmetryGraph, solve: SpaceSolver, rtol: float | None) -> SpaceSolver:
    """``solve``, except that a space keeps the identity wherever the identity's value on the same
    view is at least the solver's less ``rtol`` of it (None: ``solve`` itself). Views of low rank
    (lineage's signals) leave the optimum undetermined off their range, where Procrustes completes
    it arbitrarily (inside heads of 16 dims or more), and rounding noise passes for a gain: there
    the stored order is as good, and it is the answer that moves nothing."""
    if rtol is None:
        return solve
    identity = graph.identity()

    def solve_or_keep(name: str, views: Views) -> SpaceMap:
        found, kept = solve(name, views), identity[name]
        best = map_value(graph, name, found, views)
        return kept if map_value(graph, name, kept, views) >= best - rtol * abs(best) else found

    return solve_or_keep


def permutation_start(
    graph: SymmetryGraph,
    views: WeightViews,
    *,
    seed: int,
    progress: Progress | None,
    stage: str,
    assign: Assign = lap,
    max_iter: int = 100,
    tol: float = 0.0,
    keep: float | None = None,
) -> tuple[Transform, int]:
    """Permutations first: their discrete search escapes the poor optima a rotation started at the
    identity falls into; every permutation is an allowed orthogonal map, so the rotations that
    follow end at least as well matched as weight matching. ``views`` is of the view graph.
    Returns the transform and the passes run; ``assign`` solves the LAPs of plain spaces,
    ``max_iter`` and ``tol`` stop the passes as `descend`'s do (by default: once nothing moves);
    ``keep``: the tolerance of `keeping_identity` (None: the solver's answer always)."""
    by_lap = keeping_identity(graph, space_solver(graph, "permutation", assign=assign), keep)
    return descend(
        views.graph,
        views.sd_a,
        views.sd_b,
        by_lap,
        init=anchor_init(views, graph.identity(), by_lap),
        seed=seed,
        progress=progress,
        stage=f"{stage}: permutations",
        views=views,
        max_iter=max_iter,
        tol=tol,
    )


def rotate(
    graph: SymmetryGraph,
    views: WeightViews,
    init: Transform,
    spaces: Sequence[str],
    *,
    iterations: int,
    tol: float,
    progress: Progress | None,
    stage: str,
    assign: Assign = lap,
    keep: float | None = None,
    null_rtol: float | None = None,
) -> tuple[Transform, int]:
    """Orthogonal maps by Procrustes (heads by their circuits), space by space in ``spaces``' order,
    for at most ``iterations`` rounds; with ``tol`` > 0 it stops once a round adds less than that
    share of what all rounds added; ``keep`` as in `permutation_start`; ``null_rtol``: where a view
    is singular (singular values at most that share of its largest), the rotation nearest the
    identity among the equally good ones (`solvers.nearest_polar`). Returns the transform and the
    rounds run."""
    return descend(
        views.graph,
        views.sd_a,
        views.sd_b,
        keeping_identity(
            graph, space_solver(graph, "orthogonal", ranking="circuit", assign=assign, null_rtol=null_rtol), keep
        ),
        init=init,
        max_iter=iterations,
        order=list(spaces),
        progress=progress,
        stage=stage,
        views=views,
        tol=tol,
    )
