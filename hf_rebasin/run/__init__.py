"""Running a recipe end to end: plan, load, run the job, write the folder, push.

`run_recipe` is the entry point; `plan` gives the lines of ``--dry-run``. The modules hold one
stage each (`plan`, `load`, `stages`, `record`, one per job under `jobs`); none prints: the CLI
passes a ``progress(stage, done, total)`` callback and prints the `RunResult`.
"""

from __future__ import annotations

from ..record import RunRecord
from .clock import Progress
from .pipeline import run_recipe
from .plan import Plan, build_plan, plan
from .resolve import ResolvedModel, resolve_model
from .result import RunResult

__all__ = [
    "Plan",
    "Progress",
    "ResolvedModel",
    "RunRecord",
    "RunResult",
    "build_plan",
    "plan",
    "resolve_model",
    "run_recipe",
]
