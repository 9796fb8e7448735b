"""A small Hugging Face Hub-compatible HTTP server for tests (standard library only).

It speaks the subset of the Hub's HTTP API that `huggingface_hub` (2.x, httpx2 based) and
`transformers.from_pretrained` use: who-am-I, create/delete repo, model/dataset info, tree and
paths-info listings, refs, commits, branches, tags, preupload + NDJSON commits, and
``HEAD``/``GET`` on ``/{repo_id}/resolve/{revision}/{path}`` (with ``Range`` support).

Every file is uploaded as a *regular* git file (preupload always answers ``uploadMode: "regular"``,
so the client sends base64 content inside the commit) and no Xet headers are ever sent, so
downloads go through plain HTTP even with `hf_xet` installed.

The client reads ``HF_ENDPOINT``/``HF_TOKEN`` once, at import time: drive the server from a
subprocess (see `client_env` and `run_client`).

    with serve_hub(tmp_path / "hub") as hub:  # tokens: ALICE_TOKEN -> alice, BOB_TOKEN -> bob
        run_client(hub, "from huggingface_hub import whoami; print(whoami()['name'])", ALICE_TOKEN, tmp_path)

Blobs live on disk under ``storage/blobs`` (content addressed by their git blob id); repos,
commits and refs live in memory for the server's lifetime.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import warm_cli

try:  # only to fill `cardData` in repo info from README.md front matter; optional
    import yaml
except ImportError:  # pragma: no cover
    yaml = None  # type: ignore[assignment]

__all__ = [
    "ALICE_TOKEN",
    "BOB_TOKEN",
    "DEFAULT_TOKENS",
    "ENDPOINTS",
    "HubServer",
    "client_env",
    "git_blob_id",
    "run_client",
    "serve_hub",
]

# Tokens of `serve_hub` (and the `hub` fixture) when none are given.
ALICE_TOKEN, BOB_TOKEN = "hf_alice_token", "hf_bob_token"
DEFAULT_TOKENS = {ALICE_TOKEN: "alice", BOB_TOKEN: "bob"}

# Names accepted by `fail_next` / `drop_next` / `hang_next` / `garble_next` (one per kind of request the server answers).
ENDPOINTS = frozenset(
    {
        "whoami",
        "create",
        "delete",
        "validate-yaml",
        "info",
        "tree",
        "paths-info",
        "refs",
        "commits",
        "branch",
        "tag",
        "preupload",
        "commit",
        "resolve",
    }
)

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_API_ACTIONS = {"revision", "tree", "paths-info", "refs", "commits", "branch", "tag", "preupload", "commit"}
_HEX40 = re.compile(r"[0-9a-f]{40}")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

GITATTRIBUTES = b"""*.bin filter=lfs diff=lfs merge=lfs -text
*.h5 filter=lfs diff=lfs merge=lfs -text
*.msgpack filter=lfs diff=lfs merge=lfs -text
*.onnx filter=lfs diff=lfs merge=lfs -text
*.pt filter=lfs diff=lfs merge=lfs -text
*.pth filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
*.zip filter=lfs diff=lfs merge=lfs -text
"""


def git_blob_id(data: bytes) -> str:
    """The git blob id of `data` (what the Hub uses as ETag and ``oid`` of regular files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


@dataclass
class Commit:
    oid: str
    parent: str | None
    summary: str
    description: str
    author: str
    date: str
    tree: dict[str, str]  # path -> blob id


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    owner: str
    private: bool
    created_at: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


class HubError(Exception):
    """An error answer: status, message, and the Hub's ``X-Error-Code`` when it has one."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,  # more fields of the JSON body
    ):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers, self.extra = headers or {}, extra or {}


def _repo_not_found(repo_id: str) -> HubError:
    return HubError(404, f"Repository Not Found: {repo_id}", "RepoNotFound")


class HubServer:
    """A Hub-compatible server on ``127.0.0.1`` (free port) in a daemon thread.

    `tokens` maps a bearer token to its user name. Reads of public repos need no token; private
    repos answer 404 ``RepoNotFound`` unless the token's user owns them; writes need the owner's
    token. An unknown token gets 401 on any request.
    """

    def __init__(self, storage: Path | str, tokens: dict[str, str]):
        self.storage = Path(storage)
        self.tokens = dict(tokens)
        self.requests: list[tuple[str, str]] = []  # (method, path without query, still percent-encoded)
        self._repos: dict[tuple[str, str], Repo] = {}
        self._faults: list[tuple[str, str, int]] = []  # (endpoint, "fail" | "drop" | "hang" | "garble", status)
        self._advertised: dict[tuple[str, str], dict[str, int]] = {}  # extra / resized siblings in repo info
        self._stopping = threading.Event()
        self._lock = threading.RLock()
        self._counter = itertools.count()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> HubServer:
        if self._httpd is not None:
            return self
        (self.storage / "blobs").mkdir(parents=True, exist_ok=True)
        handler = type("BoundHubHandler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._stopping.set()  # requests held by `hang_next` end now
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("HubServer is not started")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- failure knobs ---------------------------------------------------------------------------
    def fail_next(self, endpoint: str, status: int = 500, times: int = 1) -> None:
        """Answer the next `times` requests to `endpoint` (see `ENDPOINTS`) with `status`, doing nothing."""
        self._add_fault(endpoint, "fail", status, times)

    def drop_next(self, endpoint: str, times: int = 1) -> None:
        """Close the connection of the next `times` requests to `endpoint` without answering (body is read)."""
        self._add_fault(endpoint, "drop", 0, times)

    def hang_next(self, endpoint: str, times: int = 1) -> None:
        """Accept the next `times` requests to `endpoint` and never answer them (until the server stops)."""
        self._add_fault(endpoint, "hang", 0, times)

    def garble_next(self, endpoint: str, times: int = 1) -> None:
        """Answer the next `times` requests to `endpoint` with 200 and a body that is not JSON."""
        self._add_fault(endpoint, "garble", 200, times)

    def advertise(self, repo_id: str, sizes: dict[str, int], repo_type: str = "model") -> None:
        """List these files with these sizes in the repo's info (``siblings``), whatever the repo holds:
        a file that is not there (``../../evil.json``) or a size that is not true."""
        with self._lock:
            self._advertised.setdefault((repo_type, repo_id), {}).update(sizes)

    def _add_fault(self, endpoint: str, kind: str, status: int, times: int) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {sorted(ENDPOINTS)}")
        with self._lock:
            self._faults.extend([(endpoint, kind, status)] * times)

    def _take_fault(self, endpoint: str) -> tuple[str, int] | None:
        with self._lock:
            for i, (name, kind, status) in enumerate(self._faults):
                if name == endpoint:
                    del self._faults[i]
                    return kind, status
        return None

    # -- helpers for assertions (and seeding) ------------------------------------------------------
    def repo_exists(self, repo_id: str, repo_type: str = "model") -> bool:
        with self._lock:
            return (repo_type, repo_id) in self._repos

    def create_repo(self, repo_id: str, *, private: bool = False, repo_type: str = "model") -> None:
        """Create `namespace/name` directly (no HTTP), owned by its namespace."""
        with self._lock:
            self._create(repo_type, repo_id, repo_id.split("/")[0], private)

    def add_commit(
        self,
        repo_id: str,
        files: dict[str, bytes | str] | Path | str,
        message: str = "seed",
        *,
        branch: str = "main",
        deletions: tuple[str, ...] = (),
        author: str | None = None,
        repo_type: str = "model",
    ) -> str:
        """Commit `files` ({path: content} or a local folder) on `branch` directly (no HTTP); return the oid.

        For seeding a repo that a test then reads with the real client.
        """
        if isinstance(files, (str, Path)):
            root = Path(files)
            files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            head = repo.branches[branch]
            tree = dict(repo.commits[head].tree)
            for path in deletions:
                del tree[path]
            for path, content in files.items():
                tree[path] = self._write_blob(content.encode() if isinstance(content, str) else content)
            commit = self._new_commit(repo, head, tree, message, "", author or repo.owner)
            repo.branches[branch] = commit.oid
            return commit.oid

    def commits(self, repo_id: str, branch: str = "main", repo_type: str = "model") -> list[dict[str, Any]]:
        """History of `branch` (or any revision), newest first like ``list_repo_commits``.

        Each item: ``id``, ``parent``, ``message`` (summary), ``description``, ``author``, ``date``,
        ``files`` ({path: bytes}).
        """
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            out = []
            for c in self._history(repo, self._resolve(repo, branch)):
                files = {p: self._read_blob(b) for p, b in sorted(c.tree.items())}
                out.append(
                    {
                        "id": c.oid,
                        "parent": c.parent,
                        "message": c.summary,
                        "description": c.description,
                        "author": c.author,
                        "date": c.date,
                        "files": files,
                    }
                )
            return out

    def file(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "model") -> bytes:
        """Content of `path` at `revision` (branch, tag or commit id); KeyError when missing."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            return self._read_blob(repo.commits[self._resolve(repo, revision)].tree[path])

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[str]:
        """Sorted file paths at `revision`."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            return sorted(repo.commits[self._resolve(repo, revision)].tree)

    def refs(self, repo_id: str, repo_type: str = "model") -> dict[str, dict[str, str]]:
        """``{"branches": {name: oid}, "tags": {name: oid}}``."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            return {"branches": dict(repo.branches), "tags": dict(repo.tags)}

    # -- storage ---------------------------------------------------------------------------------
    def _write_blob(self, data: bytes) -> str:
        oid = git_blob_id(data)
        path = self.storage / "blobs" / oid
        if not path.exists():
            tmp = path.with_suffix(f".tmp{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return oid

    def _read_blob(self, oid: str) -> bytes:
        return (self.storage / "blobs" / oid).read_bytes()

    def _blob_size(self, oid: str) -> int:
        return (self.storage / "blobs" / oid).stat().st_size

    def _new_commit(
        self, repo: Repo, parent: str | None, tree: dict[str, str], summary: str, description: str, author: str
    ) -> Commit:
        date = _now()
        seed = json.dumps([repo.repo_type, repo.repo_id, parent, tree, summary, description, author, date])
        oid = hashlib.sha1(f"{seed}\n{next(self._counter)}\n{time.time_ns()}".encode()).hexdigest()
        commit = Commit(oid, parent, summary, description, author, date, dict(tree))
        repo.commits[oid] = commit
        return commit

    def _create(self, repo_type: str, repo_id: str, owner: str, private: bool) -> Repo:
        repo = Repo(repo_type, repo_id, owner, private, _now())
        tree = {".gitattributes": self._write_blob(GITATTRIBUTES)}
        repo.branches["main"] = self._new_commit(repo, None, tree, "initial commit", "", "system").oid
        self._repos[(repo_type, repo_id)] = repo
        return repo

    @staticmethod
    def _resolve(repo: Repo, revision: str) -> str:
        """Commit id of a branch, a tag, a full commit id (or ``refs/heads/x``, ``refs/tags/x``)."""
        if revision.startswith("refs/heads/"):
            revision = revision[len("refs/heads/") :]
            if revision in repo.branches:
                return repo.branches[revision]
        elif revision.startswith("refs/tags/"):
            revision = revision[len("refs/tags/") :]
            if revision in repo.tags:
                return repo.tags[revision]
        elif revision in repo.branches:
            return repo.branches[revision]
        elif revision in repo.tags:
            return repo.tags[revision]
        elif _HEX40.fullmatch(revision) and revision in repo.commits:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    @staticmethod
    def _history(repo: Repo, oid: str | None) -> Iterator[Commit]:
        while oid is not None:
            commit = repo.commits[oid]
            yield commit
            oid = commit.parent


def _tree_oid(entries: dict[str, str]) -> str:
    return hashlib.sha1(json.dumps(sorted(entries.items())).encode()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer  # set on the bound subclass
    protocol_version = "HTTP/1.1"
    server_version = "HubServer/1.0"
    timeout = 60  # idle keep-alive connections end after a minute

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    # -- plumbing --------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size_line = self.rfile.readline(65537)
                if not size_line:
                    break
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)  # CRLF after each chunk
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _dispatch(self) -> None:
        hub = self.hub
        try:
            self.body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            return
        split = urlsplit(self.path)
        self.query = parse_qs(split.query, keep_blank_values=True)
        with hub._lock:
            hub.requests.append((self.command, split.path))
        try:
            route = self._route(split.path)
            if route is None:
                raise HubError(404, f"Not found: {self.command} {split.path}")
            endpoint, handler, args = route
            fault = hub._take_fault(endpoint)
            if fault is not None:
                kind, status = fault
                if kind == "drop":
                    self.close_connection = True
                    return
                if kind == "hang":
                    hub._stopping.wait(300)
                    self.close_connection = True
                    return
                if kind == "garble":
                    self._send(status, b"<html>not json \x00\xff", "application/json")
                    return
                raise HubError(status, f"Injected failure on '{endpoint}' ({status})")
            self.user = self._authenticate()
            handler(*args)
        except HubError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug in the server: answer 500 instead of hanging the client
            self._send_error(HubError(500, f"HubServer internal error: {type(e).__name__}: {e}"))

    def _authenticate(self) -> str | None:
        auth = self.headers.get("Authorization")
        if not auth:
            return None
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else auth.strip()
        user = self.hub.tokens.get(token)
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return user

    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, data: Any, status: int = 200, **headers: str) -> None:
        self._send(status, json.dumps(data).encode(), "application/json; charset=utf-8", **headers)

    def _send_error(self, e: HubError) -> None:
        headers = {**e.headers, "X-Error-Message": e.message.encode("ascii", "replace").decode().replace("\n", " ")}
        if e.code:
            headers["X-Error-Code"] = e.code
        body = json.dumps({"error": e.message, **e.extra}).encode()
        self._send(e.status, body, "application/json; charset=utf-8", **headers)

    # -- routing ---------------------------------------------------------------------------------
    def _route(self, path: str) -> tuple[str, Any, tuple] | None:
        raw = path.split("/")[1:]
        segs = [unquote(s) for s in raw]
        method = self.command
        if segs[:2] == ["api", "whoami-v2"] and method == "GET":
            return "whoami", self._whoami, ()
        if segs[:2] == ["api", "repos"] and len(segs) == 3:
            if segs[2] == "create" and method == "POST":
                return "create", self._create_repo, ()
            if segs[2] == "delete" and method in ("DELETE", "POST"):
                return "delete", self._delete_repo, ()
        if segs[:2] == ["api", "validate-yaml"] and method == "POST":
            return "validate-yaml", self._validate_yaml, ()
        if len(segs) >= 3 and segs[0] == "api" and segs[1] in REPO_TYPES:
            return self._route_api(REPO_TYPES[segs[1]], segs[2:])
        if method in ("GET", "HEAD"):
            repo_type = "model"
            if segs and segs[0] in ("datasets", "spaces"):
                repo_type, segs = REPO_TYPES[segs[0]], segs[1:]
            for n in (2, 1):
                if len(segs) >= n + 3 and segs[n] == "resolve":
                    repo_id, rev, file_path = "/".join(segs[:n]), segs[n + 1], "/".join(segs[n + 2 :])
                    return "resolve", self._resolve_file, (repo_type, repo_id, rev, file_path)
        return None

    def _route_api(self, repo_type: str, rest: list[str]) -> tuple[str, Any, tuple] | None:
        # repo ids are `name` or `namespace/name`; pick the split that makes sense (existing repo first)
        candidates = []
        if len(rest) == 2 or (len(rest) > 2 and rest[2] in _API_ACTIONS):
            candidates.append(2)
        if len(rest) == 1 or rest[1] in _API_ACTIONS:
            candidates.append(1)
        if not candidates:
            return None
        n = next((c for c in candidates if self.hub.repo_exists("/".join(rest[:c]), repo_type)), candidates[0])
        repo_id, action, args = "/".join(rest[:n]), (rest[n] if len(rest) > n else None), rest[n + 1 :]
        method = self.command
        key = (method, action)
        if key == ("GET", None):
            return "info", self._info, (repo_type, repo_id, None)
        if key == ("GET", "revision") and args:
            return "info", self._info, (repo_type, repo_id, "/".join(args))
        if key == ("GET", "tree") and args:
            return "tree", self._tree, (repo_type, repo_id, args[0], "/".join(args[1:]))
        if key == ("POST", "paths-info") and args:
            return "paths-info", self._paths_info, (repo_type, repo_id, "/".join(args))
        if key == ("GET", "refs") and not args:
            return "refs", self._refs, (repo_type, repo_id)
        if key == ("GET", "commits") and args:
            return "commits", self._commits, (repo_type, repo_id, "/".join(args))
        if action == "branch" and args and method in ("POST", "DELETE"):
            return "branch", self._branch, (repo_type, repo_id, "/".join(args))
        if action == "tag" and args and method in ("POST", "DELETE"):
            return "tag", self._tag, (repo_type, repo_id, "/".join(args))
        if key == ("POST", "preupload") and args:
            return "preupload", self._preupload, (repo_type, repo_id, "/".join(args))
        if key == ("POST", "commit") and args:
            return "commit", self._commit, (repo_type, repo_id, "/".join(args))
        return None

    # -- access ----------------------------------------------------------------------------------
    def _lookup(self, repo_type: str, repo_id: str) -> Repo | None:
        repos = self.hub._repos
        if (repo_type, repo_id) in repos:
            return repos[(repo_type, repo_id)]
        if "/" not in repo_id and self.user is not None:  # `name` -> `user/name`
            return repos.get((repo_type, f"{self.user}/{repo_id}"))
        return None

    def _readable(self, repo_type: str, repo_id: str) -> Repo:
        repo = self._lookup(repo_type, repo_id)
        if repo is None or (repo.private and repo.owner != self.user):
            raise _repo_not_found(repo_id)
        return repo

    def _writable(self, repo_type: str, repo_id: str) -> Repo:
        repo = self._readable(repo_type, repo_id)
        if self.user is None:
            raise HubError(401, "Authorization header is required for this operation")
        if repo.owner != self.user:
            raise HubError(403, f"You don't have the rights to write to {repo.repo_id}")
        return repo

    def _json_body(self) -> dict[str, Any]:
        try:
            data = json.loads(self.body or b"{}")
        except ValueError as e:
            raise HubError(400, f"Invalid JSON body: {e}") from e
        if not isinstance(data, dict):
            raise HubError(400, "JSON body must be an object")
        return data

    def _repo_url(self, repo: Repo) -> str:
        return f"{self.hub.url}/{URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    # -- endpoints -------------------------------------------------------------------------------
    def _whoami(self) -> None:
        if self.user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        self._json(
            {
                "type": "user",
                "id": hashlib.sha1(self.user.encode()).hexdigest()[:24],
                "name": self.user,
                "fullname": self.user,
                "email": f"{self.user}@example.com",
                "emailVerified": True,
                "isPro": False,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}},
            }
        )

    def _validate_yaml(self) -> None:
        self._json({"errors": [], "warnings": []})

    def _create_repo(self) -> None:
        data = self._json_body()
        if self.user is None:
            raise HubError(401, "You must be authenticated to create a repo")
        name, namespace = data.get("name"), data.get("organization") or self.user
        repo_type = data.get("type") or "model"
        if repo_type not in URL_PREFIX:
            raise HubError(400, f"Invalid repo type: {repo_type}")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or not _NAME.fullmatch(namespace):
            raise HubError(400, f"Invalid repo name: {namespace}/{name}")
        if namespace != self.user:
            raise HubError(403, f"You don't have the rights to create a {repo_type} under the namespace {namespace}")
        visibility = data.get("visibility")
        private = visibility == "private" if visibility is not None else bool(data.get("private", False))
        repo_id = f"{namespace}/{name}"
        with self.hub._lock:
            repo = self.hub._repos.get((repo_type, repo_id))
            if repo is not None:
                # the client reads `url` from this 409 when `exist_ok=True`
                raise HubError(409, f"You already created this {repo_type} repo", extra={"url": self._repo_url(repo)})
            repo = self.hub._create(repo_type, repo_id, namespace, private)
        self._json({"url": self._repo_url(repo), "name": repo_id, "id": repo_id})

    def _delete_repo(self) -> None:
        data = self._json_body()
        name, namespace = data.get("name"), data.get("organization") or self.user
        repo_type = data.get("type") or "model"
        repo_id = f"{namespace}/{name}"
        with self.hub._lock:
            self._writable(repo_type, repo_id)
            del self.hub._repos[(repo_type, repo_id)]
        self._json({})

    def _info(self, repo_type: str, repo_id: str, revision: str | None) -> None:
        with self.hub._lock:
            repo = self._readable(repo_type, repo_id)
            commit = repo.commits[self.hub._resolve(repo, revision or "main")]
            tree = dict(commit.tree)
        card = self._card_data(tree.get("README.md"))
        config = None
        if "config.json" in tree:
            try:
                config = json.loads(self.hub._read_blob(tree["config.json"]))
            except ValueError:
                config = None
        tags = list(card.get("tags") or []) if isinstance(card, dict) else []
        info: dict[str, Any] = {
            "_id": hashlib.sha1(f"{repo.repo_type}/{repo.repo_id}".encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.owner,
            "sha": commit.oid,
            "lastModified": commit.date,
            "createdAt": repo.created_at,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": tags,
            "siblings": [
                {"rfilename": p, "size": self.hub._blob_size(b), "blobId": b} for p, b in sorted(tree.items())
            ],
        }
        advertised = self.hub._advertised.get((repo.repo_type, repo.repo_id), {})
        if advertised:
            siblings = {s["rfilename"]: s for s in info["siblings"]}
            for name, size in advertised.items():
                siblings[name] = {**siblings.get(name, {"rfilename": name, "blobId": "0" * 40}), "size": size}
            info["siblings"] = list(siblings.values())
        if card:
            info["cardData"] = card
        if repo.repo_type == "model":
            if isinstance(config, dict):
                info["config"] = config
                info["library_name"] = (card or {}).get("library_name") or "transformers"
            if isinstance(card, dict) and card.get("pipeline_tag"):
                info["pipeline_tag"] = card["pipeline_tag"]
        self._json(info)

    def _card_data(self, blob: str | None) -> dict[str, Any] | None:
        if blob is None or yaml is None:
            return None
        text = self.hub._read_blob(blob).decode("utf-8", "replace")
        match = re.match(r"^\s*---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|$)", text, re.S)
        if not match:
            return None
        try:
            data = yaml.safe_load(match.group(1))
        except yaml.YAMLError:
            return None
        return json.loads(json.dumps(data, default=str)) if isinstance(data, dict) else None

    def _last_commits(self, repo: Repo, head: str, paths: list[str]) -> dict[str, Commit]:
        """For each path (file or folder), the newest commit of `head`'s history that changed it."""
        history = list(self.hub._history(repo, head))

        def digest(tree: dict[str, str], path: str) -> Any:
            if path in tree:
                return tree[path]
            prefix = path + "/"
            return sorted((p, b) for p, b in tree.items() if p.startswith(prefix))

        out = {}
        for path in paths:
            for i, commit in enumerate(history):
                parent = history[i + 1].tree if i + 1 < len(history) else {}
                if digest(commit.tree, path) != digest(parent, path):
                    out[path] = commit
                    break
            else:
                out[path] = history[-1]
        return out

    def _entries(self, repo: Repo, commit: Commit, paths: list[str], expand: bool) -> list[dict[str, Any]]:
        tree = commit.tree
        entries: list[dict[str, Any]] = []
        for path in paths:
            if path in tree:
                entries.append(
                    {"type": "file", "oid": tree[path], "size": self.hub._blob_size(tree[path]), "path": path}
                )
            else:
                prefix = path + "/"
                sub = {p: b for p, b in tree.items() if p.startswith(prefix)}
                if sub:
                    entries.append({"type": "directory", "oid": _tree_oid(sub), "size": 0, "path": path})
        if expand:
            last = self._last_commits(repo, commit.oid, [e["path"] for e in entries])
            for entry in entries:
                c = last[entry["path"]]
                entry["lastCommit"] = {"id": c.oid, "title": c.summary, "date": c.date}
        return entries

    def _flag(self, name: str) -> bool:
        values = self.query.get(name) or self.query.get(f"{name}[]") or []
        return bool(values) and values[-1].lower() in ("1", "true", "yes")

    def _tree(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        path = path.strip("/")
        recursive, expand = self._flag("recursive"), self._flag("expand")
        with self.hub._lock:
            repo = self._readable(repo_type, repo_id)
            commit = repo.commits[self.hub._resolve(repo, revision)]
            prefix = f"{path}/" if path else ""
            under = [p for p in commit.tree if p.startswith(prefix)]
            if path and (path in commit.tree or not under):
                raise HubError(
                    404, f"{path} does not exist on {revision}", "EntryNotFound", {"X-Repo-Commit": commit.oid}
                )
            names: set[str] = set()
            for p in under:
                parts = p[len(prefix) :].split("/")
                if recursive:
                    names.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
                else:
                    names.add(prefix + parts[0])
            # folders first then files, each sorted, like the Hub
            ordered = sorted(names, key=lambda p: (p in commit.tree, p))
            entries = self._entries(repo, commit, ordered, expand)
        self._json(entries)

    def _paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        content_type = self.headers.get("Content-Type", "")
        if "json" in content_type:
            data = self._json_body()
            paths, expand = data.get("paths") or [], bool(data.get("expand"))
            paths = [paths] if isinstance(paths, str) else paths
        else:
            form = parse_qs(self.body.decode(), keep_blank_values=True)
            paths = form.get("paths", []) + form.get("paths[]", [])
            expand = (form.get("expand") or ["false"])[-1].lower() in ("1", "true")
        with self.hub._lock:
            repo = self._readable(repo_type, repo_id)
            commit = repo.commits[self.hub._resolve(repo, revision)]
            entries = self._entries(repo, commit, [p.strip("/") for p in paths], expand)
        self._json(entries)

    def _refs(self, repo_type: str, repo_id: str) -> None:
        with self.hub._lock:
            repo = self._readable(repo_type, repo_id)
            data: dict[str, Any] = {
                "branches": [
                    {"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in sorted(repo.branches.items())
                ],
                "converts": [],
                "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": c} for n, c in sorted(repo.tags.items())],
            }
        if self._flag("include_prs"):
            data["pullRequests"] = []
        self._json(data)

    def _commits(self, repo_type: str, repo_id: str, revision: str) -> None:
        with self.hub._lock:
            repo = self._readable(repo_type, repo_id)
            items = [
                {
                    "id": c.oid,
                    "title": c.summary,
                    "message": c.description,
                    "date": c.date,
                    "authors": [{"user": c.author, "avatar": None}],
                    "parents": [c.parent] if c.parent else [],
                }
                for c in self.hub._history(repo, self.hub._resolve(repo, revision))
            ]
        self._json(items)

    def _branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        with self.hub._lock:
            repo = self._writable(repo_type, repo_id)
            if self.command == "DELETE":
                if branch not in repo.branches:
                    raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                if branch == "main":
                    raise HubError(403, "Cannot delete the default branch")
                del repo.branches[branch]
                self._json({})
                return
            if branch.startswith("refs/") or not re.fullmatch(r"[A-Za-z0-9._/-]+", branch) or ".." in branch:
                raise HubError(400, f"Invalid reference for a branch: {branch}")
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            start = self._json_body().get("startingPoint")
            target = self.hub._resolve(repo, start) if start else repo.branches["main"]
            repo.branches[branch] = target
        self._json({})

    def _tag(self, repo_type: str, repo_id: str, revision: str) -> None:
        with self.hub._lock:
            repo = self._writable(repo_type, repo_id)
            if self.command == "DELETE":
                if revision not in repo.tags:
                    raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
                del repo.tags[revision]
                self._json({})
                return
            tag = self._json_body().get("tag")
            if not isinstance(tag, str) or not re.fullmatch(r"[A-Za-z0-9._/-]+", tag) or tag.startswith("refs/"):
                raise HubError(400, f"Invalid tag name: {tag}")
            if tag in repo.tags:
                raise HubError(409, f"Tag already exists: refs/tags/{tag}")
            repo.tags[tag] = self.hub._resolve(repo, revision)
        self._json({})

    def _branch_head(self, repo: Repo, revision: str) -> str:
        if revision.startswith("refs/heads/"):
            revision = revision[len("refs/heads/") :]
        if revision in repo.branches:
            return revision
        if revision in repo.tags or revision in repo.commits:
            raise HubError(400, f"Can only commit to a branch, not to {revision}")
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        if self._flag("create_pr"):
            raise HubError(400, "Pull requests are not supported by this test server")
        files = self._json_body().get("files") or []
        with self.hub._lock:
            repo = self._writable(repo_type, repo_id)
            tree = repo.commits[repo.branches[self._branch_head(repo, revision)]].tree
            answer = [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": tree.get(f["path"])}
                for f in files
            ]
        self._json({"files": answer, "commitOid": None})

    def _commit(self, repo_type: str, repo_id: str, revision: str) -> None:
        if self._flag("create_pr"):
            raise HubError(400, "Pull requests are not supported by this test server")
        try:
            lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
        except ValueError as e:
            raise HubError(400, f"Invalid NDJSON body: {e}") from e
        header = next((item["value"] for item in lines if item.get("key") == "header"), None)
        if header is None:
            raise HubError(400, "Missing commit header")
        # decode contents before taking the lock (base64 of big files)
        ops: list[tuple[str, str, bytes | None]] = []
        for item in lines:
            key, value = item.get("key"), item.get("value") or {}
            if key == "header":
                continue
            path = str(value.get("path", "")).strip("/")
            if not path:
                raise HubError(400, f"Missing path in {key} operation")
            if key == "file":
                content = value.get("content", "")
                data = base64.b64decode(content) if value.get("encoding") == "base64" else content.encode()
                ops.append(("file", path, data))
            elif key in ("deletedFile", "deletedFolder"):
                ops.append((key, path, None))
            elif key == "lfsFile":
                raise HubError(400, "LFS files are not supported by this test server (preupload answers regular)")
            else:
                raise HubError(400, f"Unknown commit operation: {key}")
        with self.hub._lock:
            repo = self._writable(repo_type, repo_id)
            branch = self._branch_head(repo, revision)
            head = repo.branches[branch]
            parent = header.get("parentCommit")
            if parent and not head.startswith(parent):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(repo.commits[head].tree)
            for kind, path, data in ops:
                if kind == "file":
                    assert data is not None
                    tree[path] = self.hub._write_blob(data)
                elif kind == "deletedFile":
                    if path not in tree:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    del tree[path]
                else:
                    doomed = [p for p in tree if p.startswith(path + "/")]
                    if not doomed:
                        raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    for p in doomed:
                        del tree[p]
            commit = self.hub._new_commit(
                repo, head, tree, str(header.get("summary") or ""), str(header.get("description") or ""), str(self.user)
            )
            repo.branches[branch] = commit.oid
            url = f"{self._repo_url(repo)}/commit/{commit.oid}"
        self._json({"success": True, "commitOid": commit.oid, "commitUrl": url, "hookOutput": ""})

    def _resolve_file(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        with self.hub._lock:
            repo = self._readable(repo_type, repo_id)
            oid = self.hub._resolve(repo, revision)
            blob = repo.commits[oid].tree.get(path)
            if blob is None:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": oid})
        data = self.hub._read_blob(blob)
        total = len(data)
        headers = {"X-Repo-Commit": oid, "ETag": f'"{blob}"', "Accept-Ranges": "bytes"}
        content_type = "application/json" if path.endswith(".json") else "application/octet-stream"
        match = _RANGE.fullmatch(self.headers.get("Range", "").strip().replace(" ", ""))
        if match and (match.group(1) or match.group(2)):
            first, last = match.groups()
            if first:
                start, end = int(first), min(int(last) if last else total - 1, total - 1)
            else:
                start, end = max(total - int(last), 0), total - 1
            if start >= total or start > end:
                raise HubError(416, "Requested range not satisfiable", None, {"Content-Range": f"bytes */{total}"})
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
            self._send(206, data[start : end + 1], content_type, **headers)
            return
        self._send(200, data, content_type, **headers)


# -- client side helpers ---------------------------------------------------------------------------
_SCRUBBED = ("HF_", "HUGGING_FACE_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_PROXIES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def client_env(server: HubServer, token: str | None, tmp: Path | str, *, xet: bool = False) -> dict[str, str]:
    """Environment for a client subprocess talking to `server` (caches and token isolated under `tmp`).

    `token` None: no token at all (HF_TOKEN unset, HF_HOME empty). `xet` False sets
    ``HF_HUB_DISABLE_XET=1``: with `hf_xet` installed, `upload_folder` otherwise goes through the
    pipelined uploader, which retries a commit POST on 5xx/dropped connections (1 s, 2 s, 4 s, ...
    back-off, 6 tries), so one injected fault is silently retried instead of reaching the caller.
    Downloads never use Xet with this server either way (it sends no Xet headers).
    """
    tmp = Path(tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED) and k not in _PROXIES}
    env.update(
        HF_ENDPOINT=server.url,
        HF_HOME=str(tmp / "hf-home"),  # no token file from ~/.cache/huggingface is picked up
        HF_HUB_CACHE=str(tmp / "hub-cache"),
        HF_XET_CACHE=str(tmp / "xet-cache"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
    )
    if not xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def run_client(
    server: HubServer,
    code: str,
    token: str | None,
    tmp: Path | str,
    *,
    xet: bool = False,
    timeout: float = 120,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code`` (cwd `tmp`, stdin from /dev/null) against `server`, forked from a helper
    that has imported the HTTP stack but not the client (tests/warm_cli.py); raise with its output
    when it fails and `check`."""
    proc = warm_cli.run_code(code, env=client_env(server, token, tmp, xet=xet), cwd=Path(tmp), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"client failed ({proc.returncode}):\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


@contextmanager
def serve_hub(storage: Path | str, tokens: dict[str, str] | None = None) -> Iterator[HubServer]:
    """``with serve_hub(tmp) as hub:`` a started `HubServer` (tokens: `DEFAULT_TOKENS`), stopped on exit."""
    with HubServer(storage, DEFAULT_TOKENS if tokens is None else tokens) as server:
        yield server
