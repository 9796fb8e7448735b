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

from .symmetry import Fused, SpaceMap, SymmetryGraph


def _other_axes_mapped(
    graph: SymmetryGraph, name: str, t: Tensor, skip_axis: int, transform: Mapping[str, SpaceMap]
) -> Tensor:
    b = graph.bindings[name]
    for axis, ref in enumerate(b.axes):
        if axis == skip_axis or ref is None:
            continue
        if isinstance(ref, Fused):
            sizes = [graph.ref_size(p) for p in ref.parts]
            chunks = list(t.split(sizes, dim=axis))
            for i, part in enumerate(ref.parts):
                m = graph.axis_map(transform, part)
                if m is not None:
                    chunks[i] = m.apply(chunks[i], axis)
            t = torch.cat(chunks, dim=axis)
        else:
            m = graph.axis_map(transform, ref)
            if m is not None and not (b.norm_scale and not m.is_permutation):
                t = m.apply(t, axis)
    return t


def weight_view(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    transform: Mapping[str, SpaceMap],
    space: str,
) -> dict[str | None, Tensor]:
    """Cross-correlation matrices of ``space`` keyed by role (``None`` for a plain space)."""
    out: dict[str | None, Tensor] = {}
    for tensor, axis, role, offset in graph.users(space):
        a, b = sd_a[tensor], sd_b[tensor]
        b = _other_axes_mapped(graph, tensor, b, axis, transform)
        size = graph.ref_size(f"{space}:{role}" if role else space)
        a = a.narrow(axis, offset, size).to(torch.float64)
        b = b.narrow(axis, offset, size).to(torch.float64)
        a2 = a.movedim(axis, 0).reshape(size, -1)
        b2 = b.movedim(axis, 0).reshape(size, -1)
        m = a2 @ b2.T
        out[role] = out[role] + m if role in out else m
    return out
