"""The plan (hf_rebasin.run.plan): every weight-free check once, models by role, the dry-run lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import tiny
from hf_rebasin.core.errors import OutputExistsError
from hf_rebasin.core.roles import MergeRoles
from hf_rebasin.recipe import loads_recipe
from hf_rebasin.run import build_plan, plan


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
    assert checked.remote_checked == {0, 1}  # the run does not check these again
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
