"""The local Hub server (tests/hub_server.py) driven by the real `huggingface_hub` client.

`huggingface_hub` reads HF_ENDPOINT/HF_TOKEN at import time and this process has already imported
it, so every client call runs in a subprocess (`run_client`) pointed at the hub.
"""

from __future__ import annotations

import http.client
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hub_server import ALICE_TOKEN, BOB_TOKEN, HubServer, git_blob_id
from hub_server import run_client as _run_client

ALICE, BOB = ALICE_TOKEN, BOB_TOKEN  # users "alice" and "bob"

# Prelude for client code: `outcome(fn)` -> "ok" or [exception class, HTTP status, message].
PRELUDE = """
import json, os, pathlib
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
api = HfApi()

def outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as e:
        response = getattr(e, "response", None)
        return [type(e).__name__, getattr(response, "status_code", None), str(e)]

def report(**values):
    print("RESULT " + json.dumps(values, default=str))
"""
PRELUDE += f"BOB = {BOB!r}  # bob's token\n"


def run_client(
    hub: HubServer, code: str, token: str | None, tmp_path: Path, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``python -c PRELUDE + code`` with HF_ENDPOINT=hub.url, HF_TOKEN=token (None: no token)."""
    return _run_client(hub, PRELUDE + code, token, tmp_path, **kwargs)


def result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_whoami_and_create_repo(hub: HubServer, tmp_path: Path) -> None:
    code = """
from huggingface_hub import whoami, create_repo
private = create_repo("alice/private-model", private=True)
public = create_repo("public-model")  # no namespace: the token's user
again = [str(create_repo("alice/private-model", exist_ok=True)) for _ in range(2)]
report(
    me=whoami()["name"],
    private=[private.repo_id, private.namespace, private.repo_type],
    public=public.repo_id,
    again=again,
    conflict=outcome(lambda: create_repo("alice/private-model")),
    other_namespace=outcome(lambda: create_repo("bob/not-mine")),
    private_flag=api.model_info("alice/private-model").private,
    dataset=create_repo("alice/data", repo_type="dataset").repo_type,
)
"""
    r = result(run_client(hub, code, ALICE, tmp_path))
    assert r["me"] == "alice"
    assert r["private"] == ["alice/private-model", "alice", "model"]
    assert r["public"] == "alice/public-model"
    assert r["again"] == [f"{hub.url}/alice/private-model"] * 2
    assert r["conflict"][:2] == ["HfHubHTTPError", 409]
    assert r["other_namespace"][:2] == ["HfHubHTTPError", 403]
    assert r["private_flag"] is True
    assert r["dataset"] == "dataset"
    assert hub.repo_exists("alice/data", repo_type="dataset")
    # every repo starts like on the Hub: an "initial commit" holding .gitattributes
    (initial,) = hub.commits("alice/public-model")
    assert initial["message"] == "initial commit" and list(initial["files"]) == [".gitattributes"]


def test_upload_folder_makes_commits(hub: HubServer, tmp_path: Path, saved_model) -> None:
    folder = saved_model("gpt2")
    hub.create_repo("alice/gpt2")
    code = f"""
from huggingface_hub import upload_folder
folder = pathlib.Path({str(folder)!r})
first = upload_folder(repo_id="alice/gpt2", folder_path=folder, commit_message="first")
(folder / "notes.txt").write_text("second upload")
second = upload_folder(repo_id="alice/gpt2", folder_path=folder, commit_message="second")
unchanged = upload_folder(repo_id="alice/gpt2", folder_path=folder, commit_message="nothing new")
refs = api.list_repo_refs("alice/gpt2")
report(
    oids=[first.oid, second.oid, unchanged.oid],
    url=first.commit_url,
    commits=[[c.commit_id, c.title, c.authors] for c in api.list_repo_commits("alice/gpt2")],
    branches=[[b.name, b.target_commit] for b in refs.branches],
    files=api.list_repo_files("alice/gpt2"),
)
"""
    r = result(run_client(hub, code, ALICE, tmp_path))
    first, second, unchanged = r["oids"]
    assert unchanged == second  # unchanged files: the client skips the commit (preupload answered their oid)
    assert r["url"] == f"{hub.url}/alice/gpt2/commit/{first}"
    history = hub.commits("alice/gpt2")
    assert [c["id"] for c in history[:2]] == [second, first]
    assert history[0]["parent"] == first and history[1]["parent"] == history[2]["id"]
    assert [c[:2] for c in r["commits"]] == [[second, "second"], [first, "first"], [history[2]["id"], "initial commit"]]
    assert r["commits"][0][2] == ["alice"]
    assert r["branches"] == [["main", second]]
    assert r["files"] == [".gitattributes", "config.json", "generation_config.json", "model.safetensors", "notes.txt"]
    assert hub.file("alice/gpt2", "model.safetensors") == (folder / "model.safetensors").read_bytes()
    with pytest.raises(KeyError):
        hub.file("alice/gpt2", "notes.txt", revision=first)
    assert ("POST", "/api/models/alice/gpt2/preupload/main") in hub.requests


def test_snapshot_download_by_branch_tag_and_commit(hub: HubServer, tmp_path: Path, saved_model) -> None:
    folder = saved_model("gpt2")
    hub.create_repo("alice/snap", private=True)
    v1 = hub.add_commit("alice/snap", folder, "weights")
    v2 = hub.add_commit("alice/snap", {"config.json": "{}", "README.md": "card"}, "break config")
    code = f"""
from huggingface_hub import snapshot_download, model_info
api.create_tag("alice/snap", tag="v1", revision={v1!r})
api.create_branch("alice/snap", branch="feat/old", revision="v1")  # a `/` in a branch name: %2F in URLs
out = {{}}
for rev in ["main", "v1", "feat/old", {v1!r}]:
    path = pathlib.Path(snapshot_download("alice/snap", revision=rev, allow_patterns=["*.json", "*.safetensors"]))
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    out[rev] = [files, model_info("alice/snap", revision=rev).sha, (path / "config.json").read_text()]
report(out=out, main_sha=model_info("alice/snap").sha)
"""
    r = result(run_client(hub, code, ALICE, tmp_path))
    weights = ["config.json", "generation_config.json", "model.safetensors"]
    config = (folder / "config.json").read_text()
    assert r["out"]["main"] == [weights, v2, "{}"]  # README.md and .gitattributes filtered out
    for rev in ("v1", "feat/old", v1):
        assert r["out"][rev] == [weights, v1, config]
    assert r["main_sha"] == v2
    assert hub.refs("alice/snap") == {"branches": {"main": v2, "feat/old": v1}, "tags": {"v1": v1}}
    assert ("GET", "/api/models/alice/snap/revision/feat%2Fold") in hub.requests
    assert not any("xet" in path.lower() for _, path in hub.requests)  # plain HTTP downloads


@pytest.mark.slow  # a push and a stock load through the local Hub (5 s)
def test_from_pretrained_loads_the_pushed_model(hub: HubServer, tmp_path: Path, saved_model) -> None:
    folder = saved_model("gpt2")
    hub.create_repo("alice/tiny-gpt2")
    oid = hub.add_commit("alice/tiny-gpt2", folder, "upload model")
    code = f"""
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("alice/tiny-gpt2")
expected = load_file({str(folder / "model.safetensors")!r})
state = model.state_dict()
same = sorted(k for k, v in expected.items() if torch.equal(state[k], v))
report(type=type(model).__name__, same=len(same), total=len(expected))
"""
    r = result(run_client(hub, code, None, tmp_path, timeout=300))
    assert r["type"] == "GPT2LMHeadModel"
    assert r["same"] == r["total"] > 0
    assert ("GET", f"/alice/tiny-gpt2/resolve/{oid}/model.safetensors") in hub.requests


def test_errors_the_client_raises(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo("alice/public")
    hub.create_repo("alice/secret", private=True)
    hub.add_commit("alice/secret", {"a.txt": "x"})
    code = """
from huggingface_hub import hf_hub_download, whoami, create_repo, model_info
report(
    missing_file=outcome(lambda: hf_hub_download("alice/public", "nope.json")),
    missing_repo=outcome(lambda: hf_hub_download("alice/ghost", "config.json")),
    missing_revision=outcome(lambda: hf_hub_download("alice/public", ".gitattributes", revision="v9")),
    missing_revision_info=outcome(lambda: model_info("alice/public", revision="v9")),
    private_no_token=outcome(lambda: hf_hub_download("alice/secret", "a.txt", token=False)),
    private_info_no_token=outcome(lambda: model_info("alice/secret", token=False)),
    private_other_user=outcome(lambda: hf_hub_download("alice/secret", "a.txt", token=BOB)),
    private_owner=outcome(lambda: hf_hub_download("alice/secret", "a.txt")),
    bad_token_whoami=outcome(lambda: whoami(token="hf_bad")),
    bad_token_create=outcome(lambda: create_repo("alice/x", token="hf_bad")),
    bad_token_download=outcome(lambda: hf_hub_download("alice/public", ".gitattributes", token="hf_bad")),
    no_token_whoami=outcome(lambda: whoami(token=False)),
    write_other_user=outcome(lambda: api.create_branch("alice/public", branch="b", token=BOB)),
)
"""
    r = result(run_client(hub, code, ALICE, tmp_path))
    assert r["missing_file"][:2] == ["RemoteEntryNotFoundError", 404]  # an EntryNotFoundError
    assert r["missing_repo"][:2] == ["RepositoryNotFoundError", 404]
    assert r["missing_revision"][:2] == ["RevisionNotFoundError", 404]
    assert r["missing_revision_info"][:2] == ["RevisionNotFoundError", 404]
    assert r["private_no_token"][:2] == ["RepositoryNotFoundError", 404]
    assert r["private_info_no_token"][:2] == ["RepositoryNotFoundError", 404]
    assert r["private_other_user"][:2] == ["RepositoryNotFoundError", 404]
    assert r["private_owner"] == "ok"
    assert r["bad_token_whoami"][:2] == ["HfHubHTTPError", 401]
    assert "Invalid user token" in r["bad_token_whoami"][2]
    for key in ("bad_token_create", "bad_token_download"):
        assert r[key][:2] == ["HfHubHTTPError", 401], key
        assert "Invalid credentials in Authorization header" in r[key][2], key
    assert r["no_token_whoami"][0] == "ValueError"  # the client refuses before any request
    assert r["write_other_user"][:2] == ["HfHubHTTPError", 403]
    assert not hub.repo_exists("alice/x")


def test_model_card_push_and_load(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo("alice/carded")
    code = """
from huggingface_hub import ModelCard
text = "---\\nlicense: apache-2.0\\ntags:\\n- rebasin\\n- merge\\nlibrary_name: transformers\\n---\\n# Carded\\nHello."
ModelCard(text).push_to_hub("alice/carded", commit_message="card")
card = ModelCard.load("alice/carded")
info = api.model_info("alice/carded")
report(data=card.data.to_dict(), text=card.text, tags=info.tags, card_data=info.card_data.to_dict())
"""
    r = result(run_client(hub, code, ALICE, tmp_path))
    assert r["data"] == {"license": "apache-2.0", "tags": ["rebasin", "merge"], "library_name": "transformers"}
    assert r["text"].strip() == "# Carded\nHello."
    assert r["tags"] == ["rebasin", "merge"] and r["card_data"]["license"] == "apache-2.0"
    assert hub.commits("alice/carded")[0]["message"] == "card"
    assert ("POST", "/api/validate-yaml") in hub.requests


def test_injected_failures(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo("alice/flaky")
    before = hub.commits("alice/flaky")
    hub.fail_next("commit", 500)
    hub.drop_next("commit")
    hub.fail_next("preupload", 503)  # preupload goes through http_backoff: retried after 1 s
    code = """
from huggingface_hub import upload_folder
folder = pathlib.Path("up"); folder.mkdir(); (folder / "a.txt").write_text("a")
push = lambda: upload_folder(repo_id="alice/flaky", folder_path=folder, commit_message="push")
failed = outcome(push)
history = [c.commit_id for c in api.list_repo_commits("alice/flaky")]
report(failed=failed, history=history, dropped=outcome(push), retried=outcome(push))
"""
    r = result(run_client(hub, code, ALICE, tmp_path))  # HF_HUB_DISABLE_XET=1: commit POSTs are not retried
    assert r["failed"][:2] == ["HfHubHTTPError", 500]
    assert r["history"] == [c["id"] for c in before]  # the failed commit left nothing behind
    assert r["dropped"][0] == "RemoteProtocolError"  # httpx2.RemoteProtocolError: server disconnected
    assert r["retried"] == "ok"
    history = hub.commits("alice/flaky")
    assert len(history) == 2 and history[0]["files"]["a.txt"] == b"a"
    preuploads = [p for m, p in hub.requests if p.endswith("/preupload/main")]
    assert len(preuploads) == 4  # 1 + 1 + (503, then the retry)


def test_xet_upload_pipeline_retries_commit_faults(hub: HubServer, tmp_path: Path) -> None:
    """With hf_xet enabled, upload_folder's pipeline retries the commit POST (back-off 1 s, 2 s, ...)."""
    hub.create_repo("alice/retried")
    hub.fail_next("commit", 500)
    hub.drop_next("commit")
    code = """
from huggingface_hub import upload_folder
folder = pathlib.Path("up"); folder.mkdir(); (folder / "a.txt").write_text("a")
report(oid=upload_folder(repo_id="alice/retried", folder_path=folder).oid)
"""
    r = result(run_client(hub, code, ALICE, tmp_path, xet=True))
    history = hub.commits("alice/retried")
    assert len(history) == 2 and history[0]["id"] == r["oid"]  # one commit despite three POSTs
    assert [p for _, p in hub.requests].count("/api/models/alice/retried/commit/main") == 3


def test_commit_on_a_branch_only(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo("alice/branchy")
    main_before = hub.commits("alice/branchy")[0]["id"]
    code = """
from huggingface_hub import upload_folder
folder = pathlib.Path("up"); folder.mkdir(); (folder / "exp.txt").write_text("experiment")
api.create_branch("alice/branchy", branch="exp")
again = outcome(lambda: api.create_branch("alice/branchy", branch="exp"))
api.create_branch("alice/branchy", branch="exp", exist_ok=True)
info = upload_folder(repo_id="alice/branchy", folder_path=folder, revision="exp", commit_message="on exp")
report(
    oid=info.oid,
    again=again,
    main=api.list_repo_files("alice/branchy"),
    exp=api.list_repo_files("alice/branchy", revision="exp"),
    missing_branch=outcome(lambda: upload_folder(repo_id="alice/branchy", folder_path=folder, revision="nope")),
)
"""
    r = result(run_client(hub, code, ALICE, tmp_path))
    assert r["again"][:2] == ["HfHubHTTPError", 409]
    assert r["main"] == [".gitattributes"] and r["exp"] == [".gitattributes", "exp.txt"]
    assert hub.refs("alice/branchy")["branches"] == {"main": main_before, "exp": r["oid"]}
    assert [c["id"] for c in hub.commits("alice/branchy", "exp")] == [r["oid"], main_before]
    assert r["missing_branch"][:2] == ["RevisionNotFoundError", 404]


def test_more_client_calls(hub: HubServer, tmp_path: Path) -> None:
    """Datasets, create_commit (parentCommit, deletions), sub-folder listings, HfFileSystem, ref and repo deletion."""
    hub.create_repo("alice/m")
    head = hub.commits("alice/m")[0]["id"]
    code = f"""
from huggingface_hub import CommitOperationAdd as Add, HfFileSystem, hf_hub_download
api.create_repo("alice/ds", repo_type="dataset")
api.upload_file(path_or_fileobj=b"a,b\\n1,2\\n", path_in_repo="data/train.csv", repo_id="alice/ds", repo_type="dataset")
ops = [Add("x/y.txt", b"y"), Add("x/z.txt", b"z"), Add("w.txt", b"w")]
c1 = api.create_commit("alice/m", ops, commit_message="c1", parent_commit={head!r})
stale = outcome(lambda: api.create_commit("alice/m", [Add("q.txt", b"q")], commit_message="q", parent_commit={head!r}))
sub = [f.path for f in api.list_repo_tree("alice/m", path_in_repo="x")]
fs = HfFileSystem()
fs_read = [fs.cat_file("alice/m/x/y.txt").decode(), fs.read_bytes("alice/m/w.txt").decode()]
api.delete_file("x/y.txt", "alice/m")
api.delete_folder("x", "alice/m")
api.create_tag("alice/m", tag="v1", revision=c1.oid)
api.create_branch("alice/m", branch="dev")
api.delete_branch("alice/m", branch="dev")
report(
    csv=open(hf_hub_download("alice/ds", "data/train.csv", repo_type="dataset")).read(),
    ds_files=api.list_repo_files("alice/ds", repo_type="dataset"),
    exists=[api.repo_exists("alice/ds", repo_type="dataset"), api.repo_exists("alice/nope"),
            api.file_exists("alice/m", "w.txt"), api.file_exists("alice/m", "x/y.txt"),
            api.revision_exists("alice/m", "v1"), api.revision_exists("alice/m", "dev")],
    stale=stale,
    sub=sub,
    fs_read=fs_read,
    files=api.list_repo_files("alice/m"),
    at_tag=api.list_repo_files("alice/m", revision="v1"),
    missing_delete=outcome(lambda: api.delete_file("nope.txt", "alice/m")),
    deleted=[api.delete_repo("alice/ds", repo_type="dataset"), api.repo_exists("alice/ds", repo_type="dataset")],
    delete_missing=outcome(lambda: api.delete_repo("alice/ds", repo_type="dataset")),
)
"""
    r = result(run_client(hub, code, ALICE, tmp_path))
    assert r["csv"] == "a,b\n1,2\n" and r["ds_files"] == [".gitattributes", "data/train.csv"]
    assert r["exists"] == [True, False, True, False, True, False]  # after the deletions
    assert r["stale"][:2] == ["HfHubHTTPError", 412]  # parentCommit no longer the branch head
    assert r["sub"] == ["x/y.txt", "x/z.txt"]
    assert r["fs_read"] == ["y", "w"]
    assert r["files"] == [".gitattributes", "w.txt"]
    assert r["at_tag"] == [".gitattributes", "w.txt", "x/y.txt", "x/z.txt"]
    assert r["missing_delete"][:2] == ["RemoteEntryNotFoundError", 404]
    assert r["deleted"] == [None, False] and r["delete_missing"][:2] == ["RepositoryNotFoundError", 404]
    assert [c["message"] for c in hub.commits("alice/m")][:3] == [
        "Delete folder x with huggingface_hub",
        "Delete x/y.txt with huggingface_hub",
        "c1",
    ]
    assert set(hub.refs("alice/m")["branches"]) == {"main"}


# -- raw HTTP (no client subprocess): keep-alive, chunked bodies, ranges, errors ----------------------
def _request(
    conn: http.client.HTTPConnection, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


def test_raw_http_keep_alive_chunked_and_ranges(hub: HubServer) -> None:
    hub.create_repo("alice/raw")
    oid = hub.add_commit("alice/raw", {"w.bin": bytes(range(100))})
    conn = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=10)
    auth = {"Authorization": f"Bearer {ALICE}"}
    # a chunked body is drained: the next request on the same connection still works
    chunks = iter([b'{"files": [{"path": "w.bin", ', b'"sample": "", "size": 100}]}'])
    status, _, body = _request(conn, "POST", "/api/models/alice/raw/preupload/main", chunks, auth)
    assert status == 200
    assert json.loads(body)["files"] == [
        {"path": "w.bin", "uploadMode": "regular", "shouldIgnore": False, "oid": git_blob_id(bytes(range(100)))}
    ]
    status, headers, body = _request(conn, "HEAD", "/alice/raw/resolve/main/w.bin")
    assert (status, body) == (200, b"")
    assert headers["X-Repo-Commit"] == oid and headers["Content-Length"] == "100"
    assert headers["ETag"] == f'"{git_blob_id(bytes(range(100)))}"' and headers["Accept-Ranges"] == "bytes"
    status, headers, body = _request(conn, "GET", "/alice/raw/resolve/main/w.bin", headers={"Range": "bytes=10-19"})
    assert (status, body, headers["Content-Range"]) == (206, bytes(range(10, 20)), "bytes 10-19/100")
    status, _, body = _request(conn, "GET", f"/alice/raw/resolve/{oid}/w.bin", headers={"Range": "bytes=-5"})
    assert (status, body) == (206, bytes(range(95, 100)))
    status, headers, _ = _request(conn, "GET", "/alice/raw/resolve/main/w.bin", headers={"Range": "bytes=200-"})
    assert (status, headers["Content-Range"]) == (416, "bytes */100")
    status, headers, _ = _request(conn, "HEAD", "/alice/raw/resolve/main/nope.bin")
    assert (status, headers["X-Error-Code"], headers["X-Repo-Commit"]) == (404, "EntryNotFound", oid)
    status, headers, _ = _request(conn, "GET", "/alice/raw/resolve/v2/w.bin")
    assert (status, headers["X-Error-Code"]) == (404, "RevisionNotFound")
    status, headers, body = _request(conn, "GET", "/api/models/alice/raw", headers={"Authorization": "Bearer nope"})
    assert status == 401 and json.loads(body) == {"error": "Invalid credentials in Authorization header"}
    hub.fail_next("resolve", 502)
    status, _, _ = _request(conn, "GET", "/alice/raw/resolve/main/w.bin")
    assert status == 502
    conn.close()
    assert hub.requests[-1] == ("GET", "/alice/raw/resolve/main/w.bin")
    with pytest.raises(ValueError, match="unknown endpoint"):
        hub.fail_next("commits-typo")
