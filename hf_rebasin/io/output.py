"""Writing a result folder: nothing half-written, nothing overwritten unasked, no input ever touched.

Everything goes into a temporary folder beside the target and is renamed into place only when
complete. An output that is, contains or lies inside an input is refused before any work; an
existing target is replaced only with ``output.overwrite: true`` and only when it is a previous
hf-rebasin output (it holds ``rebasin.json``) or empty. The replace is two renames (the old folder
aside as ``.NAME.old-*``, the new one in): while a run holds the output (a lock file
``.NAME.lock`` beside it) no other run can write there, and the next run cleans up after one that
was killed (restores ``.NAME.old-*``, removes ``.NAME.tmp-*``).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from hf_rebasin.core.errors import OutputBusyError, OutputExistsError, OutputPathError, OutputWriteError
from hf_rebasin.io.layout import RECORD

_AFFIX = 16  # bytes the temporary / aside / lock names add to the target's name (".NAME.tmp-XXXXXXXX")

__all__ = [
    "RECORD",
    "OutputInterrupted",
    "check_inputs",
    "check_output",
    "check_output_path",
    "claim_output",
    "output_folder",
    "recover",
    "write_json",
    "write_text",
]


Inputs = Iterable[tuple[str, Path]]
"""``(label, path)`` of what a run reads: model folders, adapter, data files, the recipe file."""


class OutputInterrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM while a run held its output; the message says what is on disk."""


# ---------------------------------------------------------------------------------------------
# Checks (plan time: before anything is loaded, also in a dry run)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def check_inputs(target: Path, inputs: Inputs, where: str = "`output.dir`") -> None:
    """Refuse an output that is, contains or is inside an input (real paths: symlinks followed).

    A run replaces its output folder as a whole, so any overlap would destroy what it reads;
    refused whatever ``overwrite`` says.
    """
    out = _real(target)
    if out.parent == out:  # `/`: refused by check_output_path, with its own message
        return
    shown = str(Path(target).expanduser().absolute())
    for label, path in inputs:
        real = _real(path)
        if out == real:
            how = "is"
        elif out in real.parents:
            how = "already exists and contains"
        elif real in out.parents:
            how = "is inside"
        else:
            continue
        raise OutputPathError(
            f"{where}: the output folder {shown!r} {how} {label} ({str(path)!r}); the output is replaced as a "
            "whole, so it must be a new folder outside every input (models, adapter, data files, the recipe). "
            "Choose another folder, e.g. one beside the models"
        )


def _limits(folder: Path) -> tuple[int, int]:
    """(longest name, longest path) in bytes on the file system of ``folder``."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # pragma: no cover - no pathconf (Windows)
        return 255, 4096


def _clip(text: str, size: int = 40) -> str:
    return text if len(text) <= size else text[: size - 1] + "…"


def check_output_path(target: Path, where: str = "`output.dir`") -> Path:
    """``target`` absolute, refused when no folder can be made there: ``/``, under a file, a name
    or path too long, or a parent that does not accept new folders (``/proc``, read-only).

    Found at plan time, so that a run never fails only when it saves.
    """
    target = Path(target).expanduser().absolute()
    shown = str(target)
    if target.parent == target or not target.name:
        raise OutputPathError(
            f"{where}: {shown!r} is the root of the file system, not a folder that can be replaced; "
            "choose a new folder, e.g. ./merged"
        )
    existing: Path | None = None
    for parent in target.parents:
        try:
            mode = parent.stat().st_mode
        except OSError:  # missing, under a file (ENOTDIR) or too long: look further up
            continue
        if not stat.S_ISDIR(mode):
            raise OutputPathError(
                f"{where}: {shown!r} is under {str(parent)!r}, which is a file, not a folder; "
                "choose an output folder outside it"
            )
        existing = parent
        break
    name_max, path_max = _limits(existing or Path("/"))
    long = [p for p in target.parts if len(os.fsencode(p)) > name_max]
    if long or len(os.fsencode(target.name)) + _AFFIX > name_max:
        name = long[0] if long else target.name
        raise OutputPathError(
            f"{where}: the name {_clip(name)!r} in {_clip(shown, 80)!r} is too long ({len(os.fsencode(name))} bytes; "
            f"this file system allows {name_max}, and hf-rebasin adds up to {_AFFIX} for its temporary folder): "
            "choose a shorter name"
        )
    if len(os.fsencode(shown)) + _AFFIX > path_max:
        raise OutputPathError(
            f"{where}: the path {_clip(shown, 80)!r} is too long ({len(os.fsencode(shown))} bytes; at most "
            f"{path_max - _AFFIX} here): choose a shorter path"
        )
    if existing is not None:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".hf-rebasin-probe-", dir=existing))
        except OSError as e:
            raise OutputPathError(
                f"{where}: {shown!r} cannot be written: {str(existing)!r} does not accept new folders "
                f"({e.strerror or e}); choose a folder you can write to"
            ) from None
    return target


def _is_output(folder: Path) -> bool:
    """A previous hf-rebasin output (holds rebasin.json) or an empty folder: nothing of the user's to lose."""
    return (folder / RECORD).is_file() or not any(folder.iterdir())


def check_output(target: Path, overwrite: bool, *, inputs: Inputs = (), where: str = "`output.dir`") -> Path:
    """``target`` as an absolute path, refused when it overlaps an input, cannot be written, or
    exists and may not be replaced (``overwrite`` off, or not an hf-rebasin output).

    Called before any work is done, so that a long run never ends by refusing to save.
    """
    check_inputs(target, inputs, where)
    target = check_output_path(target, where)
    if not target.exists():
        return target
    if not target.is_dir():
        raise OutputExistsError(f"{where}: output {str(target)!r} is a file, not a folder; choose another folder")
    ours = _is_output(target)
    if not overwrite:
        hint = (
            "or set `output.overwrite: true` to replace it"
            if ours
            else "(it is not an hf-rebasin output: it has no rebasin.json, so `overwrite` would not replace it either)"
        )
        raise OutputExistsError(
            f"{where}: output folder {str(target)!r} already exists; choose another folder (`output.dir` or --output), "
            f"remove it, {hint}"
        )
    if not ours:
        raise OutputExistsError(
            f"{where}: output folder {str(target)!r} already exists and is not an hf-rebasin output (no rebasin.json); "
            "`output.overwrite: true` replaces only a previous hf-rebasin output (or an empty folder), never other "
            "files. Choose another folder, or remove this one yourself"
        )
    return target


# ---------------------------------------------------------------------------------------------
# Holding an output: the lock, and recovery after a killed run


@dataclass
class _Claim:
    target: Path
    existed: bool
    written: bool = False
    notes: list[str] = field(default_factory=list)


_CLAIMS: dict[Path, _Claim] = {}  # outputs this process holds (output_folder joins the claim)


def _lock(target: Path, where: str) -> FileLock:
    """Hold ``.NAME.lock`` beside ``target`` without waiting (filelock: an OS lock, gone with the
    process that held it; the file itself is removed on release)."""
    path = target.parent / f".{target.name}.lock"
    lock = FileLock(path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise OutputBusyError(
            f"{where}: another hf-rebasin run is writing {str(target)!r} (it holds {str(path)!r}); wait for it "
            "to finish or choose another output folder"
        ) from None
    return lock


def _unlock(lock: FileLock) -> None:
    """Remove the lock file while still holding it, then release: a run that opened it meanwhile
    finds its inode unlinked once it gets the lock and takes a new file (filelock checks), so no
    ``.NAME.lock`` is left beside the output."""
    try:
        os.unlink(lock.lock_file)
    except FileNotFoundError:
        pass
    lock.release()


def _leftovers(target: Path, kind: str) -> list[Path]:
    prefix = f".{target.name}.{kind}-"
    try:
        found = [p for p in target.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()]
    except OSError:
        return []
    return sorted(found, key=lambda p: p.lstat().st_ctime, reverse=True)  # a rename sets ctime: newest first


def recover(target: Path) -> list[str]:
    """Clean up after runs killed while writing ``target``; one note per thing done.

    ``.NAME.tmp-*`` (an unfinished result) is removed; ``.NAME.old-*`` (the previous result, moved
    aside for the replace) goes back to NAME when NAME is missing (the run died between the two
    renames), else it is a stale copy and is removed. Call it only while holding the lock.
    """
    target = Path(target)
    notes: list[str] = []
    for tmp in _leftovers(target, "tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
        notes.append(f"removed {tmp}, the unfinished output of an hf-rebasin run that was killed")
    for old in _leftovers(target, "old"):
        if not _is_output(old):  # not what hf-rebasin moves aside: leave it
            continue
        if not target.exists():
            old.rename(target)
            notes.append(
                f"restored {target} from {old.name}: an hf-rebasin run was killed while replacing it and had moved "
                "it aside"
            )
        else:
            shutil.rmtree(old, ignore_errors=True)
            notes.append(f"removed {old}, the previous output that a killed hf-rebasin run had already replaced")
    return notes


@contextmanager
def claim_output(
    target: Path, *, overwrite: bool, inputs: Inputs = (), where: str = "`output.dir`"
) -> Iterator[list[str]]:
    """Hold ``target`` for a run: lock it, recover a killed run's leftovers, check it again.

    Yields the recovery notes (for the CLI to print). A second run on the same output gets
    `OutputBusyError`; Ctrl-C / SIGTERM inside the block becomes `OutputInterrupted`, whose
    message says whether the output folder was completely written.
    """
    target = check_output(target, overwrite, inputs=inputs, where=where)
    created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    claim = _Claim(target, existed=False)
    lock: FileLock | None = None
    try:
        lock = _lock(target, where)
        claim.notes = recover(target)
        try:
            check_output(target, overwrite, where=where)  # a restored folder counts
        except OutputExistsError as e:
            raise type(e)(" ".join([str(e), *(f"(Just now: {n}.)" for n in claim.notes)])) from None
        claim.existed = target.exists()
        _CLAIMS[target] = claim
        yield claim.notes
    except KeyboardInterrupt:
        raise OutputInterrupted(_interrupted(claim)) from None
    finally:
        _CLAIMS.pop(target, None)
        if lock is not None:
            _unlock(lock)
        for folder in created:  # parents made for the lock only: gone again when nothing was written
            try:
                folder.rmdir()
            except OSError:
                break


def _interrupted(claim: _Claim) -> str:
    if claim.written:
        return (
            f"interrupted after the output was complete: {claim.target} holds the whole result "
            "(what came after, such as a push to the Hub, did not finish)"
        )
    if claim.existed:
        return f"interrupted before the output was written: {claim.target} is unchanged (the previous result)"
    return f"interrupted before the output was written: nothing was written to {claim.target}"


# ---------------------------------------------------------------------------------------------
# Writing


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def output_folder(target: Path, *, overwrite: bool, inputs: Inputs = (), where: str = "`output.dir`") -> Iterator[Path]:
    """A temporary folder beside ``target`` to write into; renamed to ``target`` when the block ends.

    If the block raises (Ctrl-C and SIGTERM included), the temporary folder is removed and
    ``target`` is untouched. Joins the caller's `claim_output`, or claims ``target`` itself.
    """
    target = Path(target).expanduser().absolute()
    claim = _CLAIMS.get(target)
    if claim is None:
        with (
            claim_output(target, overwrite=overwrite, inputs=inputs, where=where),
            output_folder(target, overwrite=overwrite, where=where) as tmp,
        ):
            yield tmp
        return
    check_output(target, overwrite, where=where)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; a result folder follows the umask
    try:
        try:
            yield tmp
        except Exception as e:
            reason = _write_failure(e)
            if reason is None:
                raise
            state = "is unchanged" if target.exists() else "was not created"
            raise OutputWriteError(
                f"{where}: writing the result to {str(target)!r} failed: {reason}. Nothing was replaced: the folder "
                f"{state} and the partial result was removed. Free some space (or choose a folder on another "
                "disk) and run again"
            ) from None
        _follow_umask(tmp)
        with _signals_deferred():
            _replace(tmp, target, overwrite)
            claim.written = True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def _write_failure(e: BaseException) -> str | None:
    """Why writing failed, when the file system refused (disk full, quota, file size limit,
    read-only); None for anything else. safetensors reports these as its own error type, with
    the OS error in its message."""
    if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
        return os.strerror(e.errno)
    text = str(e)
    for code in _WRITE_ERRNOS:
        if f"(os error {code})" in text:
            return os.strerror(code)
    return None


def _follow_umask(folder: Path) -> None:
    """Modes as a plain ``open`` would make them (safetensors writes weights 0600, mkdtemp 0700):
    a result folder is shared like any file the user makes."""
    mask = _umask()
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT / SIGTERM held until the block ends (then KeyboardInterrupt), so the two renames of a
    replace are never separated by Ctrl-C; only the main thread receives signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in saved:
        signal.signal(sig, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if caught:
        raise KeyboardInterrupt


def _replace(tmp: Path, target: Path, overwrite: bool) -> None:
    if not target.exists():
        tmp.rename(target)
        return
    check_output(target, overwrite)  # it may have changed while we worked
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    old.rmdir()
    target.rename(old)  # killed from here to the next rename: `recover` puts `old` back
    try:
        tmp.rename(target)
    except OSError:
        old.rename(target)  # put the previous result back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _plain(value: Any) -> Any:
    """JSON-ready: floats as Python floats (NaN / ±inf as null), tuples and paths as lists / strings."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        return _plain(value.item())
    raise TypeError(f"cannot write a {type(value).__name__} to JSON")


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as indented JSON with sorted keys (stable diffs between runs)."""
    Path(path).write_text(json.dumps(_plain(data), indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def write_text(path: Path, text: str) -> None:
    """A UTF-8 text file (Markdown tables)."""
    Path(path).write_text(text, encoding="utf-8")
