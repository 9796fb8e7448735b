"""Running a recipe end to end: the recipe read once into a plan, then the plan's steps executed
(load, run the job, write the folder, push).

`run_recipe` is the entry point (`build_plan`, then `execute`); `plan` gives the lines of
``--dry-run``. The modules hold one stage each (`plan`, `checks`, `fetch`, `load`, `stages`,
`record`, one per job under `jobs`); none prints: the CLI passes a ``progress(stage, done,
total)`` callback and prints the `RunResult`.
Imports every stage below it (the recipe, lineage, evaluation, merging, alignment, io, symmetry,
core); only the CLI imports the run.
"""

from __future__ import annotations

from hf_rebasin.evaluation.record import RunRecord
from hf_rebasin.run.clock import Progress
from hf_rebasin.run.pipeline import execute, run_recipe
from hf_rebasin.run.plan import Plan, build_plan, plan
from hf_rebasin.run.resolve import ResolvedModel, resolve_model
from hf_rebasin.run.result import RunResult

__all__ = [
    "Plan",
    "Progress",
    "ResolvedModel",
    "RunRecord",
    "RunResult",
    "build_plan",
    "execute",
    "plan",
    "resolve_model",
    "run_recipe",
]
