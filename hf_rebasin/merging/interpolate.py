"""Weighted averages of models that already share one basis.

Alignment happens before this module: every state dict handed here is in the reference model's
basis (and, for orthogonal strategies, in the same canonical form), so merging is a plain
weighted average, tensor by tensor. Pure tensor code: no transformers, no files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import overload

import torch
from torch import Tensor

from hf_rebasin.core.errors import IncompatibleModelsError
from hf_rebasin.core.lazy import LazyState, RowReader, shape_of

__all__ = ["StorageKey", "merge_state_dicts", "merge_tensor", "storage_key"]

StorageKey = tuple[int, int, tuple[int, ...], tuple[int, ...]]  # (storage, offset, shape, stride)


def storage_key(t: Tensor) -> StorageKey:
    """Identifies a tensor's memory: equal keys are aliases (tied weights), computed once."""
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))


def _check_weights(weights: Sequence[float], n: int) -> list[float]:
    if n < 1:
        raise ValueError("merge_state_dicts needs at least one state dict")
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} state dicts: give one weight per model")
    out = [float(w) for w in weights]
    if any(not math.isfinite(w) for w in out):
        raise ValueError(f"merge weights must be finite numbers, not {out}")
    return out


def _check_same(reference: Mapping[str, Tensor], other: Mapping[str, Tensor], index: int) -> None:
    if reference.keys() != other.keys():
        only_ref = sorted(set(reference) - set(other))
        only_other = sorted(set(other) - set(reference))
        raise IncompatibleModelsError(
            f"model #{index} holds different tensors than the reference: only in the reference "
            f"{only_ref[:5]}, only in model #{index} {only_other[:5]}"
        )
    for name in reference:
        shape, got = shape_of(reference, name), shape_of(other, name)
        if got != shape:
            raise IncompatibleModelsError(
                f"tensor {name!r} has shape {tuple(shape)} in the reference but {tuple(got)} in model #{index}"
            )


@overload
def merge_state_dicts(  # type: ignore[overload-overlap]  # a LazyState is a Mapping that stays lazy
    state_dicts: Sequence[LazyState], weights: Sequence[float]
) -> LazyState: ...


@overload
def merge_state_dicts(state_dicts: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]: ...


def merge_state_dicts(
    state_dicts: Sequence[Mapping[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor] | LazyState:
    """Σᵢ wᵢ·θᵢ for every floating tensor, accumulated in float64 and cast back to the reference's dtype.

    The first state dict is the reference: its non-floating tensors (integer buffers, position ids)
    are taken as they are, and names that alias one storage in it (a tied LM head and embedding)
    are computed once and stay one tensor in the result, so a tie is neither doubled nor broken.
    Weights are used as given (the recipe checks that they sum to 1). `LazyState` inputs give a
    `LazyState`: each merged tensor is computed when read, from one tensor of each input.
    """
    w = _check_weights(weights, len(state_dicts))
    reference = state_dicts[0]
    for i, sd in enumerate(state_dicts[1:], start=1):
        _check_same(reference, sd, i)
    if isinstance(reference, LazyState):
        return reference.derive(
            lambda name: merge_tensor(name, state_dicts, w), rows=lambda name: _merged_rows(name, state_dicts, w)
        )
    out: dict[str, Tensor] = {}
    done: dict[StorageKey, Tensor] = {}
    for name, ref in reference.items():
        if not ref.is_floating_point():
            out[name] = ref
            continue
        key = storage_key(ref)
        if key not in done:
            done[key] = merge_tensor(name, state_dicts, w)
        out[name] = done[key]
    return out


CHUNK = 1 << 22  # elements summed at once: float64 temporaries of 32 MB, whatever the tensor's size


def merge_tensor(name: str, state_dicts: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> Tensor:
    """Tensor ``name`` of the weighted average (the reference's own when it is not floating).

    Summed in float64 a chunk at a time: the same bits as one float64 sum of the whole tensor (the
    sum is element-wise), without float64 copies of a 32000×4096 embedding."""
    reference = state_dicts[0]
    dtype = reference.dtype(name) if isinstance(reference, LazyState) else reference[name].dtype
    if not dtype.is_floating_point:
        return reference[name]
    terms = [(w, sd[name]) for w, sd in zip(weights, state_dicts, strict=True) if w != 0.0]
    device = terms[0][1].device if isinstance(reference, LazyState) and terms else reference[name].device
    return _weighted(terms, shape_of(reference, name), dtype, device)


def _merged_rows(name: str, state_dicts: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> RowReader | None:
    """Rows of the merged tensor ``name`` from the same rows of each input (`LazyState.rows`)."""
    reference = state_dicts[0]
    assert isinstance(reference, LazyState)
    dtype = reference.dtype(name)
    if not dtype.is_floating_point:
        return reference.rows(name)
    used = [(w, sd) for w, sd in zip(weights, state_dicts, strict=True) if w != 0.0]
    readers = [sd.rows(name) if isinstance(sd, LazyState) else None for _, sd in used]
    if not used or any(r is None for r in readers):
        return None
    shape = shape_of(reference, name)

    def rows(start: int, stop: int) -> Tensor:
        terms = [(w, r(start, stop)) for (w, _), r in zip(used, readers, strict=True) if r is not None]
        return _weighted(terms, (stop - start, *shape[1:]), dtype, terms[0][1].device)

    return rows


def _weighted(
    terms: Sequence[tuple[float, Tensor]], shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Σ w·t over ``terms`` in float64, a chunk at a time, rounded once to ``dtype``."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    flat = out.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        stop = min(start + CHUNK, flat.numel())
        acc = torch.zeros(stop - start, dtype=torch.float64, device=device)
        for weight, t in terms:
            acc.add_(t.reshape(-1)[start:stop].to(device=device, dtype=torch.float64), alpha=weight)
        flat[start:stop] = acc.to(dtype)
    return out
