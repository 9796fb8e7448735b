"""The Hugging Face Hub: resolve and download models by id and revision, push result folders.

The only module that touches the network. Downloads are restricted to what hf-rebasin reads or
carries into its output, by exact file name (`download_files`): config, card, the non-weight files
`layout.is_support_file` keeps (tokenizer, generation config, chat template, processor configs),
and the weights stock ``from_pretrained`` reads: ``model.safetensors``, else
``model.safetensors.index.json`` and the shards it names (else, when allowed, the same for
``pytorch_model.bin``); never ``consolidated*.safetensors``, other precisions (``model.fp16.safetensors``)
or sub-folders (``onnx/``, ``original/``). Downloads are pinned to the commit the revision resolved
to, so a run records exactly which weights it used.
With ``HF_HUB_OFFLINE=1`` models come from the local Hugging Face cache instead (`cached_model`). Pickle
checkpoints are refused unless the recipe allows them, and no repository code is ever fetched or
run. The token comes from ``HF_TOKEN`` or the login cache through `huggingface_hub` itself; this
module never reads, stores or prints it.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from .errors import ModelNotFoundError, PickleRefusedError, RebasinUserError
from .layout import PICKLE, PICKLE_INDEX, SAFETENSORS, SAFETENSORS_INDEX, index_shards, is_support_file

__all__ = [
    "Download",
    "HubError",
    "PushError",
    "Snapshot",
    "cached_model",
    "download_files",
    "download_model",
    "endpoint",
    "is_repo_id",
    "offline",
    "plan_download",
    "push_folder",
    "repo_id_problem",
    "resolve_revision",
    "split_ref",
    "weight_layout",
]

# the weights stock `from_pretrained` reads (no `variant`, default `use_safetensors`), in its order:
# one file, else an index naming its shards; pickles only when the recipe allows them
# top-level files that may be weights (an index may name any such file as a shard): the size limits
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
PICKLE_PATTERNS = ("*.bin", "*.bin.index.json")
# how a repo's other weight formats look, to name them when none of them is loadable
_OTHER_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".index.json")
# besides the weights: the config, the card (its licence) and every file of the model that
# `layout.is_support_file` carries into the output (tokenizer, generation config, chat template,
# processor configs, ...): one list for what is downloaded and what is copied
CONFIG_FILES = ("config.json", "README.md")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# every network call gives up after this many seconds without progress (connect, each read or
# write): `huggingface_hub`'s own client waits forever on most calls
TIMEOUT_ENV = "HF_REBASIN_HUB_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
# the largest file of each kind a repo may advertise (what the download would write to disk)
MAX_CONFIG_BYTES = 16 << 20  # config.json and the other small JSON files
MAX_SUPPORT_BYTES = 512 << 20  # tokenizer and processor files (the largest tokenizer.json are ~30 MB)
MAX_WEIGHT_FILE_BYTES = 256 << 30  # one safetensors / bin file
# weights may take at most this many bytes per parameter the config implies (float64 is 8; the
# estimate is rough, so with slack) and never less than the floor (tiny or unusual configs)
BYTES_PER_PARAM = 32
MIN_WEIGHT_BUDGET = 256 << 20

T = TypeVar("T")
# file sizes the Hub advertised, by (repo, commit): `resolve_revision` records them so that the
# download checks them without asking again
_SIZES: dict[tuple[str, str], dict[str, int | None]] = {}


class HubError(RebasinUserError):
    """The Hub refused or could not answer (token, network, permissions); the message says which."""


class PushError(HubError):
    """A push failed; the local result is kept and the message says how to retry."""


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


@dataclass(frozen=True)
class Snapshot:
    """A model downloaded from the Hub: its local folder and the commit it resolved to."""

    repo: str
    revision: str | None
    commit: str
    folder: Path


def endpoint() -> str:
    """The Hub URL in use (``HF_ENDPOINT``, read by `huggingface_hub` at import)."""
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


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


def _token_hint() -> str:
    return "set HF_TOKEN or run `hf auth login` (a private or gated repo needs a token with access)"


def timeout() -> float:
    """Seconds a Hub request may go without progress (``HF_REBASIN_HUB_TIMEOUT``, default 60)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise HubError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds (e.g. 60)") from None
    if not 0 < value < float("inf"):
        raise HubError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds (e.g. 60)")
    return value


def _fill_timeouts(request: Any) -> None:
    """httpx request hook: every timeout the caller left unset (None: wait forever) becomes ours."""
    given = dict(request.extensions.get("timeout") or {})
    limit = timeout()
    request.extensions["timeout"] = {k: given.get(k) or limit for k in ("connect", "read", "write", "pool")}


def _bounded_session() -> None:
    """Install `_fill_timeouts` on `huggingface_hub`'s shared client (again if it was recreated), so
    a server that accepts a connection and never answers ends the run instead of hanging it."""
    from huggingface_hub.utils import get_session

    session = get_session()
    hooks = session.event_hooks
    if _fill_timeouts not in hooks.get("request", []):
        session.event_hooks = {**hooks, "request": [*hooks.get("request", []), _fill_timeouts]}


def _is_timeout(e: BaseException) -> bool:
    return "timeout" in type(e).__name__.lower() or isinstance(e, TimeoutError)


def _call(fn: Callable[[], T], where: str, repo: str, revision: str | None = None) -> T:
    """``fn()`` with the Hub's failures turned into user errors that name the field and repo."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{where}: " if where else ""
    try:
        _bounded_session()
        return fn()
    except GatedRepoError:
        raise HubError(f"{at}{repo!r} is gated: accept its terms on the Hub, then {_token_hint()}") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{at}repo {repo!r} was not found on {endpoint()} (check the id; if it is private, {_token_hint()})"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{at}{repo!r} has no revision {revision!r} (a branch, tag or commit id)") from None
    except EntryNotFoundError as e:
        raise ModelNotFoundError(f"{at}{repo!r}@{revision or 'main'} lacks a file: {e}") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError):
        raise HubError(
            f"{at}{repo!r} is not in the local cache and downloads are off (HF_HUB_OFFLINE=1); "
            "unset it, or give a local folder"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise HubError(f"{at}the Hub at {endpoint()} rejected the token for {repo!r}: {_token_hint()}") from None
        if status == 403:
            raise HubError(f"{at}the token has no access to {repo!r} (HTTP 403): {_token_hint()}") from None
        raise HubError(f"{at}the Hub answered HTTP {status} for {repo!r}: {_first_line(e)}") from None
    except Exception as e:
        network = isinstance(e, OSError) or type(e).__module__.startswith(
            ("httpx", "httpcore", "requests", "urllib3")  # httpx2 / httpcore2 included
        )
        if not network:
            raise
        if _is_timeout(e) or _is_timeout(e.__cause__ or e):
            raise HubError(
                f"{at}the Hub at {endpoint()} did not answer within {timeout():g} s for {repo!r} "
                f"({TIMEOUT_ENV} sets the limit); try again later"
            ) from None
        raise HubError(f"{at}cannot reach the Hub at {endpoint()} for {repo!r} ({type(e).__name__}: {e})") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def offline() -> bool:
    """Whether downloads are off (``HF_HUB_OFFLINE=1``, the norm on cluster nodes): Hub models then
    come from the local Hugging Face cache, as ``from_pretrained(local_files_only=True)`` finds them."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE) or flag


def cache_dir() -> str:
    """The Hugging Face cache the client reads (``HF_HUB_CACHE`` / ``HF_HOME``, read at import)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


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
    _SIZES[(repo, commit)] = sizes
    return commit, files


def check_file_name(name: str, at: str) -> None:
    """Refuse a file name that would land outside the download folder (``../x``, ``/x``, ``a\\b``)."""
    parts = PurePosixPath(name).parts
    if not name or name.startswith("/") or "\\" in name or "\x00" in name or any(p in ("..", ".") for p in parts):
        raise HubError(
            f"{at} lists a file named {name!r}, which points outside the repository; refusing to download "
            "anything from it (a malicious or broken repository)"
        )


def support_names(files: Sequence[str]) -> list[str]:
    """The files of a repo that a run reads or carries into its output besides the weights."""
    return [f for f in files if f in CONFIG_FILES or is_support_file(f)]


def _limit(name: str) -> tuple[int, str] | None:
    """(largest size, kind) for a file hf-rebasin may download, None for files it never fetches
    (sub-folders: ``onnx/``, ``original/``, ...). Any top-level safetensors or bin file may be a shard
    an index names, so each is bounded."""
    fetched = (*WEIGHT_PATTERNS, *PICKLE_PATTERNS, "adapter_config.json", "adapter_model.*")
    if "/" in name or (not support_names([name]) and not any(fnmatch.fnmatch(name, p) for p in fetched)):
        return None
    base = name.rsplit("/", 1)[-1]
    if base.endswith((".safetensors", ".bin")):
        return MAX_WEIGHT_FILE_BYTES, "weights file"
    if base.endswith(".json") and not base.startswith("tokenizer"):
        return MAX_CONFIG_BYTES, "configuration file"
    return MAX_SUPPORT_BYTES, "tokenizer or processor file"


def _mb(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def check_file_sizes(sizes: Mapping[str, int | None], at: str) -> None:
    """Refuse a repo that advertises a file far larger than any of its kind (before downloading)."""
    for name, size in sizes.items():
        bound = _limit(name)
        if size is not None and bound is not None and size > bound[0]:
            raise HubError(
                f"{at} lists {name} at {_mb(size)}, more than any {bound[1]} needs ({_mb(bound[0])} at most); "
                "refusing to download it (a broken or malicious repository)"
            )


def estimate_parameters(config: Mapping[str, Any]) -> int | None:
    """A generous estimate of a transformer's parameter count from its config (None: cannot tell).

    Embeddings (vocabulary, positions; input and output) plus, per layer, attention (4 h²) and
    MLP (3 h × intermediate, times the experts of a mixture); nested sub-configs add up.
    """

    def num(*keys: str) -> int | None:
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    nested = [estimate_parameters(v) for v in config.values() if isinstance(v, Mapping) and "model_type" in v]
    hidden = num("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
    layers = num("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    own = None
    if hidden is not None and layers is not None:
        inter = num("intermediate_size", "n_inner", "ffn_dim", "d_ff", "hidden_dim", "encoder_ffn_dim") or 4 * hidden
        experts = num("num_local_experts", "num_experts", "n_routed_experts") or 1
        decoder = num("decoder_layers", "num_decoder_layers") or 0
        vocab = num("vocab_size") or 0
        positions = num("max_position_embeddings", "n_positions", "n_ctx") or 0
        per_layer = 4 * hidden * hidden + 3 * hidden * inter * experts + 16 * hidden
        own = (layers + decoder) * per_layer * 2 + 2 * (vocab + positions) * hidden
    known = [n for n in [own, *nested] if n is not None]
    return sum(known) if known else None


def check_weights_size(files: Mapping[str, int | None], config: Mapping[str, Any], at: str) -> None:
    """Refuse weights far larger than the parameters ``config`` implies (before downloading them).

    ``files``: the advertised sizes of the files the download fetches (`download_files`), not of
    every file of the repo: a repo may also hold copies in other formats that are never fetched."""
    params = estimate_parameters(config)
    if params is None:
        return
    total = sum(size or 0 for name, size in files.items() if name.endswith((".safetensors", ".bin")))
    budget = max(MIN_WEIGHT_BUDGET, BYTES_PER_PARAM * params)
    if total > budget:
        raise HubError(
            f"{at} lists {_mb(total)} of weights, while its config.json implies about {params:,} parameters "
            f"({_mb(budget)} at most); refusing to download them (a broken or malicious repository)"
        )


def weight_layout(
    repo: str, revision: str | None, files: Sequence[str], *, allow_pickle: bool, where: str
) -> tuple[list[str], str | None]:
    """What to download of ``repo``, known from its file list alone, as exact file names: the
    support files and the weights stock ``from_pretrained`` reads, plus the shard index among them
    (None: not sharded) whose shards `shard_names` adds once it is read.

    ``model.safetensors``, else ``model.safetensors.index.json``, else (only with ``allow_pickle``)
    ``pytorch_model.bin`` or its index; never ``consolidated*.safetensors``, other precisions
    (``model.fp16.safetensors``), sub-folders (``onnx/``) or pickles beside safetensors.
    A PEFT adapter: ``adapter_config.json`` and its weights.
    """
    at = f"{where}: " if where else ""
    shown = f"{repo!r}@{revision or 'main'}"
    card = ["README.md"] if "README.md" in files else []  # its licence, for the output's card
    if "config.json" not in files and "adapter_config.json" in files:  # a PEFT adapter
        if "adapter_model.safetensors" in files:
            return ["adapter_config.json", "adapter_model.safetensors", *card], None
        if "adapter_model.bin" in files:
            if not allow_pickle:
                raise PickleRefusedError(
                    f"{at}{shown} holds its adapter only as a pickle (adapter_model.bin), and "
                    "loading a pickle can run code; set `allow_pickle: true` in the recipe if you trust its author"
                )
            return ["adapter_config.json", "adapter_model.bin", *card], None
        raise ModelNotFoundError(f"{at}{shown} has adapter_config.json but no adapter weights")
    if "config.json" not in files:
        raise ModelNotFoundError(
            f"{at}{shown} has no config.json, so it is not a Transformers model "
            f"(files: {', '.join(sorted(files)[:10]) or 'none'})"
        )
    support = support_names(files)
    present = set(files)
    if SAFETENSORS in present:
        return [*support, SAFETENSORS], None
    if SAFETENSORS_INDEX in present:
        return [*support, SAFETENSORS_INDEX], SAFETENSORS_INDEX
    others = sorted(f for f in files if f.lower().endswith(_OTHER_WEIGHTS))
    if PICKLE in present or PICKLE_INDEX in present:
        pickle = PICKLE if PICKLE in present else PICKLE_INDEX
        if not allow_pickle:
            unread = [f for f in others if f.endswith(".safetensors")]
            besides = f"; its safetensors ({_listing(unread)}) are not what from_pretrained reads" if unread else ""
            raise PickleRefusedError(
                f"{at}{shown} holds only pickle weights ({pickle}{besides}), and loading a pickle can run "
                "code; set `allow_pickle: true` in the recipe (or --allow-pickle) if you trust its author"
            )
        return [*support, pickle], (PICKLE_INDEX if pickle == PICKLE_INDEX else None)
    found = f"it holds only {_listing(others)}, which from_pretrained does not read" if others else "it holds none"
    raise ModelNotFoundError(
        f"{at}{shown} has no weights that transformers loads: from_pretrained reads {SAFETENSORS} or "
        f"{SAFETENSORS_INDEX} with the shards it names (or, with `allow_pickle: true`, {PICKLE} or its index); {found}"
    )


def _listing(names: Sequence[str], most: int = 10) -> str:
    return ", ".join(names[:most]) + (f", … ({len(names)} in all)" if len(names) > most else "")


def shard_names(index: Path, name: str, files: Sequence[str], at: str, holder: str = "the repository") -> list[str]:
    """The shard files the shard index ``name`` (read from ``index``) names, sorted (`layout.index_shards`),
    each one that ``files`` (the listing of ``holder``: the repository, or its cached snapshot) hold."""
    shards = index_shards(Path(index), f"{at}: {name}")
    present = set(files)
    for shard in shards:
        if shard not in present:
            raise ModelNotFoundError(f"{at}: {name} names the shard {shard!r}, which {holder} does not hold")
    return shards


def download_files(
    repo: str,
    revision: str | None,
    files: Sequence[str],
    *,
    allow_pickle: bool,
    where: str,
    read_index: Callable[[str], Path],
    holder: str = "the repository",
) -> list[str]:
    """The exact files of ``repo`` to download (`weight_layout`, then the shards of its index, which
    ``read_index(name)`` gives as a local file: fetched from the Hub, or found in the cache);
    ``files`` lists what ``holder`` holds (the repository, or its cached snapshot)."""
    names, index = weight_layout(repo, revision, files, allow_pickle=allow_pickle, where=where)
    if index is None:
        return names
    at = f"{where}: {repo!r}@{revision or 'main'}"
    return [*names, *shard_names(read_index(index), index, files, at, holder)]


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
    sizes = _SIZES.get((repo, commit), {})
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
        sizes = _SIZES.get((repo, commit))
        if sizes is None:
            resolve_revision(repo, commit, where=where)
            sizes = _SIZES[(repo, commit)]
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
    from .errors import RebasinUserError
    from .files import read_config

    path = _fetch(repo, "config.json", commit, where, revision)
    try:
        return read_config(path.parent)
    except RebasinUserError:
        return {}


def has_token() -> bool:
    """Whether `huggingface_hub` finds a token (``HF_TOKEN`` or the login cache); never returns it."""
    from huggingface_hub import get_token

    return get_token() is not None


@dataclass(frozen=True)
class PushResult:
    """Where a folder went: the repo, branch, commit id and its URL."""

    repo: str
    revision: str
    commit: str
    url: str


def retry_command(folder: Path, repo: str, *, private: bool | None, revision: str | None) -> str:
    """The command that pushes ``folder`` again (printed when a push fails), quoted for a POSIX
    shell: a folder with spaces or quotes in its name pastes back as one argument."""
    import shlex

    parts = ["hf-rebasin", "push", str(folder), "--repo", repo]
    if private:
        parts.append("--private")
    if revision:
        parts += ["--revision", revision]
    return shlex.join(parts)


def push_folder(
    folder: Path,
    repo: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    retry: bool = True,
) -> PushResult:
    """Create ``repo`` if needed, then upload ``folder`` as one commit (to ``revision``, default main).

    On failure a `PushError` names the cause and how to retry; ``folder`` is left as it is.
    ``retry``: print the command that pushes again (off for ``hf-rebasin push`` itself, whose user
    only needs to run the same command again).
    """
    from huggingface_hub import HfApi

    folder = Path(folder)
    where = "output.push_to_hub" if retry else "--repo"
    if retry:
        again = f"The result is kept in {folder}; push it again with: " + retry_command(
            folder, repo, private=private, revision=revision
        )
        then = "Then run: " + retry_command(folder, repo, private=private, revision=revision)
    else:
        again = f"{folder} is unchanged; run the same command again once that is fixed"
        then = "Then run the same command again"

    def attempt(fn: Callable[[], T]) -> T:
        try:
            return _call(fn, where, repo, revision)
        except RebasinUserError as e:
            raise PushError(f"{e}. {again}") from None
        except Exception as e:  # whatever the client raised (a garbled answer, a bug of its own): same advice
            raise PushError(
                f"{where}: pushing to {repo!r} failed ({type(e).__name__}: {_first_line(e)}). {again}"
            ) from None

    if not has_token():
        raise PushError(f"{where}: pushing needs a token: {_token_hint()}. {then}")
    api = HfApi()
    attempt(lambda: api.create_repo(repo, private=private, exist_ok=True, repo_type="model"))
    branch = revision or "main"
    if branch != "main":
        attempt(lambda: api.create_branch(repo, branch=branch, exist_ok=True))
    message = commit_message or f"hf-rebasin: upload {folder.name}"
    info: Any = attempt(
        lambda: api.upload_folder(folder_path=str(folder), repo_id=repo, revision=branch, commit_message=message)
    )
    return PushResult(repo=repo, revision=branch, commit=str(info.oid), url=str(info.commit_url))
