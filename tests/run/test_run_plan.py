"""The plan (hf_rebasin.run.plan): every weight-free check once, models by role, the dry-run lines."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import GPT2LMHeadModel

import tiny
from hf_rebasin.core.errors import OutputExistsError
from hf_rebasin.core.roles import MergeRoles
from hf_rebasin.recipe import loads_recipe
from hf_rebasin.run import build_plan, execute, pipeline, plan


@pytest.fixture
def recipe_text(tmp_path: Path) -> str:
    for seed in (0, 1):
        tiny.gpt2(seed).save_pretrained(tmp_path / f"m{seed}")
    body = {
        "job": "merge",
        "models": [str(tmp_path / "m0"), str(tmp_path / "m1")],
        "strategy": "weight-matching",
        "output": {"dir": str(tmp_path / "out")},
    }
    return yaml.safe_dump(body)


def test_a_plan_holds_the_models_by_role_and_what_it_checked(recipe_text: str, tmp_path: Path) -> None:
    checked = build_plan(loads_recipe(recipe_text))
    assert isinstance(checked.models, MergeRoles)
    assert checked.models.reference.folder == tmp_path / "m0"
    assert [m.where for m in checked.models.others] == ["models.1.model"]
    assert all(m.ready for m in checked.all)
    assert checked.checks.remote == {0, 1}  # the run does not check these again
    assert checked.output == tmp_path / "out" and checked.output_field == "`output.dir`"
    assert checked.lines()[-1].startswith("checks: ")


def test_output_given_on_the_command_line_is_shown_and_checked(recipe_text: str, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    lines = plan(loads_recipe(recipe_text), output=other)
    assert f"output: {other} (from --output)" in lines
    other.mkdir()
    (other / "x").write_text("not a run's output")
    with pytest.raises(OutputExistsError, match="--output"):
        build_plan(loads_recipe(recipe_text), output=other)


def test_the_plan_decides_the_steps_and_the_push(recipe_text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The steps the run takes are the plan's, printed by the dry run; a push is planned with its message."""
    planned = build_plan(loads_recipe(recipe_text))
    assert planned.steps == ("load", "job", "write") and planned.push is None
    assert "steps: load (streamed: tensor by tensor from the files) → merge → write" in planned.lines()
    assert planned.streamed  # a data-free merge without evaluation reads its models tensor by tensor

    monkeypatch.setattr(importlib.import_module("hf_rebasin.run.checks"), "has_token", lambda: True)
    body = {**yaml.safe_load(recipe_text), "evaluate": {"task": "causal-lm", "data": {"dataset": "shakespeare"}}}
    body["output"] = {**body["output"], "push_to_hub": {"repo": "alice/merged", "private": True}}
    pushed = build_plan(loads_recipe(yaml.safe_dump(body)))
    assert pushed.steps == ("load", "job", "write", "push") and not pushed.streamed
    assert pushed.push is not None and (pushed.push.repo, pushed.push.private) == ("alice/merged", True)
    assert pushed.push.message.startswith("hf-rebasin merge with weight-matching (")
    assert "steps: load → merge → write → push to alice/merged" in pushed.lines()


def test_execute_runs_the_plans_steps_in_order(recipe_text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`execute` runs what the plan lists, by name, and nothing else: a plan read before the run is the run."""
    planned = build_plan(loads_recipe(recipe_text))
    ran: list[str] = []
    for name, step in list(pipeline.STEPS.items()):
        monkeypatch.setitem(pipeline.STEPS, name, lambda run, name=name, step=step: ran.append(name) or step(run))
    result = execute(planned)
    assert ran == ["load", "job", "write"]
    assert result.output == planned.output and "rebasin.json" in result.files
    merged, info = GPT2LMHeadModel.from_pretrained(planned.output, output_loading_info=True)  # the stock class
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with safe_open(str(planned.output / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("transformer.wte.weight"), merged.transformer.wte.weight)
