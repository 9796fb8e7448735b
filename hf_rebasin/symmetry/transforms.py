"""Transforms of a symmetry graph: one invertible map per space, and the maps each space allows.

A transform assigns each space an invertible map: an :class:`AxisMap` (a permutation, a signed
permutation or an orthogonal map) for a plain space, a :class:`HeadMap` for the heads of an
attention layer, an :class:`ExpertMap` for the experts of a mixture-of-experts layer. This module
holds those maps, the identity and random elements of each space's allowed class (what
:meth:`SymmetryGraph.random_transform` draws and the preservation tests check), and the class a
space gets when one is asked for. Applying a transform to tensors is :mod:`hf_rebasin.symmetry.apply`.

This module imports torch only: no transformers, no hub.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hf_rebasin.core.errors import TransformError
from hf_rebasin.symmetry.spaces import TRANSFORM_CLASSES, ExpertSpace, GraphView, HeadSpace, Space, TransformClass

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
        if role == "h":  # one feature per query head: the head order alone
            return AxisMap(space.num_heads, index=(self.kv_perm[:, None] * r + self.q_perm).reshape(-1))
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
# Classes, identities and tests of maps per space
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Whole transforms of a graph
# --------------------------------------------------------------------------------------------


def identity_transform(graph: GraphView) -> Transform:
    """The transform that changes nothing, one identity map per space: the start of every
    alignment and what a model is aligned with itself by."""
    out: Transform = {}
    for name, space in graph.spaces.items():
        if isinstance(space, ExpertSpace):
            out[name] = identity_experts(space)
        elif isinstance(space, HeadSpace):
            g, r, dh = space.num_kv_heads, space.group_size, space.head_dim
            inner = torch.arange(dh).expand(g, dh).clone()
            out[name] = HeadMap(torch.arange(g), torch.arange(r).expand(g, r).clone(), inner, inner.clone())
        else:
            out[name] = AxisMap(space.size)
    return out


def space_classes(graph: GraphView, requested: TransformClass) -> dict[str, str]:
    """The class each space gets when ``requested`` is asked for (after fallbacks)."""
    out = {}
    for name, space in graph.spaces.items():
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
        elif space.pinned:
            out[name] = f"pinned (identity only: {space.reason})"
        else:
            got = plain_class(space, requested, strict=True)  # what random_transform draws
            out[name] = got + (" (fixing 1)" if got == "orthogonal" and space.centered else "")
    return out


def pinned_notes(graph: GraphView) -> list[str]:
    """Human-readable notes for spaces that keep the identity whatever class is asked for."""
    out = []
    for name, space in graph.spaces.items():
        if isinstance(space, Space) and space.pinned:
            what = "residual stream" if space.kind == "residual" else f"space {name!r}"
            out.append(f"{what} pinned: {space.reason}")
    return out


def class_fallbacks(graph: GraphView, requested: TransformClass) -> list[str]:
    """Human-readable notes for spaces that cannot take ``requested``."""
    if requested == "permutation":
        return []
    out = []
    for name, space in graph.spaces.items():
        if not isinstance(space, Space) or space.kind != "residual" or space.pinned:
            continue  # a pinned space falls back to no map at all: see pinned_notes
        got = plain_class(space, requested)
        if got != requested:
            what = "signed permutations" if got == "signed-permutation" else "permutations"
            out.append(f"space {name!r} admits only {what} ({space.reason}); using {what} there")
    return out


def random_transform(
    graph: GraphView, cls: TransformClass = "permutation", generator: torch.Generator | None = None
) -> Transform:
    """A transform drawn at random from the allowed classes (richest up to ``cls``); a pinned space
    gets the identity."""
    if cls not in TRANSFORM_CLASSES:
        raise TransformError(f"transform class must be one of {TRANSFORM_CLASSES}, got {cls!r}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    out: Transform = {}
    for name, space in graph.spaces.items():
        if isinstance(space, HeadSpace):
            out[name] = random_head_map(space, cls, g)
            continue
        if isinstance(space, ExpertSpace):
            width = graph.router_width(name) if space.router == "softmax" else None
            out[name] = random_expert_map(space, g, width)
            continue
        got = plain_class(space, cls, strict=True)
        if space.pinned:
            out[name] = AxisMap(space.size)
        elif got == "orthogonal":
            out[name] = AxisMap(space.size, blocks=random_orthogonal(space.size, g, fix_ones=space.centered)[None])
        elif got == "signed-permutation":
            signs = torch.randint(0, 2, (space.size,), generator=g) * 2 - 1
            out[name] = AxisMap.signed(torch.randperm(space.size, generator=g), signs)
        else:
            out[name] = AxisMap(space.size, index=torch.randperm(space.size, generator=g))
    return out
