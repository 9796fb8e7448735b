"""The shipped recipes (``recipes/``), the demo, the zoo command and the packaging of both.

Every example parses and dry-runs without training or loading anything; together they cover every
job × strategy. A recipe naming zoo models and built-in data runs end to end on a stand-in zoo of
tiny random models (fast); the real demo, with its trained models, runs in the slow suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import transformers as T
import yaml
from huggingface_hub import ModelCard

from helpers import ROOT, flat, run_cli, run_main
from hf_rebasin.alignment.strategies import REGISTRY
from hf_rebasin.core.resources import listing, resource
from hf_rebasin.evaluation import data
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.recipe import load_recipe
from hf_rebasin.recipe.jobs import JOBS
from hf_rebasin.run import plan

EXAMPLES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_examples_cover_every_job_and_strategy() -> None:
    assert [p.name for p in listing("recipes", "*.yaml")] == [p.name for p in EXAMPLES]
    covered = set()
    for path in EXAMPLES:
        recipe = load_recipe(path)
        covered.add((recipe.job, recipe.strategy.name))
    assert {job for job, _ in covered} == set(JOBS)  # every job has an example
    # every strategy with every job that averages or moves weights (align writes models as they are)
    assert covered >= {(job, name) for job in ("merge", "barrier", "transport") for name in REGISTRY.names}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_parses_and_dry_runs_without_training(path: Path, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_REBASIN_CACHE", str(cache))
    recipe = load_recipe(path)
    text = path.read_text(encoding="utf-8")
    assert text.lstrip().startswith("#"), "every example starts with a comment saying what it shows"
    assert recipe.text == text
    lines = plan(recipe, output=tmp_path / "out")
    assert any("zoo model, trained now (first use)" in line for line in lines)
    assert lines[-1].startswith("checks:") and "no weights were loaded" in lines[-1]
    assert not cache.exists() and not (tmp_path / "out").exists()


def test_demo_dry_run_from_the_cli(tmp_path: Path) -> None:
    proc = run_main("demo", "--dry-run", "--output", str(tmp_path / "demo"), env={"HF_REBASIN_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    out = flat(proc.stdout)
    assert (
        "zoo:gpt2-seed0" in out and "generalized-orthogonal" in out and "curves: generalized-orthogonal, vanilla" in out
    )
    assert str(resource("recipes", "demo.yaml")) in out
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Zoo models and built-in data, end to end on a stand-in zoo


def _stand_in_zoo(cache: Path, seeds: tuple[int, ...] = (0, 1)) -> list[Path]:
    """Tiny random GPT-2 where the zoo keeps its trained ones (tokenizer: the plays' characters)."""
    tok = data.char_tokenizer(data.shakespeare_text())
    folders = []
    for seed in seeds:
        folder = train.zoo_folder("gpt2", seed, cache / "zoo")
        torch.manual_seed(seed)
        cfg = T.GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=1, n_head=2, pad_token_id=0)
        T.GPT2LMHeadModel(cfg).save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
        (folder / train.TRAINING_FILE).write_text(json.dumps({"kind": "gpt2", "seed": seed}))
        folders.append(folder)
    return folders


def test_zoo_cli_prints_the_cached_folders(tmp_path: Path) -> None:
    folders = _stand_in_zoo(tmp_path)
    proc = run_main("zoo", "gpt2", "0", "1", env={"HF_REBASIN_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(f) for f in folders]


def test_zoo_cli_prints_an_adapters_folder_too(tmp_path: Path) -> None:
    import peft

    folder = train.zoo_folder("bench-t5-ft-lora", 0, tmp_path / "zoo")
    cfg = T.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2, decoder_start_token_id=0)
    lora = peft.LoraConfig(r=2, target_modules=["q", "v"], task_type="SEQ_2_SEQ_LM")
    peft.get_peft_model(T.T5ForConditionalGeneration(cfg), lora).save_pretrained(str(folder))
    (folder / train.TRAINING_FILE).write_text(json.dumps({"kind": "bench-t5-ft-lora", "seed": 0}))
    proc = run_main("zoo", "bench-t5-ft-lora", "0", env={"HF_REBASIN_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(folder)]


def test_zoo_cli_offers_every_kind_the_trainer_has_without_importing_torch() -> None:
    code = "import sys, hf_rebasin.cli as c; print(' '.join(c.build_parser()._actions[-1].choices['zoo']._actions[1].choices)); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert tuple(out[0].split()) == train.KINDS and out[1] == "False"  # `--help` stays fast


def test_zoo_models_and_builtin_data_run_end_to_end(tmp_path: Path) -> None:
    folders = _stand_in_zoo(tmp_path)
    demo = yaml.safe_load(resource("recipes", "demo.yaml").read_text(encoding="utf-8"))
    demo["evaluate"].update(points=5, max_tokens=2048)
    demo["output"] = {"dir": "merged"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(demo, sort_keys=False), encoding="utf-8")
    proc = run_main(str(path), env={"HF_REBASIN_CACHE": str(tmp_path), "HF_DATASETS_CACHE": str(tmp_path / "ds")})
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "merged"
    assert {"README.md", "rebasin.json", "barrier.png", "barrier.md", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert [m["source"] for m in record["models"]] == ["zoo", "zoo"]
    assert [m["folder"] for m in record["models"]] == [None, None]  # caches are not recorded (no local layout)
    assert record["datasets"] == [
        {"role": "evaluation", "dataset": "shakespeare", "name": None, "split": "test", "source": "builtin"}
    ]
    assert set(record["curves"]) == {"generalized-orthogonal", "vanilla"}
    for name in ("generalized-orthogonal", "vanilla"):  # weight ½ of two models: the curve's midpoint
        curve = record["curves"][name]
        mid = curve["loss"][curve["lambdas"].index(0.5)]
        assert record["merged"][name]["loss"] == pytest.approx(mid, abs=1e-6)

    card = ModelCard.load(out / "README.md")
    assert card.data.pipeline_tag == "text-generation" and "hf-rebasin" in card.data.tags
    assert card.data.base_model is None  # zoo models are not Hub ids
    assert "hf-rebasin recipe.yaml" in card.text and "zoo:gpt2-seed1" in card.text

    merged = T.AutoModelForCausalLM.from_pretrained(str(out))
    a = T.AutoModelForCausalLM.from_pretrained(str(folders[0]))
    ids = torch.randint(3, merged.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert merged(ids).logits.shape == a(ids).logits.shape


# ---------------------------------------------------------------------------------------------
# Packaging


def test_wheel_ships_the_recipes_and_the_card_template(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("hf_rebasin-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "hf_rebasin/model_cards/rebasin.md" in names
    assert {f"hf_rebasin/recipes/{p.name}" for p in EXAMPLES} <= names
    assert "hf_rebasin/recipes/metrics/f1.py" in names  # the metric script barrier-vanilla.yaml names
    assert (
        "hf_rebasin/alignment/strategies/generalized_orthogonal.py" in names
        and "hf_rebasin/symmetry/adapters/gpt2.py" in names
    )
    assert {
        "hf_rebasin/run/pipeline.py",
        "hf_rebasin/run/jobs/merge.py",
        "hf_rebasin/alignment/features/weights.py",
    } <= names
    # every package folder ships: a folder missing from pyproject's `packages` is named here
    package = ROOT / "hf_rebasin"
    folders = {
        p.parent.relative_to(ROOT).as_posix() for p in package.rglob("__init__.py") if "__pycache__" not in p.parts
    }
    assert not {f for f in folders if f"{f}/__init__.py" not in names}, "add these to [tool.setuptools] packages"


# ---------------------------------------------------------------------------------------------
# The demo itself (trains two tiny GPT-2 on first use: about two minutes, cached after)


@pytest.mark.slow
def test_demo_merges_with_a_lower_barrier_than_vanilla(tmp_path: Path) -> None:
    proc = run_cli("demo", "--output", str(tmp_path / "demo"))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "demo"
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    go, vanilla = record["barrier"]["generalized-orthogonal"], record["barrier"]["vanilla"]
    assert go["linear"] < 0.5 * vanilla["linear"], (go, vanilla)
    assert record["function_preserved"]["max_abs_diff"] < 1e-4
    printed = flat(proc.stdout)
    assert "loss barriers" in printed and "generalized-orthogonal" in printed and "vanilla" in printed
    assert "hf-rebasin demo" in (out / "README.md").read_text(encoding="utf-8")
    T.AutoModelForCausalLM.from_pretrained(str(out))
