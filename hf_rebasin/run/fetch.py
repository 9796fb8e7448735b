"""The plan's models fetched: Hub models downloaded at the commit the plan resolved, zoo models
trained, and the plan's checks run on what it could not see before (`checks.check_models`, the
same checks, on the models that were not on disk)."""

from __future__ import annotations

import dataclasses

from hf_rebasin.io.output import check_inputs
from hf_rebasin.run.checks import check_models, read_paths
from hf_rebasin.run.clock import Progress
from hf_rebasin.run.plan import Plan, fetched
from hf_rebasin.run.resolve import PlannedModel, resolve_model

__all__ = ["fetch"]


def fetch(plan: Plan, report: Progress, notes: list[str]) -> Plan:
    """The plan with every model on disk, checked and decided on (`plan.fetched`); what the record
    says about them goes to ``notes``."""
    recipe = plan.recipe

    def fetch_one(m: PlannedModel) -> PlannedModel:
        resolved = resolve_model(m.ref, m.where, progress=report, allow_pickle=recipe.allow_pickle, checked=m.resolved)
        return dataclasses.replace(m, resolved=resolved)

    inputs = plan.models.map(fetch_one)
    checks = check_models(recipe, inputs, done=plan.checks)  # the files gated again first: downloaded since
    check_inputs(plan.output, read_paths(recipe, inputs.all), plan.output_field)  # downloaded folders are inputs too
    notes.extend(
        f"{m.ref} resolved from the local Hugging Face cache (offline): commit {m.resolved.commit}"
        for m in inputs.all
        if m.resolved.cached
    )
    notes.extend(checks.tokenizer_notes())
    return fetched(plan, inputs, checks)
