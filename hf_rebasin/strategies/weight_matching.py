"""Weight matching (Ainsworth et al., git re-basin), generalised to the symmetry graph.

Randomized coordinate descent over spaces: for each space, with every other space fixed, pick the
map that maximizes ``Σ ⟨W_A, T_out W_B T_inᵀ⟩`` over all tensors touching it (weights, biases,
norm parameters); stop when a full pass improves nothing. Plain spaces solve one LAP (or one
Procrustes for an orthogonal residual); head spaces solve a two-level assignment so heads never mix.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from ..features import weight_view
from ..solvers import best_inner, inner_value, lap, procrustes
from ..symmetry import AxisMap, HeadMap, HeadSpace, Space, SpaceMap, SymmetryGraph, Transform, TransformClass


def map_value(graph: SymmetryGraph, space: str, m: SpaceMap, views: Mapping[str | None, Tensor]) -> float:
    """``Σ T[i, j] M[i, j]`` over the roles of a space: the objective restricted to that space."""
    sp = graph.spaces[space]
    if isinstance(m, HeadMap):
        assert isinstance(sp, HeadSpace)
        return sum(_axis_value(m.expand(sp, role), v) for role, v in views.items() if role is not None)
    return _axis_value(m, views[None])


def _axis_value(m: AxisMap, v: Tensor) -> float:
    cols = v if m.index is None else v[:, m.index]
    if m.blocks is None:
        return float(torch.diagonal(cols).sum())
    nb, bs, _ = m.blocks.shape
    diag = cols.reshape(nb, bs, nb, bs)[torch.arange(nb), :, torch.arange(nb), :]
    return float((m.blocks.to(torch.float64) * diag).sum())


def inner_kinds(space: HeadSpace, cls: TransformClass) -> tuple[str, str]:
    """Which inner maps a head space allows for Q/K and for V/O under ``cls``."""
    if cls == "orthogonal":
        return ("planes" if space.rotary else "orth"), "orth"
    return ("fixed" if space.rotary else "perm"), "perm"


def solve_heads(space: HeadSpace, views: Mapping[str | None, Tensor], cls: TransformClass) -> tuple[HeadMap, float]:
    """Two-level assignment: score every (A KV head, B KV head) pair by its best inner maps (with
    query heads assigned inside the group by a LAP), pair KV heads by an outer LAP, keep the inner
    maps of the chosen pairs."""
    G, r, dh = space.num_kv_heads, space.group_size, space.head_dim
    qk_kind, vo_kind = inner_kinds(space, cls)

    def blocks(role: str, heads: int) -> Tensor:
        v = views.get(role)
        if v is None:
            return torch.zeros(heads, dh, heads, dh, dtype=torch.float64)
        return v.reshape(heads, dh, heads, dh)

    bq = blocks("q", G * r).reshape(G, r, dh, G, r, dh)
    bo = blocks("o", G * r).reshape(G, r, dh, G, r, dh)
    bk, bv = blocks("k", G), blocks("v", G)

    def pair(a: int, b: int) -> tuple[Tensor, Tensor, Tensor]:
        if r == 1:
            tau = torch.zeros(1, dtype=torch.long)
        else:
            score = torch.tensor(
                [
                    [
                        inner_value(bq[a, i, :, b, j, :], qk_kind) + inner_value(bo[a, i, :, b, j, :], vo_kind)
                        for j in range(r)
                    ]
                    for i in range(r)
                ]
            )
            tau, _ = lap(score)
        qk = bk[a, :, b, :] + sum(bq[a, i, :, b, int(tau[i]), :] for i in range(r))
        vo = bv[a, :, b, :] + sum(bo[a, i, :, b, int(tau[i]), :] for i in range(r))
        return tau, qk, vo

    cost = torch.zeros(G, G, dtype=torch.float64)
    pairs = {}
    for a in range(G):
        for b in range(G):
            pairs[a, b] = tau, qk, vo = pair(a, b)
            cost[a, b] = inner_value(qk, qk_kind) + inner_value(vo, vo_kind)
    kv, total = lap(cost)
    taus, qks, vos = [], [], []
    for a in range(G):
        tau, qk, vo = pairs[a, int(kv[a])]
        taus.append(tau)
        qks.append(best_inner(qk, qk_kind)[0])
        vos.append(best_inner(vo, vo_kind)[0])
    return HeadMap(kv, torch.stack(taus), torch.stack(qks), torch.stack(vos)), total


def solve_space(
    graph: SymmetryGraph, space: str, views: Mapping[str | None, Tensor], cls: TransformClass
) -> tuple[SpaceMap, float]:
    sp = graph.spaces[space]
    if isinstance(sp, HeadSpace):
        return solve_heads(sp, views, cls)
    assert isinstance(sp, Space)
    m = views[None]
    if cls == "orthogonal" and sp.max_class == "orthogonal":
        o, value = procrustes(m, fix_ones=sp.centered)
        return AxisMap(sp.size, blocks=o[None]), value
    perm, value = lap(m)
    return AxisMap(sp.size, index=perm), value


def weight_matching(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    transform_class: TransformClass = "permutation",
    *,
    max_iter: int = 100,
    seed: int = 0,
    init: Transform | None = None,
    on_pass: Callable[[int, int], None] | None = None,
) -> Transform:
    """The transform of B's spaces that best matches A's weights (B's state dict must be in the
    same form as A's: both canonical when ``transform_class`` is orthogonal)."""
    transform = dict(init) if init is not None else graph.identity()
    rng = random.Random(seed)
    names = list(graph.spaces)
    for it in range(max_iter):
        rng.shuffle(names)
        improved = 0
        for name in names:
            views = weight_view(graph, sd_a, sd_b, transform, name)
            old = map_value(graph, name, transform[name], views)
            new_map, new = solve_space(graph, name, views, transform_class)
            if new > old + 1e-9 * max(1.0, abs(old)):
                transform[name] = new_map
                improved += 1
        if on_pass is not None:
            on_pass(it, improved)
        if not improved:
            break
    return transform
