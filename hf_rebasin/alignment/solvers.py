"""Pure tensor solvers. No transformers, no hub.

Convention everywhere: ``m[i, j]`` scores putting old feature ``j`` of model B into slot ``i`` of
model A's basis (``m = Σ A_i · B_jᵀ``). A solver returns the map that maximizes ``Σ T[i, j] m[i, j]``
and the value it reaches.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np
import threadpoolctl
import torch
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching
from torch import Tensor

from hf_rebasin.symmetry.transforms import ones_complement_basis

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass
class SolverClock:
    """Seconds spent inside the solvers themselves (LAP, SVD, Sinkhorn) and how many calls:
    benchmarks compare it with the total to see how much is overhead."""

    seconds: float = 0.0
    calls: int = 0
    depth: int = 0


_CLOCK: ContextVar[SolverClock | None] = ContextVar("hf_rebasin_solver_clock", default=None)


@contextmanager
def solver_clock() -> Iterator[SolverClock]:
    """Collect solver time of everything run inside the ``with`` block (nestable)."""
    clock = SolverClock()
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)
        outer = _CLOCK.get()
        if outer is not None:
            outer.seconds += clock.seconds
            outer.calls += clock.calls


def _timed(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        clock = _CLOCK.get()
        if clock is None or clock.depth:
            return fn(*args, **kwargs)
        clock.depth += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.depth -= 1
            clock.seconds += time.perf_counter() - start
            clock.calls += 1

    return wrapper


class _OneBlasThread:
    """NumPy's BLAS on one thread while any SVD runs, as the descent's solver threads assume.

    With a thread per core, LAPACK's many small steps wait on threads that the views' GEMMs, another
    solver or another process hold: on 2 busy cores an SVD of 12 heads' 64×64 blocks took 0.8 s
    instead of 5 ms, a 768×768 one 5 s instead of 0.2 s. Counted, since solvers run on several
    threads: the last one out restores the limits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._limiter: Any = None

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                self._limiter = _blas_pools().limit(limits=1)
            self._users += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._limiter.restore_original_limits()
                self._limiter = None


@functools.cache
def _blas_pools() -> Any:
    """The BLAS libraries loaded (NumPy's among them: imported above), found once."""
    return threadpoolctl.ThreadpoolController().select(user_api="blas")


_ONE_BLAS_THREAD = _OneBlasThread()


def svd(m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(U, S, Vh)`` of a matrix or a stack, in float64 through NumPy's LAPACK on one thread: the
    CPU build of torch here takes seconds where NumPy takes a fraction of one (768×768: 15 s vs 0.2 s)."""
    x = m.detach().to("cpu", torch.float64).numpy()
    with _ONE_BLAS_THREAD:
        u, s, vh = np.linalg.svd(x, full_matrices=False)
    return torch.from_numpy(u), torch.from_numpy(s), torch.from_numpy(vh)


def svdvals(m: Tensor) -> Tensor:
    """Singular values of a matrix or a stack (float64, NumPy's LAPACK; see :func:`svd`)."""
    x = m.detach().to("cpu", torch.float64).numpy()
    with _ONE_BLAS_THREAD:
        return torch.from_numpy(np.linalg.svd(x, compute_uv=False))


@_timed
def lap(score: Tensor) -> tuple[Tensor, float]:
    """Linear assignment maximizing ``Σ_i score[i, perm[i]]``; returns ``(perm, value)``."""
    s = score.detach().to("cpu", torch.float64).numpy()
    best = _strict_row_maxima(s)
    if best is not None:  # the unique optimum, in O(n²): what linear_sum_assignment would return
        return _scored(s, best)
    return _dense_lap(s)


def _dense_lap(s: np.ndarray) -> tuple[Tensor, float]:
    rows, cols = linear_sum_assignment(s, maximize=True)
    return _scored(s, cols[np.argsort(rows)])


def _scored(s: np.ndarray, perm: np.ndarray) -> tuple[Tensor, float]:
    """A permutation (row i → column perm[i]) and its total score."""
    return torch.as_tensor(perm, dtype=torch.long), float(s[np.arange(len(perm)), perm].sum())


SPARSE_CANDIDATES = 32  # best columns per row, and best rows per column, a sparse LAP keeps
# narrower problems take the exact LAP (2,048 unrelated units: 0.3 s): on the lineage testbed's
# 256-unit spaces the sparse one cost related pairs up to 0.28 of a space's bulk similarity
SPARSE_FROM = 2048


@_timed
def lap_sparse(score: Tensor, candidates: int = SPARSE_CANDIDATES, smallest: int = SPARSE_FROM) -> tuple[Tensor, float]:
    """`lap` restricted to the pairs among each row's ``candidates`` best columns or each column's
    ``candidates`` best rows: the best assignment among those (Jonker–Volgenant on the sparse graph,
    scipy's ``min_weight_full_bipartite_matching``), the exact one whenever every pair of the
    exact one is among them (a related pair's are). On 5,632 and 14,336 unrelated units it takes
    a fraction of `lap`'s seconds (benchmarks/README.md, "Lineage at scale"); exact `lap` where
    the candidates admit no full matching or the matrix is narrower than ``smallest``."""
    n = score.shape[0]
    if score.dim() != 2 or n != score.shape[1] or n < max(smallest, 4 * candidates):
        return lap(score)
    t = score.detach().to("cpu", torch.float64)
    s = t.numpy()  # the same memory
    best = _strict_row_maxima(s)
    if best is not None:
        return _scored(s, best)
    kept = torch.zeros(n, n, dtype=torch.bool)
    kept.scatter_(1, torch.topk(t, candidates, dim=1).indices, True)
    kept.scatter_(0, torch.topk(t, candidates, dim=0).indices, True)
    rows, cols = (x.numpy() for x in kept.nonzero(as_tuple=True))
    del kept
    values = s[rows, cols]
    weights = (values.max() - values) + 1.0  # positive: the least total weight is the largest total score
    try:
        found, matched = min_weight_full_bipartite_matching(csr_matrix((weights, (rows, cols)), shape=(n, n)))
    except ValueError:  # no full matching among the candidates: the shortcut was already tried
        return _dense_lap(s)
    perm = np.empty(n, dtype=np.int64)
    perm[found] = matched
    return _scored(s, perm)


def _strict_row_maxima(s: np.ndarray) -> np.ndarray | None:
    """Each row's column of its maximum, when every row has one strictly above its other entries and
    no two rows share it. Any other assignment then gives some row less, so this one is the unique
    optimum. Models that differ by a map (descendants, a model against itself) give such scores:
    a 14,336-wide LAP then costs 0.2 s instead of 2 s (and 32 s for unrelated models' scores)."""
    n = s.shape[0]
    if s.ndim != 2 or n != s.shape[1] or n < 2:
        return None
    top = np.argmax(s, axis=1)
    if len(np.unique(top)) != n:
        return None
    rows = np.arange(n)
    best = s[rows, top]
    masked = s.copy()
    masked[rows, top] = -np.inf
    return top if bool((best > masked.max(axis=1)).all()) else None


@_timed
def procrustes(m: Tensor, fix_ones: bool = False, null_rtol: float | None = None) -> tuple[Tensor, float]:
    """Orthogonal O maximizing ``tr(Oᵀ m)`` (= ``U Vᵀ`` from ``m = U S Vᵀ``); with ``fix_ones``
    the search is restricted to maps with ``O·1 = 1`` (solved inside the complement of 1); with
    ``null_rtol``, the maximizer nearest the identity where ``m`` is singular (`nearest_polar`)."""
    m = m.detach().to("cpu", torch.float64)
    if fix_ones:
        o = _fixing_ones(m, lambda inner: procrustes(inner, null_rtol=null_rtol)[0])
        return o, float((o * m).sum())
    o = nearest_polar(*svd(m), null_rtol)
    return o, float((o * m).sum())


def nearest_polar(u: Tensor, s: Tensor, vh: Tensor, null_rtol: float | None) -> Tensor:
    """``U Vᵀ`` of ``m = U S Vᵀ`` (a matrix or a stack). Where ``m`` is singular (singular values at
    most ``null_rtol`` of its largest; None: never) every completion of ``U Vᵀ`` on its null spaces
    maximizes ``tr(Oᵀ m)`` alike, and the SVD's is arbitrary; this takes the one nearest the
    identity (``Uₙ Q Vₙᵀ`` with Q the polar factor of ``Uₙᵀ Vₙ``), the identity itself for a
    positive semi-definite ``m`` (a model's views against its own)."""
    o = u @ vh
    if null_rtol is None:
        return o
    ranks = (s > null_rtol * s[..., :1]).sum(-1).reshape(-1).tolist()
    n = o.shape[-1]
    out, us, vs = o.reshape(-1, n, n), u.reshape(-1, n, n), vh.reshape(-1, n, n).mT
    for i, r in enumerate(ranks):
        if r < n:
            un, vn = us[i, :, r:], vs[i, :, r:]
            a, _s, bh = svd(un.T @ vn)
            out[i] = us[i, :, :r] @ vs[i, :, :r].T + un @ (a @ bh) @ vn.T
    return out.reshape(o.shape)


@_timed
def plane_rotations(m: Tensor) -> tuple[Tensor, float]:
    """Best rotation of each rotary plane (j, j + n/2) for a square block ``m`` (Q/K under RoPE).

    In one plane with sub-block [[a, b], [c, d]], ``tr(R(θ)ᵀ M) = cos θ (a + d) + sin θ (c − b)``,
    maximized at ``θ = atan2(c − b, a + d)``.
    """
    m = m.detach().to("cpu", torch.float64)
    n = m.shape[0]
    h = n // 2
    j = torch.arange(h)
    a, b, c, d = m[j, j], m[j, j + h], m[j + h, j], m[j + h, j + h]
    theta = torch.atan2(c - b, a + d)
    r = torch.zeros(n, n, dtype=torch.float64)
    r[j, j] = torch.cos(theta)
    r[j + h, j + h] = torch.cos(theta)
    r[j, j + h] = -torch.sin(theta)
    r[j + h, j] = torch.sin(theta)
    return r, float((r * m).sum())


@_timed
def inner_values(m: Tensor, kind: str) -> Tensor:
    """Best inner-map value of every ``[dh, dh]`` block of a stack ``[..., dh, dh]`` without building
    the maps: ranks many head pairs at once. ``kind``: ``perm`` (LAP), ``fixed`` (identity only),
    ``orth`` (Procrustes) or ``planes`` (rotary-plane rotations)."""
    m = m.detach().to("cpu", torch.float64)
    if kind == "orth":
        return svdvals(m).sum(-1)
    if kind == "fixed":
        return torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)
    if kind == "planes":
        h = m.shape[-1] // 2
        j = torch.arange(h)
        a, b = m[..., j, j], m[..., j, j + h]
        c, d = m[..., j + h, j], m[..., j + h, j + h]
        return torch.sqrt((a + d) ** 2 + (c - b) ** 2).sum(-1)
    if kind == "perm":
        return lap_values(m)
    raise ValueError(f"unknown inner map kind {kind!r}")


@_timed
def best_inners(m: Tensor, kind: str, null_rtol: float | None = None) -> Tensor:
    """Best inner map of every block of a stack ``[b, dh, dh]``: ``[b, dh]`` indices for ``perm`` and
    ``fixed``, ``[b, dh, dh]`` matrices for ``orth`` and ``planes`` (``orth`` with ``null_rtol``:
    the one nearest the identity where a block is singular, `nearest_polar`)."""
    m = m.detach().to("cpu", torch.float64)
    if kind == "perm":
        return lap_batch(m)
    if kind == "fixed":
        return torch.arange(m.shape[-1]).expand(m.shape[0], m.shape[-1]).clone()
    if kind == "orth":
        return nearest_polar(*svd(m), null_rtol)
    return torch.stack([plane_rotations(x)[0] for x in m]) if len(m) else m


@_timed
def lap_batch(scores: Tensor) -> Tensor:
    """One LAP per matrix of a ``[b, n, n]`` stack (the inner maps of many head pairs); ``[b, n]``."""
    s = scores.detach().to("cpu", torch.float64).numpy()
    out = np.empty(s.shape[:2], dtype=np.int64)
    for i in range(s.shape[0]):
        rows, cols = linear_sum_assignment(s[i], maximize=True)
        out[i, rows] = cols
    return torch.from_numpy(out)


@_timed
def lap_values(scores: Tensor) -> Tensor:
    """Best assignment value of every matrix of a ``[..., n, n]`` stack."""
    s = scores.detach().to("cpu", torch.float64)
    flat = s.reshape(-1, *s.shape[-2:]).numpy()
    vals = np.empty(flat.shape[0])
    for i in range(flat.shape[0]):
        rows, cols = linear_sum_assignment(flat[i], maximize=True)
        vals[i] = flat[i][rows, cols].sum()
    return torch.from_numpy(vals).reshape(s.shape[:-2])


@_timed
def singular_values(m: Tensor) -> Tensor:
    """Singular values of every matrix of a stack (TransFusion's permutation-invariant head spectrum)."""
    return svdvals(m)


@_timed
def sinkhorn(logits: Tensor, iterations: int = 20) -> Tensor:
    """A doubly stochastic matrix from ``logits`` by alternating row/column normalisation in log
    space (differentiable: soft permutations for learned matching)."""
    x = logits
    for _ in range(iterations):
        x = x - torch.logsumexp(x, dim=-1, keepdim=True)
        x = x - torch.logsumexp(x, dim=-2, keepdim=True)
    return x.exp()


class _Polar(torch.autograd.Function):
    """The orthogonal polar factor ``U Vᵀ`` of ``m = U S Vᵀ``, with its exact gradient. Autograd
    through an SVD divides by ``s_i² − s_j²`` and fails at an orthogonal input (all ``s`` equal,
    where learned matching starts); the polar factor's derivative only divides by ``s_i + s_j``:
    ``∂L/∂m = U ((M − Mᵀ) / (s_i + s_j)) Vᵀ`` with ``M = Uᵀ G V``."""

    @staticmethod
    def forward(ctx: Any, m: Tensor) -> Tensor:
        u, s, vh = (x.to(m.device) for x in svd(m))
        ctx.save_for_backward(u, s, vh)
        return (u @ vh).to(m.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        u, s, vh = ctx.saved_tensors
        inner = u.transpose(-1, -2) @ grad.to(u.dtype) @ vh.transpose(-1, -2)
        k = (inner - inner.transpose(-1, -2)) / (s[..., :, None] + s[..., None, :]).clamp_min(1e-12)
        return (u @ k @ vh).to(grad.dtype)


def polar(m: Tensor, fix_ones: bool = False) -> Tensor:
    """The nearest orthogonal matrix to ``m`` (or to each of a stack), differentiable: learned
    matching's forward pass through free matrices. With ``fix_ones`` (one matrix) the map keeps
    the all-ones vector fixed (solved inside its complement, as `procrustes`)."""
    return _fixing_ones(m, _Polar.apply) if fix_ones else _Polar.apply(m)


def _fixing_ones(m: Tensor, orthogonal: Callable[[Tensor], Tensor]) -> Tensor:
    """The orthogonal map ``orthogonal`` finds for ``m`` inside the complement of the all-ones
    vector, extended by 1 ↦ 1 (in ``m``'s dtype and device)."""
    n = m.shape[0]
    q = ones_complement_basis(n).to(m.device, m.dtype)
    return q @ orthogonal(q.T @ m @ q) @ q.T + torch.full((n, n), 1.0 / n, dtype=m.dtype, device=m.device)
