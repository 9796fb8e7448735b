"""Features for matching: weight views of a space (data-free).

For a space s and a current transform of every *other* space, the weight view is the cross
correlation ``M[i, j] = Σ_tensors ⟨A[.., i, ..], B'[.., j, ..]⟩`` along each axis bound to s, where
B' is model B with all other axes already mapped into A's basis. Head spaces give one matrix per
role (q, k, v, o). Activation statistics (streamed, float64) arrive with the activation strategies.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .symmetry import AxisMap, SpaceMap, SymmetryGraph


def weight_view(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    transform: Mapping[str, SpaceMap],
    space: str,
) -> dict[str | None, Tensor]:
    """Cross-correlation matrices of ``space`` keyed by role (``None`` for a plain space)."""
    out: dict[str | None, Tensor] = {}
    cache: dict[str, AxisMap | None] = {}
    for tensor, axis, role, offset in graph.users(space):
        a = sd_a[tensor]
        b = graph.map_tensor(tensor, sd_b[tensor], transform, skip_axis=axis, cache=cache)
        size = graph.ref_size(f"{space}:{role}" if role else space)
        a = a.narrow(axis, offset, size).to(torch.float64)
        b = b.narrow(axis, offset, size).to(torch.float64)
        a2 = a.movedim(axis, 0).reshape(size, -1)
        b2 = b.movedim(axis, 0).reshape(size, -1)
        m = a2 @ b2.T
        out[role] = out[role] + m if role in out else m
    return out
