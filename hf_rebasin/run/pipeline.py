"""`run_recipe`: the recipe read once into a `Plan`, then the plan's steps run in order.

As mergekit's planner and executor: `build_plan` reads and checks the recipe and decides all that
needs no weights (the models by role, the output, the vocabulary, streaming and memory, the
steps); `execute` runs the plan's steps on the output it claims and never reads the recipe again.
Each step is one function here over the `Run` the steps hand on: ``load`` (`run.load`), ``job``
(the job's runner, `run.jobs`), ``write`` (the job's files, ``rebasin.json`` and the card) and
``push`` (only where the plan pushes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_rebasin.io.hub.push import PushError, push_folder
from hf_rebasin.io.output import claim_output, output_folder
from hf_rebasin.recipe import Recipe
from hf_rebasin.recipe.jobs import get_job
from hf_rebasin.run.clock import Progress, noop
from hf_rebasin.run.load import Workspace, load_workspace
from hf_rebasin.run.plan import Plan, build_plan
from hf_rebasin.run.record import RunRecord, dataset_entries, model_entries, recipe_record, write_record
from hf_rebasin.run.result import JobOutput, RunResult

__all__ = ["STEPS", "Run", "execute", "run_job", "run_recipe"]


def run_recipe(
    recipe: Recipe,
    *,
    output: Path | None = None,
    device: str | None = None,
    progress: Progress | None = None,
    command: str | None = None,
    check_memory: bool = True,
) -> RunResult:
    """Run ``recipe``: align every model to the first, merge (job merge), evaluate, write the folder.

    ``output`` and ``device`` override the recipe's; ``command`` is the line the model card gives
    to reproduce the run (default ``hf-rebasin <recipe file>``). ``check_memory`` refuses a run whose
    estimated peak memory exceeds what is available, before loading (see `run.memory`). Nothing is
    written until everything is computed, and then into a temporary folder renamed into place (see
    `output.output_folder`). The output is held for the whole run (`output.claim_output`): a second
    run on it is refused at once, and the leftovers of a killed run are cleaned up first (the
    result's notes say what was done).
    """
    plan = build_plan(recipe, output=output, device=device, check_memory=check_memory)
    return execute(plan, progress=progress, command=command)


@dataclass
class Run:
    """What the steps hand on to each other: the plan, then the workspace, the job's output and the result."""

    plan: Plan
    progress: Progress
    command: str | None  # the line the card gives to reproduce the run
    ws: Workspace | None = None
    done: JobOutput | None = None

    @property
    def workspace(self) -> Workspace:
        assert self.ws is not None, "the load step runs first"
        return self.ws

    @property
    def output(self) -> JobOutput:
        assert self.done is not None, "the job step runs before write and push"
        return self.done


def execute(plan: Plan, *, progress: Progress | None = None, command: str | None = None) -> RunResult:
    """The plan's steps in order, with its output claimed for all of them (memory checked first,
    where the plan says so)."""
    if plan.check_memory and plan.memory is not None:
        plan.memory.check()
    run = Run(plan, progress or noop, command)
    with claim_output(plan.output, overwrite=plan.overwrite, where=plan.output_field) as recovered:
        for name in plan.steps:
            STEPS[name](run)
    result = run.output.result
    result.notes = [*recovered, *result.notes]
    return result


def _load(run: Run) -> None:
    run.ws = load_workspace(run.plan, progress=run.progress)


def _job(run: Run) -> None:
    run.done = run_job(run.workspace)


def run_job(ws: Workspace) -> JobOutput:
    """The plan's job on the loaded workspace: ``run`` of its folder's ``run`` module, imported now."""
    runner: Callable[[Workspace], JobOutput] = importlib.import_module(get_job(ws.plan.job).runner).run
    return runner(ws)


def _write(run: Run) -> None:
    """The job's files, then ``rebasin.json`` and the card, into a temporary folder renamed into place."""
    ws, done = run.workspace, run.output
    with output_folder(ws.output, overwrite=run.plan.overwrite) as tmp:
        with ws.clock.stage("save"):
            done.save(tmp)
        record = RunRecord(
            recipe=recipe_record(ws.recipe, ws.output),
            models=model_entries(
                ws.recipe,
                ws.inputs,
                [lm.ignored for lm in ws.models.all],
                [lm.embedded for lm in ws.models.all],
                [lm.initialised for lm in ws.models.all],
            ),
            datasets=dataset_entries(ws.recipe),
            findings=done.result.findings,
            notes=ws.notes,
            timings=ws.timings,
            cache=ws.cache.stats,
            dtype=ws.dtype,
        )
        done.result.files = write_record(tmp, record, ws.recipe, run.command)


def _push(run: Run) -> None:
    """The finished folder to the plan's repository; a failure is returned, the folder is kept."""
    result, push = run.output.result, run.plan.push
    assert push is not None, "the plan pushes only where the recipe asks"
    stage = f"pushing to {push.repo}"
    run.progress(stage, 0, 1)
    try:
        result.pushed = push_folder(
            run.plan.output, push.repo, private=push.private, revision=push.revision, commit_message=push.message
        )
    except PushError as e:
        result.push_error = str(e)
        return
    run.progress(stage, 1, 1)


STEPS: dict[str, Callable[[Run], Any]] = {"load": _load, "job": _job, "write": _write, "push": _push}
"""The steps a plan may list, by name (`Plan.steps`), in the order they run."""
