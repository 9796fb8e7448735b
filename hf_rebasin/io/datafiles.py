"""The local files a data section names (``data_files``, ``data_dir``), resolved and checked.

Torch-free on purpose: a dry run checks exactly the files a run would read, with the same
messages, before anything heavy is imported; `evaldata` calls the same check when it loads.
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_rebasin.core.errors import DataError, RebasinUserError
from hf_rebasin.io.files import file_kind, probe

__all__ = ["check_files", "has_glob", "is_folder"]


def has_glob(s: str) -> bool:
    """Whether a ``data_files`` entry is a glob pattern rather than a path."""
    return any(c in s for c in "*?[")


def _resolve_path(entry: Any, base_dir: Path, key: str) -> str:
    """``entry`` made absolute (relative to ``base_dir``); it, or its glob, must match something."""
    if not isinstance(entry, (str, Path)):
        raise DataError(f"`{key}` entries must be paths, not {entry!r}")
    path = Path(entry).expanduser()
    if not path.is_absolute():
        path = base_dir.absolute() / path
    if has_glob(str(entry)):
        found = glob.glob(str(path), recursive=True)
        if not found:
            raise DataError(f"{key} pattern {str(entry)!r} matches no file (looked for {path})")
        for match in found:
            _refuse_special(Path(match), key)
    elif _probe(path, key) is None and not path.is_symlink():
        raise DataError(f"{key} {str(entry)!r} not found (looked for {path}){_siblings(path)}")
    else:
        _refuse_special(path, key)
    return str(path)


def _probe(path: Path, key: str) -> os.stat_result | None:
    """`probe` for a data path: a name too long, no permission or a link loop is a `DataError`, so
    that the data section's field names it as it names a missing file."""
    try:
        return probe(path)
    except RebasinUserError as e:
        raise DataError(f"{key} {e}") from None


def is_folder(path: Path, key: str = "dataset") -> bool:
    """Whether ``path`` (a ``dataset`` that may be a local folder) is a folder; a path the file
    system refuses (a name too long, no permission) is a `DataError`, not an internal OSError."""
    info = _probe(path, key)
    return info is not None and stat.S_ISDIR(info.st_mode)


def _refuse_special(path: Path, key: str) -> None:
    """A data file that is a FIFO or a device (reading blocks or never ends), or a link loop or a
    link to nothing, refused before any reader opens it; folders pass (``data_dir``)."""
    info = _probe(path, key)  # a name too long, no permission, a link loop: in words
    if info is None:
        link = " (a link to nothing)" if path.is_symlink() else ""
        raise DataError(f"{key} {str(path)!r} cannot be read: it does not exist{link}")
    mode = info.st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise DataError(
            f"{key} {str(path)!r} is a {file_kind(mode)}, not a regular file: reading it could block or never end"
        )


def _resolve_files(data_files: Any, base_dir: Path) -> str | list[str] | dict[str, list[str]]:
    """``data_files`` (a path, a list, or {split: paths}) with every path absolute and existing."""
    key = "data file"
    if isinstance(data_files, (str, Path)):
        return _resolve_path(data_files, base_dir, key)
    if isinstance(data_files, Mapping) and data_files:
        return {
            str(split): [_resolve_path(f, base_dir, key) for f in ([v] if isinstance(v, (str, Path)) else v)]
            for split, v in data_files.items()
        }
    if isinstance(data_files, Sequence) and data_files:
        return [_resolve_path(f, base_dir, key) for f in data_files]
    raise DataError(f"`data_files` must be a path, a non-empty list of paths or {{split: paths}}, not {data_files!r}")


def check_files(data_files: Any, data_dir: Any, base_dir: Path) -> dict[str, Any]:
    """``{"data_files": ..., "data_dir": ...}`` (those given) made absolute; each must exist.

    A glob must match at least one file. A dry run calls this too, so it finds exactly the
    missing files a run would.
    """
    kwargs: dict[str, Any] = {}
    if data_files is not None:
        kwargs["data_files"] = _resolve_files(data_files, Path(base_dir))
    if data_dir is not None:
        kwargs["data_dir"] = _resolve_path(data_dir, Path(base_dir), "data_dir")
    return kwargs


def _siblings(path: Path, limit: int = 10) -> str:
    """``"; <folder> holds: a, b, …"`` so a typo is visible in the message."""
    folder = path.parent
    if not folder.is_dir():
        return f"; the folder {folder} does not exist"
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return f"; the folder {folder} is empty"
    more = f", … ({len(names) - limit} more)" if len(names) > limit else ""
    return f"; {folder} holds: {', '.join(names[:limit])}{more}"
