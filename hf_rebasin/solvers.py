"""Pure tensor solvers. No transformers, no hub.

Convention everywhere: ``m[i, j]`` scores putting old feature ``j`` of model B into slot ``i`` of
model A's basis (``m = Σ A_i · B_jᵀ``). A solver returns the map that maximizes ``Σ T[i, j] m[i, j]``
and the value it reaches.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from .symmetry import ones_complement_basis


def lap(score: Tensor) -> tuple[Tensor, float]:
    """Linear assignment maximizing ``Σ_i score[i, perm[i]]``; returns ``(perm, value)``."""
    s = score.detach().to("cpu", torch.float64).numpy()
    rows, cols = linear_sum_assignment(s, maximize=True)
    perm = torch.as_tensor(cols[np.argsort(rows)], dtype=torch.long)
    return perm, float(s[rows, cols].sum())


def procrustes(m: Tensor, fix_ones: bool = False) -> tuple[Tensor, float]:
    """Orthogonal O maximizing ``tr(Oᵀ m)`` (= ``U Vᵀ`` from ``m = U S Vᵀ``); with ``fix_ones``
    the search is restricted to maps with ``O·1 = 1`` (solved inside the complement of 1)."""
    m = m.detach().to("cpu", torch.float64)
    if fix_ones:
        n = m.shape[0]
        q = ones_complement_basis(n)
        inner, _ = procrustes(q.T @ m @ q)
        o = q @ inner @ q.T + torch.full((n, n), 1.0 / n, dtype=torch.float64)
        return o, float((o * m).sum())
    u, _s, vh = torch.linalg.svd(m)
    o = u @ vh
    return o, float((o * m).sum())


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


def best_inner(m: Tensor, kind: str) -> tuple[Tensor, float]:
    """The best inner map of one head block. ``kind``: ``perm`` (LAP), ``fixed`` (identity only),
    ``orth`` (Procrustes) or ``planes`` (rotary-plane rotations)."""
    if kind == "perm":
        return lap(m)
    if kind == "fixed":
        return torch.arange(m.shape[0]), float(torch.diagonal(m).sum())
    if kind == "orth":
        return procrustes(m)
    if kind == "planes":
        return plane_rotations(m)
    raise ValueError(f"unknown inner map kind {kind!r}")


def inner_value(m: Tensor, kind: str) -> float:
    """Value of the best inner map without building it (the ranking cost between two heads)."""
    if kind == "orth":
        return float(torch.linalg.svdvals(m.to(torch.float64)).sum())
    return best_inner(m, kind)[1]
