"""Applying a transform to tensors: each bound axis of a tensor contracted with its space's map.

For permutations and orthogonal maps the inverse is the transpose, so output axes (``T W``) and
input axes (``W Tᵀ``) obey one rule: ``new[..., i, ...] = Σ_j T[i, j] · old[..., j, ...]``. That is
why a binding needs nothing but the space name per axis, as in git re-basin's ``axes_to_perm``.
This module maps one tensor (fused axes part by part, through a binding's view, a router's shift
added) and a whole state dict, eager or lazy, after checking that every map is one its space
allows. :class:`~hf_rebasin.symmetry.graph.SymmetryGraph`'s ``apply``, ``map_tensor`` and
``axis_map`` are these functions.

This module imports torch only: no transformers, no hub.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from hf_rebasin.core.errors import PinnedSpaceError, TransformError
from hf_rebasin.core.lazy import LazyState, RowReader
from hf_rebasin.symmetry.spaces import Binding, ExpertSpace, Fused, GraphView, HeadSpace, Space, split_ref
from hf_rebasin.symmetry.transforms import AxisMap, ExpertMap, HeadMap, SpaceMap, is_identity_inner, is_plane_scaling

# --------------------------------------------------------------------------------------------
# One tensor
# --------------------------------------------------------------------------------------------


def axis_map(graph: GraphView, transform: Mapping[str, SpaceMap], ref: str) -> AxisMap | None:
    """The map of one axis reference (``"space"`` or ``"space:role"``) under ``transform``: a head
    or expert map expanded to the role's features; None where the transform leaves the space out."""
    name, role = split_ref(ref)
    m = transform.get(name)
    if m is None:
        return None
    if isinstance(m, HeadMap):
        space = graph.spaces[name]
        assert isinstance(space, HeadSpace) and role is not None
        return m.expand(space, role)
    if isinstance(m, ExpertMap):
        space = graph.spaces[name]
        assert isinstance(space, ExpertSpace) and role is not None
        return m.expand(space, role)
    return m


def map_tensor(
    graph: GraphView,
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
            cache[ref] = axis_map(graph, transform, ref)
        return cache[ref]

    b = graph.bindings[name]
    if b.view is not None:
        mapped = _map_axes(graph, b, b.view.read(t), get, skip_axis)
        return b.view.write(mapped)
    return _shifted(b, _map_axes(graph, b, t, get, skip_axis), transform, skip_axis)


def _shifted(b: Binding, t: Tensor, transform: Mapping[str, SpaceMap], skip_axis: int | None) -> Tensor:
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


def _map_axes(
    graph: GraphView, b: Binding, t: Tensor, get: Callable[[str], AxisMap | None], skip_axis: int | None
) -> Tensor:
    """``t`` with every bound axis of ``b`` but ``skip_axis`` mapped: a fused axis part by part, a
    norm's γ only permuted."""
    for axis, ref in enumerate(b.axes):
        if ref is None or axis == skip_axis:
            continue
        if isinstance(ref, Fused) and ref.interleaved:
            t = _map_interleaved(graph, ref, t, axis, get)
        elif isinstance(ref, Fused):
            sizes = [graph.ref_size(p) for p in ref.parts]
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


def _map_interleaved(
    graph: GraphView, ref: Fused, t: Tensor, axis: int, get: Callable[[str], AxisMap | None]
) -> Tensor:
    """``t`` with each part of an interleaved fused axis mapped: the axis viewed as
    ``[groups, per group]``, each part's rows gathered into its usual layout, mapped, and put back."""
    g = graph.groups(ref)
    sizes = [graph.ref_size(p) // g for p in ref.parts]
    chunks = list(t.unflatten(axis, (g, -1)).split(sizes, dim=axis + 1))
    for i, part in enumerate(ref.parts):
        m = get(part)
        if m is not None:
            chunks[i] = m.apply(chunks[i].flatten(axis, axis + 1), axis).unflatten(axis, (g, -1))
    return torch.cat(chunks, dim=axis + 1).flatten(axis, axis + 1)


# --------------------------------------------------------------------------------------------
# A state dict
# --------------------------------------------------------------------------------------------


def apply_transform(
    graph: GraphView, state_dict: Mapping[str, Tensor], transform: Mapping[str, SpaceMap], *, check: bool = True
) -> dict[str, Tensor] | LazyState:
    """Return a new state dict with every bound axis transformed. Tied aliases follow their
    source; invariant tensors are copied by reference. A `LazyState` gives a `LazyState` whose
    tensors are transformed when read. ``check=False`` skips the class checks
    (learned matching applies dense, relaxed permutations while it optimizes)."""
    if check:
        check_transform(graph, transform, state_dict)
    cache: dict[str, AxisMap | None] = {}
    if isinstance(state_dict, LazyState):
        return state_dict.derive(
            lambda name: _mapped(graph, state_dict, name, transform, cache),
            rows=lambda name: _mapped_rows(graph, state_dict, name, transform, cache),
        )
    out: dict[str, Tensor] = {}
    for name, t in state_dict.items():
        if name in graph.ties:
            continue
        out[name] = map_tensor(graph, name, t, transform, cache=cache) if name in graph.bindings else t
    for alias, source in graph.ties.items():
        if alias in state_dict:
            out[alias] = out[source]
    return {k: out[k] for k in state_dict}


def _mapped(
    graph: GraphView,
    state: Mapping[str, Tensor],
    name: str,
    transform: Mapping[str, SpaceMap],
    cache: dict[str, AxisMap | None],
) -> Tensor:
    """One tensor of `apply_transform`'s result, computed alone (a tied alias as its source)."""
    source = graph.ties.get(name)
    key = source if source is not None and source in state else name
    t = state[key]
    return map_tensor(graph, key, t, transform, cache=cache) if key in graph.bindings else t


def _mapped_rows(
    graph: GraphView,
    state: LazyState,
    name: str,
    transform: Mapping[str, SpaceMap],
    cache: dict[str, AxisMap | None],
) -> RowReader | None:
    """Rows of one tensor of `apply_transform`'s result from the same rows of ``state``, where no
    map touches the first axis (an embedding's vocabulary)."""
    source = graph.ties.get(name)
    key = source if source is not None and source in state else name
    read = state.rows(key)
    if read is None or key not in graph.bindings:
        return read
    if graph.bindings[key].axes[0] is not None or graph.bindings[key].view is not None:
        return None
    reader = read
    return lambda start, stop: map_tensor(graph, key, reader(start, stop), transform, cache=cache)


# --------------------------------------------------------------------------------------------
# Checks: every map one its space allows
# --------------------------------------------------------------------------------------------


def check_transform(graph: GraphView, transform: Mapping[str, SpaceMap], state_dict: Mapping[str, Tensor]) -> None:
    """Refuse a transform a space does not allow: a map of the wrong kind, a richer class than the
    space admits, an orthogonal map where a norm scale on the space is not uniform."""
    for name, m in transform.items():
        space = graph.spaces.get(name)
        if space is None:
            raise TransformError(f"transform names space {name!r}, which {graph.family!r} models do not have")
        need = HeadMap if isinstance(space, HeadSpace) else ExpertMap if isinstance(space, ExpertSpace) else AxisMap
        if not isinstance(m, need):
            raise TransformError(f"space {name!r} needs a {need.__name__}")
        if isinstance(space, HeadSpace) and isinstance(m, HeadMap):
            _check_inner(name, space, m)
        if isinstance(space, ExpertSpace) and isinstance(m, ExpertMap):
            _check_experts(name, space, m)
        if isinstance(space, Space) and space.pinned and isinstance(m, AxisMap) and not m.is_identity():
            raise PinnedSpaceError(
                f"space {name!r} is pinned ({space.reason}): only the identity map keeps the model's outputs "
                "after it is saved and loaded again; leave it out of the transform or map it to the identity"
            )
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
            for tensor, _axis, _role, _off in graph.users(name):
                b = graph.bindings[tensor]
                if b.norm_scale and tensor in state_dict:
                    g = state_dict[tensor]
                    if not torch.allclose(g, g.flatten()[0].expand_as(g)):
                        raise TransformError(
                            f"norm scale {tensor!r} is not uniform, so an orthogonal map of space "
                            f"{name!r} is not exact: bring the model to canonical form first "
                            "(hf_rebasin.symmetry.canonical.canonicalize)"
                        )


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
