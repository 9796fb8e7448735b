"""Model references: a local path or a Hub id (``org/name@revision``), resolved to a commit.

`is_path`, `split_ref` and the repo id checks read a reference without the network (the recipe uses
them); `resolve_revision` asks the Hub for a revision's commit and file list (metadata only), and
`cached_model` finds a model in the local Hugging Face cache instead when ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hf_rebasin.core.errors import ModelNotFoundError
from hf_rebasin.io.hub.client import HubError, _call, _first_line, cache_dir, offline, timeout
from hf_rebasin.io.hub.selection import check_file_name, check_file_sizes, download_files

__all__ = [
    "Snapshot",
    "cached_model",
    "is_path",
    "is_repo_id",
    "repo_id_problem",
    "resolve_revision",
    "split_ref",
]

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# file sizes the Hub advertised, by (repo, commit): `resolve_revision` records them so that the
# download checks them without asking again
SIZES: dict[tuple[str, str], dict[str, int | None]] = {}


@dataclass(frozen=True)
class Snapshot:
    """A model downloaded from the Hub: its local folder and the commit it resolved to."""

    repo: str
    revision: str | None
    commit: str
    folder: Path


def is_path(value: str) -> bool:
    """Whether ``value`` is written as a path (``./x``, ``../x``, ``/x``, ``~/x``), never a Hub id."""
    return value.startswith((".", "/", "~", "\\")) or Path(value).is_absolute()


def is_repo_id(value: str) -> bool:
    """Whether ``value`` has the shape of a Hub repo id (``name`` or ``org/name``)."""
    return repo_id_problem(value) is None


def repo_id_problem(value: str) -> str | None:
    """Why ``value`` is not a Hub repo id (the client's own check, so a recipe fails when it is read,
    not deep inside a download), or None when it is one."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not _REPO_ID.fullmatch(value):
        return "only letters, digits, - _ . and at most one / (between the org and the name)"
    try:
        validate_repo_id(value)
    except HFValidationError as e:
        return _first_line(e).rstrip(".")
    return None


def split_ref(value: str) -> tuple[str, str | None]:
    """``org/name@revision`` as (``org/name``, ``revision``); no ``@``, or a path: revision None."""
    repo, sep, revision = value.partition("@")
    return (repo, revision or None) if sep and not is_path(value) else (value, None)


def cached_model(repo: str, revision: str | None = None, *, allow_pickle: bool = False, where: str = "") -> Snapshot:
    """``repo`` at ``revision`` from the local Hugging Face cache, without the network; the commit
    is the cached snapshot's (the branch or tag as the cache last saw it, or the commit given)."""
    from huggingface_hub import try_to_load_from_cache

    at = f"{where}: " if where else ""
    shown = f"{repo}@{revision or 'main'}"
    # the snapshot folder the cache's ref (or the commit given) points at, found through a file every
    # model (config.json) or adapter has; not snapshot_download, which wants every file of the repo
    found = [try_to_load_from_cache(repo, name, revision=revision) for name in ("config.json", "adapter_config.json")]
    paths = [Path(f) for f in found if isinstance(f, str)]
    if not paths:
        raise ModelNotFoundError(
            f"{at}{shown!r} is not in the local Hugging Face cache ({cache_dir()}) and downloads from "
            f"the Hub are off (HF_HUB_OFFLINE=1). Run once with network access to fill the cache (e.g. `hf download {repo}"
            f"{f' --revision {revision}' if revision else ''}` or the same recipe), set HF_HUB_OFFLINE=0, "
            "or give a local folder"
        )
    folder = paths[0].parent
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    try:
        # the same exact files a download fetches, found in the snapshot (its index read from there)
        download_files(
            repo,
            revision,
            files,
            allow_pickle=allow_pickle,
            where=where,
            read_index=lambda name: folder / name,
            holder="the cached snapshot",
        )
    except ModelNotFoundError as e:
        raise ModelNotFoundError(
            f"{e}, in the local Hugging Face cache ({folder}): only part of it was downloaded; run once with "
            "network access (or HF_HUB_OFFLINE=0) to fetch the rest"
        ) from None
    return Snapshot(repo=repo, revision=revision, commit=folder.name, folder=folder)


def resolve_revision(repo: str, revision: str | None, *, where: str = "") -> tuple[str, list[str]]:
    """(commit id, file names) of ``repo`` at ``revision`` (default main): metadata only, no weights
    (offline: the cached snapshot's)."""
    from huggingface_hub import HfApi

    if offline():
        snap = cached_model(repo, revision, allow_pickle=True, where=where)
        return snap.commit, sorted(p.relative_to(snap.folder).as_posix() for p in snap.folder.rglob("*") if p.is_file())

    info = _call(
        lambda: HfApi().model_info(repo, revision=revision, files_metadata=True, timeout=timeout()),
        where,
        repo,
        revision,
    )
    siblings = list(info.siblings or [])
    files = [str(s.rfilename) for s in siblings]
    commit = str(info.sha)
    if not _COMMIT.fullmatch(commit):
        raise HubError(f"{where}: the Hub gave {commit!r} as the commit of {repo!r}@{revision or 'main'}")
    at = f"{where}: {repo!r}@{revision or 'main'}"
    for name in files:
        check_file_name(name, at)
    sizes = {str(s.rfilename): s.size for s in siblings}
    check_file_sizes(sizes, at)
    SIZES[(repo, commit)] = sizes
    return commit, files
