"""Generalized-orthogonal's data-free descent on weight views: permutations first, then rotations.

Shared by the strategy (views of two canonical models) and lineage (views of two models' learned
signals, kept as low-rank factors): both give it their `WeightViews`, nothing here reads a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_rebasin.alignment.features import WeightViews
from hf_rebasin.alignment.solvers import lap
from hf_rebasin.alignment.strategies.base import Progress
from hf_rebasin.alignment.strategies.engines.descent import Assign, anchor_init, descend, space_solver
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import HeadSpace, Space
from hf_rebasin.symmetry.transforms import Transform

__all__ = ["permutation_start", "rotate", "space_order"]


def space_order(graph: SymmetryGraph) -> list[str]:
    """The residual stream first, then heads, then the rest: the order rotations are solved in."""
    residual = [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual"]
    heads = [n for n, s in graph.spaces.items() if isinstance(s, HeadSpace)]
    return residual + heads + [n for n in graph.spaces if n not in residual and n not in heads]


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
) -> tuple[Transform, int]:
    """Permutations first: their discrete search escapes the poor optima a rotation started at the
    identity falls into; every permutation is an allowed orthogonal map, so the rotations that
    follow end at least as well matched as weight matching. ``views`` is of the view graph.
    Returns the transform and the passes run; ``assign`` solves the LAPs of plain spaces,
    ``max_iter`` and ``tol`` stop the passes as `descend`'s do (by default: once nothing moves)."""
    by_lap = space_solver(graph, "permutation", assign=assign)
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
) -> tuple[Transform, int]:
    """Orthogonal maps by Procrustes (heads by their circuits), space by space in ``spaces``' order,
    for at most ``iterations`` rounds; with ``tol`` > 0 it stops once a round adds less than that
    share of what all rounds added. Returns the transform and the rounds run."""
    return descend(
        views.graph,
        views.sd_a,
        views.sd_b,
        space_solver(graph, "orthogonal", ranking="circuit", assign=assign),
        init=init,
        max_iter=iterations,
        order=list(spaces),
        progress=progress,
        stage=stage,
        views=views,
        tol=tol,
    )
