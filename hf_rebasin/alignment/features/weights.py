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

from hf_rebasin.core.lazy import give_back_freed, row_blocks
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import ExpertSpace, Fused, Space, split_ref
from hf_rebasin.symmetry.transforms import AxisMap, ExpertMap, HeadMap, SpaceMap

Use = tuple[str, int, str | None, int]  # (tensor, axis, role, offset): one of `SymmetryGraph.users`


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
    axis (embeddings, LM head, biases) never change, so they are computed once. A term whose other
    maps are permutations is kept while they stay the same objects (`_kept_term`), up to one
    float32 view of the widest space in all; the rest is recomputed per call: caching every term
    would hold O(layers · d²) matrices. Products and sums run in the weights' dtype (at least
    float32: float32 GEMMs are twice as fast on CPU).
    """

    def __init__(self, graph: SymmetryGraph, sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor]) -> None:
        self.graph, self.sd_a, self.sd_b = graph, sd_a, sd_b
        self._static: dict[str, dict[str | None, Tensor]] = {}
        self._near: dict[str, set[str]] | None = None
        self._kept: dict[tuple[str, Use], tuple[tuple[SpaceMap | None, ...], Tensor]] = {}
        self._kept_bytes = 0
        # one float32 view of the widest space: the buffer that summing in place (`_add`) no longer
        # allocates per call, so the descent's peak stays what it was
        width = max((sp.size for sp in graph.spaces.values() if isinstance(sp, Space)), default=0)
        self._kept_budget = 4 * width**2

    def _term(
        self,
        transform: Mapping[str, SpaceMap],
        space: str,
        use: Use,
        cache: dict[str, AxisMap | None],
        mapped: dict[tuple[str, int], Tensor] | None = None,
    ) -> Tensor:
        """One tensor's share of a view. ``mapped`` keeps the last B mapped on all but one axis: the
        next uses of that tensor on that axis (a fused QKV's q, k and v) read it instead of mapping
        B again, the same product."""
        tensor, axis = use[0], use[1]
        if axis != 0 and self.graph.bindings[tensor].axes[0] is None:
            # an unbound first axis (an embedding's vocabulary) is summed over: blocks of its rows add up
            total: Tensor | None = None
            for a, b in row_blocks([self.sd_a, self.sd_b], tensor):
                b = self.graph.map_tensor(tensor, b, transform, skip_axis=axis, cache=cache)
                m = self._product(space, use, a, b)
                del a, b
                total = m if total is None else total + m
            assert total is not None
            return total
        known = mapped.get((tensor, axis)) if mapped is not None else None
        if known is None:
            known = self.graph.map_tensor(tensor, self.sd_b[tensor], transform, skip_axis=axis, cache=cache)
            if mapped is not None:
                mapped.clear()  # one at a time: a view's peak memory stays that of one mapped tensor
                mapped[(tensor, axis)] = known
        return self._product(space, use, self.sd_a[tensor], known)

    def _product(self, space: str, use: Use, a: Tensor, b: Tensor) -> Tensor:
        """One term (or one block of rows' share of it) of a weight view: ``b`` is B's tensor (or
        block) already mapped on every other axis."""
        tensor, axis, role, offset = use
        size = self.graph.ref_size(f"{space}:{role}" if role else space)
        work = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        a2 = self.graph.part(tensor, a, axis, offset, size).to(work)
        b2 = self.graph.part(tensor, b, axis, offset, size).to(work)
        if a2.dim() == 2:  # a transposed operand, not a transposed copy: the same product, bit for bit
            return a2.T @ b2 if axis == 1 else a2 @ b2.T
        a2, b2 = a2.movedim(axis, 0).reshape(size, -1), b2.movedim(axis, 0).reshape(size, -1)
        return a2 @ b2.T

    def _kept_term(
        self,
        transform: Mapping[str, SpaceMap],
        space: str,
        use: Use,
        others: set[str],
        cache: dict[str, AxisMap | None],
        mapped: dict[tuple[str, int], Tensor],
    ) -> tuple[Tensor, bool]:
        """``_term``, and whether it is kept (shared: not to be written to); ``others`` are the spaces
        of the tensor's other axes (`spaces_of`). Kept where it is likely asked for again unchanged:
        its other maps are permutations (a descent stops moving them after a few passes; a rotation
        moves at every pass) and are not all the neighbours of ``space`` (else its view is asked for
        again only once one of them moved). A kept term is reused while the maps are the same
        objects: maps are never changed in place, only replaced."""
        if self._near is None:
            self._near = neighbours(self.graph)
        maps = tuple(transform.get(s) for s in sorted(others))
        known = self._kept.get((space, use))
        if known is not None and all(x is y for x, y in zip(known[0], maps, strict=True)):
            return known[1], True
        if known is not None:  # its maps moved: its bytes go back to the budget
            del self._kept[(space, use)]
            self._kept_bytes -= known[1].numel() * known[1].element_size()
            del known
        give_back_freed()
        m = self._term(transform, space, use, cache, mapped)
        nbytes = m.numel() * m.element_size()
        keep = others < self._near[space] and all(_discrete(x) for x in maps)
        if not keep or self._kept_bytes + nbytes > self._kept_budget:
            return m, False
        self._kept[(space, use)] = (maps, m)
        self._kept_bytes += nbytes
        return m, True

    def _factors(
        self,
        transform: Mapping[str, SpaceMap],
        space: str,
        use: Use,
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

    def _is_units(self, space: str, use: Use) -> bool:
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
        static = self.static(space)
        out = dict(static)  # sums below are out of place: the cached terms stay as they are
        shared = {id(v) for v in static.values()}  # cached: a view that is one of them is a copy
        cache: dict[str, AxisMap | None] = {}
        mapped: dict[tuple[str, int], Tensor] = {}
        factors: list[tuple[Tensor, Tensor]] = []
        for use in self.graph.users(space):
            if self._is_units(space, use):
                factors.append(self._factors(transform, space, use, cache))
            elif others := spaces_of(self.graph, use[0], skip_axis=use[1]):
                m, kept = self._kept_term(transform, space, use, others, cache, mapped)
                if kept:
                    shared.add(id(m))
                out[use[2]] = _add(out.get(use[2]), m, shared)
        mapped.clear()
        views: dict[str | None, Tensor | ExpertBlocks] = {
            k: v.to(torch.float64, copy=id(v) in shared) for k, v in out.items()
        }
        sp = self.graph.spaces.get(space)
        if factors and isinstance(sp, ExpertSpace):
            views["units"] = ExpertBlocks(sp.num_experts, sp.units, factors)
        return views


def _add(total: Tensor | None, m: Tensor, shared: set[int]) -> Tensor:
    """``total + m``: in place where ``total`` is a sum of this view's own (not a cached term) and
    keeps its dtype, the same sum without a new buffer per term (a units × units view is 38 MB)."""
    if total is None:
        return m
    if id(total) in shared or torch.promote_types(total.dtype, m.dtype) != total.dtype:
        return total + m
    return total.add_(m)


def _discrete(m: SpaceMap | None) -> bool:
    """Whether ``m`` is one of finitely many maps (a signed permutation; heads with permuted inner maps)."""
    if isinstance(m, AxisMap):
        return m.is_signed_permutation
    if isinstance(m, HeadMap):
        return m.qk.dtype == torch.long and m.vo.dtype == torch.long
    return True  # no map yet (the identity), or an expert map: permutations


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
