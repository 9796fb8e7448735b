"""Invertible maps inside attention heads, in closed form (least squares on the circuits).

Inside a head, ``W_Q → M·W_Q`` with ``W_K → M⁻ᵀ·W_K`` leaves every attention score ``qᵀk`` unchanged,
and ``W_V → N·W_V`` with ``W_O → W_O·N⁻¹`` leaves the head's output unchanged, for any invertible M
and N (under rotary embeddings M must commute with RoPE: a scaled rotation of each rotary plane).
Orthogonal maps cannot undo a head of B that computes A's circuit in a sheared basis; these can.

Given B already aligned (head pairing, residual map, orthogonal inner maps), M solves

    min_M ‖M·Q_B − Q_A‖² + ‖Mᵀ·K_A − K_B‖²

(the K term is ``M⁻ᵀ·K_B ≈ K_A`` multiplied through by Mᵀ, which makes the problem linear), whose
normal equations are the Sylvester equation ``(K_A K_Aᵀ)·M + M·(Q_B Q_Bᵀ) = Q_A Q_Bᵀ + K_A K_Bᵀ``;
N likewise from V and O. Under RoPE each plane's M is a complex number c, solved in closed form.
When B is A under such maps, the residuals vanish and the maps are recovered exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from scipy.linalg import solve_sylvester
from torch import Tensor

from ..symmetry import HeadMap, HeadSpace, SymmetryGraph, Transform


def head_rows(graph: SymmetryGraph, sd: Mapping[str, Tensor], space: str) -> dict[str, Tensor]:
    """Per role, ``[G, dh, m]``: the rows of every tensor bound to the role, by KV slot (query and
    output heads of a group side by side along ``m``), weights and biases concatenated."""
    sp = graph.spaces[space]
    assert isinstance(sp, HeadSpace)
    G, r, dh = sp.num_kv_heads, sp.group_size, sp.head_dim
    parts: dict[str, list[Tensor]] = {}
    for tensor, axis, role, offset in graph.users(space):
        assert role is not None
        size = sp.role_size(role)
        t = sd[tensor].narrow(axis, offset, size).to(torch.float64).movedim(axis, 0).reshape(size, -1)
        heads = size // dh
        t = t.reshape(heads, dh, -1)
        if heads != G:  # query / output heads: the r heads of a group side by side
            t = t.reshape(G, r, dh, -1).permute(0, 2, 1, 3).reshape(G, dh, -1)
        parts.setdefault(role, []).append(t)
    return {role: torch.cat(blocks, dim=-1) for role, blocks in parts.items()}


def sylvester_map(xa: Tensor, xb: Tensor, ya: Tensor, yb: Tensor) -> Tensor:
    """``M`` minimizing ``‖M·xb − xa‖² + ‖Mᵀ·ya − yb‖²`` (rows ``[dh, m]``), float64."""
    lhs = (ya @ ya.T).numpy()
    rhs = (xb @ xb.T).numpy()
    q = (xa @ xb.T + ya @ yb.T).numpy()
    return torch.as_tensor(solve_sylvester(lhs, rhs, q), dtype=torch.float64)


def plane_map(xa: Tensor, xb: Tensor, ya: Tensor, yb: Tensor) -> Tensor:
    """The same problem with ``M`` a scaled rotation of each rotary plane ``(j, j + dh/2)``."""
    half = xa.shape[0] // 2
    za, zb = torch.complex(xa[:half], xa[half:]), torch.complex(xb[:half], xb[half:])
    wa, wb = torch.complex(ya[:half], ya[half:]), torch.complex(yb[:half], yb[half:])
    num = (zb.conj() * za).sum(-1) + (wa * wb.conj()).sum(-1)
    den = (zb.abs() ** 2).sum(-1) + (wa.abs() ** 2).sum(-1)
    c = num / den.clamp_min(1e-30)
    m = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    j = torch.arange(half)
    m[j, j] = c.real
    m[j + half, j + half] = c.real
    m[j, j + half] = -c.imag
    m[j + half, j] = c.imag
    return m


def _as_matrix(inner: Tensor) -> Tensor:
    if inner.dtype == torch.long:
        return torch.eye(inner.shape[-1], dtype=torch.float64)[inner]
    return inner.to(torch.float64)


def invertible_inner(
    graph: SymmetryGraph, sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], transform: Transform
) -> Transform:
    """``transform`` with every head space's inner maps refined to invertible ones by the least
    squares above, solved on B under ``transform``; other spaces unchanged."""
    aligned = graph.apply(sd_b, transform, check=False)
    out = dict(transform)
    for name, sp in graph.spaces.items():
        m = transform.get(name)
        if not isinstance(sp, HeadSpace) or not isinstance(m, HeadMap):
            continue
        rows_a, rows_b = head_rows(graph, sd_a, name), head_rows(graph, aligned, name)
        if not {"q", "k", "v", "o"} <= set(rows_a):
            continue
        solve_qk = plane_map if sp.rotary else sylvester_map
        extra_qk = torch.stack(
            [solve_qk(rows_a["q"][g], rows_b["q"][g], rows_a["k"][g], rows_b["k"][g]) for g in range(sp.num_kv_heads)]
        )
        extra_vo = torch.stack(
            [
                sylvester_map(rows_a["v"][g], rows_b["v"][g], rows_a["o"][g], rows_b["o"][g])
                for g in range(sp.num_kv_heads)
            ]
        )
        qk, vo = m.inner("q"), m.inner("v")  # compose: the new map acts after the old one
        out[name] = HeadMap(m.kv_perm, m.q_perm, extra_qk @ _as_matrix(qk), extra_vo @ _as_matrix(vo), invertible=True)
    return out
