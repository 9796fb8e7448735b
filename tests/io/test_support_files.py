"""Files and numbers a user can trust: model A's files reach the output as they were, the card
inherits the licence and shows no local path, a Hub model runs offline from the cache, a failed
push prints a retry that pastes back, a misspelt strategy gets a suggestion."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shlex
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

import tiny
from helpers import flat, run_cli
from hf_rebasin.evaluation.data import char_tokenizer
from hub_server import ALICE_TOKEN, HubServer, client_env, run_client

TEXT = "to be, or not to be, that is the question\n" * 4
CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _card(license: str | None) -> str:
    meta = f"---\nlicense: {license}\n---\n" if license else ""
    return meta + "# a tiny model\n"


def _model(folder: Path, seed: int, *, license: str | None = "apache-2.0", extras: bool = False) -> Path:
    """A tiny GPT-2 with a character tokenizer; ``extras``: the files a real release carries besides."""
    from transformers import GenerationConfig

    tiny.gpt2(seed).save_pretrained(str(folder))
    tokenizer = char_tokenizer(TEXT)
    if extras:
        tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(str(folder))
    (folder / "README.md").write_text(_card(license), encoding="utf-8")
    if extras:
        GenerationConfig(
            eos_token_id=[2, 7], pad_token_id=0, do_sample=True, temperature=0.7, top_p=0.9
        ).save_pretrained(str(folder))
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<pad>"}))
        (folder / "LICENSE").write_text("Apache License 2.0 (the text)\n", encoding="utf-8")
        (folder / "modeling_custom.py").write_text("raise SystemExit('never copied')\n", encoding="utf-8")
        (folder / "training_args.bin").write_bytes(b"\x80\x04not weights hf-rebasin reads")
    return folder


def _run(recipe: Path) -> Any:
    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run import run_recipe

    return run_recipe(load_recipe(recipe))


def _recipe(tmp_path: Path, models: list[Any], **extra: Any) -> Path:
    body = {"job": "merge", "models": models, "strategy": "weight-matching", "output": {"dir": "out"}, "device": "cpu"}
    body.update(extra)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_non_weight_file_of_a_arrives_as_it_was(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard
    from transformers import AutoTokenizer, GenerationConfig

    a = _model(tmp_path / "a", 0, extras=True)
    _model(tmp_path / "b", 1)
    result = _run(_recipe(tmp_path, ["./a", "./b"]))
    out = result.output
    for name in ("generation_config.json", "chat_template.jinja", "special_tokens_map.json", "LICENSE"):
        assert (out / name).is_file(), sorted(p.name for p in out.iterdir())
        assert _sha(out / name) == _sha(a / name), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert _sha(out / name) == _sha(a / name), name
    assert not (out / "modeling_custom.py").exists() and not (out / "training_args.bin").exists()
    # read back by the libraries, independently of the bytes
    assert GenerationConfig.from_pretrained(str(out)).to_dict() == GenerationConfig.from_pretrained(str(a)).to_dict()
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == [2, 7]
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == CHAT
    # the inputs agree on their licence: the card's metadata carries it, and the card is ours
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "apache-2.0" and "hf-rebasin" in card.data.tags


def test_licence_only_when_the_inputs_agree() -> None:
    from hf_rebasin.run.card.metadata import card_metadata

    def models(*licenses: str | None) -> dict[str, Any]:
        entries = [
            {"model": f"org/m{i}", "source": "hub", **({"license": x} if x else {})} for i, x in enumerate(licenses)
        ]
        return {"recipe": {"job": "merge"}, "models": entries, "task": "causal-lm"}

    assert card_metadata(models("mit", "mit")).license == "mit"
    assert card_metadata(models("mit", None)).license == "mit"  # the one that declares one
    assert card_metadata(models("mit", "apache-2.0")).license is None
    assert card_metadata(models(None, None)).license is None


def test_how_to_load_never_shows_a_local_absolute_path() -> None:
    from test_card import merge_record

    from hf_rebasin.run.card import render_card

    for folder, shown in (("/home/someone/runs/gpt2-merge", '"gpt2-merge"'), ("../../x/merged", '"merged"')):
        record = merge_record()
        record["recipe"]["output"] = {"dir": folder}
        card = render_card(record, recipe_text="job: merge", command="hf-rebasin recipe.yaml")
        load = card.split("## How to load", 1)[1]
        assert f"from_pretrained({shown})" in load and "/home/someone" not in load and ".." not in load, load


def test_retry_command_is_shell_quoted_and_not_repeated_by_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_rebasin.io.hub import push

    folder = tmp_path / "my runs" / "it's merged"
    command = push.retry_command(folder, "alice/merged", private=True, revision="v1")
    assert shlex.split(command) == [
        "hf-rebasin",
        "push",
        str(folder),
        "--repo",
        "alice/merged",
        "--private",
        "--revision",
        "v1",
    ]
    monkeypatch.setattr(push, "has_token", lambda: False)
    with pytest.raises(push.PushError) as from_run:
        push.push_folder(folder, "alice/merged")
    assert shlex.split(str(from_run.value).split("Then run: ", 1)[1])[2] == str(folder)
    with pytest.raises(push.PushError) as from_push:
        push.push_folder(folder, "alice/merged", retry=False)
    assert "hf-rebasin push" not in str(from_push.value) and "run the same command again" in str(from_push.value)


def _main(*argv: str) -> tuple[int, str]:
    from hf_rebasin.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, flat(err.getvalue())


def test_misspelt_strategy_and_options_get_a_suggestion(tmp_path: Path) -> None:
    from hf_rebasin.recipe import RecipeError, loads_recipe

    code, err = _main("align", "./a", "./b", "--strategy", "weight-matchng")
    assert code == 2 and err.startswith("error: `--strategy`:") and "did you mean `weight-matching`?" in err, err
    code, err = _main("align", "./a", "./b", "--set", "max_itr=3")
    assert code == 2 and "`--set max_itr=3`: is not an option of strategy 'weight-matching'" in err, err
    assert "did you mean `max_iter`?" in err
    with pytest.raises(RecipeError, match="did you mean `weight-matching`"):
        loads_recipe("job: merge\nmodels: [a/b, c/d]\nstrategy: weight-matchng\noutput: {dir: out}\n")


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


FILL_CACHE = """
from hf_rebasin.io.hub.download import download_model
for repo, rev in (("alice/tiny-a", None), ("alice/tiny-b", {commit!r})):
    print(download_model(repo, rev).folder)
"""


@pytest.mark.slow  # a run online, then offline, through the local Hub (9 s)
def test_hub_models_run_offline_from_the_cache(hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    from hf_rebasin.core.errors import ModelNotFoundError
    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run import plan

    hub.create_repo("alice/tiny-a")
    commit_a = hub.add_commit("alice/tiny-a", _model(tmp_path / "src-a", 0, extras=True, license="mit"))
    hub.create_repo("alice/tiny-b")
    commit_b = hub.add_commit("alice/tiny-b", _model(tmp_path / "src-b", 1, license="mit"))
    run_client(hub, FILL_CACHE.format(commit=commit_b), ALICE_TOKEN, tmp_path)  # online, once: fills the cache
    recipe = _recipe(tmp_path, ["alice/tiny-a", f"alice/tiny-b@{commit_b}"], output={"dir": str(tmp_path / "out")})

    # the plan (in this process: the cache and HF_HUB_OFFLINE as the client would read them)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    lines = plan(load_recipe(recipe))
    assert f"resolved: alice/tiny-a -> commit {commit_a} (resolved from the local Hugging Face cache, offline)" in lines
    cached = f"resolved: alice/tiny-b@{commit_b} -> commit {commit_b} (resolved from the local Hugging Face cache"
    assert any(line.startswith(cached) for line in lines), lines

    # the run, as on a cluster node: downloads off, the Hub unreachable
    env = client_env(hub, ALICE_TOKEN, tmp_path)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_ENDPOINT=_closed_port(), HF_REBASIN_HUB_TIMEOUT="2")
    proc = run_cli(str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "resolved from the local Hugging Face cache (offline)" in flat(proc.stdout)
    out = tmp_path / "out"
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert [m["commit"] for m in record["models"]] == [commit_a, commit_b]
    assert _sha(out / "chat_template.jinja") == _sha(tmp_path / "src-a" / "chat_template.jinja")
    assert _sha(out / "generation_config.json") == _sha(tmp_path / "src-a" / "generation_config.json")
    assert "license: mit" in (out / "README.md").read_text(encoding="utf-8")

    # a revision the cache does not hold: named, with what to do
    missing = _recipe(tmp_path, ["alice/tiny-a", "alice/tiny-b@v2"], output={"dir": str(tmp_path / "out2")})
    with pytest.raises(
        ModelNotFoundError, match=r"`models.1.model`: 'alice/tiny-b@v2' is not in the local Hugging Face cache"
    ):
        plan(load_recipe(missing))
