"""The router's gauge in mixture-of-experts layers, and the experts' two-level assignment.

A softmax over experts is blind to a vector ``c`` added to every router row (every logit moves by
``c·x``), so two routers that route alike may differ by such a vector, and weight matching would see
them as unlike. Matching compares *centred* routers (the mean row subtracted); afterwards B's router
gets, in A's basis, A's mean row back (the shift of its :class:`~hf_rebasin.symmetry.transforms.ExpertMap`), so
that interpolating the routers averages like with like and A is left as it is. A sigmoid router has
no such gauge: its rows are compared as stored and never shifted.

Pure tensor code: no transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from hf_rebasin.alignment.features.weights import ExpertBlocks
from hf_rebasin.alignment.solvers import best_inners, inner_values, lap
from hf_rebasin.core.lazy import LazyState
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import ExpertSpace
from hf_rebasin.symmetry.transforms import ExpertMap, Transform

__all__ = [
    "center_routers",
    "expert_spaces",
    "fit_router_shifts",
    "softmax_routers",
    "solve_experts",
    "unit_blocks",
]


def unit_blocks(units: Tensor | ExpertBlocks, E: int, f: int) -> Callable[[int, int], Tensor]:
    """Block (a, b) of an expert space's unit view, whether kept as factors or dense (head-perm's)."""
    if isinstance(units, ExpertBlocks):
        return units.block
    grid = units.reshape(E, f, E, f)
    return lambda a, b: grid[a, :, b, :]


def expert_spaces(graph: SymmetryGraph) -> dict[str, ExpertSpace]:
    return {n: s for n, s in graph.spaces.items() if isinstance(s, ExpertSpace)}


def softmax_routers(graph: SymmetryGraph) -> dict[str, str]:
    """Router weight → its expert space, for every softmax router (the ones with a gauge)."""
    return {r: n for n, s in expert_spaces(graph).items() if s.router == "softmax" for r in graph.routers(n)}


def _centred(t: Tensor) -> Tensor:
    t64 = t.to(torch.float64)
    return (t64 - t64.mean(dim=0, keepdim=True)).to(t.dtype)


def center_routers(graph: SymmetryGraph, state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """An equivalent state with every softmax router's mean row subtracted (sigmoid routers as
    stored). A `LazyState` stays lazy."""
    routers = softmax_routers(graph)
    if not routers:
        return state
    if isinstance(state, LazyState):
        return state.derive(
            lambda name: _centred(state[name]) if name in routers else state[name],
            rows=lambda name: None if name in routers else state.rows(name),
        )
    return {name: _centred(t) if name in routers else t for name, t in state.items()}


def fit_router_shifts(
    graph: SymmetryGraph, sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], transform: Transform
) -> Transform:
    """``transform`` with every softmax router's shift set so that B's router, mapped, has A's mean
    row: the shift that brings mapped B closest to A (``‖A − (T(B) + 1cᵀ)‖`` is least at
    ``c = mean(A) − mean(T(B))``), and exact whatever it is."""
    out = dict(transform)
    for router, space in softmax_routers(graph).items():
        m = out.get(space)
        if not isinstance(m, ExpertMap) or router not in sd_a:
            continue
        plain = dataclasses.replace(m, shift=None)
        mapped = graph.map_tensor(router, sd_b[router], {**out, space: plain})
        shift = sd_a[router].to(torch.float64).mean(0) - mapped.to(torch.float64).mean(0)
        out[space] = dataclasses.replace(m, shift=shift.cpu())
    return out


def solve_experts(space: ExpertSpace, views: Mapping[str | None, Tensor | ExpertBlocks]) -> ExpertMap:
    """Two-level assignment: the value of pairing A's expert a with B's expert b is the best
    matching of their units (a LAP on their block of the unit view) plus the correlation of their
    router rows; a LAP on those values pairs the experts, then each pair keeps its unit matching."""
    E, f = space.num_experts, space.units
    units = views.get("units")
    cost = torch.zeros(E, E, dtype=torch.float64)
    block = unit_blocks(units, E, f) if units is not None else None
    if block is not None:  # block by block: one f×f block at a time, never the whole view
        for a in range(E):
            for b in range(E):
                cost[a, b] = inner_values(block(a, b), "perm")
    router = views.get("experts")
    if router is not None:
        assert isinstance(router, Tensor)
        cost = cost + router.detach().to("cpu", torch.float64)
    perm, _ = lap(cost)
    if block is None:
        return ExpertMap(perm, torch.arange(f).expand(E, f).clone())
    inner = torch.stack([best_inners(block(a, int(perm[a]))[None], "perm")[0] for a in range(E)])
    return ExpertMap(perm, inner)
