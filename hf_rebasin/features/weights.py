"""Weight views of a space, for data-free matching.

For a space s and a current transform of every *other* space, the weight view is the cross
correlation ``M[i, j] = Σ_tensors ⟨A[.., i, ..], B'[.., j, ..]⟩`` along each axis bound to s, where
B' is model B with all other axes already mapped into A's basis. Head spaces give one matrix per
role (q, k, v, o). Nothing here runs a model: the views read two state dicts and the graph.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ..symmetry import AxisMap, ExpertMap, ExpertSpace, Fused, SpaceMap, SymmetryGraph, split_ref
from ..tensors import give_back_freed, row_blocks


def spaces_of(graph: SymmetryGraph, tensor: str, skip_axis: int | None = None) -> set[str]:
    """Spaces bound to ``tensor``'s axes (all parts of fused axes), except ``skip_axis``."""
    out: set[str] = set()
    for axis, ref in enumerate(graph.bindings[tensor].axes):
        if ref is None or axis == skip_axis:
            continue
        for part in ref.parts if isinstance(ref, Fused) else (ref,):
            out.add(split_ref(part)[0])
    return out


class ExpertBlocks:
    """The unit view of an expert space, ``[E·f, E·f]``, kept as its factors: pairs ``(A, B)`` of
    ``[E·f, n]`` matrices (A's units and B's, mapped on every other axis, one pair per tensor
    part), whose products ``Σ A Bᵀ`` it is. Block (a, b), A's expert a against B's expert b, is
    computed when asked for: a layer's view of Mixtral-8x7B's 8 × 14,336 units would be 98 GiB in
    float64, one block 1.6 GiB."""

    def __init__(self, experts: int, units: int, factors: list[tuple[Tensor, Tensor]]) -> None:
        self.experts, self.units, self.factors = experts, units, factors

    def block(self, a: int, b: int) -> Tensor:
        f = self.units
        out = torch.zeros(f, f, dtype=torch.float64)
        for fa, fb in self.factors:
            out += (fa[a * f : (a + 1) * f] @ fb[b * f : (b + 1) * f].T).to("cpu", torch.float64)
        return out

    def numel(self) -> int:
        """Elements of the whole view (what a dense view would hold: the solver threads' size rule)."""
        return (self.experts * self.units) ** 2

    def value(self, m: ExpertMap) -> float:
        """``Σ T[i, j] M[i, j]`` over the units under ``m``: each pair's block at its unit map."""
        total = 0.0
        for a in range(self.experts):
            block = self.block(a, int(m.perm[a]))
            total += float(block.gather(1, m.inner[a][:, None].to(torch.long)).sum())
        return total


class WeightViews:
    """Weight views of one pair of state dicts, for many transforms.

    A tensor's term depends only on the maps of its *other* axes; terms with no other symmetric
    axis (embeddings, LM head, biases) never change, so they are computed once. The rest is
    recomputed per call: caching every term would hold O(layers · d²) matrices. Products and sums
    run in the weights' dtype (at least float32: float32 GEMMs are twice as fast on CPU).
    """

    def __init__(self, graph: SymmetryGraph, sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor]) -> None:
        self.graph, self.sd_a, self.sd_b = graph, sd_a, sd_b
        self._static: dict[str, dict[str | None, Tensor]] = {}

    def _term(
        self,
        transform: Mapping[str, SpaceMap],
        space: str,
        use: tuple[str, int, str | None, int],
        cache: dict[str, AxisMap | None],
    ) -> Tensor:
        tensor, axis = use[0], use[1]
        if axis != 0 and self.graph.bindings[tensor].axes[0] is None:
            # an unbound first axis (an embedding's vocabulary) is summed over: blocks of its rows add up
            pairs = row_blocks([self.sd_a, self.sd_b], tensor)
        else:
            pairs = iter([[self.sd_a[tensor], self.sd_b[tensor]]])
        total: Tensor | None = None
        for a, b in pairs:
            m = self._product(transform, space, use, cache, a, b)
            del a, b
            total = m if total is None else total + m
        assert total is not None
        return total

    def _product(
        self,
        transform: Mapping[str, SpaceMap],
        space: str,
        use: tuple[str, int, str | None, int],
        cache: dict[str, AxisMap | None],
        a: Tensor,
        b: Tensor,
    ) -> Tensor:
        """One term (or one block of rows' share of it) of a weight view."""
        tensor, axis, role, offset = use
        b = self.graph.map_tensor(tensor, b, transform, skip_axis=axis, cache=cache)
        size = self.graph.ref_size(f"{space}:{role}" if role else space)
        work = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        a2 = self.graph.part(tensor, a, axis, offset, size).to(work)
        b2 = self.graph.part(tensor, b, axis, offset, size).to(work)
        if a2.dim() == 2:  # a transposed operand, not a transposed copy: the same product, bit for bit
            return a2.T @ b2 if axis == 1 else a2 @ b2.T
        a2, b2 = a2.movedim(axis, 0).reshape(size, -1), b2.movedim(axis, 0).reshape(size, -1)
        return a2 @ b2.T

    def _factors(
        self,
        transform: Mapping[str, SpaceMap],
        space: str,
        use: tuple[str, int, str | None, int],
        cache: dict[str, AxisMap | None],
    ) -> tuple[Tensor, Tensor]:
        """A's and B's (mapped on its other axes) features of one use of an expert space's units,
        ``[E·f, n]`` each: the factors of its share of the unit view (`ExpertBlocks`)."""
        tensor, axis, role, offset = use
        b = self.graph.map_tensor(tensor, self.sd_b[tensor], transform, skip_axis=axis, cache=cache)
        size = self.graph.ref_size(f"{space}:{role}")
        work = torch.promote_types(torch.promote_types(self.sd_a[tensor].dtype, b.dtype), torch.float32)
        a2 = self.graph.part(tensor, self.sd_a[tensor], axis, offset, size).to(work)
        b2 = self.graph.part(tensor, b, axis, offset, size).to(work)
        return a2.movedim(axis, 0).reshape(size, -1), b2.movedim(axis, 0).reshape(size, -1)

    def _is_units(self, space: str, use: tuple[str, int, str | None, int]) -> bool:
        return use[2] == "units" and isinstance(self.graph.spaces.get(space), ExpertSpace)

    def static(self, space: str) -> dict[str | None, Tensor]:
        """The terms of tensors with no other symmetric axis (anchors), computed once per space."""
        known = self._static.get(space)
        if known is None:
            known = {}
            for use in self.graph.users(space):
                if self._is_units(space, use):
                    continue  # an expert space's units are kept as factors, never as products
                if not spaces_of(self.graph, use[0], skip_axis=use[1]):
                    give_back_freed()
                    m = self._term({}, space, use, {})
                    known[use[2]] = known[use[2]] + m if use[2] in known else m
            self._static[space] = known
        return known

    def __call__(self, transform: Mapping[str, SpaceMap], space: str) -> dict[str | None, Tensor | ExpertBlocks]:
        """Cross-correlation matrices of ``space`` keyed by role (``None`` for a plain space), float64;
        an expert space's units as `ExpertBlocks` (its factors: blocks computed when asked for).

        The freed operands of each term are given back (`give_back_freed`): left in the heap,
        fragmented, they set the peak of a streamed descent. A term is a GEMM, which costs far
        more than the trim."""
        out = {k: v.clone() for k, v in self.static(space).items()}
        cache: dict[str, AxisMap | None] = {}
        factors: list[tuple[Tensor, Tensor]] = []
        for use in self.graph.users(space):
            if self._is_units(space, use):
                factors.append(self._factors(transform, space, use, cache))
            elif spaces_of(self.graph, use[0], skip_axis=use[1]):
                give_back_freed()
                m = self._term(transform, space, use, cache)
                out[use[2]] = out[use[2]] + m if use[2] in out else m
        views: dict[str | None, Tensor | ExpertBlocks] = {k: v.to(torch.float64) for k, v in out.items()}
        sp = self.graph.spaces.get(space)
        if factors and isinstance(sp, ExpertSpace):
            views["units"] = ExpertBlocks(sp.num_experts, sp.units, factors)
        return views


def neighbours(graph: SymmetryGraph) -> dict[str, set[str]]:
    """Spaces that share a tensor with each space: a space's weight view changes only when one of
    them gets a new map."""
    out: dict[str, set[str]] = {name: set() for name in graph.spaces}
    for tensor in graph.bindings:
        if tensor in graph.ties:
            continue
        spaces = spaces_of(graph, tensor)
        for s in spaces:
            if s in out:
                out[s] |= spaces - {s}
    return out
