"""Lazy state dicts: tensors computed when read, in blocks of rows where they can be.

A `LazyState` is a state dict that holds nothing: each tensor is computed when it is read and
dropped by the caller. A checkpoint on disk (`hf_rebasin.io.tensors.CheckpointSource`) is one;
derived states (a canonical form, a transformed model, a merge) are `LazyState`s over other
`LazyState`s, so a whole run of a data-free strategy flows tensor by tensor from the input files
into the files written. Every stage reads models through this type; torch only.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import overload

import torch
from torch import Tensor

__all__ = [
    "ROW_BLOCK_ELEMENTS",
    "WORK_DTYPE",
    "LazyState",
    "RowReader",
    "dtype_of",
    "gather_rows",
    "give_back_freed",
    "is_lazy",
    "mean_rows",
    "picked_rows",
    "row_blocks",
    "rowwise",
    "shape_of",
    "under",
]

WORK_DTYPE = torch.float32  # what floating tensors are read as: every computation runs in float32


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (macOS, Windows, musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


def give_back_freed() -> None:
    """Return the free pages of the C heap to the operating system (glibc's ``malloc_trim(0)``).

    A streamed run frees thousands of 1–32 MB tensors; glibc keeps them in its heap, fragmented,
    and the resident size grew to several times what was live (TinyLlama weight matching: a
    3.8 GB heap holding 0.2 GB). Called between stages and spaces, not per tensor: trimming also
    costs the page faults of reusing those pages, which per tensor doubled the time of a merge.
    Elsewhere than glibc it does nothing.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


RowReader = Callable[[int, int], Tensor]  # rows [start, stop) of one tensor, computed without the others


class LazyState(Mapping[str, Tensor]):
    """A state dict computed on read: ``state[name]`` builds the tensor, nothing is kept.

    Names, shapes and dtypes are known without computing a tensor, so checks and plans that need
    only shapes cost nothing. Reading the same name twice computes it twice: callers that need a
    tensor more than once keep it themselves for as long as they need it.

    ``rows(name)`` says whether a block of a tensor's first-axis rows can be computed alone, and
    how: a checkpoint reads their bytes, and a derived state can when every stage maps each row
    on its own (an embedding, whose vocabulary axis no symmetry maps). Without it, a 151936×1024
    embedding is computed whole, in float32, by every stage that reads it; `row_blocks` reads
    it a block at a time where every state in the chain allows.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, torch.dtype],
        read: Callable[[str], Tensor],
        *,
        aliases: Mapping[str, str] | None = None,
        rows: Callable[[str], RowReader | None] | None = None,
    ) -> None:
        self._shapes = dict(shapes)
        self._dtypes = dict(dtypes)
        self._read = read
        self._rows = rows
        self.aliases: dict[str, str] = dict(aliases or {})  # tied names -> the name that holds the data
        # where its tensors are computed (a checkpoint's: the run's device; a state derived from it says so)
        self.device: torch.device = getattr(self, "device", torch.device("cpu"))

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._shapes[name])

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``state[name]`` has (float32 for the floating tensors of a checkpoint)."""
        return self._dtypes[name]

    def numel(self, name: str) -> int:
        return math.prod(self._shapes[name])

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        if math.prod(self._shapes[name]) > ROW_BLOCK_ELEMENTS:
            read = self.rows(name)
            if read is not None:  # whole, but each stage of the chain holds one block of rows, not a copy
                return _assembled(read, self._shapes[name])
        return self._read(name)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def rows(self, name: str) -> RowReader | None:
        """How to compute rows ``[start, stop)`` of tensor ``name`` alone, or None where only the
        whole tensor can be (a stage that mixes its rows, or a scalar)."""
        if self._rows is None or name not in self._shapes or not self._shapes[name]:
            return None
        return self._rows(name)

    def derive(
        self,
        read: Callable[[str], Tensor],
        *,
        dtypes: Mapping[str, torch.dtype] | None = None,
        rows: Callable[[str], RowReader | None] | None = None,
    ) -> LazyState:
        """A state with the same names and shapes whose tensors ``read`` computes (from this one);
        ``rows`` as `rows` (None: no tensor in blocks)."""
        out = LazyState(
            self._shapes, dtypes if dtypes is not None else self._dtypes, read, aliases=self.aliases, rows=rows
        )
        out.device = self.device
        return out


ROW_BLOCK_ELEMENTS = 1 << 23  # values per block of rows (32 MB in float32)


def _rows_per_block(shape: Sequence[int], elements: int) -> int:
    """Rows of ``shape`` that hold about ``elements`` values (one at least)."""
    return max(1, elements * shape[0] // max(1, math.prod(shape)))


def _assembled(read: RowReader, shape: Sequence[int]) -> Tensor:
    """A whole tensor filled from its blocks of rows. A forward pass needs an embedding or LM head
    whole; built whole through canonical form and a rotation it took three float32 copies at once
    (the peak of a streamed generalized-orthogonal run at the Qwen3-0.6B shape), built from blocks one."""
    step = _rows_per_block(shape, ROW_BLOCK_ELEMENTS)
    out: Tensor | None = None
    for start in range(0, shape[0], step):
        block = read(start, min(start + step, shape[0]))
        if out is None:
            out = torch.empty(tuple(shape), dtype=block.dtype, device=block.device)
        out[start : start + block.shape[0]] = block
        del block
    assert out is not None
    return out


def row_blocks(
    states: Sequence[Mapping[str, Tensor]], name: str, *, elements: int | None = None
) -> Iterator[list[Tensor]]:
    """Tensor ``name`` of every state, as ``[one per state]`` lists of matching row blocks, in
    order: in blocks of about ``elements`` values where it is larger than that and every state
    computes its rows alone (`LazyState.rows`), else whole, in one list. For work that is a sum
    over rows or row-wise (saving, merging, sums over an axis the first one is not): the same
    values as the whole tensors, without holding them (``elements``: `ROW_BLOCK_ELEMENTS`)."""
    elements = ROW_BLOCK_ELEMENTS if elements is None else elements
    shape = shape_of(states[0], name)
    numel = math.prod(shape)
    readers = [s.rows(name) if isinstance(s, LazyState) else None for s in states]
    if numel <= elements or any(r is None for r in readers):
        yield [s[name] for s in states]
        return
    step = _rows_per_block(shape, elements)
    for start in range(0, shape[0], step):
        stop = min(start + step, shape[0])
        yield [r(start, stop) for r in readers if r is not None]


def is_lazy(state: Mapping[str, Tensor]) -> bool:
    return isinstance(state, LazyState)


def shape_of(state: Mapping[str, Tensor], name: str) -> torch.Size:
    """A tensor's shape without computing a lazy one."""
    return state.shape(name) if isinstance(state, LazyState) else state[name].shape


def dtype_of(state: Mapping[str, Tensor], name: str) -> torch.dtype:
    """A tensor's dtype (as read) without computing a lazy one."""
    return state.dtype(name) if isinstance(state, LazyState) else state[name].dtype


ROW_GAP = 64  # stored rows skipped rather than read in two pieces (`gather_rows`)


def rowwise(
    state: LazyState,
    names: Collection[str],
    block: Callable[[str, int, int], Tensor],
    rows: Mapping[str, int] | None = None,
) -> LazyState:
    """``state`` with the tensors ``names`` computed by ``block(name, start, stop)``, their first-axis
    rows ``[start, stop)`` alone (``rows``: their row counts where they change), every other tensor
    as it is: a stage that maps each row on its own, read a block of rows at a time."""
    shapes = {n: tuple(state.shape(n)) for n in state}
    for name, count in (rows or {}).items():
        shapes[name] = (count, *shapes[name][1:])

    def read(name: str) -> Tensor:
        return block(name, 0, shapes[name][0]) if name in names else state[name]

    def reader(name: str) -> RowReader | None:
        return (lambda start, stop: block(name, start, stop)) if name in names else state.rows(name)

    out = LazyState(shapes, {n: state.dtype(n) for n in state}, read, aliases=state.aliases, rows=reader)
    out.device = state.device
    return out


def gather_rows(
    state: LazyState, picks: Mapping[str, Tensor], fill: Callable[[str], Tensor] | None = None
) -> LazyState:
    """``state`` with the first-axis rows of the tensors in ``picks`` chosen anew: row ``r`` of the
    result is row ``picks[name][r]`` of ``state[name]``, or where that is -1 ``fill(name)`` (a row;
    zeros without). Every other tensor as it is. A vocabulary matched by token this way is computed
    a block of rows at a time, each block reading only the rows it needs: a 32,768-row embedding
    re-indexed from a 32,000-row one never holds both whole."""
    return rowwise(
        state,
        picks.keys(),
        lambda name, start, stop: picked_rows(state, name, picks[name][start:stop], fill),
        {name: len(idx) for name, idx in picks.items()},
    )


ROWS_AT_ONCE = 4096  # rows summed at a time by `mean_rows`


def mean_rows(state: Mapping[str, Tensor], name: str, idx: Tensor) -> Tensor:
    """The mean of rows ``idx`` of ``state[name]`` (a float64 sum, ``ROWS_AT_ONCE`` rows read at a
    time; zeros when ``idx`` is empty), in the tensor's dtype."""
    total: Tensor | None = None
    for start in range(0, len(idx), ROWS_AT_ONCE):
        part = picked_rows(state, name, idx[start : start + ROWS_AT_ONCE]).to(torch.float64).sum(0)
        total = part if total is None else total + part
    if total is None:
        return torch.zeros(tuple(shape_of(state, name)[1:]), dtype=dtype_of(state, name))
    return (total / len(idx)).to(dtype_of(state, name))


def picked_rows(
    state: Mapping[str, Tensor], name: str, idx: Tensor, fill: Callable[[str], Tensor] | None = None
) -> Tensor:
    """Rows ``idx`` of ``state[name]`` (-1: ``fill(name)``, else zeros), read in runs of nearby
    rows where ``state`` reads rows alone, else from the whole tensor read once."""
    reader = state.rows(name) if isinstance(state, LazyState) else None
    whole = None if reader is not None else state[name]
    have = idx >= 0
    out: Tensor | None = None
    for lo, hi in _runs(idx[have]):
        src = reader(lo, hi) if reader is not None else whole[lo:hi]  # type: ignore[index]
        if out is None:
            out = torch.zeros((len(idx), *src.shape[1:]), dtype=src.dtype, device=src.device)
        sel = have & (idx >= lo) & (idx < hi)
        out[sel.to(out.device)] = src[(idx[sel] - lo).to(src.device)]
        del src
    if out is None:
        shape = (len(idx), *shape_of(state, name)[1:])
        device = whole.device if whole is not None else getattr(state, "device", torch.device("cpu"))
        out = torch.zeros(shape, dtype=dtype_of(state, name), device=device)
    if fill is not None and not bool(have.all()):
        out[(~have).to(out.device)] = fill(name).to(out)
    return out


def _runs(ids: Tensor) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``ids``, split where more than `ROW_GAP` rows lie between two."""
    if ids.numel() == 0:
        return []
    u = torch.unique(ids).tolist()
    out, lo, last = [], u[0], u[0]
    for i in u[1:]:
        if i - last > ROW_GAP:
            out.append((lo, last + 1))
            lo = i
        last = i
    out.append((lo, last + 1))
    return out


def replaced(state: Mapping[str, Tensor], values: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """``state`` with the tensors of ``values`` in place of its own (no other tensor copied; a lazy
    state stays lazy, and reads a replaced tensor whole)."""
    if not values:
        return state
    if isinstance(state, LazyState):
        rows = state.rows
        return state.derive(
            lambda n: values[n].clone() if n in values else state[n],
            rows=lambda n: None if n in values else rows(n),
        )
    return {**state, **values}


def zeroed(state: Mapping[str, Tensor], names: Collection[str]) -> Mapping[str, Tensor]:
    """``state`` with the tensors ``names`` read as zeros: what a comparison must not read as
    evidence, on both sides alike."""

    def zeros(n: str) -> Tensor:  # on the device the state's tensors are read onto
        if isinstance(state, LazyState):
            return torch.zeros(state.shape(n), dtype=state.dtype(n), device=state.device)
        return torch.zeros_like(state[n])

    return replaced(state, {n: zeros(n) for n in names if n in state})


@overload
def under(state: LazyState, prefix: str) -> LazyState: ...


@overload
def under(state: Mapping[str, Tensor], prefix: str) -> Mapping[str, Tensor]: ...


def under(state: Mapping[str, Tensor], prefix: str) -> Mapping[str, Tensor]:
    """The tensors of ``state`` named ``prefix…``, named without it: a classifier's body as the
    bare model names it, so that two classifiers with other heads are compared on what both have.
    A lazy state stays lazy (nothing read; shapes, dtypes and row blocks from ``state``)."""
    names = {n[len(prefix) :]: n for n in state if n.startswith(prefix)}
    if not isinstance(state, LazyState):
        return {short: state[n] for short, n in names.items()}
    aliases = {
        a[len(prefix) :]: s[len(prefix) :]
        for a, s in state.aliases.items()
        if a.startswith(prefix) and s.startswith(prefix)
    }
    out = LazyState(
        {short: tuple(state.shape(n)) for short, n in names.items()},
        {short: state.dtype(n) for short, n in names.items()},
        lambda short: state[names[short]],
        aliases=aliases,
        rows=lambda short: state.rows(names[short]),
    )
    out.device = state.device
    return out
