"""Pushing a result folder to the Hub: create the repo (and branch), upload the folder as one commit.

The token comes from ``HF_TOKEN`` or the login cache through `huggingface_hub` itself; this module
never reads, stores or prints it. A failed push keeps the local result and says how to retry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hf_rebasin.core.errors import RebasinUserError
from hf_rebasin.io.hub.client import HubError, _call, _first_line, token_hint

__all__ = ["PushError", "push_folder"]

T = TypeVar("T")


class PushError(HubError):
    """A push failed; the local result is kept and the message says how to retry."""


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
        raise PushError(f"{where}: pushing needs a token: {token_hint()}. {then}")
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
