"""`run_recipe`: plan → load → job → write the folder → push. Each step is its own module."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_rebasin.io.hub.push import PushError, push_folder
from hf_rebasin.io.output import claim_output, output_folder
from hf_rebasin.recipe import Recipe
from hf_rebasin.recipe.jobs import get_job
from hf_rebasin.run.clock import Progress
from hf_rebasin.run.load import Workspace, load_workspace
from hf_rebasin.run.plan import Plan, build_plan
from hf_rebasin.run.record import RunRecord, dataset_entries, model_entries, recipe_record, write_record
from hf_rebasin.run.result import JobOutput, RunResult

__all__ = ["run_job", "run_recipe"]


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
    estimated peak memory exceeds what is available, before loading (see `run.memory`). Nothing is written until everything is computed,
    and then into a temporary folder renamed into place (see `output.output_folder`). The output is
    held for the whole run (`output.claim_output`): a second run on it is refused at once, and the
    leftovers of a killed run are cleaned up first (the result's notes say what was done).
    """
    plan = build_plan(recipe, output=output)
    if check_memory and plan.memory is not None:
        plan.memory.check()
    with claim_output(plan.output, overwrite=recipe.output.overwrite, where=plan.output_field) as recovered:
        ws = load_workspace(plan, device_name=device, progress=progress, check_memory=check_memory)
        done = run_job(ws)
        result = done.result
        result.files = write_folder(ws, done, command)
        result.pushed, result.push_error = push(plan, ws.progress)
    result.notes = [*recovered, *result.notes]
    return result


def run_job(ws: Workspace) -> JobOutput:
    """The recipe's job on the loaded workspace: ``run`` of its folder's ``run`` module, imported now."""
    runner: Callable[[Workspace], JobOutput] = importlib.import_module(get_job(ws.recipe.job).runner).run
    return runner(ws)


def write_folder(ws: Workspace, done: JobOutput, command: str | None) -> list[str]:
    """The job's files, then ``rebasin.json`` and the card, into a temporary folder renamed into
    place; the folder's file names."""
    with output_folder(ws.output, overwrite=ws.recipe.output.overwrite) as tmp:
        with ws.clock.stage("save"):
            done.save(tmp)
        record = RunRecord(
            recipe=recipe_record(ws.recipe, ws.output),
            models=model_entries(
                ws.recipe, ws.inputs, [lm.ignored for lm in ws.models.all], [lm.embedded for lm in ws.models.all]
            ),
            datasets=dataset_entries(ws.recipe),
            findings=done.result.findings,
            notes=ws.notes,
            timings=ws.timings,
            cache=ws.cache.stats,
            dtype=ws.dtype,
        )
        return write_record(tmp, record, ws.recipe, command)


def push(plan: Plan, report: Progress) -> tuple[Any, str | None]:
    """Push the finished folder when the recipe asks; a failure is returned, the folder is kept."""
    recipe = plan.recipe
    push = recipe.output.push_to_hub
    if push is None:
        return None, None
    stage = f"pushing to {push.repo}"
    report(stage, 0, 1)
    message = push.commit_message or f"hf-rebasin {recipe.job} with {recipe.strategy.name} ({Path(recipe.source).name})"
    try:
        result = push_folder(
            plan.output, push.repo, private=push.private, revision=push.revision, commit_message=message
        )
    except PushError as e:
        return None, str(e)
    report(stage, 1, 1)
    return result, None
