"""The jobs (hf_rebasin.jobs): each folder declares one job and is found without a table; a folder
that does not declare itself properly is refused at import, naming what is wrong."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import hf_rebasin.jobs as jobs
from hf_rebasin.jobs import JOBS, Job, discover, get_job
from hf_rebasin.recipe import AlignedRecipe, loads_recipe

GOOD = """
from typing import Literal

from hf_rebasin.jobs import CardPart, Job
from hf_rebasin.recipe import ModelsRecipe, AlignedRecipe


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


def test_every_job_folder_declares_its_job_and_its_recipe_model() -> None:
    folders = sorted(p.name for p in Path(jobs.__file__).parent.iterdir() if (p / "__init__.py").is_file())
    assert list(JOBS) == folders
    for name, job in JOBS.items():
        assert isinstance(job, Job) and job.name == name and job.module == f"hf_rebasin.jobs.{name}"
        assert issubclass(job.recipe, AlignedRecipe)
        assert job.recipe.model_fields["job"].default == name
        assert callable(importlib.import_module(f"{job.module}.run").run)


def test_a_recipe_is_validated_by_its_jobs_model() -> None:
    recipe = loads_recipe(
        "job: barrier\nmodels: [zoo:gpt2-seed0, zoo:gpt2-seed1]\nstrategy: vanilla\n"
        "evaluate: {task: causal-lm, data: {dataset: shakespeare, split: test}}\noutput: {dir: out}\n"
    )
    assert type(recipe) is get_job("barrier").recipe


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    """An empty package ``testjobs`` on sys.path, dropped from sys.modules afterwards."""
    root = tmp_path / "testjobs"
    root.mkdir()
    (root / "__init__.py").write_text("", encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    yield root
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m == "testjobs" or m.startswith("testjobs.")]:
        del sys.modules[name]


def _folder(root: Path, name: str, declaration: str, *, run: bool = True) -> None:
    folder = root / name
    folder.mkdir()
    (folder / "__init__.py").write_text(textwrap.dedent(declaration), encoding="utf-8")
    if run:
        (folder / "run.py").write_text("def run(ws):\n    raise NotImplementedError\n", encoding="utf-8")


def test_a_job_folder_is_found_without_a_table(package: Path) -> None:
    _folder(package, "sweep", GOOD.format(name="sweep", declared="sweep"))
    found = discover([str(package)], "testjobs")
    assert list(found) == ["sweep"] and found["sweep"].module == "testjobs.sweep"


@pytest.mark.parametrize(
    ("declaration", "run", "message"),
    [
        ("X = 1\n", True, r"testjobs\.sweep declares no JOB"),
        (GOOD.format(name="sweep", declared="other"), True, r"declares job 'other': a job's folder is named after it"),
        (GOOD.format(name="sweep", declared="sweep"), False, r"job 'sweep' has no run module \(testjobs\.sweep\.run\)"),
        (GOOD.format(name="merge", declared="sweep"), True, r"job 'sweep': its recipe model's `job` is 'merge'"),
    ],
    ids=["no-declaration", "misnamed", "no-run-module", "recipe-of-another-job"],
)
def test_a_folder_that_is_not_a_proper_job_is_refused(package: Path, declaration: str, run: bool, message: str) -> None:
    _folder(package, "sweep", declaration, run=run)
    with pytest.raises(RuntimeError, match=message):
        discover([str(package)], "testjobs")
