"""The Hugging Face Hub: resolve and download models by id and revision, push result folders.

The only module that touches the network (DESIGN.md §2). Downloads are restricted to what
hf-rebasin reads (config, safetensors, tokenizer / processor and adapter files), pinned to the
commit the revision resolved to, so a run records exactly which weights it used. Pickle
checkpoints are refused unless the recipe allows them, and no repository code is ever fetched or
run. The token comes from ``HF_TOKEN`` or the login cache through `huggingface_hub` itself; this
module never reads, stores or prints it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .errors import ModelNotFoundError, PickleRefusedError, RebasinUserError

__all__ = [
    "HubError",
    "PushError",
    "Snapshot",
    "download_model",
    "endpoint",
    "is_repo_id",
    "push_folder",
    "resolve_revision",
    "split_ref",
]

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
PICKLE_PATTERNS = ("*.bin", "*.bin.index.json")
# everything else a model folder needs: config, tokenizer, image processor, PEFT adapter config
SUPPORT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",  # sentencepiece (tokenizer.model, spiece.model)
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "adapter_config.json",
)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_COMMIT = re.compile(r"[0-9a-f]{40}")

T = TypeVar("T")


class HubError(RebasinUserError):
    """The Hub refused or could not answer (token, network, permissions); the message says which."""


class PushError(HubError):
    """A push failed; the local result is kept and the message says how to retry."""


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
    return bool(_REPO_ID.fullmatch(value))


def split_ref(value: str) -> tuple[str, str | None]:
    """``org/name@revision`` as (``org/name``, ``revision``); no ``@``, or a path: revision None."""
    repo, sep, revision = value.partition("@")
    return (repo, revision or None) if sep and not is_path(value) else (value, None)


def _token_hint() -> str:
    return "set HF_TOKEN or run `hf auth login` (a private or gated repo needs a token with access)"


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
    except OSError as e:  # connection refused, DNS, timeouts (httpx errors are not OSErrors: see below)
        raise HubError(f"{at}cannot reach the Hub at {endpoint()} for {repo!r}: {e}") from None
    except Exception as e:
        if type(e).__module__.startswith(("httpx", "httpcore", "requests", "urllib3")):
            raise HubError(f"{at}cannot reach the Hub at {endpoint()} for {repo!r} ({type(e).__name__}: {e})") from None
        raise


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def resolve_revision(repo: str, revision: str | None, *, where: str = "") -> tuple[str, list[str]]:
    """(commit id, file names) of ``repo`` at ``revision`` (default main): metadata only, no weights."""
    from huggingface_hub import HfApi

    info = _call(lambda: HfApi().model_info(repo, revision=revision), where, repo, revision)
    files = [s.rfilename for s in info.siblings or []]
    commit = str(info.sha)
    if not _COMMIT.fullmatch(commit):
        raise HubError(f"{where}: the Hub gave {commit!r} as the commit of {repo!r}@{revision or 'main'}")
    return commit, files


def weight_patterns(
    repo: str, revision: str | None, files: Sequence[str], *, allow_pickle: bool, where: str
) -> list[str]:
    """The allow-patterns to download: support files plus safetensors (or, if allowed, pickles)."""
    at = f"{where}: " if where else ""
    if "config.json" not in files and "adapter_config.json" in files:  # a PEFT adapter
        if "adapter_model.safetensors" in files:
            return ["adapter_config.json", "adapter_model.safetensors"]
        if "adapter_model.bin" in files:
            if not allow_pickle:
                raise PickleRefusedError(
                    f"{at}{repo!r}@{revision or 'main'} holds its adapter only as a pickle (adapter_model.bin), and "
                    "loading a pickle can run code; set `allow_pickle: true` in the recipe if you trust its author"
                )
            return ["adapter_config.json", "adapter_model.bin"]
        raise ModelNotFoundError(f"{at}{repo!r}@{revision or 'main'} has adapter_config.json but no adapter weights")
    if "config.json" not in files:
        raise ModelNotFoundError(
            f"{at}{repo!r}@{revision or 'main'} has no config.json, so it is not a Transformers model "
            f"(files: {', '.join(sorted(files)[:10]) or 'none'})"
        )
    if any(f.endswith(".safetensors") for f in files):
        return [*SUPPORT_PATTERNS, *WEIGHT_PATTERNS]
    if any(f.endswith(".bin") for f in files):
        if not allow_pickle:
            raise PickleRefusedError(
                f"{at}{repo!r}@{revision or 'main'} holds only pickle weights (.bin), and loading a pickle can run "
                "code; set `allow_pickle: true` in the recipe (or --allow-pickle) if you trust its author"
            )
        return [*SUPPORT_PATTERNS, *PICKLE_PATTERNS]
    raise ModelNotFoundError(f"{at}{repo!r}@{revision or 'main'} has no weights (.safetensors or .bin)")


def download_model(
    repo: str,
    revision: str | None = None,
    *,
    allow_pickle: bool = False,
    where: str = "",
    resolved: tuple[str, Sequence[str]] | None = None,
) -> Snapshot:
    """Download what hf-rebasin reads of ``repo`` at ``revision``, pinned to the resolved commit.

    ``resolved``: the (commit, files) an earlier `resolve_revision` gave, so that a run downloads
    the very commit its checks saw, even if the branch moved since, without asking again.
    """
    from huggingface_hub import snapshot_download

    commit, files = resolved if resolved is not None else resolve_revision(repo, revision, where=where)
    patterns = weight_patterns(repo, revision, files, allow_pickle=allow_pickle, where=where)
    folder = _call(
        lambda: snapshot_download(repo, revision=commit, allow_patterns=patterns), where, repo, revision or commit
    )
    return Snapshot(repo=repo, revision=revision, commit=commit, folder=Path(folder))


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
    """The command that pushes ``folder`` again (printed when a push fails)."""
    parts = ["hf-rebasin", "push", str(folder), "--repo", repo]
    if private:
        parts.append("--private")
    if revision:
        parts += ["--revision", revision]
    return " ".join(parts)


def push_folder(
    folder: Path,
    repo: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """Create ``repo`` if needed, then upload ``folder`` as one commit (to ``revision``, default main).

    On failure a `PushError` names the cause and the command to retry; ``folder`` is left as it is.
    """
    from huggingface_hub import HfApi

    folder = Path(folder)
    retry = retry_command(folder, repo, private=private, revision=revision)

    def attempt(fn: Callable[[], T]) -> T:
        try:
            return _call(fn, "output.push_to_hub", repo, revision)
        except RebasinUserError as e:
            raise PushError(f"{e}. The result is kept in {folder}; push it again with: {retry}") from None

    if not has_token():
        raise PushError(f"output.push_to_hub: pushing needs a token: {_token_hint()}. Then run: {retry}")
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
