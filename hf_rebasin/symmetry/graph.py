"""The symmetry graph: which hidden-feature spaces a model has and which tensor axes live in them.

A *space* is a feature axis shared by several tensors (the residual stream, the MLP units of a
layer, the heads of an attention layer). A transform assigns each space an invertible map; every
tensor axis bound to that space is contracted with it. :class:`SymmetryGraph` holds one concrete
model's spaces and tensor bindings (their types: :mod:`hf_rebasin.symmetry.spaces`) with what the
model declares beside them: ties, norms and the tensors that read them, gated MLPs, sublayers. Its
transforms are :mod:`hf_rebasin.symmetry.transforms`; applying them is :mod:`hf_rebasin.symmetry.apply`.

This module imports torch only: no transformers, no hub.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, overload

import torch
from torch import Tensor

from hf_rebasin.core.errors import AdapterError, CheckpointError
from hf_rebasin.core.lazy import LazyState
from hf_rebasin.symmetry.apply import apply_transform, axis_map, map_tensor
from hf_rebasin.symmetry.spaces import (
    EXPERT_ROLES,
    ROLES,
    AnySpace,
    AxisRef,
    Binding,
    ExpertSpace,
    Fused,
    HeadSpace,
    TransformClass,
    split_ref,
)
from hf_rebasin.symmetry.transforms import (
    AxisMap,
    SpaceMap,
    Transform,
    class_fallbacks,
    identity_transform,
    pinned_notes,
    random_transform,
    space_classes,
)

# --------------------------------------------------------------------------------------------
# What a model declares beside its spaces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Norm:
    """A norm whose output is read only by ``readers`` (weight names); foldable into them."""

    weight: str
    bias: str | None
    space: str
    readers: tuple[str, ...]
    offset: float = 0.0  # the scale is γ = weight + offset (Gemma's RMSNorm computes x·(1 + w): 1)


@dataclass(frozen=True)
class Glu:
    """The units of a gated MLP, ``down(act(gate·x) ⊙ (up·x))``: unit i may be scaled by any s ≠ 0
    (row i of ``up`` and its bias times s, column i of ``down`` divided by s) without changing the
    function, so matching compares units in a canonical scaling. Each field names a tensor and which
    occurrence of ``space`` on its unit axis holds the part (0 unless the axis is fused, as Phi-3's
    ``gate_up_proj``: gate 0, up 1)."""

    space: str
    gate: tuple[str, int]
    up: tuple[str, int]
    down: tuple[str, int]


@dataclass(frozen=True)
class Sublayer:
    """One sublayer on the residual stream (an attention or MLP block), by module prefixes: those
    that read the stream (its norm, its input projections) and those that write it back (its output
    projection, a post-norm). Forward order of these is what splits the stream per sublayer
    (:mod:`hf_rebasin.symmetry.sublayers`)."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]


# --------------------------------------------------------------------------------------------
# The graph
# --------------------------------------------------------------------------------------------


@dataclass
class SymmetryGraph:
    """All spaces of one concrete model and the binding of every tensor to them."""

    family: str
    spaces: dict[str, AnySpace]
    bindings: dict[str, Binding]
    ties: dict[str, str] = field(default_factory=dict)
    norms: list[Norm] = field(default_factory=list)
    invariant: frozenset[str] = frozenset()
    norm_type: Literal["layernorm", "rmsnorm"] = "layernorm"
    sublayers: tuple[Sublayer, ...] = ()  # in forward order
    embeddings: tuple[str, ...] = ()  # module prefixes that write the stream before the first sublayer
    last_hidden: dict[str, str] = field(default_factory=dict)  # residual space -> module: its final state
    glus: tuple[Glu, ...] = ()  # gated MLPs: their units' free scaling
    # tensor -> p: the model multiplies what it writes by (its space's size)**p, read from the config
    # (Gemma's embeddings times √hidden_size): a wider model scales it by another factor
    embedding_scales: dict[str, float] = field(default_factory=dict)
    # RMSNorms over a role of a head space (OLMo 2's q_norm / k_norm over every head's features):
    # ``Norm.space`` is that role ("layers.0.attn:q"); their γ is bound as a plain tensor on it
    role_norms: tuple[Norm, ...] = ()
    # norm weight -> what reads a norm whose output is also the model's output (a bare model's final
    # norm, read by ViT's pooler): never folded into, since that norm keeps its γ
    output_readers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # module prefixes of the stacks that run one after the other on the residual stream (an encoder's,
    # then its decoder's); empty for one stack
    stacks: tuple[str, ...] = ()

    # ---- structure -------------------------------------------------------------------------

    def ref_size(self, ref: str) -> int:
        name, role = split_ref(ref)
        space = self.spaces[name]
        if isinstance(space, HeadSpace):
            if role not in ROLES:
                raise AdapterError(f"head space {name!r} needs a role q/k/v/o/h, got {ref!r}")
            return space.role_size(role)
        if isinstance(space, ExpertSpace):
            if role not in EXPERT_ROLES:
                raise AdapterError(f"expert space {name!r} needs a role experts/units, got {ref!r}")
            return space.role_size(role)
        return space.size

    def logical(self, tensor: str, t: Tensor) -> Tensor:
        """``t`` (the value of ``tensor`` as stored) as its binding's axes describe it: itself,
        unless the binding has a :class:`View` (a MoE layer's 3-D expert tensors)."""
        b = self.bindings.get(tensor)
        return b.view.read(t) if b is not None and b.view is not None else t

    def stored(self, tensor: str, t: Tensor) -> Tensor:
        """The inverse of :meth:`logical`: ``t`` as the model stores ``tensor``."""
        b = self.bindings.get(tensor)
        return b.view.write(t) if b is not None and b.view is not None else t

    def axis_size(self, ref: AxisRef) -> int | None:
        if ref is None:
            return None
        if isinstance(ref, Fused):
            return sum(self.ref_size(p) for p in ref.parts)
        return self.ref_size(ref)

    def groups(self, ref: AxisRef) -> int:
        """How many blocks a fused axis interleaves its parts in (1: one part after the other)."""
        if not isinstance(ref, Fused) or not ref.interleaved:
            return 1
        spaces = {split_ref(p)[0] for p in ref.parts}
        space = self.spaces.get(next(iter(spaces))) if len(spaces) == 1 else None
        if not isinstance(space, HeadSpace):
            raise AdapterError(f"an interleaved fused axis {ref.parts} needs the roles of one head space")
        return space.num_kv_heads

    def part(self, tensor: str, t: Tensor, axis: int, offset: int, size: int) -> Tensor:
        """Features ``[offset, offset + size)`` of axis ``axis`` of ``t`` (the value of ``tensor``),
        counted as :meth:`users` counts them: a ``narrow``, or the gathered rows of a part of an
        interleaved fused axis. ``t`` is read through the binding's view, if it has one."""
        t = self.logical(tensor, t)
        g = self.groups(self.bindings[tensor].axes[axis])
        if g == 1:
            return t.narrow(axis, offset, size)
        return t.unflatten(axis, (g, -1)).narrow(axis + 1, offset // g, size // g).flatten(axis, axis + 1)

    def users(self, space: str) -> list[tuple[str, int, str | None, int]]:
        """Reverse index: ``(tensor, axis, role, offset)`` for every axis touching ``space``."""
        out = []
        for b in self.bindings.values():
            if b.name in self.ties:
                continue  # a tied alias is its source: count it once
            for axis, ref in enumerate(b.axes):
                parts = ref.parts if isinstance(ref, Fused) else (ref,)
                offset = 0
                for part in parts:
                    if part is None:
                        continue
                    name, role = split_ref(part)
                    if name == space:
                        out.append((b.name, axis, role, offset))
                    offset += self.ref_size(part)
        return out

    def routers(self, space: str) -> list[str]:
        """The router weights ``[E, d]`` of expert space ``space``: the 2-D tensors one row per expert."""
        return [
            t
            for t, axis, role, _ in self.users(space)
            if role == "experts" and axis == 0 and len(self.bindings[t].axes) == 2
        ]

    def router_width(self, space: str) -> int | None:
        """The width of the rows of ``space``'s router (what a shift adds to), if it has one."""
        for tensor in self.routers(space):
            return self.axis_size(self.bindings[tensor].axes[1])
        return None

    def check(self, state_dict: Mapping[str, Tensor], source: str = "checkpoint") -> None:
        """Every tensor is described and has the shape its spaces imply."""
        known = set(self.bindings) | set(self.invariant) | set(self.ties)
        unknown = sorted(k for k in state_dict if k not in known)
        if unknown:
            raise AdapterError(
                f"adapter {self.family!r} does not describe tensor(s) {unknown[:5]} of {source}: "
                "a transformers version with other parameter names? Please report it."
            )
        for name, b in self.bindings.items():
            if name not in state_dict:
                raise CheckpointError(f"{source}: tensor {name!r} is missing")
            t = state_dict[name]
            if b.view is not None:
                if tuple(t.shape) != b.view.stored:
                    raise CheckpointError(
                        f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {b.view.stored} "
                        "according to its config.json"
                    )
                t = torch.empty(b.view.shape, device="meta")
            if t.dim() != len(b.axes):
                raise CheckpointError(
                    f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {len(b.axes)} axes"
                )
            for axis, ref in enumerate(b.axes):
                self.groups(ref)  # an interleaved axis names the roles of one head space
                want = self.axis_size(ref)
                if want is not None and t.shape[axis] != want:
                    raise CheckpointError(
                        f"{source}: tensor {name!r} has shape {tuple(t.shape)}; axis {axis} should "
                        f"have {want} features (space {ref}) according to its config.json"
                    )

    # ---- transforms ------------------------------------------------------------------------

    # ---- transforms (drawn by hf_rebasin.symmetry.transforms, applied by hf_rebasin.symmetry.apply)

    def axis_map(self, transform: Mapping[str, SpaceMap], ref: str) -> AxisMap | None:
        """The map of axis reference ``ref`` under ``transform`` (a head or expert map expanded to
        the role's features); None where the transform leaves the space out."""
        return axis_map(self, transform, ref)

    def map_tensor(
        self,
        name: str,
        t: Tensor,
        transform: Mapping[str, SpaceMap],
        *,
        skip_axis: int | None = None,
        cache: dict[str, AxisMap | None] | None = None,
    ) -> Tensor:
        """Tensor ``name`` with every bound axis mapped (except ``skip_axis``). ``cache`` shares
        expanded axis maps across calls with the same transform."""
        return map_tensor(self, name, t, transform, skip_axis=skip_axis, cache=cache)

    @overload
    def apply(  # type: ignore[overload-overlap]  # a LazyState is a Mapping that stays lazy
        self, state_dict: LazyState, transform: Mapping[str, SpaceMap], *, check: bool = True
    ) -> LazyState: ...

    @overload
    def apply(
        self, state_dict: Mapping[str, Tensor], transform: Mapping[str, SpaceMap], *, check: bool = True
    ) -> dict[str, Tensor]: ...

    def apply(
        self, state_dict: Mapping[str, Tensor], transform: Mapping[str, SpaceMap], *, check: bool = True
    ) -> dict[str, Tensor] | LazyState:
        """Return a new state dict with every bound axis transformed. Tied aliases follow their
        source; invariant tensors are copied by reference. A `LazyState` gives a `LazyState` whose
        tensors are transformed when read. ``check=False`` skips the class checks
        (learned matching applies dense, relaxed permutations while it optimizes)."""
        return apply_transform(self, state_dict, transform, check=check)

    def identity(self) -> Transform:
        """The transform that changes nothing: one identity map per space."""
        return identity_transform(self)

    def classes(self, requested: TransformClass) -> dict[str, str]:
        """The class each space gets when ``requested`` is asked for (after fallbacks)."""
        return space_classes(self, requested)

    def fallbacks(self, requested: TransformClass) -> list[str]:
        """Human-readable notes for spaces that cannot take ``requested``."""
        return class_fallbacks(self, requested)

    def pinned(self) -> list[str]:
        """Human-readable notes for spaces that keep the identity whatever class is asked for."""
        return pinned_notes(self)

    def random_transform(
        self, cls: TransformClass = "permutation", generator: torch.Generator | None = None
    ) -> Transform:
        """A transform drawn at random from the allowed classes (richest up to ``cls``)."""
        return random_transform(self, cls, generator)
