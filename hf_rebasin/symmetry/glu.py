"""Canonical scaling of gated-MLP units, so that weight matching compares like with like.

A gated MLP computes ``down(act(gate·x) ⊙ (up·x))``. Unit i may be scaled by any s ≠ 0, sign
included: row i of ``up`` (and its bias) times s, column i of ``down`` divided by s — exactly the
same function. Two models whose units agree up to such scales look unlike to weight matching, which
compares rows as stored. So before matching, every unit is brought to one scaling: the one where
``‖up row i‖ = ‖down column i‖`` (s = sqrt(‖down col i‖ / ‖up row i‖)) and ``up_i · gate_i ≥ 0``.
Both quantities are invariant under any orthogonal map of the residual stream that ``up``, ``gate``
and ``down`` read or write, so the canonical scaling commutes with residual alignment (and with unit
permutations, which only reorder the units). A unit with a zero norm keeps s = 1; a zero dot product
keeps the sign.

Like :mod:`hf_rebasin.symmetry.canonical`, it works on a state dict in memory and on a `LazyState` (a
checkpoint read tensor by tensor): the scales of one gated MLP are computed from its three tensors
when one of them is first read, kept (a vector per layer), and applied to each tensor as it is read.
All arithmetic is in float64, rounded once to each tensor's dtype. Pure tensor code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import overload

import torch
from torch import Tensor

from hf_rebasin.core.errors import AdapterError, TransformError
from hf_rebasin.core.lazy import LazyState, RowReader
from hf_rebasin.symmetry.graph import Glu, SymmetryGraph
from hf_rebasin.symmetry.spaces import Fused
from hf_rebasin.symmetry.transforms import SpaceMap

__all__ = [
    "apply_unit_scales",
    "balance",
    "is_balanced",
    "log_scaled",
    "match_scales",
    "matched_unit_scales",
    "unit_scales",
]

CHUNK = 1 << 22  # float64 elements per working block (32 MiB): a 7B layer's MLP never goes float64 whole


@dataclass(frozen=True)
class _Span:
    """The features of one copy of a unit space in one tensor: ``[start, start + size)`` of ``axis``."""

    axis: int
    start: int
    size: int


def _span(graph: SymmetryGraph, tensor: str, space: str, occurrence: int) -> _Span:
    """Where the ``occurrence``-th copy of ``space`` lies in ``tensor`` (counted over its axes in
    order, and over the parts of a fused axis)."""
    binding = graph.bindings.get(tensor)
    if binding is None:
        raise AdapterError(f"gated MLP {space!r}: tensor {tensor!r} is not in the symmetry graph")
    seen = 0
    for axis, ref in enumerate(binding.axes):
        parts = ref.parts if isinstance(ref, Fused) else (ref,)
        start = 0
        for part in parts:
            if part is None:
                continue
            size = graph.ref_size(part)
            if part == space:
                if seen == occurrence:
                    if isinstance(ref, Fused) and ref.interleaved:
                        raise AdapterError(f"gated MLP {space!r}: {tensor!r} interleaves its unit axis")
                    return _Span(axis, start, size)
                seen += 1
            start += size
    raise AdapterError(f"gated MLP {space!r}: {tensor!r} has no copy {occurrence} of that space")


def _bias_of(weight: str, graph: SymmetryGraph, names: Mapping[str, object]) -> str | None:
    if weight.endswith(".weight"):
        bias = weight[: -len(".weight")] + ".bias"
        if bias in names and bias in graph.bindings:
            return bias
    return None


def _blocks(t: Tensor, span: _Span, step: int) -> Iterator[tuple[int, Tensor]]:
    """``(first unit, [n, rest] float64)``: the span's units in blocks of ``step``, each unit's
    weights flattened over the other axes."""
    for lo in range(0, span.size, step):
        n = min(step, span.size - lo)
        block = t.narrow(span.axis, span.start + lo, n).movedim(span.axis, 0)
        yield lo, block.reshape(n, -1).to(torch.float64)


def _step(t: Tensor, span: _Span) -> int:
    return max(1, CHUNK // max(1, t.numel() // t.shape[span.axis]))


def _glu_scales(graph: SymmetryGraph, glu: Glu, state: Mapping[str, Tensor]) -> Tensor:
    """The canonical s of every unit of ``glu`` (float64), from its gate, up and down as stored."""
    read: dict[str, Tensor] = {}  # Phi-3's gate and up are one tensor: read it once

    def get(name: str) -> Tensor:
        if name not in read:
            read[name] = graph.logical(name, state[name])
        return read[name]

    gate, up, down = (get(t) for t, _ in (glu.gate, glu.up, glu.down))
    g_span, u_span, d_span = (_span(graph, t, glu.space, k) for t, k in (glu.gate, glu.up, glu.down))
    n = u_span.size
    up_sq, dot, down_sq = (torch.zeros(n, dtype=torch.float64, device=up.device) for _ in range(3))
    step = min(_step(up, u_span), _step(gate, g_span))
    for (lo, u), (_, g) in zip(_blocks(up, u_span, step), _blocks(gate, g_span, step), strict=True):
        up_sq[lo : lo + len(u)] = u.square().sum(1)
        dot[lo : lo + len(u)] = (u * g).sum(1)
    for lo, d in _blocks(down, d_span, _step(down, d_span)):
        down_sq[lo : lo + len(d)] = d.square().sum(1)
    magnitude = (down_sq.sqrt() / up_sq.sqrt()).sqrt()
    sign = torch.where(dot < 0, -1.0, 1.0).to(torch.float64)
    ok = (up_sq > 0) & (down_sq > 0) & torch.isfinite(magnitude) & (magnitude > 0)
    return torch.where(ok, magnitude * sign, torch.ones_like(magnitude))


def unit_scales(graph: SymmetryGraph, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The canonical scale s of every unit of every gated MLP, by unit space (float64 vectors):
    ``apply_unit_scales(graph, state, unit_scales(graph, state))`` is `balance`. Reads each gated
    MLP's tensors once (one layer at a time for a `LazyState`)."""
    return {glu.space: _glu_scales(graph, glu, state) for glu in graph.glus}


def lazy_unit_scales(graph: SymmetryGraph, state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """`unit_scales`, each space's computed when first asked for and kept: `balance` with a handle
    on the scales it applied (lineage compares models as stored by undoing them)."""
    return _LazyScales(graph, state)


class _LazyScales(Mapping[str, Tensor]):
    """`unit_scales`, each space's computed when first asked for and kept (a vector per layer)."""

    def __init__(self, graph: SymmetryGraph, state: Mapping[str, Tensor]) -> None:
        self._graph, self._state = graph, state
        self._glus = {glu.space: glu for glu in graph.glus}
        self._done: dict[str, Tensor] = {}

    def __getitem__(self, space: str) -> Tensor:
        if space not in self._done:
            self._done[space] = _glu_scales(self._graph, self._glus[space], self._state)
        return self._done[space]

    def __iter__(self) -> Iterator[str]:
        return iter(self._glus)

    def __len__(self) -> int:
        return len(self._glus)


@dataclass(frozen=True)
class _Edit:
    """Multiply (or, for ``down``, divide) one span of a tensor by the scales of ``space``."""

    space: str
    span: _Span
    divide: bool


def _edits(graph: SymmetryGraph, names: Mapping[str, object]) -> dict[str, list[_Edit]]:
    """Per tensor, what the unit scales do to it: ``up`` and its bias (the same copy of the space
    on their unit axis) are multiplied, ``down`` divided; ``gate`` and ``down``'s bias stay."""
    out: dict[str, list[_Edit]] = {}
    for glu in graph.glus:
        (up, k_up), (down, k_down) = glu.up, glu.down
        targets = [(up, k_up, False), (down, k_down, True)]
        bias = _bias_of(up, graph, names)
        if bias is not None:
            targets.append((bias, k_up, False))
        for tensor, k, divide in targets:
            out.setdefault(tensor, []).append(_Edit(glu.space, _span(graph, tensor, glu.space, k), divide))
    return out


def _edited(t: Tensor, edits: list[_Edit], scales: Mapping[str, Tensor]) -> Tensor:
    """``t`` with every edit applied, each span computed in float64 from ``t`` and rounded once."""
    active = [e for e in edits if e.space in scales]
    if not active:
        return t
    out = t.clone()
    for e in active:
        s = scales[e.space].to(device=t.device, dtype=torch.float64)
        shape = [1] * t.dim()
        shape[e.span.axis] = -1
        step = _step(t, e.span)
        for lo in range(0, e.span.size, step):
            n = min(step, e.span.size - lo)
            block = t.narrow(e.span.axis, e.span.start + lo, n).to(torch.float64)
            factor = s[lo : lo + n].reshape(shape)
            out.narrow(e.span.axis, e.span.start + lo, n).copy_(block / factor if e.divide else block * factor)
    return out


def _check_scales(graph: SymmetryGraph, scales: Mapping[str, Tensor]) -> None:
    known = {glu.space for glu in graph.glus}
    for space in scales:
        if space not in known:
            raise TransformError(f"unit scales name space {space!r}, which is not a gated MLP of {graph.family!r}")
        s = scales[space]
        size = graph.ref_size(space)
        if s.shape != (size,):
            raise TransformError(f"unit scales of {space!r} have shape {tuple(s.shape)}, expected ({size},)")
        if not bool(torch.isfinite(s).all()) or bool((s == 0).any()):
            raise TransformError(f"unit scales of {space!r} must be finite and nonzero")


@overload
def apply_unit_scales(  # type: ignore[overload-overlap]  # a LazyState is a Mapping that stays lazy
    graph: SymmetryGraph, state: LazyState, scales: Mapping[str, Tensor]
) -> LazyState: ...


@overload
def apply_unit_scales(
    graph: SymmetryGraph, state: Mapping[str, Tensor], scales: Mapping[str, Tensor]
) -> dict[str, Tensor]: ...


def apply_unit_scales(
    graph: SymmetryGraph, state: Mapping[str, Tensor], scales: Mapping[str, Tensor]
) -> dict[str, Tensor] | LazyState:
    """An equivalent state: for every gated MLP in ``scales`` (unit space → s, nonzero, signs
    allowed), row i of ``up`` and its bias times sᵢ, column i of ``down`` divided by sᵢ. Spaces
    missing from ``scales`` keep their scaling. A `LazyState` gives a `LazyState` (tensors scaled
    when read); a state dict in memory a new dict (unchanged tensors shared, not copied)."""
    if not isinstance(scales, _LazyScales):
        _check_scales(graph, scales)
    edits = _edits(graph, state)

    def one(name: str) -> Tensor:
        source = graph.ties.get(name)
        key = source if source is not None and source in edits and source in state else name
        todo = edits.get(key, [])
        if not any(e.space in scales for e in todo):
            return state[key]
        return graph.stored(key, _edited(graph.logical(key, state[key]), todo, scales))

    def rows(name: str) -> RowReader | None:  # a tensor no gated MLP edits, as its rows come
        assert isinstance(state, LazyState)
        touched = name in edits or graph.ties.get(name) in edits
        return None if touched else state.rows(name)

    if isinstance(state, LazyState):
        return state.derive(one, rows=rows)
    return {name: one(name) if (name in edits or graph.ties.get(name) in edits) else state[name] for name in state}


@overload
def balance(graph: SymmetryGraph, state: LazyState) -> LazyState: ...  # type: ignore[overload-overlap]


@overload
def balance(graph: SymmetryGraph, state: Mapping[str, Tensor]) -> dict[str, Tensor]: ...


def balance(graph: SymmetryGraph, state: Mapping[str, Tensor]) -> dict[str, Tensor] | LazyState:
    """An equivalent state with every gated MLP in canonical unit scaling (‖up row i‖ = ‖down col i‖,
    ``up_i · gate_i ≥ 0``): models that differ by unit scales become equal, so matching sees the
    units alike. Idempotent up to rounding. Call it after `canonical.canonicalize` (folding a norm's
    γ into ``up`` changes its rows' norms). A `LazyState` stays lazy: a gated MLP's scales are
    computed from its three tensors when one of them is first read, then kept."""
    if not graph.glus:
        return state if isinstance(state, LazyState) else dict(state)
    if isinstance(state, LazyState):
        return apply_unit_scales(graph, state, _LazyScales(graph, state))
    return apply_unit_scales(graph, state, unit_scales(graph, state))


def is_balanced(graph: SymmetryGraph, state: Mapping[str, Tensor], rtol: float = 1e-5) -> bool:
    """Whether every gated MLP is in canonical unit scaling (its canonical s within ``rtol`` of 1)."""
    return all(bool(((s - 1).abs() <= rtol).all()) for s in unit_scales(graph, state).values())


def match_scales(
    graph: SymmetryGraph, sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], transform: Mapping[str, SpaceMap]
) -> dict[str, Tensor] | LazyState:
    """B with every gated unit scaled so that, where ``transform`` moves it, it has the scale and
    sign of A's unit in that slot. Matching pairs units between balanced forms; this carries the
    pairing back to A's own scaling, so that interpolating A with aligned B averages like with like
    (a unit and its negation would average to nothing). Exact: B's function is unchanged. Units of a
    space the transform maps by anything but a permutation keep their scaling."""
    if not graph.glus:
        return sd_b if isinstance(sd_b, LazyState) else dict(sd_b)
    return apply_unit_scales(graph, sd_b, matched_unit_scales(graph, sd_a, sd_b, transform))


def matched_unit_scales(
    graph: SymmetryGraph, sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], transform: Mapping[str, SpaceMap]
) -> dict[str, Tensor]:
    """The scales `match_scales` applies to B (float64, by unit space; B's unit order): kept apart
    so that a caller can compose them with further scales of its own (learned matching's) and apply
    the product once, and a cache can store them instead of recomputing them."""
    relative: dict[str, Tensor] = {}
    for glu in graph.glus:
        m = graph.axis_map(transform, glu.space)
        if m is not None and not m.is_permutation:
            continue
        s_a, s_b = _glu_scales(graph, glu, sd_a), _glu_scales(graph, glu, sd_b)
        index = m.index if m is not None and m.index is not None else torch.arange(len(s_b))
        r = torch.ones_like(s_b)
        r[index] = s_b[index] / s_a  # slot i holds B's unit index[i]: balanced, then A's scaling undone
        # The canonical sign (up·gate ≥ 0) is arbitrary where up·gate ≈ 0, so near-equal models can
        # disagree there: each slot keeps the sign under which B's unit, mapped, agrees with A's
        agree = _agreement(
            graph, glu, sd_a, apply_unit_scales(graph, _only(graph, glu, sd_b), {glu.space: r}), transform
        )
        r[index[agree < 0]] *= -1
        relative[glu.space] = r
    return relative


def _only(graph: SymmetryGraph, glu: Glu, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The tensors of one gated MLP (and up's bias): what `_agreement` reads."""
    names = {glu.up[0], glu.down[0], glu.gate[0]}
    bias = _bias_of(glu.up[0], graph, state)
    return {n: state[n] for n in (*names, *([bias] if bias else []))}


def _agreement(
    graph: SymmetryGraph,
    glu: Glu,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    transform: Mapping[str, SpaceMap],
) -> Tensor:
    """Per slot, ⟨A's unit, B's unit mapped there⟩ over its up row and down column (float64)."""
    total = torch.zeros(graph.ref_size(glu.space), dtype=torch.float64, device=sd_a[glu.up[0]].device)
    for tensor, occurrence in (glu.up, glu.down):
        span = _span(graph, tensor, glu.space, occurrence)
        a = graph.logical(tensor, sd_a[tensor]).narrow(span.axis, span.start, span.size).to(torch.float64)
        b = graph.logical(tensor, graph.map_tensor(tensor, sd_b[tensor], transform))
        b = b.narrow(span.axis, span.start, span.size)
        other = tuple(d for d in range(a.dim()) if d != span.axis)
        total += (a * b.to(torch.float64)).sum(dim=other)
    return total


def log_scaled(
    graph: SymmetryGraph, state: Mapping[str, Tensor], log_scales: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """``state`` with unit i of each gated MLP in ``log_scales`` scaled by exp(tᵢ): row i of ``up``
    (and its bias) times exp(tᵢ), column i of ``down`` times exp(−tᵢ); signs stay. Differentiable
    in ``log_scales`` and in each tensor's own dtype (learned matching optimises the t in float32);
    `apply_unit_scales` is the exact float64 version for the scales a run keeps."""
    edits = _edits(graph, state)
    out = dict(state)
    for name, todo in edits.items():
        if name not in state:
            continue
        t = graph.logical(name, state[name])
        for e in todo:
            if e.space not in log_scales:
                continue
            logs = log_scales[e.space].to(device=t.device, dtype=t.dtype)
            axis = t.shape[e.span.axis]
            factor = torch.cat(
                [
                    torch.ones(e.span.start, dtype=t.dtype, device=t.device),
                    torch.exp(-logs if e.divide else logs),
                    torch.ones(axis - e.span.start - e.span.size, dtype=t.dtype, device=t.device),
                ]
            )
            shape = [1] * t.dim()
            shape[e.span.axis] = axis
            t = t * factor.reshape(shape)
        out[name] = graph.stored(name, t)
    for alias, source in graph.ties.items():  # a tied copy of a scaled tensor is scaled with it
        if alias in out and source in edits and source in state:
            out[alias] = out[source]
    return out
