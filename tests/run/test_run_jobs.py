"""The jobs (hf_rebasin.recipe.jobs): each module there declares one job, found without a table,
with its runner in hf_rebasin.run.jobs; a module that does not declare itself properly is refused
at import, naming what is wrong."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import hf_rebasin.recipe.jobs as jobs
import hf_rebasin.run.jobs as runners
from hf_rebasin.recipe import AlignedRecipe, loads_recipe
from hf_rebasin.recipe.jobs import JOBS, Job, discover, get_job

GOOD = """
from typing import Literal

from hf_rebasin.recipe import ModelsRecipe, AlignedRecipe
from hf_rebasin.recipe.jobs import CardPart, Job


class R(ModelsRecipe, AlignedRecipe):
    job: Literal["{name}"] = "{name}"


JOB = Job(
    name="{declared}",
    summary="a job of a test",
    recipe=R,
    writes_model=False,
    card=CardPart(title=lambda names: "t", intro="i", why="w", preserved="p", pair="B and aligned B"),
)
"""


def _names(package: object) -> list[str]:
    folder = Path(package.__file__).parent  # type: ignore[attr-defined]
    return sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_"))


def test_every_job_module_declares_its_job_and_has_a_runner() -> None:
    assert list(JOBS) == _names(jobs) == _names(runners)
    for name, job in JOBS.items():
        assert isinstance(job, Job) and job.name == name and job.runner == f"hf_rebasin.run.jobs.{name}"
        assert issubclass(job.recipe, AlignedRecipe)
        assert job.recipe.model_fields["job"].default == name
        assert callable(importlib.import_module(job.runner).run)


def test_a_recipe_is_validated_by_its_jobs_model() -> None:
    recipe = loads_recipe(
        "job: barrier\nmodels: [zoo:gpt2-seed0, zoo:gpt2-seed1]\nstrategy: vanilla\n"
        "evaluate: {task: causal-lm, data: {dataset: shakespeare, split: test}}\noutput: {dir: out}\n"
    )
    assert type(recipe) is get_job("barrier").recipe


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    """Two empty packages on sys.path, ``testjobs`` (declarations) and ``testruns`` (runners),
    dropped from sys.modules afterwards."""
    for name in ("testjobs", "testruns"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("", encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] in ("testjobs", "testruns")]:
        del sys.modules[name]


def _job(root: Path, name: str, declaration: str, *, run: bool = True) -> None:
    (root / "testjobs" / f"{name}.py").write_text(textwrap.dedent(declaration), encoding="utf-8")
    if run:
        (root / "testruns" / f"{name}.py").write_text("def run(ws):\n    raise NotImplementedError\n", encoding="utf-8")


def test_a_job_module_is_found_without_a_table(package: Path) -> None:
    _job(package, "sweep", GOOD.format(name="sweep", declared="sweep"))
    found = discover([str(package / "testjobs")], "testjobs", runners="testruns", runner_dir=package / "testruns")
    assert list(found) == ["sweep"] and found["sweep"].runner == "testruns.sweep"


@pytest.mark.parametrize(
    ("declaration", "run", "message"),
    [
        ("X = 1\n", True, r"testjobs\.sweep declares no JOB"),
        (GOOD.format(name="sweep", declared="other"), True, r"declares job 'other': a job's module is named after it"),
        (GOOD.format(name="sweep", declared="sweep"), False, r"job 'sweep' has no run module \(testruns\.sweep\)"),
        (GOOD.format(name="merge", declared="sweep"), True, r"job 'sweep': its recipe model's `job` is 'merge'"),
    ],
    ids=["no-declaration", "misnamed", "no-run-module", "recipe-of-another-job"],
)
def test_a_module_that_is_not_a_proper_job_is_refused(package: Path, declaration: str, run: bool, message: str) -> None:
    _job(package, "sweep", declaration, run=run)
    with pytest.raises(RuntimeError, match=message):
        discover([str(package / "testjobs")], "testjobs", runners="testruns", runner_dir=package / "testruns")
