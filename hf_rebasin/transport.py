"""Transport of task vectors onto a new base release: θ = B + α·π(τ), τ = A_ft − A (DESIGN.md §3).

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

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .canonical import canonicalize
from .errors import IncompatibleModelsError
from .merge import StorageKey, storage_key
from .strategies import Alignment
from .symmetry import SymmetryGraph

__all__ = ["add_task_vector", "task_vector"]


def _same_tensors(names_a: Sequence[str], names_b: Sequence[str], what: str) -> None:
    if list(names_a) != list(names_b):
        only_a = sorted(set(names_a) - set(names_b))
        only_b = sorted(set(names_b) - set(names_a))
        raise IncompatibleModelsError(
            f"{what}: the fine-tune and its base hold different tensors (only in the fine-tune: {only_a[:5]}, "
            f"only in the base: {only_b[:5]})"
        )


def task_vector(alignment: Alignment, graph: SymmetryGraph, finetuned: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """π(A_ft) − π(A) in the target's basis (and form), for every floating tensor.

    ``alignment`` brings the old base A (its ``sd_b``) into the target B's basis; ``graph`` is the
    symmetry graph of the original (not canonical) models; ``finetuned`` is A_ft's state dict, of
    the same architecture as A. Integer buffers are not part of a task vector.
    """
    ft = canonicalize(graph, finetuned)[0] if alignment.canonical else dict(finetuned)
    _same_tensors(list(ft), list(alignment.sd_b), "task vector")
    moved_ft = alignment.graph.apply(ft, alignment.transform)
    moved_base = alignment.aligned_b()
    out: dict[str, Tensor] = {}
    for name, base in moved_base.items():
        if base.is_floating_point():
            out[name] = moved_ft[name].to(torch.float32) - base.to(torch.float32)
    return out


def add_task_vector(target: Mapping[str, Tensor], tau: Mapping[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """``target + α·τ`` for every floating tensor of ``target`` (others copied), in its dtypes.

    Tensors tied in ``target`` (one storage under two names) stay one tensor, so a tied LM head
    remains tied; τ must agree on them, which it does when it came from `task_vector`.
    """
    out: dict[str, Tensor] = {}
    done: dict[StorageKey, Tensor] = {}
    for name, t in target.items():
        if not t.is_floating_point() or name not in tau:
            out[name] = t
            continue
        if tau[name].shape != t.shape:
            raise IncompatibleModelsError(
                f"task vector {name!r} has shape {tuple(tau[name].shape)}, the target {tuple(t.shape)}"
            )
        key = storage_key(t)
        if key not in done:
            done[key] = (t.to(torch.float32) + alpha * tau[name].to(torch.float32)).to(t.dtype)
        out[name] = done[key]
    return out
