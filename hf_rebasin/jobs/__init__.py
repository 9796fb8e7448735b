"""The jobs a recipe can name. Each job is one folder here, and nothing else names it:

- ``jobs/<job>/__init__.py`` declares the job (`Job`): its recipe model (the keys of a recipe with
  ``job: <job>``), its summary, whether it writes a model (dtype rules, the card's metadata), when
  it may stream, its lines of the dry-run plan and its part of the model card. Torch-free, so
  validating a recipe and printing the plan or the schema never load torch.
- ``jobs/<job>/run.py`` runs it: ``run(ws) -> JobOutput`` on a loaded `run.load.Workspace`;
  imported when the job runs (`run.pipeline.run_job`), as a strategy's module is, so that what a
  job is stays apart from the run that loads models.

A folder with an ``__init__.py`` that defines ``JOB`` is a job: adding one touches its folder, a
recipe example and a test (docs/contributing.md walks through it).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..recipe.sections import AlignedRecipe

__all__ = ["JOBS", "CardPart", "Job", "discover", "get_job"]


@dataclass(frozen=True)
class CardPart:
    """What a job's model card says that another job's would not.

    ``intro`` and ``why`` are Jinja text rendered with the card's context (``strategy_name``,
    ``adapter``, ...); the card places them under its title.
    """

    title: Callable[[Sequence[str]], str]  # the title, from the inputs' short names (in the recipe's order)
    intro: str  # what the folder is
    why: str  # why the job works
    preserved: str  # what the function-preservation check compares, in one sentence
    pair: str  # the two models of that check ("B and aligned B")
    relation: str | None = None  # the Hub's base_model_relation of the output (a merge: "merge")


@dataclass(frozen=True)
class Job:
    """One job: what a recipe with ``job: <name>`` holds, what the run writes and says, and the
    module whose ``run(ws)`` runs it."""

    name: str
    summary: str
    recipe: type[AlignedRecipe]
    card: CardPart
    writes_model: bool  # the output folder holds weights (its dtype is chosen; the card says how to load it)
    # whether the run may read its models tensor by tensor and write the result the same way
    streams: Callable[[Any], bool] = lambda _recipe: False
    describe: Callable[[Any], list[str]] = lambda _recipe: []  # the job's own lines of the dry-run plan
    module: str = field(default="", compare=False)  # set by the registry: ``hf_rebasin.jobs.<name>``


def discover(path: Iterable[str], package: str) -> dict[str, Job]:
    """Every job folder of the package ``package`` (found at ``path``), by name, sorted: the
    schema and the docs list them so. A folder that is not a proper job is refused, naming why."""
    found: dict[str, Job] = {}
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
        if not info.ispkg:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        job = getattr(module, "JOB", None)
        if not isinstance(job, Job):
            raise RuntimeError(f"{module.__name__} declares no JOB (a `hf_rebasin.jobs.Job`)")
        if job.name != info.name:
            raise RuntimeError(f"{module.__name__} declares job {job.name!r}: a job's folder is named after it")
        if importlib.util.find_spec(f"{module.__name__}.run") is None:
            raise RuntimeError(f"job {job.name!r} has no run module ({module.__name__}.run)")
        declared = job.recipe.model_fields["job"].default
        if declared != job.name:
            raise RuntimeError(f"job {job.name!r}: its recipe model's `job` is {declared!r}")
        found[job.name] = dataclasses.replace(job, module=module.__name__)
    return found


JOBS: Mapping[str, Job] = discover(__path__, __name__)


def get_job(name: str) -> Job:
    """The job ``name`` (a recipe names only these; a record from a newer version may name another)."""
    return JOBS[name]
