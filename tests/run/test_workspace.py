"""The run's seams in process: a recipe planned and loaded into a `Workspace` (hf_rebasin.run.load),
a shared stage on it (`stages.align_others`) and a job run on it (`jobs.<job>.run`), each checked
against plain transformers and safetensors rather than against hf-rebasin's own code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import tiny
from hf_rebasin.core.roles import MergeRoles
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from hf_rebasin.recipe import load_recipe
from hf_rebasin.run.load import Workspace, load_workspace
from hf_rebasin.run.pipeline import run_job
from hf_rebasin.run.plan import build_plan
from hf_rebasin.run.stages import align_others
from lm_folders import stock_lm, transformers_loss


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """A barrier of two tiny GPT-2 (different seeds) on built-in Shakespeare, loaded on the CPU."""
    root = tmp_path_factory.mktemp("workspace")
    tok = char_tokenizer(shakespeare_text(["hamlet"])[:3000].lower())
    for seed in (0, 1):
        tiny.gpt2(seed).save_pretrained(str(root / f"m{seed}"))
        tok.save_pretrained(str(root / f"m{seed}"))
    recipe = {
        "job": "barrier",
        "models": ["./m0", "./m1"],
        "strategy": "weight-matching",
        "evaluate": {
            "task": "causal-lm",
            "data": {"dataset": "shakespeare", "name": "hamlet", "split": "test", "max_tokens": 600},
            "points": 3,
            "compare": [],
        },
        "output": {"dir": "out"},
        "device": "cpu",
        "cache": False,
    }
    path = root / "barrier.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return load_workspace(build_plan(load_recipe(path)))


def test_the_workspace_holds_the_models_by_role_as_their_files_store_them(workspace: Workspace) -> None:
    models = workspace.models
    assert isinstance(models, MergeRoles) and models.names == ("A", "B")
    for planned, loaded in zip(workspace.inputs.all, models.all, strict=True):
        stored = load_file(str(Path(planned.path) / "model.safetensors"))
        live = loaded.model.state_dict()
        assert all(torch.equal(stored[k], live[k]) for k in stored)
    assert workspace.dtype.inputs == {"A": "float32", "B": "float32"}
    assert workspace.eval_batches and all({"input_ids", "labels"} <= set(b) for b in workspace.eval_batches)
    assert workspace.align is None  # weight matching reads no data


def test_a_stage_on_the_workspace_aligns_b_without_changing_what_it_computes(workspace: Workspace) -> None:
    models = workspace.models
    assert isinstance(models, MergeRoles)
    (alignment,) = align_others(workspace, models)
    b = stock_lm(Path(workspace.inputs.all[1].path))
    moved = stock_lm(Path(workspace.inputs.all[1].path))
    moved.load_state_dict({k: v.clone() for k, v in alignment.aligned_b().items()}, strict=False)
    ids = workspace.eval_batches[0]["input_ids"]
    with torch.no_grad():
        assert (b(input_ids=ids).logits - moved(input_ids=ids).logits).abs().max() <= 1e-4


def test_a_job_run_on_the_workspace_scores_the_ends_as_transformers_does(workspace: Workspace, tmp_path: Path) -> None:
    done = run_job(workspace)
    curve = done.result.findings.curves["weight-matching"]
    assert curve["lambdas"] == [0.0, 0.5, 1.0]
    a, b = (stock_lm(Path(m.path)) for m in workspace.inputs.all)
    # λ is the weight on A: λ = 1 is A, λ = 0 is B (aligned: the same function as B)
    assert curve["loss"][-1] == pytest.approx(transformers_loss(a, workspace.eval_batches), rel=1e-5)
    assert curve["loss"][0] == pytest.approx(transformers_loss(b, workspace.eval_batches), rel=1e-5)
    assert done.result.written == "report" and not done.result.saved_model
    done.save(tmp_path)
    assert {"barrier.png", "barrier.md"} <= {p.name for p in tmp_path.iterdir()}
    assert not (tmp_path / "model.safetensors").exists()
