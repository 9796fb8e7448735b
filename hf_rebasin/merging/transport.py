"""Transport of task vectors onto a new base release: θ = B + α·π(τ), τ = A_ft − A.

The alignment is found between the two bases (the target B as the reference, the old base A as
the model brought into its basis), so π is the transform that maps A onto B. It is then applied,
unchanged, to the fine-tune A_ft, and the task vector is taken in B's basis:
π(τ) = π(A_ft) − π(A), computed exactly. ``apply`` is linear in the weights for a fixed transform,
so for permutation strategies this equals π applied to τ itself. Orthogonal strategies work in
canonical form (norm scales folded into their readers); there the fine-tune is brought to canonical
form with its own norm scales first, so π(τ) is exact at α = 1 (θ is B's basis version of A_ft's
update) and linear in α in canonical coordinates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import overload

import torch
from torch import Tensor

from hf_rebasin.alignment.strategies import Alignment
from hf_rebasin.core.errors import IncompatibleModelsError
from hf_rebasin.core.lazy import LazyState, RowReader, shape_of
from hf_rebasin.merging.interpolate import StorageKey, storage_key
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.sublayers import is_per_sublayer, per_sublayer

__all__ = ["add_task_vector", "check_shared", "move_finetune", "task_vector"]


def check_shared(base: Mapping[str, Tensor], finetuned: Mapping[str, Tensor], where: str = "task vector") -> None:
    """Every tensor a fine-tune shares with its base has the base's shape (its own head may be new)."""
    for name in base:
        if name not in finetuned:
            continue
        shape, other = shape_of(base, name), shape_of(finetuned, name)
        if other != shape:
            raise IncompatibleModelsError(
                f"{where}: tensor {name!r} has shape {tuple(other)} in the fine-tune but "
                f"{tuple(shape)} in its base: the fine-tune was not trained from this base"
            )


def task_vector(
    alignment: Alignment,
    graph: SymmetryGraph,
    finetuned: Mapping[str, Tensor],
    finetuned_graph: SymmetryGraph | None = None,
) -> Mapping[str, Tensor]:
    """π(A_ft) − π(A) in the target's basis (and form), for every floating tensor they share.

    ``alignment`` brings the old base A (its ``sd_b``) into the target B's basis; ``graph`` is the
    symmetry graph of the original (not canonical) models; ``finetuned`` is A_ft's state dict, of
    the same architecture as A, or of a sibling class (another head) with ``finetuned_graph``.
    Integer buffers are not part of a task vector. :func:`move_finetune` also returns the tensors
    only the fine-tune has.
    """
    return move_finetune(alignment, graph, finetuned, finetuned_graph)[0]


def move_finetune(
    alignment: Alignment,
    graph: SymmetryGraph,
    finetuned: Mapping[str, Tensor],
    finetuned_graph: SymmetryGraph | None = None,
) -> tuple[Mapping[str, Tensor], dict[str, Tensor]]:
    """``(π(τ), carried)``: the task vector of :func:`task_vector`, and the fine-tune's tensors its
    base lacks (a new head trained on A's features) in B's basis, from one transform of A_ft.

    Carried tensors have no counterpart in B, so they move whole: π(A_ft)[name], with the transform
    of the axes they read (the residual stream for a classifier head).
    """
    moved_ft = _moved_finetune(alignment, graph, finetuned, finetuned_graph)
    aligned = alignment.aligned_b()
    if isinstance(aligned, LazyState) and isinstance(moved_ft, LazyState) and set(moved_ft) == set(aligned):
        return aligned.derive(
            lambda name: _difference(moved_ft[name], aligned[name]),
            rows=lambda name: _rows_of(_difference, moved_ft, aligned, name),
        ), {}
    tau: dict[str, Tensor] = {}
    for name, base in aligned.items():
        if base.is_floating_point() and name in moved_ft:
            tau[name] = moved_ft[name].to(torch.float32) - base.to(torch.float32)
    carried = {name: t for name, t in moved_ft.items() if name not in alignment.sd_b and t.is_floating_point()}
    return tau, carried


def _difference(finetuned: Tensor, base: Tensor) -> Tensor:
    """One tensor of τ (a non-floating buffer is no part of a task vector: the base's, unused)."""
    return finetuned.to(torch.float32) - base.to(torch.float32) if base.is_floating_point() else base


def _moved_finetune(
    alignment: Alignment,
    graph: SymmetryGraph,
    finetuned: Mapping[str, Tensor],
    finetuned_graph: SymmetryGraph | None,
) -> Mapping[str, Tensor]:
    ft_graph = finetuned_graph if finetuned_graph is not None else graph
    if is_per_sublayer(alignment.graph):  # the fine-tune's tensors follow the maps of their own sublayers
        ft_graph = per_sublayer(ft_graph)
    if finetuned_graph is None and list(finetuned) != list(alignment.sd_b) and not alignment.canonical:
        only_ft = sorted(set(finetuned) - set(alignment.sd_b))
        only_base = sorted(set(alignment.sd_b) - set(finetuned))
        raise IncompatibleModelsError(
            f"task vector: the fine-tune and its base hold different tensors (only in the fine-tune: {only_ft[:5]}, "
            f"only in the base: {only_base[:5]}) and no graph of the fine-tune was given"
        )
    ft: Mapping[str, Tensor]
    if alignment.canonical:
        ft, ft_graph, _ = canonicalize(ft_graph, finetuned)
    else:
        ft = finetuned if isinstance(finetuned, LazyState) else dict(finetuned)
    check_shared(alignment.sd_b, ft)
    return ft_graph.apply(ft, alignment.transform)


@overload
def add_task_vector(  # type: ignore[overload-overlap]  # a LazyState is a Mapping that stays lazy
    target: LazyState, tau: Mapping[str, Tensor], alpha: float
) -> LazyState: ...


@overload
def add_task_vector(target: Mapping[str, Tensor], tau: Mapping[str, Tensor], alpha: float) -> dict[str, Tensor]: ...


def add_task_vector(
    target: Mapping[str, Tensor], tau: Mapping[str, Tensor], alpha: float
) -> dict[str, Tensor] | LazyState:
    """``target + α·τ`` for every floating tensor of ``target`` (others copied), in its dtypes.

    Tensors tied in ``target`` (one storage under two names) stay one tensor, so a tied LM head
    remains tied; τ must agree on them, which it does when it came from `task_vector`. A
    `LazyState` target gives a `LazyState`, each tensor added when read.
    """
    for name in target:
        if name in tau and shape_of(tau, name) != shape_of(target, name):
            raise IncompatibleModelsError(
                f"task vector {name!r} has shape {tuple(shape_of(tau, name))}, the target {tuple(shape_of(target, name))}"
            )
    if isinstance(target, LazyState):
        return target.derive(
            lambda name: _added(target[name], tau, name, alpha),
            rows=lambda name: _rows_of(lambda t, d: _added(t, {name: d}, name, alpha), target, tau, name),
        )
    out: dict[str, Tensor] = {}
    done: dict[StorageKey, Tensor] = {}
    for name, t in target.items():
        key = storage_key(t)
        if key not in done:
            done[key] = _added(t, tau, name, alpha)
        out[name] = done[key]
    return out


def _rows_of(
    combine: Callable[[Tensor, Tensor], Tensor], first: Mapping[str, Tensor], second: Mapping[str, Tensor], name: str
) -> RowReader | None:
    """Rows of ``combine(first[name], second[name])`` (an element-wise sum) from the same rows of
    each, where both compute rows alone (``first``'s own where ``second`` lacks the tensor)."""
    if not isinstance(first, LazyState):
        return None
    if name not in second:
        return first.rows(name)
    if not isinstance(second, LazyState):
        return None
    a, b = first.rows(name), second.rows(name)
    if a is None or b is None:
        return None
    read_a, read_b = a, b
    return lambda start, stop: combine(read_a(start, stop), read_b(start, stop))


def _added(t: Tensor, tau: Mapping[str, Tensor], name: str, alpha: float) -> Tensor:
    if not t.is_floating_point() or name not in tau:
        return t
    return (t.to(torch.float32) + alpha * tau[name].to(torch.float32)).to(t.dtype)
