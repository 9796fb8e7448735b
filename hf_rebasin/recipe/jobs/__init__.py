"""The jobs a recipe can name. A job is two modules, one per layer, and nothing else names it:

- ``recipe/jobs/<job>.py`` declares it (`Job`): its recipe model (the keys of a recipe with
  ``job: <job>``), its summary, whether it writes a model (dtype rules, the card's metadata), when
  it may stream, the output's vocabulary where the models' differ, its lines of the dry-run plan
  and its part of the model card. Torch-free, so validating a recipe and printing the plan or the
  schema never load torch.
- ``run/jobs/<job>.py`` runs it: ``run(ws) -> JobOutput`` on a loaded `run.load.Workspace`;
  imported by name when the job runs (`run.pipeline.run_job`), as a strategy's module is.

A module here that defines ``JOB`` is a job, found without a table: adding one touches these two
modules, a recipe example and a test (docs/contributing.md walks through it).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_rebasin.core.names import VocabularyChoice
from hf_rebasin.recipe.sections import AlignedRecipe
from hf_rebasin.recipe.tokenizer import merge_vocabulary

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
    # its dry run also prints the lineage of the models it combines (`lineage.preview`), when cheap
    lineage_preview: bool = False
    # the output's vocabulary where the models' differ, from the recipe's `tokenizer.source` and
    # `pad_to_multiple_of` (None, None without the section); None: the job decides none and the
    # models keep their rows (lineage compares the rows of the tokens they share)
    vocabulary: Callable[[str | None, int | None], VocabularyChoice] | None = merge_vocabulary
    # it maps the models' other depths itself (lineage): the load leaves them unchecked against the reference
    compares_depths: bool = False
    runner: str = field(default="", compare=False)  # set by the registry: the module whose ``run(ws)`` runs it


def discover(path: Iterable[str], package: str, runners: str, runner_dir: Path) -> dict[str, Job]:
    """Every job module of the package ``package`` (found at ``path``), by name, sorted: the
    schema and the docs list them so. Each must define ``JOB``, named after its module, with a
    recipe model of that job, and have a runner module ``<runners>.<name>``, a file of
    ``runner_dir`` (looked for, not imported: that would load torch); anything else is refused at
    import, naming why."""
    found: dict[str, Job] = {}
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
        if info.ispkg or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        job = getattr(module, "JOB", None)
        if not isinstance(job, Job):
            raise RuntimeError(f"{module.__name__} declares no JOB (a `hf_rebasin.recipe.jobs.Job`)")
        if job.name != info.name:
            raise RuntimeError(f"{module.__name__} declares job {job.name!r}: a job's module is named after it")
        runner = f"{runners}.{job.name}"
        if not (runner_dir / f"{job.name}.py").is_file():
            raise RuntimeError(f"job {job.name!r} has no run module ({runner})")
        declared = job.recipe.model_fields["job"].default
        if declared != job.name:
            raise RuntimeError(f"job {job.name!r}: its recipe model's `job` is {declared!r}")
        found[job.name] = dataclasses.replace(job, runner=runner)
    return found


JOBS: Mapping[str, Job] = discover(
    __path__, __name__, runners="hf_rebasin.run.jobs", runner_dir=Path(__file__).resolve().parents[2] / "run" / "jobs"
)


def get_job(name: str) -> Job:
    """The job ``name`` (a recipe names only these; a record from a newer version may name another)."""
    return JOBS[name]
