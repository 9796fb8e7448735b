"""Calls to the Hugging Face Hub: the client's failures as user errors, every call time-bounded.

`_call` wraps each network call of `hf_rebasin.io.hub`: a gated, missing or private repo, a bad token,
an unreachable or silent server each become a `HubError` that names the recipe field and the repo.
Also what the client reads from the environment: the endpoint, offline mode and the cache folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from hf_rebasin.core.errors import ModelNotFoundError, RebasinUserError

__all__ = ["HubError", "endpoint", "offline"]

# every network call gives up after this many seconds without progress (connect, each read or
# write): `huggingface_hub`'s own client waits forever on most calls
TIMEOUT_ENV = "HF_REBASIN_HUB_TIMEOUT"
DEFAULT_TIMEOUT = 60.0

T = TypeVar("T")


class HubError(RebasinUserError):
    """The Hub refused or could not answer (token, network, permissions); the message says which."""


def endpoint() -> str:
    """The Hub URL in use (``HF_ENDPOINT``, read by `huggingface_hub` at import)."""
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def token_hint() -> str:
    """What to do about a missing or refused token, for every message that needs one."""
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
        raise HubError(f"{at}{repo!r} is gated: accept its terms on the Hub, then {token_hint()}") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{at}repo {repo!r} was not found on {endpoint()} (check the id; if it is private, {token_hint()})"
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
            raise HubError(f"{at}the Hub at {endpoint()} rejected the token for {repo!r}: {token_hint()}") from None
        if status == 403:
            raise HubError(f"{at}the token has no access to {repo!r} (HTTP 403): {token_hint()}") from None
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
