"""Coordinate descent over the spaces of a symmetry graph: the engine behind weight matching,
TransFusion and generalized-orthogonal.

Each step fixes every space but one, builds that space's weight view (cross-correlations of A with B
mapped on all other axes) and asks a space solver for a new map. Strategies differ only in their
solvers: how heads are paired (best inner maps, singular-value spectra, QK/OV circuits) and which
class each space gets (permutation or orthogonal).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import dataclasses
import functools
import os
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from hf_rebasin.alignment.experts import solve_experts
from hf_rebasin.alignment.features import WeightViews, neighbours
from hf_rebasin.alignment.features.weights import ExpertBlocks, spaces_of
from hf_rebasin.alignment.solvers import best_inners, inner_values, lap, lap_batch, procrustes, svdvals
from hf_rebasin.alignment.strategies.base import Pair, Progress
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import ExpertSpace, HeadSpace, Space, TransformClass, pinned_spaces
from hf_rebasin.symmetry.transforms import AxisMap, ExpertMap, HeadMap, SpaceMap, Transform, plain_class

Views = Mapping[str | None, Tensor | ExpertBlocks]  # an expert space's units: blocks on demand
SpaceSolver = Callable[[str, Views], SpaceMap]
Assign = Callable[[Tensor], tuple[Tensor, float]]  # a LAP: (permutation, value)
Ranking = Literal["inner", "circuit"]


# --------------------------------------------------------------------------------------------
# Objective
# --------------------------------------------------------------------------------------------


def dense(v: Tensor | ExpertBlocks) -> Tensor:
    """A view as a matrix: every view but an expert space's units (`ExpertBlocks`) is one."""
    assert isinstance(v, Tensor), "an expert space's unit view has no dense form here"
    return v


def map_value(graph: SymmetryGraph, space: str, m: SpaceMap, views: Views) -> float:
    """``Σ T[i, j] M[i, j]`` over the roles of a space: the objective restricted to that space."""
    sp = graph.spaces[space]
    if isinstance(m, HeadMap):
        assert isinstance(sp, HeadSpace)
        return sum(_axis_value(m.expand(sp, role), dense(v)) for role, v in views.items() if role is not None)
    if isinstance(m, ExpertMap):
        assert isinstance(sp, ExpertSpace)
        return sum(
            v.value(m) if isinstance(v, ExpertBlocks) else _axis_value(m.expand(sp, role), dense(v))
            for role, v in views.items()
            if role is not None
        )
    return _axis_value(m, dense(views[None]))


def _axis_value(m: AxisMap, v: Tensor) -> float:
    index = m.index.to(v.device) if m.index is not None else None  # maps live on the CPU, views may not
    if m.blocks is None:
        if index is None:
            return float(torch.diagonal(v).sum())
        return float(v.gather(1, index[:, None]).sum())
    nb, bs, _ = m.blocks.shape
    if index is None:
        rows = torch.arange(nb, device=v.device)
        diag = v.reshape(nb, bs, nb, bs)[rows, :, rows, :]
    else:  # the diagonal blocks of v[:, index], without gathering every column
        diag = v.reshape(nb, bs, -1).gather(2, index.reshape(nb, 1, bs).expand(nb, bs, bs))
    return float((m.blocks.to(device=v.device, dtype=torch.float64) * diag).sum())


# --------------------------------------------------------------------------------------------
# Head spaces
# --------------------------------------------------------------------------------------------


def inner_kinds(space: HeadSpace, cls: TransformClass) -> tuple[str, str]:
    """Which inner maps a head space allows for Q/K and for V/O under ``cls`` (solver kinds: a
    fixed Q/K, and under rotary embeddings any Q/K permutation, is the identity)."""
    if cls == "orthogonal":
        return {"free": "orth", "planes": "planes", "fixed": "fixed"}[space.qk], "orth"
    return ("perm" if space.qk == "free" else "fixed"), "perm"


@dataclasses.dataclass
class HeadPairs:
    """Every (A KV head, B KV head) pairing of one attention layer, as ``[G, G, …]`` stacks:
    ``q``/``o`` hold ``[G, G, r, r, dh, dh]`` blocks (query head i of group a against j of b),
    ``k``/``v`` hold ``[G, G, dh, dh]``."""

    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor

    @classmethod
    def from_views(cls, space: HeadSpace, views: Views) -> HeadPairs:
        G, r, dh = space.num_kv_heads, space.group_size, space.head_dim
        present = {role: dense(v).to(torch.float64) for role in "qkvo" if (v := views.get(role)) is not None}
        device = next((t.device for t in present.values()), None)  # a missing role's zeros sit beside the rest

        def get(role: str, heads: int) -> Tensor:
            if role in present:
                return present[role]
            return torch.zeros(heads * dh, heads * dh, dtype=torch.float64, device=device)

        q = get("q", G * r).reshape(G, r, dh, G, r, dh).permute(0, 3, 1, 4, 2, 5)
        o = get("o", G * r).reshape(G, r, dh, G, r, dh).permute(0, 3, 1, 4, 2, 5)
        k = get("k", G).reshape(G, dh, G, dh).permute(0, 2, 1, 3)
        v = get("v", G).reshape(G, dh, G, dh).permute(0, 2, 1, 3)
        return cls(q, k, v, o)


def head_terms(space: HeadSpace, views: Views, like: Tensor) -> Tensor:
    """``[G, G, r, r]``: what pairing query head i of A's group a with j of B's group b adds through
    the per-head role ``h`` (T5's position bias columns, no inner map); zeros without one."""
    G, r = space.num_kv_heads, space.group_size
    view = views.get("h")
    if view is None:
        return torch.zeros(G, G, r, r, dtype=torch.float64, device=like.device)
    return dense(view).to(device=like.device, dtype=torch.float64).reshape(G, r, G, r).permute(0, 2, 1, 3)


def _rotation_part(m: Tensor) -> tuple[Tensor, Tensor]:
    """Per rotary plane, the part of a 2×2 block that commutes with rotations (α I + β J)."""
    h = m.shape[-1] // 2
    j = torch.arange(h)
    alpha = (m[..., j, j] + m[..., j + h, j + h]) / 2
    beta = (m[..., j + h, j] - m[..., j, j + h]) / 2
    return alpha, beta


def circuit_similarity(pairs: HeadPairs, rotary: bool) -> Tensor:
    """``[G, G, r, r]`` similarity of query heads' QK circuits (W_Qᵀ W_K) plus OV circuits (W_O W_V).

    ``⟨W_Qᵃᵀ W_Kᵃ, W_Qᵇᵀ W_Kᵇ⟩ = ⟨W_Qᵃ W_Qᵇᵀ, W_Kᵃ W_Kᵇᵀ⟩``, so the d×d circuits are never built: the
    ``dh×dh`` blocks of the weight views suffice. Under RoPE (``rotary``: Q/K maps restricted to
    rotary planes) the QK circuit depends on the relative position; averaging over it keeps, per
    rotary plane, the rotation-commuting part of each block. Heads whose Q/K are fixed compare the
    whole circuit (a ranking only: the descent keeps a pairing only when it also matches better).
    """
    k = pairs.k[:, :, None, None]
    if rotary:
        aq, bq = _rotation_part(pairs.q)
        ak, bk = _rotation_part(k)
        qk = 2 * (aq * ak + bq * bk).sum(-1)
    else:
        qk = (pairs.q * k).sum((-1, -2))
    ov = (pairs.o * pairs.v[:, :, None, None]).sum((-1, -2))
    return qk + ov


def solve_heads(
    space: HeadSpace,
    views: Views,
    cls: TransformClass,
    *,
    ranking: Ranking = "inner",
    outer: tuple[Tensor, Tensor] | None = None,
    null_rtol: float | None = None,
) -> HeadMap:
    """Two-level assignment; heads never mix.

    Query heads are assigned inside each (A group, B group) pair, KV heads are paired by an outer
    LAP, then each chosen pair gets its best inner maps (LAP, Procrustes, rotary-plane rotations, or
    the identity where the space fixes them).
    ``ranking`` scores pairs by the value of their best inner maps (weight matching) or by QK/OV
    circuit similarity (invariant to the inner maps); ``outer`` fixes the pairing (TransFusion);
    ``null_rtol``: inner rotations nearest the identity where a pair's block is singular.
    """
    G, r = space.num_kv_heads, space.group_size
    qk_kind, vo_kind = inner_kinds(space, cls)
    pairs = HeadPairs.from_views(space, views)
    per_head = head_terms(space, views, pairs.q)
    a_idx = torch.arange(G)
    if outer is not None:
        kv, q_perm = outer
        b_idx = kv
        tau = q_perm[:, None, :].expand(G, G, r)  # only [a, kv[a]] is read below
    else:
        b_idx = None
        if ranking == "circuit":
            score = circuit_similarity(pairs, space.qk == "planes") + per_head
        else:
            score = inner_values(pairs.q, qk_kind) + inner_values(pairs.o, vo_kind) + per_head
        tau = (
            lap_batch(score.reshape(G * G, r, r)).reshape(G, G, r) if r > 1 else torch.zeros(G, G, 1, dtype=torch.long)
        )
    # blocks summed over the assigned query heads: [G, G, dh, dh]
    gi = torch.arange(G)[:, None, None]
    gj = torch.arange(G)[None, :, None]
    ii = torch.arange(r)[None, None, :]
    qk = pairs.k + pairs.q[gi, gj, ii, tau].sum(2)
    vo = pairs.v + pairs.o[gi, gj, ii, tau].sum(2)
    if b_idx is None:
        if ranking == "circuit":
            cost = score[gi, gj, ii, tau].sum(2)
        else:
            cost = inner_values(qk, qk_kind) + inner_values(vo, vo_kind) + per_head[gi, gj, ii, tau].sum(2)
        b_idx, _ = lap(cost)
    chosen_tau = tau[a_idx, b_idx]
    return HeadMap(
        b_idx.clone(),
        chosen_tau.clone(),
        best_inners(qk[a_idx, b_idx], qk_kind, null_rtol),
        best_inners(vo[a_idx, b_idx], vo_kind, null_rtol),
    )


# --------------------------------------------------------------------------------------------
# Plain spaces and the descent
# --------------------------------------------------------------------------------------------


def solve_plain(
    space: Space, view: Tensor, cls: TransformClass, assign: Assign = lap, null_rtol: float | None = None
) -> AxisMap:
    """LAP, Procrustes (inside 1⊥ for a LayerNorm stream) where the space admits rotations, or a
    LAP on |view| with each pair's sign where it admits signed permutations (the best signed
    permutation: ``Σ sᵢ M[i, π(i)]`` is largest with sᵢ = sign M[i, π(i)]). ``assign`` solves the
    LAPs (`solvers.lap_sparse` trades exactness on unrelated scores for speed on wide spaces);
    ``null_rtol``: the rotation nearest the identity where the view is singular. A pinned space
    gets the identity whatever its view."""
    if space.pinned:
        return AxisMap(space.size)
    got = plain_class(space, cls)
    if got == "orthogonal":
        o, _ = procrustes(view, fix_ones=space.centered, null_rtol=null_rtol)
        return AxisMap(space.size, blocks=o[None])
    if got == "signed-permutation":
        perm, _ = assign(view.abs())
        picked = view.gather(1, perm[:, None].to(view.device))[:, 0].cpu()
        return AxisMap.signed(perm, torch.where(picked < 0, -1.0, 1.0))
    perm, _ = assign(view)
    return AxisMap(space.size, index=perm)


def view_graph(graph: SymmetryGraph, cls: TransformClass) -> SymmetryGraph:
    """The graph whose tensors inform matching. A norm scale on a rotated space is a scaled identity
    (all ones in canonical form), not a vector of that space, so it is left out: as a vector it
    would pull the solution towards maps that fix the all-ones direction. On a space matched with
    signs it is left out too: it only permutes, so as a signed vector it would score a flip wrongly."""
    skip = {n for n, s in graph.spaces.items() if isinstance(s, Space) and plain_class(s, cls) != "permutation"}
    if not skip:
        return graph
    keep = {k: b for k, b in graph.bindings.items() if not (b.norm_scale and set(b.axes) & skip)}
    return dataclasses.replace(graph, bindings=keep)


def anchor_init(views: WeightViews, transform: Transform, solve: SpaceSolver) -> Transform:
    """Start each residual space from its *anchors*: tensors with no other symmetric axis
    (embeddings, LM head, biases). Their view does not depend on any other space, so when the
    anchors determine the map (full rank) the descent starts at the right residual basis instead of
    the identity, where it can stall in a poor local optimum. Pass the same ``views`` to
    :func:`descend`: the anchor terms are computed once."""
    out = dict(transform)
    for name, space in views.graph.spaces.items():
        if not isinstance(space, Space) or space.kind != "residual" or space.pinned:
            continue
        view = views.static(name).get(None)
        if view is None:
            continue
        view = view.to(torch.float64)
        s = svdvals(view)
        if s.numel() == 0 or s[-1] <= 1e-6 * s[0]:
            continue  # too few anchors to pin the basis down
        out[name] = solve(name, {None: view})
    return out


def descend(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    solve: SpaceSolver,
    *,
    init: Transform | None = None,
    max_iter: int = 100,
    order: Sequence[str] | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    stage: str = "matching",
    views: WeightViews | None = None,
    tol: float = 0.0,
) -> tuple[Transform, int]:
    """Coordinate descent; returns the transform and the number of passes.

    A new map is kept only when it raises the weight-matching objective, and the descent stops
    after a pass without improvement (git re-basin): monotone whatever the solver ranks by (head
    pairings chosen by circuit similarity are accepted only when they also match better).
    Rotations improve a little at every pass (Procrustes is continuous), so ``tol`` > 0 also stops
    after a pass that gained less than ``tol`` × what all passes so far gained.
    ``order=None`` visits spaces in a random order per pass. ``views`` shares cached anchor terms
    with :func:`anchor_init`.
    """
    transform = dict(init) if init is not None else graph.identity()
    rng = random.Random(seed)
    pinned = pinned_spaces(graph.spaces)  # only the identity survives a reload there: never visited
    transform.update({n: AxisMap(graph.ref_size(n)) for n in pinned})
    names = [n for n in (order if order is not None else graph.spaces) if n not in pinned]
    views_of = views if views is not None else WeightViews(graph, sd_a, sd_b)
    near = neighbours(graph)
    solved_at: dict[str, tuple[int, ...]] = {}  # neighbours' versions when a space was last solved
    gained = 0.0
    accept = _Accept(graph, transform, dict.fromkeys(graph.spaces, 0), progress, stage, len(names))
    tally = accept.tally
    with _SolverThreads() as threads:
        for _ in range(max_iter):
            accept.passes += 1
            if order is None:
                rng.shuffle(names)
            tally.update(changed=0, done=0, gain=0.0)
            for run in independent_runs(names, near):
                # spaces of one run share no tensor: each view ignores the others' maps, so their
                # solvers may run while the next view is built, with the same result as in turn
                for name in run:
                    state = tuple(accept.version[n] for n in sorted(near[name]))
                    if solved_at.get(name) == state:  # nothing it depends on moved: same view, same answer
                        tally["done"] += 1
                        continue
                    solved_at[name] = state
                    threads.submit(name, views_of(transform, name), solve, accept)
                threads.drain(accept)
            gained += tally["gain"]
            if not tally["changed"] or tally["gain"] <= tol * gained:
                break
    return transform, accept.passes


class _Accept:
    """What keeps a solved map in `descend`: the map replaces the current one only when it raises
    the weight-matching objective, which bumps the space's version (its neighbours are then solved
    again) and counts towards the current pass's ``tally``."""

    def __init__(
        self,
        graph: SymmetryGraph,
        transform: Transform,
        version: dict[str, int],
        progress: Progress | None,
        stage: str,
        total: int,
    ) -> None:
        self.graph, self.transform, self.version = graph, transform, version
        self.progress, self.stage, self.total = progress, stage, total
        self.passes = 0
        self.tally = {"changed": 0, "done": 0, "gain": 0.0}  # of the current pass

    def __call__(self, name: str, view: Views, new_map: SpaceMap) -> None:
        transform, tally = self.transform, self.tally
        old = map_value(self.graph, name, transform[name], view)
        new = map_value(self.graph, name, new_map, view)
        if new > old + 1e-12 * max(1.0, abs(old)):
            transform[name] = new_map
            self.version[name] += 1
            tally["changed"] += 1
            tally["gain"] += new - old
        tally["done"] += 1
        if self.progress is not None:
            self.progress(f"{self.stage} (pass {self.passes})", int(tally["done"]), self.total)


def independent_runs(names: Sequence[str], near: Mapping[str, set[str]]) -> list[list[str]]:
    """``names`` cut, in order, into runs of spaces no two of which share a tensor."""
    runs: list[list[str]] = []
    current: list[str] = []
    for name in names:
        if current and near[name] & set(current):
            runs.append(current)
            current = []
        current.append(name)
    if current:
        runs.append(current)
    return runs


# a view of at least MIN and at most MAX elements is solved on a worker thread while the next is
# built (the LAP of a 3,072-unit MLP takes as long as its view). A smaller one is solved in turn:
# handing it to a thread costs more than solving it (a tiny model's descent took twice as long).
# A larger one (a 7B model's MLP: 11,008² float64, about 1 GB) too, so that no second view of that
# size is alive at once.
PIPELINE_MIN_ELEMENTS = 1 << 18
PIPELINE_MAX_ELEMENTS = 1 << 24


class _SolverThreads:
    """Solvers (LAP, SVD: single-threaded, they release the GIL) on worker threads, at most
    ``workers`` in flight, while the main thread builds the next view (multi-threaded GEMMs)."""

    def __init__(self) -> None:
        cores = os.cpu_count() or 1
        self.workers = max(1, min(4, cores // 2)) if cores > 1 else 0
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.pending: collections.deque[tuple[str, Views, concurrent.futures.Future[SpaceMap]]] = collections.deque()

    def __enter__(self) -> _SolverThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(
        self, name: str, view: Views, solve: SpaceSolver, accept: Callable[[str, Views, SpaceMap], None]
    ) -> None:
        size = sum(v.numel() for v in view.values())
        if not self.workers or not PIPELINE_MIN_ELEMENTS <= size <= PIPELINE_MAX_ELEMENTS:
            self.drain(accept)
            accept(name, view, solve(name, view))
            return
        if self.pool is None:  # threads start with the first view worth them
            self.pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="hf-rebasin-solver")
        context = contextvars.copy_context()  # the solver clock of the caller counts the worker's time
        self.pending.append((name, view, self.pool.submit(context.run, solve, name, view)))
        while len(self.pending) > self.workers:
            self._first(accept)

    def drain(self, accept: Callable[[str, Views, SpaceMap], None]) -> None:
        while self.pending:
            self._first(accept)

    def _first(self, accept: Callable[[str, Views, SpaceMap], None]) -> None:
        name, view, future = self.pending.popleft()
        accept(name, view, future.result())


def space_solver(
    graph: SymmetryGraph,
    cls: TransformClass,
    *,
    ranking: Ranking = "inner",
    outer: Mapping[str, tuple[Tensor, Tensor]] | None = None,
    assign: Assign = lap,
    null_rtol: float | None = None,
) -> SpaceSolver:
    """The per-space solver of a strategy: heads by :func:`solve_heads`, experts by
    :func:`~hf_rebasin.alignment.experts.solve_experts`, others by :func:`solve_plain`
    (``null_rtol``: rotations nearest the identity where a view is singular, `nearest_polar`)."""

    def solve(name: str, views: Views) -> SpaceMap:
        sp = graph.spaces[name]
        if isinstance(sp, Space) and sp.pinned:
            return AxisMap(sp.size)
        if isinstance(sp, ExpertSpace):
            return solve_experts(sp, views)
        if isinstance(sp, HeadSpace):
            fixed = outer.get(name) if outer is not None else None
            return solve_heads(sp, views, cls, ranking=ranking, outer=fixed, null_rtol=null_rtol)
        return solve_plain(sp, dense(views[None]), cls, assign, null_rtol)

    return solve


def matching_objective(
    graph: SymmetryGraph, sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], transform: Transform
) -> float:
    """``Σ_tensors ⟨A, T(B)⟩``, tensor by tensor: what every descent raises, to compare two results."""
    cache: dict[str, AxisMap | None] = {}
    total = 0.0
    for name in graph.bindings:
        if name in graph.ties or name not in sd_a:
            continue
        b = graph.map_tensor(name, sd_b[name], transform, cache=cache)
        total += float((sd_a[name].to(torch.float64) * b.to(torch.float64)).sum())
    return total


def chain_init(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    solve: SpaceSolver,
    order: Sequence[str],
    init: Transform,
) -> Transform:
    """One sweep in ``order`` (a chain: stream 0, the first heads, stream 1, …), each space solved
    from only the tensors whose other spaces this sweep has solved already. The embeddings pin stream
    0, stream 0 pins the first heads, they pin stream 1, and so on; a descent that mixes in the
    terms of neighbours not solved yet (as heavy as the right ones, and wrong) stalls instead."""
    transform = dict(init)
    touched = {t: spaces_of(graph, t) for t in graph.bindings if t not in graph.ties}
    done: set[str] = set()
    for name in order:
        upstream = {t: graph.bindings[t] for t, spaces in touched.items() if name in spaces and spaces - {name} <= done}
        if upstream:
            view = WeightViews(dataclasses.replace(graph, bindings=upstream), sd_a, sd_b)(transform, name)
            if view:
                transform[name] = solve(name, view)
        done.add(name)
    return transform


def per_sublayer_descent(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    start: Transform,
    solver: Callable[[SymmetryGraph], SpaceSolver],
    *,
    cls: TransformClass = "permutation",
    keep: Collection[str] = (),
    max_iter: int,
    progress: Progress | None,
    stage: str,
) -> tuple[SymmetryGraph, Transform]:
    """``graph`` split per sublayer and its maps: a descent from the one global map ``start`` spread
    over every stream, and one from a forward sweep down the chain (:func:`chain_init`); the better
    matched. ``solver`` builds the strategy's space solver for the split graph; spaces in ``keep``
    keep their ``start`` maps."""
    from hf_rebasin.symmetry.sublayers import depth_order, per_sublayer, spread

    split = per_sublayer(graph)
    vgraph = view_graph(split, cls)
    solve = solver(split)
    order = [n for n in depth_order(split) if n not in keep]
    views = WeightViews(vgraph, sd_a, sd_b)
    init = spread(start, split)
    results = []
    for first in (init, chain_init(vgraph, sd_a, sd_b, solve, order, init)):
        transform, _ = descend(
            vgraph,
            sd_a,
            sd_b,
            solve,
            init=first,
            max_iter=max_iter,
            order=order,
            progress=progress,
            stage=stage,
            views=views,
        )
        results.append((matching_objective(vgraph, sd_a, sd_b, transform), transform))
    return split, max(results, key=lambda r: r[0])[1]


def finish_permutations(
    pair: Pair,
    matched: Pair,
    balanced: bool,
    transform: Transform,
    options: Any,
    progress: Progress | None,
    outer: Mapping[str, tuple[Tensor, Tensor]] | None = None,
) -> tuple[SymmetryGraph, Transform, list[str], Mapping[str, Tensor]]:
    """Weight matching's and TransFusion's last steps: :func:`permutation_streams` on the forms
    ``matched`` compared, then (``balanced``) B's gated units rescaled to A's. Returns ``(graph,
    transform, notes, sd_b)``, ``sd_b`` the B the transform applies to."""
    graph, transform, notes = permutation_streams(matched, transform, options, progress, outer)
    if not balanced:
        return graph, transform, notes, pair.sd_b
    from hf_rebasin.symmetry import glu

    return graph, transform, notes, glu.match_scales(graph, pair.sd_a, pair.sd_b, transform)


def permutation_streams(
    pair: Pair,
    transform: Transform,
    options: Any,
    progress: Progress | None,
    outer: Mapping[str, tuple[Tensor, Tensor]] | None = None,
) -> tuple[SymmetryGraph, Transform, list[str]]:
    """Weight matching's and TransFusion's last step: ``(graph, transform, notes)``, split per
    sublayer when ``options.residual_maps`` asks for it (head pairings ``outer`` stay fixed)."""
    if options.residual_maps != "per-sublayer":
        return pair.graph, transform, []
    from hf_rebasin.symmetry.sublayers import PER_SUBLAYER_NOTE, PER_SUBLAYER_STACKS_NOTE

    if len(pair.graph.stacks) > 1:
        return pair.graph, transform, [PER_SUBLAYER_STACKS_NOTE]

    solver = functools.partial(space_solver, cls="permutation", outer=outer)
    graph, transform = per_sublayer_descent(
        pair.graph,
        pair.sd_a,
        pair.sd_b,
        transform,
        solver,
        max_iter=options.max_iter,
        progress=progress,
        stage="per-sublayer",
    )
    return graph, transform, [PER_SUBLAYER_NOTE]
