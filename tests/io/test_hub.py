"""Recipes against a Hub: models pulled by id@revision, results pushed with their card.

A Hub-compatible server (tests/hub_server.py) runs in this process; the CLI and every client check
run as subprocesses pointed at it (`huggingface_hub` reads HF_ENDPOINT at import).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import tiny
from helpers import assert_user_error, flat, run_cli
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from hub_server import ALICE_TOKEN, HubServer, client_env, run_client

TEXT = shakespeare_text(["hamlet"])[:2000].lower()


def _env(hub: HubServer, tmp_path: Path, token: str | None = ALICE_TOKEN) -> dict[str, str]:
    """The CLI's environment: this hub, this token, downloads allowed, caches inside the test."""
    env = client_env(hub, token, tmp_path)
    env.update(HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0", HF_DATASETS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = str(tmp_path / "ds-cache")
    return env


def _model_folder(tmp_path: Path, seed: int) -> Path:
    folder = tmp_path / f"gpt2-{seed}"
    tiny.gpt2(seed).save_pretrained(str(folder))
    char_tokenizer(TEXT).save_pretrained(str(folder))
    return folder


@pytest.fixture
def seeded(hub: HubServer, tmp_path: Path) -> dict[str, Any]:
    """alice/gpt2-a (one commit) and alice/gpt2-b (two commits: the recipe pins the first)."""
    hub.create_repo("alice/gpt2-a")
    a = hub.add_commit("alice/gpt2-a", _model_folder(tmp_path, 0), "seed 0")
    hub.create_repo("alice/gpt2-b")
    b_old = hub.add_commit("alice/gpt2-b", _model_folder(tmp_path, 1), "seed 1")
    hub.add_commit("alice/gpt2-b", _model_folder(tmp_path, 2), "seed 2: a later upload the recipe must not get")
    (tmp_path / "eval.txt").write_text(TEXT, encoding="utf-8")
    return {"a": a, "b": b_old}


def _recipe(tmp_path: Path, models: list[Any], push: dict[str, Any] | None = None, **output: Any) -> Path:
    body: dict[str, Any] = {
        "job": "merge",
        "models": models,
        "strategy": "weight-matching",
        "merge": {"weight": 0.5},
        "evaluate": {"task": "causal-lm", "data": {"dataset": "text", "data_files": "eval.txt"}, "points": 3},
        "output": {"dir": "out", **output, **({"push_to_hub": push} if push else {})},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    return path


CHECK_PUSHED = """
import json
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModel
repo, local = {repo!r}, {local!r}
model = AutoModel.from_pretrained(repo)
mine = AutoModel.from_pretrained(local)
same = all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), mine.state_dict().values()))
data = ModelCard.load(repo).data.to_dict()
print("RESULT " + json.dumps({{"same": same, "n": len(model.state_dict()), "card": data}}))
"""


@pytest.mark.slow  # ~25 s: runs in CI's slow pass, keeping the default run under 10 minutes
def test_pull_by_revision_merge_push_and_pull_back(hub: HubServer, seeded: dict[str, Any], tmp_path: Path) -> None:
    env = _env(hub, tmp_path)
    recipe = _recipe(
        tmp_path,
        ["alice/gpt2-a", {"model": "alice/gpt2-b", "revision": seeded["b"]}],
        push={"repo": "alice/merged", "private": True},
        overwrite=True,
        max_shard_size="40KB",  # the tiny model is written, pushed and pulled back as shards
    )
    # the dry run resolves revisions from metadata: no weights are downloaded
    proc = run_cli(str(recipe), "--dry-run", env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"resolved: alice/gpt2-b@{seeded['b']} -> commit {seeded['b']}" in flat(proc.stdout)
    assert not any(path.endswith(".safetensors") for _, path in hub.requests)
    assert not hub.repo_exists("alice/merged")

    hub.requests.clear()
    proc = run_cli(str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    # each model's revision is resolved once, by the checks, and that commit is what is downloaded
    infos = [path for _, path in hub.requests if re.fullmatch(r"/api/models/alice/gpt2-[ab](/revision/[^/]+)?", path)]
    assert len(infos) == 2, infos
    out = tmp_path / "out"
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert [(m["model"], m["revision"], m["commit"], m["source"]) for m in record["models"]] == [
        ("alice/gpt2-a", None, seeded["a"], "hub"),
        ("alice/gpt2-b", seeded["b"], seeded["b"], "hub"),
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text(encoding="utf-8"))
    assert len(set(index["weight_map"].values())) > 1
    first = hub.commits("alice/merged")
    assert "pushed to alice/merged@main" in flat(proc.stdout) and first[0]["id"] in proc.stdout
    assert {p.name for p in out.iterdir()} <= set(first[0]["files"])
    assert ALICE_TOKEN not in "".join(
        p.read_text(errors="ignore") for p in out.iterdir() if p.suffix in (".json", ".md")
    )

    check = run_client(hub, CHECK_PUSHED.format(repo="alice/merged", local=str(out)), ALICE_TOKEN, tmp_path).stdout
    got = json.loads(next(line for line in check.splitlines() if line.startswith("RESULT "))[7:])
    assert got["same"] and got["n"] > 0
    card = got["card"]
    assert card["base_model"] == ["alice/gpt2-a", "alice/gpt2-b"] and card["base_model_relation"] == "merge"
    assert {"merge", "hf-rebasin", "re-basin"} <= set(card["tags"])
    assert card["library_name"] == "transformers" and card["pipeline_tag"] == "text-generation"

    # a second run is a new commit on the same repo
    proc = run_cli(str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    second = hub.commits("alice/merged")
    assert len(second) == len(first) + 1 and second[1]["id"] == first[0]["id"]
    assert hub.file("alice/merged", "README.md").decode().count("alice/gpt2-b") >= 1


@pytest.mark.slow  # several CLI processes against the local Hub (16 s)
def test_missing_repo_revision_config_and_pickle_only_repo_exit_2(
    hub: HubServer, seeded: dict[str, Any], tmp_path: Path
) -> None:
    env = _env(hub, tmp_path)
    hub.create_repo("alice/no-config")
    hub.add_commit("alice/no-config", {"model.safetensors": b"", "README.md": "# not a model"})
    hub.create_repo("alice/pickled")
    folder = _model_folder(tmp_path, 3)
    torch.save(tiny.gpt2(3).state_dict(), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    hub.add_commit("alice/pickled", folder)
    cases = [
        (["alice/gpt2-a", "alice/nope"], ["models.1.model", "'alice/nope' was not found", "HF_TOKEN"]),
        (["alice/gpt2-a", "alice/gpt2-b@v9"], ["models.1.model", "has no revision 'v9'"]),
        (["alice/no-config", "alice/gpt2-a"], ["models.0.model", "no config.json"]),
        (["alice/gpt2-a", "alice/pickled"], ["models.1.model", "only pickle weights", "allow_pickle: true"]),
    ]
    for i, (models, needles) in enumerate(cases):
        for dry_run in (("--dry-run",), ()) if i == len(cases) - 1 else (("--dry-run",),):  # runs resolve alike
            proc = run_cli(str(_recipe(tmp_path, models)), *dry_run, env=env)
            assert_user_error(proc, *needles)
            assert not (tmp_path / "out").exists()


@pytest.mark.slow  # ~25 s: runs in CI's slow pass, keeping the default run under 10 minutes
def test_failed_pushes_keep_the_result_and_print_the_retry(hub: HubServer, tmp_path: Path) -> None:
    models = [str(_model_folder(tmp_path, 0)), str(_model_folder(tmp_path, 1))]
    (tmp_path / "eval.txt").write_text(TEXT, encoding="utf-8")
    recipe = _recipe(tmp_path, models, push={"repo": "alice/merged"}, overwrite=True)

    # a token the Hub rejects: exit 2, the folder is complete, the message says how to retry
    proc = run_cli(str(recipe), env=_env(hub, tmp_path, token="hf_not_a_valid_token_0000"))
    err = assert_user_error(proc, "rejected the token", "The result is kept in", "hf-rebasin push")
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "README.md").is_file()
    assert "hf_not_a_valid_token" not in err + proc.stdout

    # no token at all: refused before any work
    proc = run_cli(str(recipe), env=_env(hub, tmp_path, token=None))
    assert_user_error(proc, "output.push_to_hub", "needs a token")

    # the server drops the connection mid-push: the folder is kept; the printed retry works
    hub.drop_next("commit")
    proc = run_cli(str(recipe), env=_env(hub, tmp_path))
    err = assert_user_error(proc, "cannot reach the Hub", "The result is kept in")
    retry = err.split("push it again with: ", 1)[1].strip()
    assert retry.startswith("hf-rebasin push ") and "--repo alice/merged" in retry
    assert hub.commits("alice/merged")[0]["message"] != "hf-rebasin merge"  # only the initial commit
    proc = run_cli(*shlex.split(retry)[1:], env=_env(hub, tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "model.safetensors" in hub.commits("alice/merged")[0]["files"]

    # push refuses a folder that is not an output folder
    assert_user_error(run_cli("push", str(tmp_path), "--repo", "alice/x", env=_env(hub, tmp_path)), "rebasin.json")


@pytest.mark.slow  # CLI processes against the local Hub (11 s)
def test_verify_a_hub_model_by_id(hub: HubServer, seeded: dict[str, Any], tmp_path: Path) -> None:
    proc = run_cli("verify", f"alice/gpt2-b@{seeded['b']}", env=_env(hub, tmp_path, token=None))
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout
    assert_user_error(run_cli("verify", "alice/nope", env=_env(hub, tmp_path)), "MODEL", "'alice/nope' was not found")
    proc = run_cli("verify", "tiny-gpt2", env=_env(hub, tmp_path))  # a folder typo, read as a Hub id
    assert_user_error(proc, "'tiny-gpt2' was not found", "no local folder 'tiny-gpt2'", "./tiny-gpt2")


@pytest.mark.slow  # CLI processes against the local Hub (8 s)
def test_align_hub_models_by_id(hub: HubServer, seeded: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "pair"
    env = _env(hub, tmp_path, token=None)
    proc = run_cli("align", f"alice/gpt2-a@{seeded['a']}", f"alice/gpt2-b@{seeded['b']}", "--output", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    assert (out / "b" / "tokenizer.json").read_bytes() == (tmp_path / "gpt2-1" / "tokenizer.json").read_bytes()
    record = json.loads((out / "alignment.json").read_text())
    assert record["models"]["B"]["given"] == f"alice/gpt2-b@{seeded['b']}"
    assert_user_error(run_cli("align", "alice/nope", "alice/gpt2-b", env=env), "MODEL_A", "'alice/nope' was not found")
