"""The symmetry graph: which hidden-feature spaces a model has and which tensor axes live in them.

A *space* is a feature axis shared by several tensors (the residual stream, the MLP units of a
layer, the heads of an attention layer). A transform assigns each space an invertible map; every
tensor axis bound to that space is contracted with it. For permutations and orthogonal maps the
inverse is the transpose, so output axes (``T W``) and input axes (``W Tᵀ``) obey one rule:
``new[..., i, ...] = Σ_j T[i, j] · old[..., j, ...]``. That is why a binding needs nothing but the
space name per axis, as in git re-basin's ``axes_to_perm``.

This module imports torch only: no transformers, no hub.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, overload

import torch
from torch import Tensor

from .errors import AdapterError, CheckpointError, TransformError
from .tensors import LazyState, RowReader

TransformClass = Literal["permutation", "signed-permutation", "orthogonal"]
# richest last; "signed-permutation" (a permutation times diag(±1)) is exact wherever every norm on
# the space is sign-blind (RMSNorm: rms(Sx) = rms(x)), even where a norm's γ cannot be folded away
TRANSFORM_CLASSES: tuple[TransformClass, ...] = ("permutation", "signed-permutation", "orthogonal")
ROLES = ("q", "k", "v", "o")


# --------------------------------------------------------------------------------------------
# Spaces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Space:
    """A plain feature space (residual stream, MLP units, pooler, joint embedding).

    ``max_class`` is the richest transform that is exact. ``centered`` marks a LayerNorm residual
    stream: orthogonal maps must fix the all-ones vector (LayerNorm subtracts the mean).
    ``reason`` says why the class is limited, for messages.
    """

    name: str
    size: int
    max_class: TransformClass = "permutation"
    centered: bool = False
    kind: str = "plain"
    reason: str = ""

    @property
    def allows_signs(self) -> bool:
        """Whether signed permutations are exact: a signed-permutation space, or an orthogonal one
        that need not fix 1 (every signed permutation with a −1 moves the all-ones vector)."""
        return self.max_class == "signed-permutation" or (self.max_class == "orthogonal" and not self.centered)


QKMode = Literal["free", "planes", "fixed"]
QK_MODES: tuple[QKMode, ...] = ("free", "planes", "fixed")


@dataclass(frozen=True)
class HeadSpace:
    """The heads of one attention layer (multi-head or grouped-query).

    Roles: ``q`` and ``o`` have ``num_heads * head_dim`` features, ``k`` and ``v`` have
    ``num_kv_heads * head_dim``. Heads never mix, so a transform is a permutation of KV heads, a
    permutation of query heads inside each group, and one inner map per KV head for Q/K and another
    for V/O. The V/O inner map is always free; ``qk`` says which Q/K inner maps keep the scores:

    * ``"free"``: any (orthogonal, or invertible with its inverse transpose on K);
    * ``"planes"``: only rotations (and scalings) of each rotary plane ``(j, j + head_dim/2)``, the
      maps RoPE commutes with; what ``rotary=True`` implies unless ``qk`` says otherwise;
    * ``"fixed"``: only the identity: a per-feature scale inside each head (Qwen3's ``q_norm`` /
      ``k_norm``) or partial rotary embeddings (rotated and pass-through features in one head).

    ``rotary`` records that the layer has rotary position embeddings; ``reason`` says why Q/K are
    fixed, for messages.
    """

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: bool = False
    kind: str = "attention"
    qk: QKMode = "free"
    reason: str = ""

    def __post_init__(self) -> None:
        if self.qk not in QK_MODES:
            raise AdapterError(f"head space {self.name!r}: qk must be one of {QK_MODES}, got {self.qk!r}")
        if self.rotary and self.qk == "free":  # RoPE rotates each plane: only plane rotations commute
            object.__setattr__(self, "qk", "planes")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def role_size(self, role: str) -> int:
        heads = self.num_heads if role in ("q", "o") else self.num_kv_heads
        return heads * self.head_dim


Router = Literal["softmax", "sigmoid"]
EXPERT_ROLES = ("experts", "units")


@dataclass(frozen=True)
class ExpertSpace:
    """The experts of one mixture-of-experts layer: ``num_experts`` gated MLPs of ``units`` units.

    Experts may be put in any order, each moving as a unit with its row of the router; inside an
    expert its units permute as in a dense gated MLP (and scale: :mod:`hf_rebasin.glu`). Units
    never move between experts (each expert's output is weighted by its own routing weight). Roles:
    ``experts`` (``num_experts`` features: the router's rows) and ``units`` (``num_experts *
    units``: expert e's unit u at ``e * units + u``). ``router`` says how routing weights are made:
    a softmax over experts is blind to a vector added to every router row (the router's gauge,
    centred away before matching); a sigmoid is not.
    """

    name: str
    num_experts: int
    units: int
    router: Router = "softmax"
    kind: str = "experts"

    def role_size(self, role: str) -> int:
        return self.num_experts if role == "experts" else self.num_experts * self.units


AnySpace = Space | HeadSpace | ExpertSpace


# --------------------------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AxisMap:
    """An orthogonal map of one axis, stored compactly.

    First ``index`` reorders the axis (``new[i] = old[index[i]]``), then ``blocks`` (shape
    ``[nb, bs, bs]``) multiplies each consecutive block of ``bs`` features. A permutation has no
    blocks; a dense orthogonal map is one block; a head permutation with rotated heads has one block
    per head.
    """

    size: int
    index: Tensor | None = None
    blocks: Tensor | None = None

    @property
    def is_permutation(self) -> bool:
        return self.blocks is None

    @property
    def is_signed_permutation(self) -> bool:
        """A permutation times diag(±1): 1×1 blocks of ±1 (a plain permutation counts too)."""
        if self.blocks is None:
            return True
        return self.blocks.shape[1:] == (1, 1) and bool((self.blocks.detach().abs() == 1).all())

    @property
    def unsigned(self) -> AxisMap:
        """The permutation part of a signed permutation: what a norm's γ on the space takes."""
        return AxisMap(self.size, index=self.index)

    @staticmethod
    def signed(index: Tensor | None, signs: Tensor) -> AxisMap:
        """``new[i] = signs[i] · old[index[i]]``."""
        return AxisMap(len(signs), index=index, blocks=signs.to(torch.float64).reshape(-1, 1, 1))

    def matrix(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """The dense ``[size, size]`` matrix (for solvers and tests; apply never builds it)."""
        return self.apply(torch.eye(self.size, dtype=dtype), 0)

    def apply(self, t: Tensor, axis: int) -> Tensor:
        if t.shape[axis] != self.size:
            raise TransformError(f"axis of size {t.shape[axis]} cannot take a map of size {self.size}")
        if self.index is not None:
            t = t.index_select(axis, self.index.to(t.device))
        if self.blocks is not None and self.blocks.shape[1] == 1:  # a diagonal: one product per entry
            shape = [1] * t.dim()
            shape[axis] = -1
            work = torch.promote_types(t.dtype, torch.float32)
            t = (t.to(work) * self.blocks.reshape(shape).to(device=t.device, dtype=work)).to(t.dtype)
        elif self.blocks is not None:
            nb, bs, _ = self.blocks.shape
            work = torch.promote_types(t.dtype, torch.float32)
            moved = t.movedim(axis, -1)
            x = moved.to(work).reshape(*moved.shape[:-1], nb, bs)
            x = torch.einsum("...bj,bij->...bi", x, self.blocks.to(device=t.device, dtype=work))
            t = x.reshape(moved.shape).to(t.dtype).movedim(-1, axis)
        return t

    def is_identity(self, atol: float = 1e-6) -> bool:
        if self.index is not None and not torch.equal(self.index.cpu(), torch.arange(self.size)):
            return False
        if self.blocks is not None:
            eye = torch.eye(self.blocks.shape[-1], dtype=self.blocks.dtype)
            return bool(torch.allclose(self.blocks.cpu(), eye.expand_as(self.blocks), atol=atol))
        return True


@dataclass(frozen=True)
class HeadMap:
    """A transform of a :class:`HeadSpace`, indexed by the *new* position of each head.

    ``kv_perm[g]``: which old KV head goes to KV slot g. ``q_perm[g, j]``: which old query head
    (index inside its group) goes to query slot j of group g. ``qk`` / ``vo``: inner maps per new KV
    slot, either ``[G, dh]`` index tensors (permutations) or ``[G, dh, dh]`` matrices, orthogonal
    unless ``invertible``. An invertible inner map M multiplies Q (and V) by M and K (and O's input)
    by M⁻ᵀ, which leaves QᵀK (and O·V) unchanged; for orthogonal maps M⁻ᵀ = M.
    """

    kv_perm: Tensor
    q_perm: Tensor
    qk: Tensor
    vo: Tensor
    invertible: bool = False

    def inner(self, role: str) -> Tensor:
        """The inner maps role ``role`` is multiplied by: Q/V take ``qk``/``vo``, K/O their inverse
        transposes (the same matrices unless ``invertible``)."""
        inner = self.qk if role in ("q", "k") else self.vo
        if self.invertible and role in ("k", "o") and inner.dtype != torch.long:
            inner = torch.linalg.inv(inner).mT
        return inner

    def expand(self, space: HeadSpace, role: str) -> AxisMap:
        dh, r = space.head_dim, space.group_size
        inner = self.inner(role)
        if role in ("k", "v"):
            heads = self.kv_perm
            inner_per_head = inner
        else:
            heads = (self.kv_perm[:, None] * r + self.q_perm).reshape(-1)
            inner_per_head = inner.repeat_interleave(r, dim=0)
        base = heads[:, None] * dh
        if inner_per_head.dtype == torch.long:
            return AxisMap(len(heads) * dh, index=(base + inner_per_head).reshape(-1))
        index = (base + torch.arange(dh)).reshape(-1)
        return AxisMap(len(heads) * dh, index=index, blocks=inner_per_head)

    def is_identity(self) -> bool:
        g, r = self.q_perm.shape
        if not torch.equal(self.kv_perm, torch.arange(g)):
            return False
        if not torch.equal(self.q_perm, torch.arange(r).expand(g, r)):
            return False
        for inner in (self.qk, self.vo):
            if inner.dtype == torch.long:
                if not torch.equal(inner, torch.arange(inner.shape[1]).expand_as(inner)):
                    return False
            else:
                eye = torch.eye(inner.shape[-1], dtype=inner.dtype).expand_as(inner)
                if not torch.allclose(inner, eye, atol=1e-6):
                    return False
        return True


@dataclass(frozen=True)
class ExpertMap:
    """A transform of an :class:`ExpertSpace`, indexed by the *new* position: ``perm[e]`` is the old
    expert that goes to slot e (with its router row), ``inner[e, i]`` the unit of that old expert
    that goes to unit slot i of slot e. Always a permutation: an expert's units feed an elementwise
    activation, which no other map commutes with. ``shift`` (``[d]``, in the mapped basis): a vector
    added to every router row after the map, the softmax router's gauge (no sigmoid router has one)."""

    perm: Tensor
    inner: Tensor
    shift: Tensor | None = None

    def expand(self, space: ExpertSpace, role: str) -> AxisMap:
        if role == "experts":
            return AxisMap(space.num_experts, index=self.perm)
        index = (self.perm[:, None] * space.units + self.inner).reshape(-1)
        return AxisMap(space.num_experts * space.units, index=index)

    def is_identity(self) -> bool:
        e, f = self.inner.shape
        if self.shift is not None and bool(self.shift.any()):
            return False
        return torch.equal(self.perm.cpu(), torch.arange(e)) and torch.equal(
            self.inner.cpu(), torch.arange(f).expand(e, f)
        )


SpaceMap = AxisMap | HeadMap | ExpertMap
Transform = dict[str, SpaceMap]


# --------------------------------------------------------------------------------------------
# Bindings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fused:
    """An axis that concatenates several spaces (GPT-2 ``c_attn``: q | k | v; Phi-3 ``qkv_proj``
    with fewer K/V heads; ``gate_up_proj``: gate | up, one space twice).

    ``interleaved``: the parts are roles of one head space and the axis holds them per KV head,
    ``[head 0: its q | k | v, head 1: …]`` (GPT-NeoX ``query_key_value``). Offsets of
    :meth:`SymmetryGraph.users` count in the parts' concatenated order either way; read a part with
    :meth:`SymmetryGraph.part`, never with ``narrow``.
    """

    parts: tuple[str, ...]
    interleaved: bool = False


AxisRef = str | Fused | None


@dataclass(frozen=True)
class View:
    """How a stored tensor reads as the tensor its binding's axes describe: reshaped to ``split``,
    its axes put in ``order``, reshaped to ``shape``. Transformers 5 stores a MoE layer's experts as
    3-D tensors (``gate_up_proj`` ``[E, 2f, d]``, ``down_proj`` ``[E, d, f]``); read as matrices
    (``[gate units | up units, d]``, ``[d, units]``) their unit axis is the expert space's, and every
    map, slice and statistic works on them as on a dense MLP's. Concrete sizes, no config."""

    stored: tuple[int, ...]
    split: tuple[int, ...]
    order: tuple[int, ...]
    shape: tuple[int, ...]

    def read(self, t: Tensor) -> Tensor:
        return t.reshape(self.split).permute(self.order).reshape(self.shape)

    def write(self, t: Tensor) -> Tensor:
        """The inverse of :meth:`read`: a tensor of the binding's shape, stored as the model stores it."""
        permuted = tuple(self.split[i] for i in self.order)
        inverse = tuple(sorted(range(len(self.order)), key=lambda i: self.order[i]))
        return t.reshape(permuted).permute(inverse).reshape(self.stored).contiguous()


@dataclass(frozen=True)
class Binding:
    """One tensor: per axis the space (``"res"``, ``"h.0.attn:q"``) or ``None``.

    ``norm_scale`` marks a norm's γ: it is a diagonal, not a vector, so it permutes but cannot be
    rotated; orthogonal maps need it folded away first (:mod:`hf_rebasin.canonical`). ``view``: the
    axes describe the tensor as :class:`View` reads it, not as stored (read it with
    :meth:`SymmetryGraph.logical`).
    """

    name: str
    axes: tuple[AxisRef, ...]
    norm_scale: bool = False
    view: View | None = None


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
    (:mod:`hf_rebasin.sublayers`)."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]


def split_ref(ref: str) -> tuple[str, str | None]:
    space, _, role = ref.partition(":")
    return space, (role or None)


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

    # ---- structure -------------------------------------------------------------------------

    def ref_size(self, ref: str) -> int:
        name, role = split_ref(ref)
        space = self.spaces[name]
        if isinstance(space, HeadSpace):
            if role not in ROLES:
                raise AdapterError(f"head space {name!r} needs a role q/k/v/o, got {ref!r}")
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

    def axis_map(self, transform: Mapping[str, SpaceMap], ref: str) -> AxisMap | None:
        name, role = split_ref(ref)
        m = transform.get(name)
        if m is None:
            return None
        if isinstance(m, HeadMap):
            space = self.spaces[name]
            assert isinstance(space, HeadSpace) and role is not None
            return m.expand(space, role)
        if isinstance(m, ExpertMap):
            space = self.spaces[name]
            assert isinstance(space, ExpertSpace) and role is not None
            return m.expand(space, role)
        return m

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
        cache = {} if cache is None else cache

        def get(ref: str) -> AxisMap | None:
            if ref not in cache:
                cache[ref] = self.axis_map(transform, ref)
            return cache[ref]

        b = self.bindings[name]
        if b.view is not None:
            mapped = self._map_axes(b, b.view.read(t), get, skip_axis)
            return b.view.write(mapped)
        return self._shifted(b, self._map_axes(b, t, get, skip_axis), transform, skip_axis)

    def _shifted(self, b: Binding, t: Tensor, transform: Mapping[str, SpaceMap], skip_axis: int | None) -> Tensor:
        """A router ``[E, d]`` with its expert map's shift added to every row (none while its expert
        axis is left out: a weight view of the experts compares rows as they are)."""
        if len(b.axes) != 2 or (skip_axis is not None and skip_axis == 0):
            return t
        ref = b.axes[0]
        if not isinstance(ref, str) or split_ref(ref)[1] != "experts":
            return t
        m = transform.get(split_ref(ref)[0])
        if not isinstance(m, ExpertMap) or m.shift is None:
            return t
        work = torch.promote_types(t.dtype, torch.float32)
        return (t.to(work) + m.shift.to(device=t.device, dtype=work)[None, :]).to(t.dtype)

    def _map_axes(self, b: Binding, t: Tensor, get: Callable[[str], AxisMap | None], skip_axis: int | None) -> Tensor:
        for axis, ref in enumerate(b.axes):
            if ref is None or axis == skip_axis:
                continue
            if isinstance(ref, Fused) and ref.interleaved:
                t = self._map_interleaved(ref, t, axis, get)
            elif isinstance(ref, Fused):
                sizes = [self.ref_size(p) for p in ref.parts]
                chunks = list(t.split(sizes, dim=axis))
                for i, part in enumerate(ref.parts):
                    m = get(part)
                    if m is not None:
                        chunks[i] = m.apply(chunks[i], axis)
                t = torch.cat(chunks, dim=axis)
            else:
                m = get(ref)
                if m is not None and b.norm_scale and not m.is_permutation:
                    # a norm's γ is a diagonal: under a signed permutation it only permutes (the
                    # signs pass through the sign-blind norm); under any other orthogonal map it is
                    # isotropic (checked), so the map leaves it alone
                    m = m.unsigned if m.is_signed_permutation else None
                if m is None:
                    continue
                t = m.apply(t, axis)
        return t

    def _map_interleaved(self, ref: Fused, t: Tensor, axis: int, get: Callable[[str], AxisMap | None]) -> Tensor:
        """``t`` with each part of an interleaved fused axis mapped: the axis viewed as
        ``[groups, per group]``, each part's rows gathered into its usual layout, mapped, and put back."""
        g = self.groups(ref)
        sizes = [self.ref_size(p) // g for p in ref.parts]
        chunks = list(t.unflatten(axis, (g, -1)).split(sizes, dim=axis + 1))
        for i, part in enumerate(ref.parts):
            m = get(part)
            if m is not None:
                chunks[i] = m.apply(chunks[i].flatten(axis, axis + 1), axis).unflatten(axis, (g, -1))
        return torch.cat(chunks, dim=axis + 1).flatten(axis, axis + 1)

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
        if check:
            self._check_transform(transform, state_dict)
        cache: dict[str, AxisMap | None] = {}
        if isinstance(state_dict, LazyState):
            return state_dict.derive(
                lambda name: self._mapped(state_dict, name, transform, cache),
                rows=lambda name: self._mapped_rows(state_dict, name, transform, cache),
            )
        out: dict[str, Tensor] = {}
        for name, t in state_dict.items():
            if name in self.ties:
                continue
            out[name] = self.map_tensor(name, t, transform, cache=cache) if name in self.bindings else t
        for alias, source in self.ties.items():
            if alias in state_dict:
                out[alias] = out[source]
        return {k: out[k] for k in state_dict}

    def _mapped(
        self,
        state: Mapping[str, Tensor],
        name: str,
        transform: Mapping[str, SpaceMap],
        cache: dict[str, AxisMap | None],
    ) -> Tensor:
        """One tensor of `apply`'s result, computed alone (a tied alias as its source)."""
        source = self.ties.get(name)
        key = source if source is not None and source in state else name
        t = state[key]
        return self.map_tensor(key, t, transform, cache=cache) if key in self.bindings else t

    def _mapped_rows(
        self,
        state: LazyState,
        name: str,
        transform: Mapping[str, SpaceMap],
        cache: dict[str, AxisMap | None],
    ) -> RowReader | None:
        """Rows of one tensor of `apply`'s result from the same rows of ``state``, where no map
        touches the first axis (an embedding's vocabulary)."""
        source = self.ties.get(name)
        key = source if source is not None and source in state else name
        read = state.rows(key)
        if read is None or key not in self.bindings:
            return read
        if self.bindings[key].axes[0] is not None or self.bindings[key].view is not None:
            return None
        reader = read
        return lambda start, stop: self.map_tensor(key, reader(start, stop), transform, cache=cache)

    def _check_transform(self, transform: Mapping[str, SpaceMap], state_dict: Mapping[str, Tensor]) -> None:
        for name, m in transform.items():
            space = self.spaces.get(name)
            if space is None:
                raise TransformError(f"transform names space {name!r}, which {self.family!r} models do not have")
            need = HeadMap if isinstance(space, HeadSpace) else ExpertMap if isinstance(space, ExpertSpace) else AxisMap
            if not isinstance(m, need):
                raise TransformError(f"space {name!r} needs a {need.__name__}")
            if isinstance(space, HeadSpace) and isinstance(m, HeadMap):
                _check_inner(name, space, m)
            if isinstance(space, ExpertSpace) and isinstance(m, ExpertMap):
                _check_experts(name, space, m)
            if isinstance(space, Space) and isinstance(m, AxisMap) and not m.is_permutation:
                if m.is_signed_permutation and space.allows_signs:
                    continue  # exact whatever the norm scales: they only permute
                if m.is_signed_permutation and space.max_class == "orthogonal":
                    raise TransformError(
                        f"space {name!r} admits orthogonal maps fixing the all-ones vector only "
                        "(LayerNorm subtracts the mean); a sign flip moves it"
                    )
                if space.max_class == "signed-permutation":
                    raise TransformError(
                        f"space {name!r} admits only signed permutations ({space.reason or 'a norm scale on its path'}); "
                        "any other orthogonal map would change the model's outputs"
                    )
                if space.max_class != "orthogonal":
                    raise TransformError(
                        f"space {name!r} admits only permutations ({space.reason or 'post-norm'}); "
                        "an orthogonal map would change the model's outputs"
                    )
                for tensor, _axis, _role, _off in self.users(name):
                    b = self.bindings[tensor]
                    if b.norm_scale and tensor in state_dict:
                        g = state_dict[tensor]
                        if not torch.allclose(g, g.flatten()[0].expand_as(g)):
                            raise TransformError(
                                f"norm scale {tensor!r} is not uniform, so an orthogonal map of space "
                                f"{name!r} is not exact: bring the model to canonical form first "
                                "(hf_rebasin.canonical.canonicalize)"
                            )

    def identity(self) -> Transform:
        out: Transform = {}
        for name, space in self.spaces.items():
            if isinstance(space, ExpertSpace):
                out[name] = identity_experts(space)
            elif isinstance(space, HeadSpace):
                g, r, dh = space.num_kv_heads, space.group_size, space.head_dim
                inner = torch.arange(dh).expand(g, dh).clone()
                out[name] = HeadMap(torch.arange(g), torch.arange(r).expand(g, r).clone(), inner, inner.clone())
            else:
                out[name] = AxisMap(space.size)
        return out

    def classes(self, requested: TransformClass) -> dict[str, str]:
        """The class each space gets when ``requested`` is asked for (after fallbacks)."""
        out = {}
        for name, space in self.spaces.items():
            if isinstance(space, ExpertSpace):
                shift = " + router shift" if space.router == "softmax" else ""
                out[name] = f"expert-permutation (with router rows) + unit permutations{shift}"
            elif isinstance(space, HeadSpace):
                if space.qk == "fixed":
                    inner = " + inner rotations (V/O only: Q/K fixed)" if requested == "orthogonal" else ""
                    out[name] = "head-permutation" + (inner or " (V/O inner only: Q/K fixed)")
                elif requested == "orthogonal":
                    out[name] = "head-permutation + inner rotations" + (
                        " (rotary planes for Q/K)" if space.qk == "planes" else ""
                    )
                else:
                    out[name] = "head-permutation" + (" (V/O inner only: rotary)" if space.qk == "planes" else "")
            else:
                got = plain_class(space, requested, strict=True)  # what random_transform draws
                out[name] = got + (" (fixing 1)" if got == "orthogonal" and space.centered else "")
        return out

    def fallbacks(self, requested: TransformClass) -> list[str]:
        """Human-readable notes for spaces that cannot take ``requested``."""
        if requested == "permutation":
            return []
        out = []
        for name, space in self.spaces.items():
            if not isinstance(space, Space) or space.kind != "residual":
                continue
            got = plain_class(space, requested)
            if got != requested:
                what = "signed permutations" if got == "signed-permutation" else "permutations"
                out.append(f"space {name!r} admits only {what} ({space.reason}); using {what} there")
        return out

    def random_transform(
        self, cls: TransformClass = "permutation", generator: torch.Generator | None = None
    ) -> Transform:
        """A transform drawn at random from the allowed classes (richest up to ``cls``)."""
        if cls not in TRANSFORM_CLASSES:
            raise TransformError(f"transform class must be one of {TRANSFORM_CLASSES}, got {cls!r}")
        g = generator if generator is not None else torch.Generator().manual_seed(0)
        out: Transform = {}
        for name, space in self.spaces.items():
            if isinstance(space, HeadSpace):
                out[name] = random_head_map(space, cls, g)
                continue
            if isinstance(space, ExpertSpace):
                width = self.router_width(name) if space.router == "softmax" else None
                out[name] = random_expert_map(space, g, width)
                continue
            got = plain_class(space, cls, strict=True)
            if got == "orthogonal":
                out[name] = AxisMap(space.size, blocks=random_orthogonal(space.size, g, fix_ones=space.centered)[None])
            elif got == "signed-permutation":
                signs = torch.randint(0, 2, (space.size,), generator=g) * 2 - 1
                out[name] = AxisMap.signed(torch.randperm(space.size, generator=g), signs)
            else:
                out[name] = AxisMap(space.size, index=torch.randperm(space.size, generator=g))
        return out


def plain_class(space: Space, requested: TransformClass, *, strict: bool = False) -> TransformClass:
    """The class a plain space gets when ``requested`` is asked for: the richest the space admits up
    to it. A signed-permutation space keeps its signs even when plain permutations are asked for
    (a strategy matching it without signs would miss half its symmetry) unless ``strict``."""
    if requested == "orthogonal" and space.max_class == "orthogonal":
        return "orthogonal"
    if space.max_class == "signed-permutation" and (requested != "permutation" or not strict):
        return "signed-permutation"
    if requested == "signed-permutation" and space.allows_signs:
        return "signed-permutation"
    return "permutation"


def _is_permutation(index: Tensor, n: int) -> bool:
    return index.dtype == torch.long and index.shape == (n,) and torch.equal(index.sort().values.cpu(), torch.arange(n))


def _check_experts(name: str, space: ExpertSpace, m: ExpertMap) -> None:
    """An expert map moves whole experts and permutes units inside each: anything else (units
    crossing experts, a rotation of units) changes the model; so does a router shift under a
    sigmoid router."""
    E, f = space.num_experts, space.units
    if m.shift is not None and space.router != "softmax" and bool(m.shift.any()):
        raise TransformError(
            f"expert space {name!r} has a {space.router} router: a vector added to its rows changes the "
            "routing weights (only a softmax over experts is blind to it)"
        )
    if m.shift is not None and not bool(torch.isfinite(m.shift).all()):
        raise TransformError(f"expert space {name!r}: the router shift is not finite")
    if not _is_permutation(m.perm, E):
        raise TransformError(f"expert space {name!r}: the expert map must be a permutation of {E} experts")
    if m.inner.shape != (E, f) or not all(_is_permutation(row, f) for row in m.inner):
        raise TransformError(
            f"expert space {name!r}: the unit maps must be one permutation of {f} units per expert "
            "(units never leave their expert, and an expert's activation commutes with nothing else)"
        )


def identity_experts(space: ExpertSpace) -> ExpertMap:
    return ExpertMap(
        torch.arange(space.num_experts), torch.arange(space.units).expand(space.num_experts, space.units).clone()
    )


def random_expert_map(space: ExpertSpace, g: torch.Generator, shift: int | None = None) -> ExpertMap:
    """Random experts and units; with ``shift`` (the router's width) a random router shift too."""
    perm = torch.randperm(space.num_experts, generator=g)
    inner = torch.stack([torch.randperm(space.units, generator=g) for _ in range(space.num_experts)])
    vector = torch.randn(shift, generator=g, dtype=torch.float64) if shift else None
    return ExpertMap(perm, inner, vector)


def _check_inner(name: str, space: HeadSpace, m: HeadMap) -> None:
    """Inner head maps that keep the function: finite and well conditioned; for Q/K, under rotary
    embeddings a scaled rotation of each rotary plane (the only maps RoPE commutes with), and the
    identity where the space fixes them (``qk="fixed"``)."""
    if space.qk == "fixed" and not is_identity_inner(m.qk):
        raise TransformError(
            f"space {name!r} fixes its Q/K inner maps ({space.reason or 'no inner map keeps its scores'}): "
            "any Q/K inner map but the identity changes the attention scores"
        )
    for label, inner in (("Q/K", m.qk), ("V/O", m.vo)):
        if inner.dtype == torch.long:
            continue
        if not bool(torch.isfinite(inner).all()):
            raise TransformError(f"space {name!r}: the {label} inner maps are not finite")
        if m.invertible and float(torch.linalg.cond(inner.detach().double()).max()) > 1e8:
            raise TransformError(f"space {name!r}: a {label} inner map is (nearly) singular")
    if space.qk == "planes" and m.qk.dtype == torch.long and not is_identity_inner(m.qk):
        raise TransformError(
            f"space {name!r} has rotary embeddings: a Q/K inner permutation other than the identity "
            "moves features between rotary planes and changes the attention scores"
        )
    if space.qk == "planes" and m.qk.dtype != torch.long and not is_plane_scaling(m.qk):
        raise TransformError(
            f"space {name!r} has rotary embeddings: its Q/K inner maps may only rotate and scale each rotary "
            "plane (j, j + head_dim/2); any other map changes the attention scores"
        )


def is_identity_inner(inner: Tensor, atol: float = 1e-6) -> bool:
    """Whether every inner map of a head map (``[G, dh]`` indices or ``[G, dh, dh]`` matrices) is
    the identity."""
    if inner.dtype == torch.long:
        return torch.equal(inner.cpu(), torch.arange(inner.shape[-1]).expand_as(inner))
    eye = torch.eye(inner.shape[-1], dtype=inner.dtype).expand_as(inner)
    return bool(torch.isfinite(inner).all()) and bool(torch.allclose(inner.detach().cpu(), eye, atol=atol))


def identity_inner(space: HeadSpace) -> Tensor:
    """The identity inner maps of a head space, as ``[G, dh]`` indices."""
    return torch.arange(space.head_dim).expand(space.num_kv_heads, space.head_dim).clone()


def is_plane_scaling(m: Tensor, atol: float = 1e-6) -> bool:
    """Whether every ``[dh, dh]`` block of ``m`` is a scaled rotation of each rotary plane
    ``(j, j + dh/2)`` (HF's ``rotate_half`` pairing): ``[[a, -b], [b, a]]`` in each plane, 0 elsewhere."""
    dh = m.shape[-1]
    half = dh // 2
    j = torch.arange(half)
    a, b = m[..., j, j], m[..., j + half, j]
    rebuilt = torch.zeros_like(m)
    rebuilt[..., j, j] = a
    rebuilt[..., j + half, j + half] = a
    rebuilt[..., j, j + half] = -b
    rebuilt[..., j + half, j] = b
    return bool(torch.allclose(m.detach(), rebuilt.detach(), atol=atol * max(1.0, float(m.detach().abs().max()))))


# --------------------------------------------------------------------------------------------
# Random elements of the allowed groups
# --------------------------------------------------------------------------------------------


def random_orthogonal(n: int, generator: torch.Generator, fix_ones: bool = False, batch: int | None = None) -> Tensor:
    """Haar-random orthogonal matrix (float64), or ``[batch, n, n]`` of them in one batched QR;
    with ``fix_ones`` it maps 1 to 1."""
    if fix_ones:
        if n == 1:
            return torch.ones(1, 1, dtype=torch.float64)
        basis = ones_complement_basis(n)
        inner = random_orthogonal(n - 1, generator)
        return basis @ inner @ basis.T + torch.full((n, n), 1.0 / n, dtype=torch.float64)
    a = torch.randn(batch or 1, n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    return q if batch is not None else q[0]


def ones_complement_basis(n: int) -> Tensor:
    """An orthonormal basis ``[n, n-1]`` of the subspace orthogonal to the all-ones vector (the
    Helmert basis: closed form, O(n²), no factorisation)."""
    return _helmert(n).clone()


@functools.lru_cache(maxsize=8)
def _helmert(n: int) -> Tensor:
    k = torch.arange(1, n, dtype=torch.float64)  # column k-1 averages the first k entries against entry k
    rows = torch.arange(n, dtype=torch.float64)[:, None]
    norm = torch.sqrt(k * (k + 1))
    basis = torch.where(rows < k, 1.0 / norm, torch.where(rows == k, -k / norm, torch.zeros(())))
    return basis


def inner_matrices(inner: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """A head map's inner maps as ``[G, dh, dh]`` matrices, whether stored as index tensors
    (permutations: row i picks feature ``inner[g, i]``) or as matrices."""
    if inner.dtype == torch.long:
        return torch.eye(inner.shape[-1], dtype=dtype)[inner]
    return inner.to(dtype)


def plane_scalings(p: Tensor) -> Tensor:
    """``[G, dh, dh]`` scaled rotations of each rotary plane ``(j, j + dh/2)`` from ``p = [G, dh/2, 2]``,
    ``(a, b)`` per plane giving the block ``[[a, -b], [b, a]]`` (differentiable in ``p``)."""
    half = p.shape[1]
    a, b = p[..., 0], p[..., 1]
    eye = torch.eye(half, dtype=p.dtype)
    top = torch.cat([a[:, :, None] * eye, -b[:, :, None] * eye], dim=2)
    low = torch.cat([b[:, :, None] * eye, a[:, :, None] * eye], dim=2)
    return torch.cat([top, low], dim=1)


def rotary_plane_rotations(angles: Tensor) -> Tensor:
    """Block matrices ``[G, dh, dh]`` rotating each rotary plane (j, j + dh/2) by ``angles[g, j]``.

    HF's ``rotate_half`` pairs feature j with j + dh/2; rotations in one plane commute with RoPE's
    position-dependent rotation of that plane, so Q·K is unchanged when Q and K share them.
    """
    g, half = angles.shape
    dh = 2 * half
    m = torch.zeros(g, dh, dh, dtype=torch.float64)
    c, s = torch.cos(angles), torch.sin(angles)
    j = torch.arange(half)
    m[:, j, j] = c
    m[:, j + half, j + half] = c
    m[:, j, j + half] = -s
    m[:, j + half, j] = s
    return m


def random_invertible_head_map(space: HeadSpace, g: torch.Generator, spread: float = 1.0) -> HeadMap:
    """A head map with random invertible inner maps (singular values ``exp(±spread/2)``), under
    rotary embeddings scaled rotations of each plane for Q/K, the identity where Q/K are fixed: the
    function-preservation tests' class."""
    perm = random_head_map(space, "orthogonal", g)
    G, dh = space.num_kv_heads, space.head_dim

    def scales(*shape: int) -> Tensor:
        return torch.exp((torch.rand(*shape, generator=g, dtype=torch.float64) - 0.5) * spread)

    def general() -> Tensor:
        return random_orthogonal(dh, g, batch=G) * scales(G, 1, dh) @ random_orthogonal(dh, g, batch=G)

    if space.qk == "fixed":
        qk = identity_inner(space)
    elif space.qk == "planes":
        planes = rotary_plane_rotations(torch.rand(G, dh // 2, generator=g, dtype=torch.float64) * 2 * math.pi)
        qk = planes * torch.cat([scales(G, dh // 2)] * 2, dim=1)[:, :, None]
    else:
        qk = general()
    return HeadMap(perm.kv_perm, perm.q_perm, qk, general(), invertible=True)


def random_head_map(space: HeadSpace, cls: TransformClass, g: torch.Generator) -> HeadMap:
    G, r, dh = space.num_kv_heads, space.group_size, space.head_dim
    kv = torch.randperm(G, generator=g)
    q = torch.stack([torch.randperm(r, generator=g) for _ in range(G)])
    if cls == "orthogonal":
        if space.qk == "fixed":
            qk = identity_inner(space)
        elif space.qk == "planes":
            qk = rotary_plane_rotations(torch.rand(G, dh // 2, generator=g, dtype=torch.float64) * 2 * math.pi)
        else:
            qk = random_orthogonal(dh, g, batch=G)
        vo = random_orthogonal(dh, g, batch=G)
    else:
        if space.qk != "free":  # no permutation but the identity keeps rotary planes or fixed features
            qk = identity_inner(space)
        else:
            qk = torch.stack([torch.randperm(dh, generator=g) for _ in range(G)])
        vo = torch.stack([torch.randperm(dh, generator=g) for _ in range(G)])
    return HeadMap(kv, q, qk, vo)
