"""Tensors read from disk one at a time, and written to disk one at a time.

`CheckpointSource` (a `hf_rebasin.core.lazy.LazyState`: a state dict that holds nothing) reads a model's safetensors files (sharded with their
index) with plain file reads, no memory map, so a pass over a 7B model costs its largest tensor
in memory, not the model. Derived states (a canonical form, a transformed model, a merge) are
`LazyState`s over other `LazyState`s, so a whole run of a data-free strategy flows tensor by
tensor from the input files into `write_shards`, which writes safetensors shards with the index
`save_pretrained` writes.

The safetensors format is small enough to read and write here: 8 bytes of header length, a JSON
header of names, dtypes, shapes and byte ranges, then the bytes. Torch only: no transformers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import CheckpointError
from hf_rebasin.core.lazy import WORK_DTYPE, LazyState, RowReader, give_back_freed
from hf_rebasin.io.files import read_header

__all__ = [
    "DTYPES",
    "CheckpointSource",
    "SafetensorsEntry",
    "StackedKeys",
    "read_safetensors_header",
    "write_safetensors",
]

# safetensors dtype names
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class SafetensorsEntry:
    """Where one tensor's bytes are: file, absolute byte offset, length, dtype and shape."""

    __slots__ = ("dtype", "file", "nbytes", "offset", "shape")

    def __init__(self, file: Path, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.file, self.offset, self.nbytes, self.dtype, self.shape = file, offset, nbytes, dtype, shape


def read_safetensors_header(path: Path) -> dict[str, SafetensorsEntry]:
    """Every tensor of a safetensors file, from its header alone (no weight is read), through the
    gate (`files.read_header`: confined, a regular file, spans checked against the file)."""
    header = read_header(path)
    out: dict[str, SafetensorsEntry] = {}
    for name, t in header.tensors.items():
        dtype = DTYPES.get(t.dtype)
        if dtype is None:
            raise CheckpointError(f"{str(path)!r}: tensor {name!r} has a dtype hf-rebasin cannot read: {t.dtype}")
        out[name] = SafetensorsEntry(Path(path), header.start + t.begin, t.end - t.begin, dtype, t.shape)
    return out


def _read_entry(entry: SafetensorsEntry) -> Tensor:
    buf = bytearray(entry.nbytes)
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.offset)
        view = memoryview(buf)
        done = 0
        while done < entry.nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{str(entry.file)!r} ends before the tensor bytes its header promises")
            done += got
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    return torch.frombuffer(buf, dtype=entry.dtype).reshape(entry.shape)


@dataclasses.dataclass(frozen=True)
class StackedKeys:
    """A model tensor that transformers assembles while loading from one checkpoint tensor per
    expert: ``parts[p][j]`` is the key of part ``p`` of expert ``j`` (a legacy Mixtral's ``w1`` and
    ``w3``, gate and up). Expert ``j`` of the model's ``[E, rows, ...]`` tensor is its parts
    concatenated along their first axis, in order (transformers' ``MergeModulelist`` over the
    experts, then ``Concatenate`` of the parts)."""

    parts: tuple[tuple[str, ...], ...]

    @property
    def keys(self) -> list[str]:
        return [key for part in self.parts for key in part]


class CheckpointSource(LazyState):
    """A model's tensors by the names its module uses, read from its safetensors files on demand.

    Floating tensors come as float32 (what every computation here runs in, like a model loaded
    with ``dtype=float32``); ``stored_dtypes`` keeps what the files hold. ``names`` maps a model
    name to the checkpoint key holding it (transformers may rename keys when it loads); ``aliases``
    maps a tied name to the name that holds the data (a tied LM head is stored once); ``stacks``
    the model tensors stored one expert at a time (`StackedKeys`), assembled when read, one stacked
    tensor in memory. Tensors are read on the CPU and handed over on ``device`` (a CUDA device:
    every step after the read runs there).
    """

    def __init__(
        self,
        folder: Path,
        entries: Mapping[str, SafetensorsEntry],
        names: Mapping[str, str],
        *,
        aliases: Mapping[str, str] | None = None,
        order: Sequence[str] | None = None,
        device: torch.device | None = None,
        stacks: Mapping[str, StackedKeys] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.device = device or torch.device("cpu")  # where tensors go once read: the run's device
        aliases = dict(aliases or {})
        stacks = dict(stacks or {})
        self._where: dict[str, SafetensorsEntry] = {}
        self._stacks: dict[str, list[list[SafetensorsEntry]]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        self.stored_dtypes: dict[str, torch.dtype] = {}
        for name in order if order is not None else list(names) + list(aliases):
            stack = stacks.get(name) or stacks.get(aliases.get(name, ""))
            if stack is not None:
                parts = [[entries[key] for key in part] for part in stack.parts]
                first = parts[0][0]
                self._stacks[name] = parts
                shapes[name] = (len(parts[0]), sum(p[0].shape[0] for p in parts), *first.shape[1:])
                self.stored_dtypes[name] = first.dtype
                continue
            key = names.get(name) or names[aliases[name]]
            self._where[name] = entries[key]
            shapes[name] = self._where[name].shape
            self.stored_dtypes[name] = self._where[name].dtype
        dtypes = {n: WORK_DTYPE if d.is_floating_point else d for n, d in self.stored_dtypes.items()}
        super().__init__(shapes, dtypes, self._load, aliases=aliases, rows=self._row_reader)

    def _load(self, name: str) -> Tensor:
        if name in self._stacks:
            return self._experts(name, 0, self._shapes[name][0], work=True)
        return self._work(self.stored(name))

    def _work(self, t: Tensor) -> Tensor:
        t = t.to(self.device)
        return t.to(WORK_DTYPE) if t.is_floating_point() else t

    def _experts(self, name: str, start: int, stop: int, *, work: bool) -> Tensor:
        """Experts ``[start, stop)`` of a stacked tensor, filled part by part from their entries
        (float32 on the run's device when ``work``, else as stored): one expert's part is read at
        a time, into the one tensor returned."""
        parts = self._stacks[name]
        stored = parts[0][0].dtype
        dtype = WORK_DTYPE if work and stored.is_floating_point else stored
        out = torch.empty((stop - start, *self._shapes[name][1:]), dtype=dtype)
        for j in range(start, stop):
            row = 0
            for part in parts:
                piece = _read_entry(part[j])
                out[j - start, row : row + piece.shape[0]] = piece
                row += piece.shape[0]
                del piece
        return out.to(self.device) if work else out

    def _row_reader(self, name: str) -> RowReader:
        """Rows of a stored tensor: their bytes are contiguous in the file, read alone (the experts
        of a stacked tensor: theirs)."""
        if name in self._stacks:
            return lambda start, stop: self._experts(name, start, stop, work=True)
        entry = self._where[name]
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0

        def read(start: int, stop: int) -> Tensor:
            part = SafetensorsEntry(
                entry.file,
                entry.offset + start * row_bytes,
                (stop - start) * row_bytes,
                entry.dtype,
                (stop - start, *entry.shape[1:]),
            )
            return self._work(_read_entry(part))

        return read

    def stored(self, name: str) -> Tensor:
        """Tensor ``name`` as the file stores it (bf16 stays bf16): for checks that need no float32."""
        if name in self._stacks:
            return self._experts(name, 0, self._shapes[name][0], work=False)
        return _read_entry(self._where[name])

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name`` (a stacked tensor: its first expert's)."""
        if name in self._stacks:
            return self._stacks[name][0][0].file
        return self._where[name].file

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (each stored tensor once)."""
        entries = [*self._where.values(), *(e for parts in self._stacks.values() for p in parts for e in p)]
        seen = {(e.file, e.offset): e.nbytes for e in entries}
        return sum(seen.values())


def checkpoint_entries(files: Sequence[Path]) -> dict[str, SafetensorsEntry]:
    """Every tensor of a (sharded) safetensors checkpoint by its key."""
    out: dict[str, SafetensorsEntry] = {}
    for f in files:
        out.update(read_safetensors_header(f))
    return out


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _header(entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        n = _nbytes(shape, dtype)
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data start 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    path: Path,
    entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    produce: Callable[[str], Tensor | Iterable[Tensor]],
    *,
    done: Callable[[str], None] | None = None,
) -> None:
    """A safetensors file of ``entries`` (name, shape, dtype written), each tensor computed by
    ``produce(name)`` just before its bytes are written and dropped after: the header is known
    from the shapes, so nothing waits in memory. ``produce`` may give a tensor or its blocks of
    rows in order (`row_blocks`), each cast and written as it comes. A tensor whose shape differs
    from its entry is a bug, raised before a wrong byte count could corrupt the file."""
    with open(path, "wb") as f:
        f.write(_header(entries))
        for name, shape, dtype in entries:
            made = produce(name)
            blocks = [made] if isinstance(made, Tensor) else made
            rows = 0
            for block in blocks:
                if tuple(block.shape[1:]) != tuple(shape[1:]) or (isinstance(made, Tensor) and block.shape != shape):
                    raise AssertionError(f"{name}: produced shape {tuple(block.shape)}, planned {tuple(shape)}")
                rows += block.shape[0] if block.dim() else 1
                t = block.detach().to(device="cpu", dtype=dtype).contiguous()
                del block
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                del t
            if shape and rows != shape[0]:
                raise AssertionError(f"{name}: produced {rows} rows, planned {shape[0]}")
            del made, blocks
            if _nbytes(shape, torch.float32) >= GIVE_BACK_BYTES:
                give_back_freed()  # a large tensor's float32 temporaries: not kept in the heap for the next
            if done is not None:
                done(name)
        f.flush()
        os.fsync(f.fileno())


GIVE_BACK_BYTES = 1 << 28  # float32 bytes of a tensor after whose writing the freed heap is given back
