"""Downloading a Hub model: exactly the files loading reads (`selection`), pinned to its commit.

`plan_download` says what a run will fetch and how many bytes (a dry run), `download_model` fetches
it, pinned to the commit the revision resolved to, so a run records exactly which weights it used;
with ``HF_HUB_OFFLINE=1`` the model comes from the local cache instead (`resolve.cached_model`).
No repository code is ever fetched or run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_rebasin.core.errors import ModelNotFoundError
from hf_rebasin.io.hub.client import _call, offline, timeout
from hf_rebasin.io.hub.resolve import SIZES, Snapshot, cached_model, resolve_revision
from hf_rebasin.io.hub.selection import check_file_name, check_weights_size, download_files, shard_names, weight_layout

__all__ = ["Download", "download_model", "plan_download"]


@dataclass(frozen=True)
class Download:
    """What fetching a Hub model at its commit takes: the exact files it reads, and which of them
    (with the size the Hub advertised) the local cache lacks, so the run downloads them."""

    files: tuple[str, ...]  # every file downloaded or already cached: support files, index, weights
    fetch: tuple[tuple[str, int | None], ...]  # (name, advertised bytes) of those not in the cache yet
    index: str | None = None  # the shard index read (fetched) to list the shards

    @property
    def nbytes(self) -> int:
        """The bytes still to download (files of unknown size count 0; `summary` names them)."""
        return sum(size or 0 for _, size in self.fetch)

    def summary(self) -> str:
        """``downloads 2 files, 12.3 MiB = 12,912,345 bytes (model.safetensors, config.json)``, or
        ``already in the cache`` when nothing is left to download."""
        if not self.fetch:
            return f"already in the cache ({_count(len(self.files), 'file')}, nothing to download)"
        names = [name for name, _ in self.fetch]
        shown = ", ".join(names[:8]) + (f", … and {len(names) - 8} more" if len(names) > 8 else "")
        text = f"downloads {_count(len(names), 'file')}, {_size(self.nbytes)} = {self.nbytes:,} bytes ({shown})"
        unknown = [name for name, size in self.fetch if size is None]
        if unknown:
            text += f"; the Hub gave no size for {', '.join(unknown)}"
        cached = len(self.files) - len(self.fetch)
        if cached:
            text += f"; {_count(cached, 'file')} already in the cache"
        if self.index is not None:
            text += f"; {self.index} was read to list the shards"
        return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _size(n: int) -> str:
    """``n`` bytes for people: B, KiB, MiB or GiB."""
    if n < 1 << 10:
        return f"{n} B"
    for unit, shift in (("KiB", 10), ("MiB", 20)):
        if n < 1 << (shift + 10):
            return f"{n / (1 << shift):,.1f} {unit}"
    return f"{n / (1 << 30):,.1f} GiB"


def plan_download(
    repo: str, revision: str | None, commit: str, files: Sequence[str], *, allow_pickle: bool, where: str
) -> Download:
    """What `download_model` will fetch of ``repo`` at ``commit``, with the sizes the Hub advertised
    (`resolve_revision` gathered them), before any weight is fetched. A sharded repo's index is
    fetched (a small JSON file, into the cache) to list its shards: the one download a dry run makes."""
    from huggingface_hub import try_to_load_from_cache

    def cached(name: str) -> bool:
        return isinstance(try_to_load_from_cache(repo, name, revision=commit), str)

    names, index = weight_layout(repo, revision, files, allow_pickle=allow_pickle, where=where)
    missing = [name for name in names if not cached(name)]
    read = None
    if index is not None:
        read = index if index in missing else None
        shards = shard_names(
            _fetch(repo, index, commit, where, revision), index, files, f"{where}: {repo!r}@{revision or 'main'}"
        )
        names += shards
        missing += [name for name in shards if not cached(name)]
    sizes = SIZES.get((repo, commit), {})
    return Download(tuple(names), tuple((name, sizes.get(name)) for name in missing), read)


def glob_escape(name: str) -> str:
    """``name`` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def download_model(
    repo: str,
    revision: str | None = None,
    *,
    allow_pickle: bool = False,
    where: str = "",
    resolved: tuple[str, Sequence[str]] | None = None,
) -> Snapshot:
    """Download what hf-rebasin reads of ``repo`` at ``revision`` (`download_files`: exact file
    names, a sharded repo's index first), pinned to the resolved commit.

    ``resolved``: the (commit, files) an earlier `resolve_revision` gave, so that a run downloads
    the very commit its checks saw, even if the branch moved since, without asking again.
    """
    from huggingface_hub import snapshot_download

    if offline():
        return cached_model(repo, revision, allow_pickle=allow_pickle, where=where)
    commit, files = resolved if resolved is not None else resolve_revision(repo, revision, where=where)
    at = f"{where}: {repo!r}@{revision or 'main'}"
    for name in files:
        check_file_name(name, at)
    names = download_files(
        repo,
        revision,
        files,
        allow_pickle=allow_pickle,
        where=where,
        read_index=lambda index: _fetch(repo, index, commit, where, revision),
    )
    if "config.json" in files:  # weights against the size the config implies, before fetching them
        sizes = SIZES.get((repo, commit))
        if sizes is None:
            resolve_revision(repo, commit, where=where)
            sizes = SIZES[(repo, commit)]
        config = _config(repo, commit, where, revision)
        check_weights_size({name: sizes.get(name) for name in names}, config, at)
    patterns = [glob_escape(name) for name in names]  # names, not globs: `[` or `*` match only themselves
    folder = Path(
        _call(
            lambda: snapshot_download(repo, revision=commit, allow_patterns=patterns, etag_timeout=timeout()),
            where,
            repo,
            revision or commit,
        )
    )
    lost = [name for name in names if not (folder / name).is_file()]
    if lost:  # the Hub listed it in the repo's info, then did not serve it
        raise ModelNotFoundError(f"{at}: the download lacks {', '.join(lost)}, which the repository lists")
    _remember_ref(folder, revision, commit)
    return Snapshot(repo=repo, revision=revision, commit=commit, folder=folder)


def _remember_ref(folder: Path, revision: str | None, commit: str) -> None:
    """Record in the cache which commit ``revision`` (default main) resolved to, as the client does
    when it downloads by branch: the download went by commit id, and an offline run (or
    ``from_pretrained(local_files_only=True)``) finds ``org/name@revision`` through this ref."""
    name = revision or "main"
    if name == commit or folder.parent.name != "snapshots":
        return
    ref = folder.parent.parent / "refs" / name
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        if not ref.is_file() or ref.read_text(encoding="utf-8").strip() != commit:
            ref.write_text(commit, encoding="utf-8")
    except OSError:  # a read-only cache: offline runs then need the commit id
        pass


def _fetch(repo: str, name: str, commit: str, where: str, revision: str | None) -> Path:
    """One file of ``repo`` at ``commit``, downloaded into the cache (or found there)."""
    from huggingface_hub import hf_hub_download

    return Path(
        _call(
            lambda: hf_hub_download(repo, name, revision=commit, etag_timeout=timeout()),
            where,
            repo,
            revision or commit,
        )
    )


def _config(repo: str, commit: str, where: str, revision: str | None) -> dict[str, Any]:
    """config.json of ``repo`` at ``commit`` through the gate (`files`), {} if the gate refuses it:
    loading the model names what is wrong with it."""
    from hf_rebasin.core.errors import RebasinUserError
    from hf_rebasin.io.files import read_config

    path = _fetch(repo, "config.json", commit, where, revision)
    try:
        return read_config(path.parent)
    except RebasinUserError:
        return {}
