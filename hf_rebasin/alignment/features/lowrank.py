"""Weight views of low-rank matrices, computed from their factors.

A weight view sums ``A Bᵀ`` along the axis of one space. When both matrices are kept as rank-r
factors, ``A = La·Ra`` and ``B = Lb·Rb``, the same view is ``La (Ra Rbᵀ) Lbᵀ``: r²-sized work in
the middle instead of a product over the other axis. For a 7B model's 14,336 × 4,096 MLP matrices
at rank 64, a units view costs 64× fewer operations and a residual view about 200× fewer, and the
factors of both models fit in 1.4 GB where the dense signals would take 58 GB in float32. Lineage
aligns the learned signals of two models this way (`hf_rebasin.lineage`).

Only plain matrices are kept as factors: two axes, no binding view (stacked experts keep theirs) and
no router (a router's rows move with a shift added). Every other tensor is read dense.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from hf_rebasin.alignment.features.weights import Use, WeightViews
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import split_ref
from hf_rebasin.symmetry.transforms import AxisMap, SpaceMap

__all__ = ["LowRank", "LowRankViews", "factorable"]


@dataclass(frozen=True)
class LowRank:
    """A matrix (or a stack of them) as ``left @ right``: ``[..., rows, r]`` and ``[..., r, cols]``."""

    left: Tensor
    right: Tensor

    def dense(self) -> Tensor:
        return self.left @ self.right

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.left.shape[:-1], self.right.shape[-1]))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.left, self.right))


def factorable(graph: SymmetryGraph, name: str) -> bool:
    """Whether tensor ``name``'s views can be computed from its factors (see the module docstring)."""
    binding = graph.bindings.get(name)
    if binding is None or binding.view is not None or len(binding.axes) != 2 or name in graph.ties:
        return False
    first = binding.axes[0]
    return not (isinstance(first, str) and split_ref(first)[1] == "experts")


class LowRankViews(WeightViews):
    """`WeightViews` of two states whose plain matrices are also given as factors: those terms
    come from the factors, the others from ``sd_a`` and ``sd_b`` (which read them dense)."""

    def __init__(
        self,
        graph: SymmetryGraph,
        sd_a: Mapping[str, Tensor],
        sd_b: Mapping[str, Tensor],
        factors_a: Mapping[str, LowRank],
        factors_b: Mapping[str, LowRank],
    ) -> None:
        super().__init__(graph, sd_a, sd_b)
        both = set(factors_a) & set(factors_b)
        self.factors = {n: (factors_a[n], factors_b[n]) for n in both if factorable(graph, n)}

    def _term(
        self,
        transform: Mapping[str, SpaceMap],
        space: str,
        use: Use,
        cache: dict[str, AxisMap | None],
        mapped: dict[tuple[str, int], Tensor] | None = None,
    ) -> Tensor:
        tensor, axis, role, offset = use
        pair = self.factors.get(tensor)
        if pair is None:
            return super()._term(transform, space, use, cache, mapped)
        fa, fb = pair
        size = self.graph.ref_size(f"{space}:{role}" if role else space)
        if axis == 0:  # B's columns mapped: Rb's columns; the rows of the view are L's
            right_b = self.graph.map_tensor(tensor, fb.right, transform, skip_axis=0, cache=cache)
            core = fa.right @ right_b.T
            la = self.graph.part(tensor, fa.left, 0, offset, size)
            lb = self.graph.part(tensor, fb.left, 0, offset, size)
            return la @ core @ lb.T
        left_b = self.graph.map_tensor(tensor, fb.left, transform, skip_axis=1, cache=cache)
        core = fa.left.T @ left_b
        ra = self.graph.part(tensor, fa.right, 1, offset, size)
        rb = self.graph.part(tensor, fb.right, 1, offset, size)
        return ra.T @ core @ rb
