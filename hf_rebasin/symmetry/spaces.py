"""The vocabulary of a symmetry graph: feature spaces, and how a tensor's axes bind to them.

A *space* is a feature axis shared by several tensors (the residual stream, the MLP units of a
layer, the heads of an attention layer): a plain :class:`Space`, the heads of an attention layer
(:class:`HeadSpace`) or the experts of a mixture-of-experts layer (:class:`ExpertSpace`), with the
richest class of transform that is exact on it. A :class:`Binding` names, per axis of one tensor,
the space (or the :class:`Fused` spaces) it lives in. These types sit below the transforms and the
graph, which both read them.

This module imports torch only: no transformers, no hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

from hf_rebasin.core.errors import AdapterError

TransformClass = Literal["permutation", "signed-permutation", "orthogonal"]
# richest last; "signed-permutation" (a permutation times diag(±1)) is exact wherever every norm on
# the space is sign-blind (RMSNorm: rms(Sx) = rms(x)), even where a norm's γ cannot be folded away
TRANSFORM_CLASSES: tuple[TransformClass, ...] = ("permutation", "signed-permutation", "orthogonal")
# a head space's roles: q/k/v/o hold head_dim features per head; "h" one feature per query head (a
# per-head tensor such as T5's relative position bias, [buckets, heads]: it follows the head order)
ROLES = ("q", "k", "v", "o", "h")


# --------------------------------------------------------------------------------------------
# Spaces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Space:
    """A plain feature space (residual stream, MLP units, pooler, joint embedding).

    ``max_class`` is the richest transform that is exact. ``centered`` marks a LayerNorm residual
    stream: orthogonal maps must fix the all-ones vector (LayerNorm subtracts the mean).
    ``reason`` says why the class is limited, for messages. ``pinned`` marks a space no map but the
    identity keeps exact whatever its class (a residual stream that a table regenerated on load
    writes: Marian's and M2M100's sinusoidal positions); ``reason`` then says why.
    """

    name: str
    size: int
    max_class: TransformClass = "permutation"
    centered: bool = False
    kind: str = "plain"
    reason: str = ""
    pinned: bool = False

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
    fixed, for messages. ``scores_scaled``: the model divides its scores by √head_dim (T5 does
    not), so a wider head's queries must be rescaled to keep them. Role ``h`` has one feature per query head (a per-head tensor: T5's
    relative position bias); it takes the head order only, no inner map.
    """

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: bool = False
    kind: str = "attention"
    qk: QKMode = "free"
    reason: str = ""
    scores_scaled: bool = True

    def __post_init__(self) -> None:
        if self.qk not in QK_MODES:
            raise AdapterError(f"head space {self.name!r}: qk must be one of {QK_MODES}, got {self.qk!r}")
        if self.rotary and self.qk == "free":  # RoPE rotates each plane: only plane rotations commute
            object.__setattr__(self, "qk", "planes")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def role_size(self, role: str) -> int:
        if role == "h":
            return self.num_heads
        heads = self.num_heads if role in ("q", "o") else self.num_kv_heads
        return heads * self.head_dim


Router = Literal["softmax", "sigmoid"]
EXPERT_ROLES = ("experts", "units")


@dataclass(frozen=True)
class ExpertSpace:
    """The experts of one mixture-of-experts layer: ``num_experts`` gated MLPs of ``units`` units.

    Experts may be put in any order, each moving as a unit with its row of the router; inside an
    expert its units permute as in a dense gated MLP (and scale: :mod:`hf_rebasin.symmetry.glu`). Units
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


def is_pinned(space: AnySpace | None) -> bool:
    """Whether ``space`` must keep the identity map (see :attr:`Space.pinned`)."""
    return isinstance(space, Space) and space.pinned


def pinned_spaces(spaces: dict[str, AnySpace]) -> set[str]:
    """The names of the pinned spaces among ``spaces``: what every strategy leaves at the identity."""
    return {name for name, space in spaces.items() if is_pinned(space)}


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
    rotated; orthogonal maps need it folded away first (:mod:`hf_rebasin.symmetry.canonical`). ``view``: the
    axes describe the tensor as :class:`View` reads it, not as stored (read it with
    :meth:`SymmetryGraph.logical`).
    """

    name: str
    axes: tuple[AxisRef, ...]
    norm_scale: bool = False
    view: View | None = None


def split_ref(ref: str) -> tuple[str, str | None]:
    space, _, role = ref.partition(":")
    return space, (role or None)


class GraphView(Protocol):
    """What the transforms and their application read of a symmetry graph (`SymmetryGraph` is one):
    declared here, below both, so the graph can hand its work to them without a circle of imports."""

    family: str
    spaces: dict[str, AnySpace]
    bindings: dict[str, Binding]
    ties: dict[str, str]

    def ref_size(self, ref: str) -> int: ...

    def groups(self, ref: AxisRef) -> int: ...

    def users(self, space: str) -> list[tuple[str, int, str | None, int]]: ...

    def router_width(self, space: str) -> int | None: ...
