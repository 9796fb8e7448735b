"""Canonical form for orthogonal residual maps (Theus et al.).

Orthogonal maps do not commute with a norm's per-feature scale γ, nor with LayerNorm's mean
subtraction unless they fix the all-ones vector. So, for every space that admits orthogonal maps:
fold each norm's γ (and β, where every reader has a bias) into the linear layers that read it, and
for LayerNorm also center every writer of the stream (its mean is invisible to every reader).
The result computes the same function with standard modules (γ = 1); a tie between a reader and a
writer (LM head and embeddings) breaks and is untied. Pure tensor code.

A norm's scale is γ = weight + ``Norm.offset`` (Gemma's RMSNorm computes x·(1 + w): offset 1), so
its neutral weight is 1 − offset (0 for Gemma). A `WriterScale` (DINOv2's LayerScale λ, a diagonal
on a sublayer's output) folds into the writers it multiplies, which are centered after the fold. A
reader whose axis concatenates copies of the stream (DINOv2's classifier reads [CLS, mean of
patches]) takes γ in each copy and, with β, one shift per copy. A `BypassedNorm`'s readers also
read tensors in place of its output (SigLIP's pooling probe): each becomes (p − β)/γ, so the folded
readers see it as before, and is never centered (it writes nothing to the stream). A `RawStream` is
a LayerNorm stream that something also reads without a norm (SigLIP's pooled stream is the image
embedding): its writers keep their mean. Neither needs the centering to be exact: a map R fixing 1
commutes with LayerNorm whatever the mean (mean(Rx) = mean(x), ‖R(x − m·1)‖ = ‖x − m·1‖).

The form is a list of steps per tensor (`canonical_steps`), each reading only that tensor, its
norm's γ/β and, for a folded bias, its reader: a state dict in memory is rewritten at once, a
`LazyState` (a checkpoint on disk) tensor by tensor when read, with the same arithmetic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import Tensor

from hf_rebasin.core.errors import TransformError
from hf_rebasin.core.lazy import LazyState, RowReader
from hf_rebasin.symmetry.graph import Norm, SymmetryGraph
from hf_rebasin.symmetry.spaces import Fused, Space


@dataclass(frozen=True)
class WriterScale(Norm):
    """A per-feature scale λ (``weight``) on what the tensors ``readers`` write to the stream
    (DINOv2's LayerScale: a sublayer's output times λ). Here ``readers`` are *writers* (an output
    projection's weight and bias): λ folds into them along the stream's axis like a norm's γ into
    its readers, and leaves λ = 1; they stay writers, so a LayerNorm stream centers them after the
    fold. Every other use of a `Norm` (its stream, its class checks) holds unchanged."""


@dataclass(frozen=True)
class BypassedNorm(Norm):
    """A norm whose readers also read the tensors ``bypass`` *in place of* its output (SigLIP's
    attention-pooling ``probe``: the query of an ``nn.MultiheadAttention`` whose keys and values
    read ``post_layernorm``, through the same fused ``in_proj`` columns). Once γ (and β) are folded
    into the readers, a bypass input p becomes (p − β)/γ (p/γ where β stays in the norm), so the
    readers compute what they did. It writes nothing to the stream, so it is not centered; it moves
    with the readers' columns, so every orthogonal map of the space keeps their product."""

    bypass: tuple[str, ...] = ()


@dataclass(frozen=True)
class RawStream(Space):
    """A ``centered`` space (a LayerNorm reads it: orthogonal maps fix 1) whose stream something
    also reads without a norm, as it is (SigLIP's pooling-head stream *is* the image embedding):
    canonical form folds its norms as usual but leaves its writers' mean, which that reader sees."""


def gamma(norm: Norm, weight: Tensor) -> Tensor:
    """The scale ``norm`` multiplies by, from its stored ``weight``: weight + offset, in float64."""
    g = weight.to(torch.float64)
    return g + norm.offset if norm.offset else g


def neutral(norm: Norm) -> float:
    """The stored weight of a scale of 1 (1 − offset: 0 for Gemma's RMSNorm)."""
    return 1.0 - norm.offset


Span = tuple[int, int, int] | tuple[int, None, None]  # (axis, start, size) of one copy of a space


def _spans(graph: SymmetryGraph, tensor: str, space: str) -> list[Span]:
    """Where ``tensor`` is bound to ``space``: a whole axis, or each copy of it inside a fused axis."""
    out: list[Span] = []
    for axis, ref in enumerate(graph.bindings[tensor].axes):
        if ref == space:
            out.append((axis, None, None))
        elif isinstance(ref, Fused):
            if ref.interleaved and space in ref.parts:
                raise AssertionError(f"{tensor} reads {space} in an interleaved fused axis")  # adapter bug
            start = 0
            for part in ref.parts:
                size = graph.ref_size(part)
                if part == space:
                    out.append((axis, start, size))
                start += size
    if not out:
        raise AssertionError(f"{tensor} is not bound to {space}")  # adapter bug, caught by tests
    return out


def bias_of(weight: str, state_dict: Mapping[str, object]) -> str | None:
    """The bias beside ``weight`` in ``state_dict``: ``x.weight`` → ``x.bias``, and
    ``nn.MultiheadAttention``'s ``in_proj_weight`` → ``in_proj_bias``."""
    for suffix in (".weight", "_weight"):
        if weight.endswith(suffix):
            bias = weight[: -len(suffix)] + suffix[0] + "bias"
            return bias if bias in state_dict else None
    return None


def is_canonical(graph: SymmetryGraph, state_dict: Mapping[str, Tensor]) -> bool:
    """True when every foldable norm (and writer scale) of an orthogonal-capable space has γ = 1."""
    for norm in graph.norms:
        space = graph.spaces.get(norm.space)
        if isinstance(space, Space) and space.max_class == "orthogonal" and norm.readers:
            if not torch.all(state_dict[norm.weight] == neutral(norm)):
                return False
    return True


StepKind = Literal["scale", "shift", "ones", "zeros", "divide", "center", "unfold", "unscale"]


@dataclass(frozen=True)
class Step:
    """One rewrite of one tensor: ``scale`` a reader by γ along ``axis``; ``shift`` a reader's bias
    by W·β (W: ``reader`` as stored); set a norm's γ to ``ones`` (its neutral weight, 1 − offset),
    its β to ``zeros`` or β/γ (``divide``); ``center`` a writer of a LayerNorm stream along ``axis``;
    a `BypassedNorm`'s bypass input p to (p − β)/γ (``unfold``) or, where β stays in the norm, p/γ
    (``unscale``) along ``axis``.
    ``start``/``size``: only that slice of ``axis`` (one copy of the stream in a fused axis)."""

    kind: StepKind
    norm: Norm | None = None
    axis: int = 0
    reader: str | None = None
    start: int | None = None
    size: int | None = None


@dataclass(frozen=True)
class CanonicalSteps:
    """The canonical form of one graph: the steps of every tensor it changes, in order, the graph
    without the broken ties, and the tied names that had to be untied."""

    steps: dict[str, list[Step]]
    graph: SymmetryGraph
    untied: list[str]


def canonical_steps(graph: SymmetryGraph, names: Mapping[str, object]) -> CanonicalSteps:
    """The steps that bring a state dict with tensors ``names`` of ``graph`` to canonical form."""
    steps: dict[str, list[Step]] = {}
    spaces = [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.max_class == "orthogonal"]
    norm_params = {p for n in graph.norms for p in (n.weight, n.bias) if p is not None}
    touched: set[str] = set()

    def add(tensor: str, step: Step) -> None:
        steps.setdefault(tensor, []).append(step)

    for name in spaces:
        norms = [n for n in graph.norms if n.space == name and n.readers]
        # a writer scale's tensors write the stream: they are centered below, after the fold
        readers = {r for n in norms if not isinstance(n, WriterScale) for r in n.readers}
        # what the readers read in a norm's place is no writer: rewritten below, never centered
        bypass = {p for n in norms if isinstance(n, BypassedNorm) for p in n.bypass}
        for norm in norms:
            biases = [bias_of(r, names) for r in norm.readers]
            fold_beta = norm.bias is not None and all(b is not None for b in biases)
            for reader, bias in zip(norm.readers, biases, strict=False):
                spans = _spans(graph, reader, name)
                if fold_beta and bias is not None:
                    if reader in steps:  # the shift reads the reader as stored
                        raise AssertionError(f"{reader} is changed before its bias is folded")
                    for axis, start, size in spans:
                        add(bias, Step("shift", norm, axis, reader, start, size))
                    touched.add(bias)
                for axis, start, size in spans:
                    add(reader, Step("scale", norm, axis, None, start, size))
                touched.add(reader)
            for tensor in norm.bypass if isinstance(norm, BypassedNorm) else ():
                for axis, start, _size in _spans(graph, tensor, name):
                    if start is not None:
                        raise AssertionError(f"bypass input {tensor} has a fused axis")  # adapter bug
                    add(tensor, Step("unfold" if fold_beta else "unscale", norm, axis))
                touched.add(tensor)
            add(norm.weight, Step("ones", norm))
            if norm.bias is not None:
                add(norm.bias, Step("zeros" if fold_beta else "divide", norm))
        space = graph.spaces[name]
        if isinstance(space, Space) and space.centered and not isinstance(space, RawStream):
            for tensor, axis, _role, _off in graph.users(name):
                if tensor in readers or tensor in norm_params or tensor in bypass:
                    continue
                if isinstance(graph.bindings[tensor].axes[axis], Fused):
                    raise AssertionError(f"writer {tensor} has a fused residual axis")
                add(tensor, Step("center", axis=axis))
                touched.add(tensor)
    # a touched tensor gets a value of its own, so an untied alias has storage of its own
    untied = [alias for alias, source in graph.ties.items() if alias in touched or source in touched]
    ties = {a: s for a, s in graph.ties.items() if a not in untied}
    return CanonicalSteps(steps, dataclasses.replace(graph, ties=ties), untied)


def _apply(step: Step, t: Tensor, raw: Mapping[str, Tensor], graph: SymmetryGraph) -> Tensor:
    """``t`` after ``step`` (``t`` as its binding's axes describe it); γ, β and a reader come from
    ``raw`` (the state as stored)."""
    norm = step.norm
    if step.kind == "center":
        t64 = t.to(torch.float64)
        return (t64 - t64.mean(dim=step.axis, keepdim=True)).to(t.dtype)
    assert norm is not None
    if step.kind == "ones":
        return torch.full_like(t, neutral(norm)) if norm.offset else torch.ones_like(t)
    if step.kind == "zeros":
        return torch.zeros_like(t)
    scale = gamma(norm, raw[norm.weight])
    if step.kind in ("unfold", "unscale"):
        return _unfolded(step, t, raw, scale)
    if step.kind == "scale":
        if step.start is None:
            return _scaled(t, scale, step.axis)
        assert step.size is not None
        out = t.clone()
        out.narrow(step.axis, step.start, step.size).copy_(
            _scaled(t.narrow(step.axis, step.start, step.size), scale, step.axis)
        )
        return out
    assert norm.bias is not None
    beta = raw[norm.bias].to(torch.float64)
    if step.kind == "shift":
        assert step.reader is not None
        w = graph.logical(step.reader, raw[step.reader])
        if step.start is not None:
            assert step.size is not None
            w = w.narrow(step.axis, step.start, step.size)
        shift = torch.tensordot(w.to(torch.float64), beta, dims=([step.axis], [0]))
        return (t.to(torch.float64) + shift).to(t.dtype)
    # divide: β stays in the norm (a reader has no bias); the reader now scales by γ, so β/γ
    if scale.abs().min() < 1e-8:
        raise TransformError(
            f"norm scale {norm.weight!r} has a zero entry and its readers have no bias, "
            "so its shift cannot be folded; use `class: permutation` for this model"
        )
    return (beta / scale).to(t.dtype)


def _unfolded(step: Step, t: Tensor, raw: Mapping[str, Tensor], scale: Tensor) -> Tensor:
    """A bypass input p as its folded readers must read it: (p − β)/γ (``unfold``) or p/γ."""
    norm = step.norm
    assert norm is not None
    if scale.abs().min() < 1e-8:
        raise TransformError(
            f"norm scale {norm.weight!r} has a zero entry, so what its readers read in its place "
            "cannot follow its fold; use `class: permutation` for this model"
        )
    shape = [1] * t.dim()
    shape[step.axis] = -1
    p = t.to(torch.float64)
    if step.kind == "unfold":
        assert norm.bias is not None
        p = p - raw[norm.bias].to(torch.float64).reshape(shape)
    return (p / scale.reshape(shape)).to(t.dtype)


def _scaled(t: Tensor, scale: Tensor, axis: int) -> Tensor:
    """``t`` times ``scale`` (float64) along ``axis``, rounded once to t's dtype."""
    shape = [1] * t.dim()
    shape[axis] = -1
    # one product per weight, rounded once: in t's dtype when γ is exact in it (the usual case),
    # which gives the same bits as a float64 product without a float64 copy of the weight
    g = scale.to(t.dtype)
    exact = torch.equal(g.to(torch.float64), scale)
    return (t * g.reshape(shape) if exact else t.double() * scale.reshape(shape)).to(t.dtype)


def canonical_tensor(form: CanonicalSteps, name: str, raw: Mapping[str, Tensor]) -> Tensor:
    """Tensor ``name`` of ``raw`` in canonical form (``raw[name]`` itself when no step changes it)."""
    steps = form.steps.get(name, ())
    if not steps:
        return raw[name]
    t = form.graph.logical(name, raw[name])
    for step in steps:
        t = _apply(step, t, raw, form.graph)
    return form.graph.stored(name, t)


def _canonical_rows(form: CanonicalSteps, name: str, raw: LazyState) -> RowReader | None:
    """Rows of tensor ``name`` in canonical form from the same rows as stored, where every step
    acts within a row (a reader scaled or a writer centered along a later axis: an embedding)."""
    read = raw.rows(name)
    steps = form.steps.get(name, ())
    binding = form.graph.bindings.get(name)
    if read is None or any(step.kind not in ("scale", "center") or step.axis == 0 for step in steps):
        return None
    if binding is not None and binding.view is not None:
        return None
    reader = read

    def rows(start: int, stop: int) -> Tensor:
        t = reader(start, stop)
        for step in steps:
            t = _apply(step, t, raw, form.graph)
        return t

    return rows


@overload
def canonicalize(  # type: ignore[overload-overlap]  # a LazyState is a Mapping that stays lazy
    graph: SymmetryGraph, state_dict: LazyState
) -> tuple[LazyState, SymmetryGraph, list[str]]: ...


@overload
def canonicalize(
    graph: SymmetryGraph, state_dict: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor], SymmetryGraph, list[str]]: ...


def canonicalize(
    graph: SymmetryGraph, state_dict: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor] | LazyState, SymmetryGraph, list[str]]:
    """Return ``(state_dict, graph, untied)``: an equivalent state dict in canonical form, the graph
    with broken ties removed, and the tied aliases that had to be untied.

    A `LazyState` stays lazy: its canonical tensors are computed when read."""
    form = canonical_steps(graph, state_dict)
    if isinstance(state_dict, LazyState):
        untied = set(form.untied)
        lazy = state_dict.derive(
            lambda name: canonical_tensor(form, name, state_dict),
            rows=lambda name: _canonical_rows(form, name, state_dict),
        )
        lazy.aliases = {a: s for a, s in state_dict.aliases.items() if a not in untied}
        return lazy, form.graph, form.untied
    sd = {name: canonical_tensor(form, name, state_dict) for name in state_dict}
    return sd, form.graph, form.untied
