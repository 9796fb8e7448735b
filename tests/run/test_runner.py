"""Recipes through the real CLI: ``hf-rebasin RECIPE.yaml`` on tiny models saved to folders.

Every task gets a merge or barrier run on tiny random models with their own tokenizer or image
processor; the output folder is checked file by file (model, card, plot, tables, rebasin.json), and broken
recipes must exit 2 naming the field, without a traceback and without creating the output.
The CLI runs in this process (`test_cli.run_main`): what it prints and the folder it writes are the
point here; the process itself (start-up, signals, the terminal) is tested in test_cli.py,
test_output_safety.py and test_examples.py.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml

import tiny
from helpers import assert_user_error, flat, run_main
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text

RUN_KEYS = {"recipe", "models", "strategy", "barrier", "curves", "function_preserved", "timings"}
TIMING_KEYS = {"load", "align", "check", "evaluate", "save"}  # check: the function-preservation check


@pytest.fixture(scope="module")
def text() -> str:
    """A little lower-case Shakespeare: few distinct characters, so the vocabulary fits tiny.V."""
    return shakespeare_text(["hamlet"])[:3000].lower()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """Offline, with `datasets`' cache inside the test's folder."""
    return {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds-cache")}


def _tokenizer(text: str, mask: bool = False) -> T.PreTrainedTokenizerBase:
    tok = char_tokenizer(text)
    if mask:
        tok.add_special_tokens({"mask_token": "[MASK]"})
    assert len(tok) <= tiny.V
    return tok


def _save(model: torch.nn.Module, folder: Path, processor: Any) -> Path:
    model.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    return folder


def _recipe(tmp_path: Path, body: dict[str, Any], name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    return path


def _text_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def gpt2_pair(tmp_path: Path, text: str) -> tuple[Path, Path]:
    tok = _tokenizer(text)
    return _save(tiny.gpt2(0), tmp_path / "gpt2-a", tok), _save(tiny.gpt2(1), tmp_path / "gpt2-b", tok)


def _rebasin_json(folder: Path) -> dict[str, Any]:
    data = json.loads((folder / "rebasin.json").read_text(encoding="utf-8"))
    assert RUN_KEYS <= set(data), sorted(data)
    assert set(data["timings"]) == TIMING_KEYS
    assert all(isinstance(v, float) and v >= 0 for v in data["timings"].values())
    return data


def _check_curves(data: dict[str, Any], names: list[str], points: int) -> None:
    assert list(data["curves"]) == sorted(names) and sorted(data["barrier"]) == sorted(names)
    for name in names:
        curve = data["curves"][name]
        assert curve["lambdas"] == [i / (points - 1) for i in range(points)]
        assert len(curve["loss"]) == points and all(isinstance(x, float) for x in curve["loss"])
        assert set(data["barrier"][name]) == {"midpoint", "linear"}


def _logits(model: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**inputs).logits


# ------------------------------------------------------------------------------------------------
# merge and barrier jobs, one per task
# ------------------------------------------------------------------------------------------------


def test_causal_lm_canonical_merge_at_weight_one_is_model_a(tmp_path: Path, text: str, env, gpt2_pair) -> None:
    a, b = gpt2_pair
    corpus = _text_file(tmp_path, text)
    recipe = _recipe(
        tmp_path,
        {
            "job": "merge",
            "models": [str(a), {"model": "./gpt2-b"}],
            "strategy": {"name": "generalized-orthogonal", "iterations": 2},
            "merge": {"weight": 1.0},
            "evaluate": {
                "task": "causal-lm",
                "data": {"dataset": "text", "data_files": corpus.name},
                "points": 3,
                "max_tokens": 400,
            },
            "output": {"dir": "out/merged"},
        },
    )
    proc = run_main(str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out" / "merged"
    names = {p.name for p in out.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "rebasin.json",
        "barrier.png",
        "barrier.md",
        "README.md",
    } <= names
    assert set(data_merged := json.loads((out / "rebasin.json").read_text(encoding="utf-8"))["merged"]) == {
        "generalized-orthogonal",
        "vanilla",
    }
    assert data_merged["generalized-orthogonal"]["count"] > 0
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folder left behind
    data = _rebasin_json(out)
    assert data["strategy"] == "generalized-orthogonal"
    assert data["models"] == [
        {"model": a.name, "revision": None, "commit": None, "source": "local", "folder": a.name, "ignored_tensors": {}},
        {"model": b.name, "revision": None, "commit": None, "source": "local", "folder": b.name, "ignored_tensors": {}},
    ]
    assert data["recipe"]["job"] == "merge" and data["recipe"]["strategy"]["iterations"] == 2
    _check_curves(data, ["generalized-orthogonal", "vanilla"], 3)
    assert data["function_preserved"]["max_abs_diff"] < 1e-4
    text_out = flat(proc.stdout)
    assert "midpoint" in text_out and "linear" in text_out and "loss at ½" in text_out and "vanilla" in text_out

    # canonical form: norms folded, the LM head untied, still a stock GPT-2 computing A's function
    merged = T.GPT2LMHeadModel.from_pretrained(str(out))
    assert merged.config.tie_word_embeddings is False and data["untied"] == ["lm_head.weight"]
    assert torch.all(merged.transformer.ln_f.weight == 1)
    reference = T.GPT2LMHeadModel.from_pretrained(str(a))
    ids = torch.randint(0, tiny.V, (2, 10), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(merged, input_ids=ids), _logits(reference, input_ids=ids), atol=1e-4, rtol=0)
    assert T.AutoTokenizer.from_pretrained(str(out)).get_vocab() == T.AutoTokenizer.from_pretrained(str(a)).get_vocab()


def _digits(tmp_path: Path, n: int = 20) -> Path:
    """An imagefolder of 8×8 digits, classes 0..4 (the tiny ViT's 5 labels)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    root = tmp_path / "digits"
    for i in range(n):
        folder = root / str(int(digits.target[i]) % 5)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((digits.images[i] * 15).astype("uint8"), mode="L").save(folder / f"{i}.png")
    return root


def test_image_classification_merge_of_three_models(tmp_path: Path, env) -> None:
    processor = T.ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5], image_std=[0.5])
    folders = [_save(tiny.vit(seed), tmp_path / f"vit-{seed}", processor) for seed in range(3)]
    _digits(tmp_path)
    recipe = _recipe(
        tmp_path,
        {
            "job": "merge",
            "models": [f"./vit-{i}" for i in range(3)],
            "strategy": "weight-matching",
            "merge": {"weight": [1.0, 0.0, 0.0]},
            "evaluate": {
                "task": "image-classification",
                "data": {"dataset": "imagefolder", "data_dir": "digits"},
                "points": 3,
                "compare": [],
            },
            "output": {"dir": "vit-merged"},
        },
    )
    proc = run_main("run", str(recipe), "--device", "cpu", env=env)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "vit-merged"
    assert {"model.safetensors", "config.json", "preprocessor_config.json", "barrier.png", "barrier.md"} <= {
        p.name for p in out.iterdir()
    }
    data = _rebasin_json(out)
    _check_curves(data, ["weight-matching"], 3)
    assert set(data["curves"]["weight-matching"]["metric"]) == {"accuracy"}
    assert [m["model"] for m in data["models"]] == [f.name for f in folders]  # relative to the recipe
    assert data["function_preserved"]["max_abs_diff"] < 1e-4
    assert "accuracy at λ=½" in (out / "barrier.md").read_text(encoding="utf-8")
    merged = T.ViTForImageClassification.from_pretrained(str(out))
    reference = T.ViTForImageClassification.from_pretrained(str(folders[0]))
    pixels = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(merged, pixel_values=pixels), _logits(reference, pixel_values=pixels))
    assert isinstance(T.AutoImageProcessor.from_pretrained(str(out)), T.ViTImageProcessorPil | T.ViTImageProcessor)


def test_masked_lm_barrier_with_alignment_data(tmp_path: Path, text: str, env) -> None:
    tok = _tokenizer(text, mask=True)
    a = _save(tiny.bert_mlm(0), tmp_path / "bert-a", tok)
    _save(tiny.bert_mlm(1), tmp_path / "bert-b", tok)
    _text_file(tmp_path, text)
    recipe = _recipe(
        tmp_path,
        {
            "job": "barrier",
            "models": ["./bert-a", "./bert-b"],
            "strategy": {"name": "head-perm"},
            "data": {"dataset": "text", "data_files": "corpus.txt", "max_tokens": 800},
            "evaluate": {
                "task": "masked-lm",
                "data": {"dataset": "text", "data_files": "corpus.txt"},
                "points": 3,
                "max_tokens": 400,
                "compare": ["vanilla"],
            },
            "output": {"dir": "bert-barrier"},
        },
    )
    output = tmp_path / "elsewhere"
    proc = run_main(str(recipe), "--output", str(output), env=env)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "bert-barrier").exists()  # --output overrides output.dir
    names = {p.name for p in output.iterdir()}
    assert names == {"rebasin.json", "barrier.png", "barrier.md", "alignment.png", "README.md"}  # no model
    data = _rebasin_json(output)
    assert data["recipe"]["output"]["dir"] == "elsewhere"  # relative to the recipe: no local folder layout
    _check_curves(data, ["head-perm", "vanilla"], 3)
    assert data["strategy_options"]["residual"] == "all"  # unset in the recipe: settled from the models
    assert set(data["curves"]["vanilla"]["metric"]) == {"pseudo_perplexity"}
    assert data["function_preserved"]["max_abs_diff"] < 1e-4
    assert data["models"][0] == {
        "model": a.name,
        "revision": None,
        "commit": None,
        "source": "local",
        "folder": a.name,
        "ignored_tensors": {},
    }
    assert "activation statistics" in proc.stdout


def test_sequence_classification_barrier_from_csv(tmp_path: Path, text: str, env) -> None:
    tok = _tokenizer(text)
    _save(tiny.bert_cls(0), tmp_path / "cls-a", tok)
    _save(tiny.bert_cls(1), tmp_path / "cls-b", tok)
    lines = [line for line in text.splitlines() if line.strip()][:24]
    with (tmp_path / "labels.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence", "label"])
        writer.writerows([line, i % 3] for i, line in enumerate(lines))
    recipe = _recipe(
        tmp_path,
        {
            "job": "barrier",
            "models": ["./cls-a", "./cls-b"],
            "strategy": "transfusion",
            "evaluate": {
                "task": "sequence-classification",
                "data": {"dataset": "csv", "data_files": "labels.csv", "column": "sentence"},
                "points": 3,
            },
            "output": {"dir": "cls-barrier"},
        },
    )
    proc = run_main(str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    data = _rebasin_json(tmp_path / "cls-barrier")
    _check_curves(data, ["transfusion", "vanilla"], 3)
    accuracy = data["curves"]["transfusion"]["metric"]["accuracy"]
    assert len(accuracy) == 3 and all(0.0 <= x <= 1.0 for x in accuracy)
    out = flat(proc.stdout)
    assert "transfusion" in out and "vanilla" in out and "report written to" in out


# ------------------------------------------------------------------------------------------------
# dry runs and broken recipes: exit 2 naming the field, no traceback, nothing written
# ------------------------------------------------------------------------------------------------


def _merge_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "job": "merge",
        "models": ["./gpt2-a", "./gpt2-b"],
        "strategy": {"name": "weight-matching"},
        "output": {"dir": "out"},
    }
    body.update(changes)
    return body


def test_dry_run_loads_no_weights_and_writes_nothing(tmp_path: Path, env, gpt2_pair) -> None:
    path = tmp_path / "gpt2-b" / "model.safetensors"
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")  # a checked header, then bytes that are all NaN:
    path.write_bytes(data[:start] + b"\xff" * (len(data) - start))  # loading them would fail
    recipe = _recipe(tmp_path, _merge_body(evaluate=None))
    proc = run_main(str(recipe), "--dry-run", env=env)
    assert proc.returncode == 0, proc.stderr
    out = flat(proc.stdout)
    assert "job: merge" in out and "strategy: weight-matching" in out and "no weights were loaded" in out
    assert not (tmp_path / "out").exists()


def _broken(tmp_path: Path, body: dict[str, Any], capsys: Any, *needles: str, dry_run: bool = False) -> str:
    """Run a broken recipe through the CLI's entry point."""
    from hf_rebasin.cli import main

    recipe = _recipe(tmp_path, body, name="broken.yaml")
    capsys.readouterr()  # what the fixtures printed
    code = main([str(recipe), *(["--dry-run"] if dry_run else [])])
    captured = capsys.readouterr()
    err = flat(captured.err)
    assert code == 2, (code, captured.out, captured.err)
    assert err.startswith("error:") and "Traceback" not in captured.err + captured.out
    for needle in needles:
        assert needle in err, (needle, captured.err)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    return err


def test_broken_recipes_exit_2_naming_the_field(tmp_path: Path, capsys: Any, gpt2_pair) -> None:
    _broken(tmp_path, _merge_body(strategy={"name": "weight-matching", "iteratons": 3}), capsys, "strategy.iteratons")
    _broken(tmp_path, _merge_body(colour="red"), capsys, "`colour`", "not a known key")
    _broken(tmp_path, _merge_body(job="blend"), capsys, "`job`", "merge", "barrier")
    _broken(tmp_path, _merge_body(strategy={"name": "weight-matching", "seed": "x"}), capsys, "strategy.seed")
    _broken(tmp_path, _merge_body(job="barrier"), capsys, "evaluate")
    body = _merge_body(models=["./gpt2-a", "./no-such-model"])
    for dry_run in (True, False):
        _broken(tmp_path, body, capsys, "models.1.model", "no-such-model", dry_run=dry_run)
    body = _merge_body(
        evaluate={"task": "causal-lm", "data": {"dataset": "text", "data_files": "missing.txt"}, "points": 3}
    )
    _broken(tmp_path, body, capsys, "evaluate.data", "missing.txt", dry_run=True)
    _broken(tmp_path, _merge_body(models=["./gpt2-a", "org/not-downloaded"]), capsys, "models.1.model", "the Hub")
    body = _merge_body(evaluate={"task": "masked-lm", "data": {"dataset": "text", "data_files": "corpus.txt"}})
    (tmp_path / "corpus.txt").write_text("some text\n")
    for dry_run in (True, False):  # the head is read from config.json: no weights needed to refuse it
        _broken(tmp_path, body, capsys, "evaluate.task", "'masked-lm'", "GPT2LMHeadModel", "causal-lm", dry_run=dry_run)


def test_existing_output_folder_is_refused_and_kept(tmp_path: Path, env, gpt2_pair) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier result")
    recipe = _recipe(tmp_path, _merge_body())
    proc = run_main(str(recipe), env=env)
    assert_user_error(proc, "already exists", "overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_overwrite_replaces_the_folder(tmp_path: Path, capsys: Any, gpt2_pair) -> None:
    from hf_rebasin.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("earlier result")
    (out / "rebasin.json").write_text("{}")  # an earlier hf-rebasin output: the only kind overwrite replaces
    recipe = _recipe(tmp_path, _merge_body(output={"dir": "out", "overwrite": True}))
    assert main([str(recipe)]) == 0, capsys.readouterr().err
    names = {p.name for p in out.iterdir()}
    assert "stale.txt" not in names and {"model.safetensors", "rebasin.json", "tokenizer.json"} <= names
    data = _rebasin_json(out)
    assert data["barrier"] == {} and data["curves"] == {}  # no evaluate: section
    assert data["timings"]["evaluate"] == 0.0
    assert data["function_preserved"]["inputs"] == "random example inputs"
    assert data["function_preserved"]["max_abs_diff"] < 1e-4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_schema_prints_the_recipe_json_schema(capsys: Any) -> None:
    from hf_rebasin.cli import main

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert (
        schema["title"].startswith("hf-rebasin recipe") and "strategy" in schema["$defs"]["MergeRecipe"]["properties"]
    )


def test_recipe_shorthand_only_takes_recipe_paths() -> None:
    from hf_rebasin.cli import recipe_shorthand

    assert recipe_shorthand(["r.yaml", "--dry-run"]) == ["run", "r.yaml", "--dry-run"]
    assert recipe_shorthand(["--dry-run", "dir/r.YML"]) == ["run", "--dry-run", "dir/r.YML"]
    assert recipe_shorthand(["--output", "out", "r.yaml"]) == ["run", "--output", "out", "r.yaml"]
    assert recipe_shorthand(["verify.yaml"]) == ["run", "verify.yaml"]
    assert recipe_shorthand(["verify", "model"]) == ["verify", "model"]
    assert recipe_shorthand(["nonsense"]) == ["nonsense"]  # argparse then names the valid commands
    assert recipe_shorthand(["run", "r.yaml"]) == ["run", "r.yaml"]
    assert recipe_shorthand(["schema"]) == ["schema"]
    assert recipe_shorthand(["--version"]) == ["--version"]


def test_missing_recipe_file_exits_2(tmp_path: Path, capsys: Any) -> None:
    from hf_rebasin.cli import main

    assert main([str(tmp_path / "nope.yaml")]) == 2
    err = flat(capsys.readouterr().err)
    assert err.startswith("error:") and "nope.yaml" in err and "does not exist" in err


# ------------------------------------------------------------------------------------------------
# the pieces under the runner
# ------------------------------------------------------------------------------------------------


def test_merge_state_dicts_keeps_ties_dtypes_and_buffers() -> None:
    from hf_rebasin.merging.interpolate import merge_state_dicts

    models = [tiny.gpt2(seed) for seed in range(3)]
    sds = [m.state_dict() for m in models]
    merged = merge_state_dicts(sds, [0.5, 0.25, 0.25])
    for name, t in merged.items():
        want = 0.5 * sds[0][name].double() + 0.25 * sds[1][name].double() + 0.25 * sds[2][name].double()
        torch.testing.assert_close(t, want.float(), atol=1e-6, rtol=0)
    # the tied LM head stays one tensor with the embeddings
    assert merged["lm_head.weight"].data_ptr() == merged["transformer.wte.weight"].data_ptr()
    # weight 1 on the reference gives the reference exactly, dtypes kept, integer buffers from the reference
    half = {"w": torch.randn(3, 4).half(), "n": torch.tensor([7])}
    other = {"w": torch.randn(3, 4).half(), "n": torch.tensor([9])}
    out = merge_state_dicts([half, other], [1.0, 0.0])
    assert out["w"].dtype == torch.float16 and torch.equal(out["w"], half["w"]) and out["n"].item() == 7
    with pytest.raises(ValueError, match="one weight per model"):
        merge_state_dicts([half, other], [1.0])
    from hf_rebasin.core.errors import IncompatibleModelsError

    with pytest.raises(IncompatibleModelsError, match="'w'"):
        merge_state_dicts([half, {"w": torch.zeros(4, 3).half(), "n": torch.tensor([1])}], [0.5, 0.5])


def test_output_folder_leaves_nothing_half_written(tmp_path: Path) -> None:
    from hf_rebasin.core.errors import OutputExistsError
    from hf_rebasin.io.output import output_folder

    target = tmp_path / "result"
    with pytest.raises(RuntimeError), output_folder(target, overwrite=False) as tmp:
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("failed while saving")
    assert list(tmp_path.iterdir()) == []
    with output_folder(target, overwrite=False) as tmp:
        (tmp / "rebasin.json").write_text("first")  # an hf-rebasin output: overwrite may replace it
    with pytest.raises(OutputExistsError, match="overwrite"), output_folder(target, overwrite=False):
        pass
    with pytest.raises(RuntimeError), output_folder(target, overwrite=True) as tmp:
        raise RuntimeError("failed while saving")
    assert [p.name for p in tmp_path.iterdir()] == ["result"] and (target / "rebasin.json").read_text() == "first"
    with output_folder(target, overwrite=True) as tmp:
        (tmp / "rebasin.json").write_text("second")
    assert [p.name for p in tmp_path.iterdir()] == ["result"] and [p.name for p in target.iterdir()] == ["rebasin.json"]
    assert (target / "rebasin.json").read_text() == "second"


def test_custom_code_needs_trust_remote_code_and_never_runs(tmp_path: Path, capsys: Any, gpt2_pair) -> None:
    config = tmp_path / "gpt2-b" / "config.json"
    data = json.loads(config.read_text(encoding="utf-8"))
    data["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    config.write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "gpt2-b" / "modeling_evil.py").write_text("raise SystemExit('repository code ran')\n")
    for dry_run in (True, False):
        _broken(tmp_path, _merge_body(), capsys, "models.1.model", "ships its own modeling code", dry_run=dry_run)

    from hf_rebasin.cli import main

    recipe = _recipe(tmp_path, _merge_body(trust_remote_code=True))
    assert main([str(recipe)]) == 0, capsys.readouterr()  # the stock GPT2LMHeadModel, the code untouched
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_learned_matching_writes_its_curve_and_the_card_shows_it(tmp_path: Path, text: str, env, gpt2_pair) -> None:
    """`learned: true` in a barrier run: learned.png (a real PNG), the held-out curve in rebasin.json,
    a card section with the plot and the sentence, and B's function still preserved."""
    a, b = gpt2_pair
    _text_file(tmp_path, text)
    recipe = _recipe(
        tmp_path,
        {
            "job": "barrier",
            "models": [a.name, b.name],
            "strategy": {
                "name": "generalized-orthogonal",
                "iterations": 2,
                "learned": True,
                "steps": 6,
                "eval_every": 2,
                "patience": 0,
                "lr": 0.05,
                "sampler": "fixed(0.5)",
            },
            "data": {"dataset": "text", "data_files": "corpus.txt", "max_tokens": 1200, "block_size": 24},
            "evaluate": {"task": "causal-lm", "data": {"dataset": "text", "data_files": "corpus.txt"}, "points": 3},
            "output": {"dir": "learned"},
        },
    )
    proc = run_main(str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "learned"
    assert (out / "learned.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = _rebasin_json(out)
    history = data["diagnostics"]["learned"]
    assert history["steps"] == [0, 2, 4, 6] and history["unit"] == "tokens"
    assert len(history["barrier"]) == 4 and history["best"] == min(history["barrier"])
    assert history["tokens"][0] == 0 and history["tokens"][-1] > 0
    assert data["function_preserved"]["max_abs_diff"] < 1e-4
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "## Learned matching" in card and "![learned matching](learned.png)" in card
    assert (out / "alignment.png").read_bytes()[
        :8
    ] == b"\x89PNG\r\n\x1a\n" and "![alignment per space](alignment.png)" in card
    spaces = {e["space"]: e for e in data["diagnostics"]["alignment"]["spaces"]}
    assert list(spaces) == ["res", "h.0.attn", "h.1.attn", "h.0.mlp", "h.1.mlp"]
    weakest = min(spaces, key=lambda n: spaces[n]["after"])
    assert f"The alignment is weakest in `{weakest}`" in card
    assert f"{history['barrier'][0]:.4f} nats at the data-free start" in card
