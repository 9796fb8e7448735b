"""job: align (hf_rebasin/recipe/jobs/align.py, hf_rebasin/run/jobs/align.py): every model written in A's basis as a stock model folder,
checked with stock transformers (not hf-rebasin's loader): each folder computes what its input
computed, and B's folder is B moved towards A (its weights closer to A's than B's were)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T
import yaml
from safetensors.torch import load_file

import tiny
from helpers import flat, run_main
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from hf_rebasin.recipe import RecipeError, loads_recipe
from hf_rebasin.recipe.describe import describe


@pytest.fixture
def models(tmp_path: Path) -> list[Path]:
    """Three tiny GPT-2 of different seeds with one character tokenizer."""
    tok = char_tokenizer(shakespeare_text(["hamlet"])[:3000].lower())
    folders = []
    for seed in range(3):
        folder = tmp_path / f"gpt2-{seed}"
        tiny.gpt2(seed).save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
        folders.append(folder)
    return folders


def _recipe(tmp_path: Path, models: list[Path], strategy: str) -> Path:
    body = {"job": "align", "models": [str(m) for m in models], "strategy": strategy, "output": {"dir": "out"}}
    path = tmp_path / "align.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    return path


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = T.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    keys = [k for k in a if k in b and a[k].is_floating_point() and a[k].shape == b[k].shape]
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in keys) ** 0.5


@pytest.mark.parametrize("strategy", ["weight-matching", "generalized-orthogonal"])
def test_align_writes_each_model_in_a_s_basis_computing_what_it_did(
    tmp_path: Path, models: list[Path], strategy: str
) -> None:
    pair = models[:2]
    proc = run_main(str(_recipe(tmp_path, pair, strategy)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert {"a", "b", "mergekit.yaml", "rebasin.json", "README.md"} <= {p.name for p in out.iterdir()}
    assert "models in one basis (a/, b/) and report written to" in flat(proc.stdout)
    ids = torch.randint(0, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    for given, written in zip(pair, (out / "a", out / "b"), strict=True):
        assert (written / "tokenizer.json").is_file()  # the input's tokenizer travels along
        assert (_logits(given, ids) - _logits(written, ids)).abs().max() <= 1e-4
    a, b = load_file(str(out / "a" / "model.safetensors")), load_file(str(out / "b" / "model.safetensors"))
    b_given = load_file(str(pair[1] / "model.safetensors"))
    a_given = load_file(str(pair[0] / "model.safetensors"))
    if strategy == "weight-matching":  # permutations: A is written as it was
        assert all(torch.equal(a[k], a_given[k]) for k in a_given if k in a)
        assert _distance(a_given, b) < _distance(a_given, b_given)
    else:  # canonical form: A's LayerNorm scales folded; still, B moved towards A
        assert _distance(a, b) < _distance(a, b_given)
    config = yaml.safe_load((out / "mergekit.yaml").read_text(encoding="utf-8"))
    assert config["merge_method"] == "slerp" and [m["model"] for m in config["models"]] == ["./a", "./b"]
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert record["recipe"]["job"] == "align" and set(record["function_preserved"]["written"]) == {"A", "B"}
    distance = record["diagnostics"]["distance"]["B"]
    assert distance["after"] < distance["before"]
    card = (out / "README.md").read_text(encoding="utf-8")
    assert card.splitlines()[0] == "---" and "# In one basis: gpt2-0, gpt2-1" in card
    assert "library_name" not in card.split("---")[1]  # the folder is not itself a model


def test_align_of_three_models_writes_a_linear_mergekit_config(tmp_path: Path, models: list[Path]) -> None:
    proc = run_main(str(_recipe(tmp_path, models, "weight-matching")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    config = yaml.safe_load((out / "mergekit.yaml").read_text(encoding="utf-8"))
    assert config["merge_method"] == "linear"
    assert [m["model"] for m in config["models"]] == ["./a", "./b", "./c"]
    assert all((out / name / "model.safetensors").is_file() for name in "abc")


def test_align_recipes_refuse_what_belongs_to_other_jobs(tmp_path: Path) -> None:
    head = "job: align\nmodels: [zoo:gpt2-seed0, zoo:gpt2-seed1]\nstrategy: vanilla\noutput: {dir: out}\n"
    recipe = loads_recipe(head, base_dir=tmp_path)
    assert "align: writes a/, b/" in "\n".join(describe(recipe))
    for extra, message in [
        ("merge: {weight: 0.5}\n", "averages nothing"),
        ("evaluate: {task: causal-lm, data: {dataset: shakespeare, split: test}}\n", "scores nothing"),
        ("alpha: 1.0\n", "belongs to job: transport"),
    ]:
        with pytest.raises(RecipeError, match=message):
            loads_recipe(head + extra, base_dir=tmp_path)
