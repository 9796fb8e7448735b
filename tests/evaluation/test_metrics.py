"""`evaluate.metrics`: metrics a recipe names, loaded with `evaluate.load` (local scripts here: no
network), computed at every λ of a classification curve and shown in rebasin.json, the table,
the plot and the card; a metric that does not load, or a task it does not fit, is a user error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml
from PIL import Image
from test_train_eval import TINY_VIT

from helpers import assert_user_error, run_cli
from hf_rebasin.evaluation import data
from hf_rebasin.evaluation.zoo import train

METRIC = Path(__file__).resolve().parents[2] / "recipes" / "metrics" / "f1.py"  # shipped with the recipes


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """Offline, with the caches `evaluate` and `datasets` write inside the test's folder."""
    return {
        "HF_DATASETS_OFFLINE": "1",
        "HF_EVALUATE_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_DATASETS_CACHE": str(tmp_path / "ds-cache"),
    }


def _recipe(tmp_path: Path, evaluate: dict[str, Any], models: list[str] | None = None) -> Path:
    """A barrier recipe in ``tmp_path`` on ``models`` (default: the zoo ViTs, trained on first use)."""
    if models is None:
        models = [str(train.cached_model("vit", 0)), str(train.cached_model("vit", 1))]
    body = {"job": "barrier", "models": models, "strategy": "vanilla", "evaluate": evaluate}
    body["output"] = {"dir": "out"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    return path


def _sklearn_f1(folder: Path) -> float:
    """Macro F1 of the zoo ViT in ``folder`` on the digits test split, from its own logits, by scikit-learn."""
    from sklearn.metrics import f1_score

    images, labels = data.digits_dataset("test")
    pixels = ((images[:, 0] * 0.5 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    processor = T.AutoImageProcessor.from_pretrained(str(folder))
    model = T.AutoModelForImageClassification.from_pretrained(str(folder)).eval()
    inputs = processor(images=[Image.fromarray(p) for p in pixels], return_tensors="pt")
    with torch.no_grad():
        predicted = model(**inputs).logits.argmax(-1)
    return float(f1_score(labels.numpy(), predicted.numpy(), average="macro"))


@pytest.mark.slow  # trains the two zoo ViTs on an empty cache (75 s)
def test_local_metric_at_every_lambda_matches_sklearn(tmp_path: Path, env: dict[str, str]) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "simple_f1.py").write_text(METRIC.read_text(encoding="utf-8"), encoding="utf-8")
    recipe = _recipe(
        tmp_path,
        {
            "task": "image-classification",
            "data": {"dataset": "digits", "split": "test"},
            "points": 3,
            "compare": [],
            "metrics": [{"name": "metrics/simple_f1.py", "kwargs": {"average": "macro"}}],  # relative to the recipe
        },
    )
    proc = run_cli(str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    curve = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))["curves"]["vanilla"]
    assert set(curve["metric"]) == {"accuracy", "f1"} and len(curve["metric"]["f1"]) == 3
    assert all(0.0 <= v <= 1.0 for v in curve["metric"]["f1"])
    a_f1 = curve["metric"]["f1"][curve["lambdas"].index(1.0)]
    assert a_f1 == pytest.approx(_sklearn_f1(train.cached_model("vit", 0)), abs=1e-9)
    assert a_f1 > 0.5  # a trained model, not chance
    assert "f1" in (out / "barrier.md").read_text(encoding="utf-8")
    assert "f1" in (out / "README.md").read_text(encoding="utf-8")
    assert (out / "barrier.png").stat().st_size > 0


@pytest.mark.slow  # two CLI processes that load evaluate and the zoo ViT
def test_metric_that_does_not_load_is_a_user_error(tmp_path: Path, env: dict[str, str]) -> None:
    evaluate = {"task": "image-classification", "data": {"dataset": "digits", "split": "test"}, "points": 2}
    proc = run_cli(str(_recipe(tmp_path, {**evaluate, "metrics": ["accuracy"]})), env={**env, "HF_HUB_OFFLINE": "1"})
    assert_user_error(proc, "`evaluate.metrics`", "'accuracy'", "local")
    assert not (tmp_path / "out").exists()
    proc = run_cli(str(_recipe(tmp_path, {**evaluate, "metrics": ["metrics/missing.py"]})), env=env)
    assert_user_error(proc, "`evaluate.metrics`", "metrics/missing.py", "not there")


def _quick_vits(tmp_path: Path) -> list[str]:
    """Two ViTs of the zoo's kind trained for a few steps (a second, not the zoo's minute): for checks
    that need a digits classifier's predictions, not a good one."""
    return [str(train.cached_model("vit", seed, tmp_path / "zoo", config=TINY_VIT)) for seed in (0, 1)]


@pytest.mark.slow  # trains two ViTs for a few steps and runs the CLI in a process of its own (8 s)
def test_metric_that_fails_on_the_predictions_is_a_user_error(tmp_path: Path, env: dict[str, str]) -> None:
    evaluate = {"task": "image-classification", "data": {"dataset": "digits", "split": "test"}, "points": 2}
    recipe = _recipe(tmp_path, {**evaluate, "metrics": [str(METRIC)]}, models=_quick_vits(tmp_path))
    proc = run_cli(str(recipe), env=env)  # binary F1, 10 classes
    assert_user_error(proc, "`evaluate.metrics`", "multiclass", "kwargs")


def test_metrics_on_a_language_model_are_refused_at_recipe_time(tmp_path: Path, env: dict[str, str]) -> None:
    (tmp_path / "t.txt").write_text("hello\n", encoding="utf-8")
    evaluate = {"task": "causal-lm", "data": {"dataset": "text", "data_files": "t.txt"}, "metrics": [str(METRIC)]}
    proc = run_cli(str(_recipe(tmp_path, evaluate, models=["zoo:gpt2-seed0", "zoo:gpt2-seed1"])), "--dry-run", env=env)
    assert_user_error(proc, "evaluate.metrics", "classification", "causal-lm")
