"""The one gate every file of a model folder passes before a byte of it is read (torch-free).

The order is the rule (docs/safety.md): a path that a recipe, a shard index or a config names is
first resolved and confined to its model's folder (or, for a Hub cache snapshot, to that
repository's cache folder, whose blobs the snapshot's links point at), then found to be a regular
file (a FIFO blocks its reader forever, a device never ends) of a sane size, and a JSON file is
then parsed into its typed schema (`schemas`). Only then may the memory estimate, the dry run or
a loader use it. `check_folder` passes every file a run reads through the gate at once; the
readers here (`read_json`, `read_config`, `read_header`) pass each file through it again, so a
module that reads a file without the plan's check is still safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import itertools
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import TypeAdapter, ValidationError

from hf_rebasin.core.errors import (
    CheckpointError,
    ConfigError,
    FileFormatError,
    ModelNotFoundError,
    UnreadableFileError,
    UserPathError,
)
from hf_rebasin.io.schemas import SAFETENSORS_DTYPES, SCHEMAS, HeaderEntry, size_problems

__all__ = [
    "MAX_HEADER",
    "SafetensorsHeader",
    "TensorHeader",
    "checked",
    "file_kind",
    "model_root",
    "path_reason",
    "probe",
    "read_config",
    "read_header",
    "read_json",
    "resolve_folder",
]

MIB = 1024 * 1024
JSON_LIMIT = 16 * MIB  # a config, an index entry list, a processor config: far below this
_JSON_LIMITS = {"tokenizer.json": 256 * MIB, "model.safetensors.index.json": 64 * MIB}
_JSON_LIMITS["pytorch_model.bin.index.json"] = 64 * MIB
SUPPORT_LIMIT = 4096 * MIB  # a file an output carries byte for byte (tokenizer.model, a licence text)
MAX_HEADER = 100_000_000  # bytes: a larger safetensors header is a damaged file, not a model
_MAX_JSON_DEPTH = 200  # nesting no file of ours needs; deeper JSON exhausts Python's stack


def _shown(path: Path) -> str:
    return repr(str(path))


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in (
        (stat.S_ISDIR, "folder"),
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "regular file" if stat.S_ISREG(mode) else "special file"


def _clipped(path: Path | str, size: int = 120) -> str:
    """A path as messages quote it, its middle cut when long (a 300-character name fills no screen)."""
    text = str(path)
    return repr(text if len(text) <= size else f"{text[: size // 2]}…{text[-(size // 3) :]}")


def _part_through_file(path: Path) -> Path | None:
    """The first folder on the way to ``path`` that is a file (``a/config.json`` of ``a/config.json/x``)."""
    for parent in reversed(Path(path).parents):
        with contextlib.suppress(OSError):
            if not stat.S_ISDIR(os.stat(parent).st_mode):
                return parent
    return None


def path_reason(path: Path | str, e: OSError | ValueError) -> str:
    """Why the file system refused to look ``path`` up, in words (what the user can change)."""
    code = getattr(e, "errno", None)
    if isinstance(e, ValueError):  # os.stat: "embedded null byte"
        return "the path contains a NUL character, which no file name may hold"
    if code == errno.ENAMETOOLONG:
        longest = max(Path(path).parts, key=lambda p: len(os.fsencode(p)), default="")
        return (
            f"the name is longer than the file system allows (its longest part has {len(os.fsencode(longest))} "
            f"bytes, the whole path {len(os.fsencode(str(path)))}); give a shorter path"
        )
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied: a folder on the way cannot be read or entered by this user"
    if code == errno.ENOTDIR:
        part = _part_through_file(Path(path))
        return f"{_clipped(part) if part else 'a part of the path'} is a file, not a folder"
    return f"the file system refused it ({e.strerror or e})"


def probe(path: Path | str, where: str | None = None) -> os.stat_result | None:
    """What is at a path the user gave, links followed: its ``os.stat``, or None when nothing is
    there (a link to nothing included). Any other refusal of the file system (a name too long,
    no permission, a file on the way, a link loop) is a user error naming ``where`` and the
    reason, not an OSError that would reach the user as an internal error."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise _refused(Path(path), e, where=where) from None


def _refused(path: Path, e: Exception, hint: str = "", *, where: str | None = None) -> Exception:
    """The user error for a path the file system refused (`os.stat`, `Path.resolve`): a link loop
    (Python 3.11's resolve raises RuntimeError, the rest ELOOP) or any other reason, in words."""
    head = f"{where}: " if where else ""
    if isinstance(e, RuntimeError) or getattr(e, "errno", None) == errno.ELOOP:
        return UnreadableFileError(
            f"{head}{_shown(path)} is a symbolic link loop (or a chain of links too long to follow){hint}"
        )
    assert isinstance(e, (OSError, ValueError))
    return UserPathError(f"{head}{_clipped(path)} cannot be used: {path_reason(path, e)}")


def resolve_folder(folder: Path | str) -> Path:
    """``folder`` with every link resolved; a link loop or a missing folder is a user error."""
    path = Path(folder)
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        raise ModelNotFoundError(f"the model folder {_shown(path)} does not exist") from None
    except (RuntimeError, OSError) as e:
        raise _refused(path, e, "; point it at the real model folder") from None
    if not real.is_dir():
        raise ModelNotFoundError(f"{_shown(path)} is not a folder; give the folder that holds config.json")
    return real


def model_root(folder: Path) -> Path:
    """The folder a model's files must stay inside: ``folder`` itself, or for a Hub cache snapshot
    (``…/models--org--name/snapshots/<commit>``) its repository's cache folder, whose ``blobs/``
    the snapshot's files link to."""
    folder = Path(folder)
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith(("models--", "datasets--")):
        return folder.parent.parent
    return folder


def checked(path: Path | str, root: Path | None = None, *, limit: int | None = None) -> Path:
    """``path`` resolved, inside ``root`` (default: the model root of its folder), a regular file of
    at most ``limit`` bytes: the path that may be opened. Nothing is opened here."""
    path = Path(path)
    root = model_root(resolve_folder(path.parent)) if root is None else root
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        link = f" (a link to {os.readlink(path)!r}, which does not exist)" if path.is_symlink() else ""
        raise ModelNotFoundError(f"{_shown(path)} does not exist{link}") from None
    except (RuntimeError, OSError) as e:
        raise _refused(path, e) from None
    if not real.is_relative_to(root):
        raise UnreadableFileError(
            f"{_shown(path)} leads outside its model folder {_shown(root)} (it is a link to {_shown(real)}); "
            "hf-rebasin reads only files inside a model's folder: copy the file into the folder"
        )
    info = os.stat(real)
    _refuse_kind(path, info, limit)
    return real


def _refuse_kind(path: Path, info: os.stat_result, limit: int | None) -> None:
    kind = file_kind(info.st_mode)
    if kind != "regular file":
        raise UnreadableFileError(
            f"{_shown(path)} is a {kind}, not a regular file: reading it could block or never end; "
            "put the real file there"
        )
    if limit is not None and info.st_size > limit:
        raise UnreadableFileError(
            f"{_shown(path)} is {info.st_size:,} bytes; hf-rebasin reads a {path.name} of at most {limit:,} bytes "
            "(no model needs more): is it the right file?"
        )


@contextlib.contextmanager
def _opened(real: Path, shown: Path, limit: int | None) -> Iterator[BinaryIO]:
    """A file that passed `checked`, opened without blocking and checked again on the open
    descriptor, so a file swapped for a FIFO in between is still refused."""
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        _refuse_kind(shown, os.fstat(f.fileno()), limit)
        yield f


def _error_class(name: str) -> type[Exception]:
    if name == "config.json":
        return ConfigError
    if name.endswith((".index.json", ".safetensors")) or name.startswith("adapter_"):
        return CheckpointError
    return FileFormatError


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _depth(raw: bytes) -> int:
    """How deep a JSON text nests, counted on its brackets outside strings, without parsing it
    (C speed: a regular expression and a running sum, 0.2 s for a 6 MB tokenizer.json)."""
    import numpy as np

    skeleton = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not skeleton:
        return 0
    steps = np.frombuffer(skeleton, dtype=np.uint8)
    return int(np.cumsum(np.where((steps == 0x5B) | (steps == 0x7B), 1, -1)).max())


def parse_json(raw: bytes, path: Path) -> Any:
    """``raw`` as JSON, or an error naming ``path``."""
    error = _error_class(path.name)
    if raw.count(b"[") + raw.count(b"{") > _MAX_JSON_DEPTH and _depth(raw) > _MAX_JSON_DEPTH:
        raise error(f"{_shown(path)} nests JSON more than {_MAX_JSON_DEPTH} levels deep, which no model file does")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise error(f"{_shown(path)} is not valid JSON: {e}") from None


@functools.cache
def _adapter(schema: Any) -> TypeAdapter[Any]:
    return TypeAdapter(schema)


_JSON_KINDS = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
_JSON_KINDS |= {bool: "true or false", type(None): "null"}


def _key_path(data: Any, loc: tuple[Any, ...]) -> list[str]:
    """The keys of ``loc`` that lead through ``data`` (pydantic adds the names of union members
    and ``[key]`` markers, which no file writes)."""
    out: list[str] = []
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        elif isinstance(data, dict) and isinstance(part, str) and part != "[key]" and part.isidentifier():
            out.append(part)  # a required key the file lacks
            break
        else:
            continue
        out.append(str(part))
    return out


def _validation_message(e: ValidationError, data: Any) -> str:
    """The first problem of a failed validation: the key path as the file writes it, what is wrong."""
    err = e.errors(include_url=False)[0]
    keys = _key_path(data, tuple(err["loc"]))
    given = repr(err.get("input"))
    given = given if len(given) <= 80 else given[:77] + "..."
    if not keys:
        return f"the file must hold a JSON object; it holds {_JSON_KINDS.get(type(data), type(data).__name__)}"
    what = "the key " if "[key]" in err["loc"] else ""
    return f"`{'.'.join(keys)}`: {what}{err['msg'][:1].lower()}{err['msg'][1:]}; given {given}"


def validate(data: Any, path: Path, schema: Any) -> Any:
    """``data`` of the file ``path`` checked against ``schema``; an error names the file and key."""
    try:
        _adapter(schema).validate_python(data)
    except ValidationError as e:
        raise _error_class(path.name)(f"{_shown(path)}: {_validation_message(e, data)}") from None
    return data


# files that passed their schema or header check: resolved path -> (size, mtime, inode) when they did;
# a run passes a folder through the gate more than once (plan, load), and a 30 MB tokenizer.json
# need not be parsed again while it is the same file
_PASSED: dict[Path, tuple[int, int, int]] = {}
_HEADERS: dict[Path, tuple[tuple[int, int, int], SafetensorsHeader]] = {}


def _stamp(info: os.stat_result) -> tuple[int, int, int]:
    """What says a file is the one that passed: its size, modification time and inode."""
    return (info.st_size, info.st_mtime_ns, info.st_ino)


def read_json(path: Path | str, root: Path | None = None, *, schema: Any = "auto", limit: int | None = None) -> Any:
    """A JSON file of a model folder through the gate, parsed and checked against its schema
    (by file name; ``schema=None``: any JSON)."""
    path = Path(path)
    limit = _JSON_LIMITS.get(path.name, JSON_LIMIT) if limit is None else limit
    real = checked(path, root, limit=limit)
    with _opened(real, path, limit) as f:
        data = parse_json(f.read(limit + 1), path)
        stamp = _stamp(os.fstat(f.fileno()))
    schema = SCHEMAS.get(path.name) if schema == "auto" else schema  # None: no loader reads it, any JSON
    if schema is None:
        return data
    validate(data, path, schema)
    _PASSED[real] = stamp
    return data


def check_json(path: Path, root: Path | None = None) -> None:
    """`read_json` for its checks only: a file that passed them unchanged is not parsed again
    (confinement and kind are checked every time)."""
    real = checked(path, root, limit=_JSON_LIMITS.get(path.name, JSON_LIMIT))
    if _PASSED.get(real) != _stamp(os.stat(real)):
        read_json(path, root)


def read_config(folder: Path | str) -> dict[str, Any]:
    """config.json of ``folder`` through the gate: an object with typed sizes, none of which is
    beyond what any machine could hold ("config.json says n_embd = 1000000")."""
    path = Path(folder) / "config.json"
    data: dict[str, Any] = read_json(path)
    problems = size_problems(data)
    if problems:
        raise ConfigError(f"{_shown(path)} says {problems[0]}: no machine could hold such a model")
    return data


@dataclass(frozen=True)
class TensorHeader:
    """One tensor of a safetensors file as its checked header states it (offsets from the data start)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header, checked: every tensor's bytes inside the file, one tensor per
    byte, each span the size its dtype and shape make. ``start``: where the data begins."""

    path: Path
    start: int
    tensors: dict[str, TensorHeader]
    metadata: dict[str, str]


def read_header(path: Path | str, root: Path | None = None) -> SafetensorsHeader:
    """The header of a safetensors file through the gate, typed and checked against the file's
    size before any tensor is read (a tensor of 10¹² elements in an 8 MB file is the header's lie)."""
    path = Path(path)
    real = checked(path, root)
    with _opened(real, path, None) as f:
        info = os.fstat(f.fileno())
        known = _HEADERS.get(real)
        if known is not None and known[0] == _stamp(info):
            return dataclasses.replace(known[1], path=path)
        header = _read_header(path, f, info.st_size)
    if len(_HEADERS) > 1024:
        _HEADERS.clear()
    _HEADERS[real] = (_stamp(info), header)
    return header


def _read_header(path: Path, f: BinaryIO, size_on_disk: int) -> SafetensorsHeader:
    prefix = f.read(8)
    if len(prefix) < 8:
        raise CheckpointError(f"{_shown(path)} is not a safetensors file: it has {len(prefix)} bytes")
    length = int.from_bytes(prefix, "little")
    if length > min(MAX_HEADER, size_on_disk - 8):
        raise CheckpointError(
            f"{_shown(path)} is not a readable safetensors file: its header claims {length:,} bytes of a "
            f"{size_on_disk:,}-byte file (at most {MAX_HEADER:,})"
        )
    data = parse_json(f.read(length), path)
    if not isinstance(data, dict):
        kind = _JSON_KINDS.get(type(data), type(data).__name__)
        raise CheckpointError(f"{_shown(path)}: the safetensors header must be a JSON object; it is {kind}")
    metadata = data.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{_shown(path)}: the header's `__metadata__` must map names to strings")
    tensors = {name: _tensor(path, name, info) for name, info in data.items()}
    _check_spans(path, tensors, size_on_disk - 8 - length)
    return SafetensorsHeader(path, 8 + length, tensors, metadata)


def _tensor(path: Path, name: str, info: Any) -> TensorHeader:
    try:
        entry = HeaderEntry.model_validate(info)
    except ValidationError as e:
        raise CheckpointError(f"{_shown(path)}: tensor {name!r}: {_validation_message(e, info)}") from None
    begin, end = entry.data_offsets
    return TensorHeader(entry.dtype, tuple(entry.shape), begin, end)


def _check_spans(path: Path, tensors: dict[str, TensorHeader], data_bytes: int) -> None:
    """Each tensor's span holds exactly its values, inside the file, and no two spans overlap."""
    for name, t in tensors.items():
        need = (t.numel * SAFETENSORS_DTYPES[t.dtype] + 7) // 8
        if t.end - t.begin != need or t.end > data_bytes:
            raise CheckpointError(
                f"{_shown(path)}: tensor {name!r} has shape {list(t.shape)} ({t.numel:,} values of {t.dtype}, "
                f"{need:,} bytes) but its data_offsets {[t.begin, t.end]} span {t.end - t.begin:,} bytes of the "
                f"file's {data_bytes:,}: the header does not describe this file"
            )
    spans = sorted((t.begin, t.end, name) for name, t in tensors.items() if t.end > t.begin)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise CheckpointError(f"{_shown(path)}: tensors {first!r} and {second!r} share bytes (overlapping data)")
