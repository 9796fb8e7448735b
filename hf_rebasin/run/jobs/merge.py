"""job: merge: align every model to A, check preservation, draw the curves, average with the
recipe's weights (or a universe merge), score the result and save it as a model folder."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from hf_rebasin.alignment.strategies import Alignment, get_strategy
from hf_rebasin.core.roles import MergeRoles
from hf_rebasin.evaluation.scores import Preservation, Score, Universe
from hf_rebasin.io.export import copy_support_files, save_merged_model
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.merging.initialised import left_out
from hf_rebasin.merging.interpolate import merge_state_dicts
from hf_rebasin.merging.universe import universe_merge
from hf_rebasin.recipe.jobs.merge import MergeRecipe
from hf_rebasin.run.jobs.barrier import aligned_preservation, findings_of, save_curves
from hf_rebasin.run.load import Workspace, weights
from hf_rebasin.run.result import JobOutput
from hf_rebasin.run.stages import (
    align_others,
    check_inputs,
    curves,
    filled,
    job_result,
    merge_fill,
    preservation,
    writing,
)

__all__ = ["run"]


def own(ws: Workspace) -> MergeRecipe:
    """The run's recipe, as this job's own model."""
    recipe = ws.recipe
    assert isinstance(recipe, MergeRecipe)  # the pipeline runs a job on its own recipes
    return recipe


def run(ws: Workspace) -> JobOutput:
    """The merged model of every model aligned to A (λ on A: ``merge.weight``)."""
    models = ws.models
    assert isinstance(models, MergeRoles)  # the recipe's job
    alignments = align_others(ws, models)
    primary = alignments[0]
    aligned: list[Mapping[str, Tensor]] = [al.aligned_b() for al in alignments]
    preserved = aligned_preservation(ws, models, alignments, aligned)
    primary, aligned = filled(ws, primary, aligned)
    found, barriers = curves(ws, models, primary, aligned[0])
    mix = own(ws).merge.weights(len(models.all))
    universe: Universe | None = None
    learned: dict[str, Any] | None = None  # the universe's Dirichlet refinement: the curve of the maps merged
    if own(ws).merge.universe is not None:
        merged, universe, learned, preserved = _universe(ws, models, alignments, mix, preserved, bool(primary.untied))
    else:
        merged = merge_state_dicts([primary.sd_a, *aligned], mix)
    scores = _scores(ws, models, merged, mix, bool(primary.untied), universe)
    findings = findings_of(
        ws, primary, preserved, found, barriers, merged=scores, merge_weights=mix, universe=universe, learned=learned
    )

    def save(folder: Path) -> None:
        _save_model(ws, models.reference, merged, bool(primary.untied), folder)
        save_curves(ws, folder, found, barriers, findings.diagnostics)

    return JobOutput(job_result(ws, findings, found, saved_model=True, written="merged model and report"), save)


def _scores(
    ws: Workspace,
    models: MergeRoles[LoadedModel],
    merged: dict[str, Tensor],
    mix: list[float],
    untie: bool,
    universe: Universe | None,
) -> dict[str, Score]:
    """Loss and metric of the merged model as written, and of the unaligned average (``compare: [vanilla]``)."""
    ev, name, a = ws.recipe.evaluate, ws.recipe.strategy.name, models.reference
    if ev is None or ws.eval_batches is None:
        return {}
    scores: dict[str, Score] = {}
    with ws.clock.stage("evaluate"):
        scores[name] = Score(**ws.score(a.model, merged, untie, ws.eval_batches, ws.task))
        naive = ev.plain  # the plain average, unless it is ours
        if naive and not get_strategy(name).identity:
            states = [weights(lm) for lm in models.all]
            plain = merge_state_dicts(ws.rows.fill_merge(states) if ws.rows is not None else states, mix)
            scores[naive[0]] = Score(**ws.score(a.model, plain, False, ws.eval_batches, ws.task))
    if universe is not None and universe.reference is not None:
        ws.notes.append(
            f"universe: loss {scores[name].loss:.4f} nats; the reference merge (every model aligned "
            f"to A only) {universe.reference.loss:.4f}"
        )
    return scores


def _universe(
    ws: Workspace,
    models: MergeRoles[LoadedModel],
    alignments: list[Alignment],
    mix: list[float],
    preserved: Preservation,
    untie: bool,
) -> tuple[dict[str, Tensor], Universe, dict[str, Any] | None, Preservation]:
    """``merge.universe``: the universe merge, its ``rebasin.json`` entry (with the score of the
    reference merge it started from, every model aligned to A), the curve of its learned matching
    (None without) and the preservation check widened to every model's map into the merge's basis
    (model A's included)."""
    recipe = own(ws)
    settings = recipe.merge.universe
    assert settings is not None  # the caller checked
    with ws.clock.stage("align"):
        result = universe_merge(
            recipe.strategy.name,
            recipe.strategy.options,
            models.reference.graph,
            [weights(lm) for lm in models.all],
            mix,
            models=[lm.model for lm in models.all],
            data=ws.data,
            iterations=settings.iterations,
            tol=settings.tol,
            leave_one_out=settings.leave_one_out,
            initial=alignments,
            progress=ws.progress,
            fill=merge_fill(ws),
        )
    ws.notes.extend(n for n in result.notes if n not in ws.notes)
    if preserved.max_abs_diff is not None:
        aligned = [al.aligned_b() for al in result.alignments]
        inputs = check_inputs(models.reference, [ws.eval_batches, ws.align_batches], ws.device)  # as before
        again = preservation(recipe.strategy.name, models.all, result.alignments, aligned, inputs, real=True)
        worst = {k: max(getattr(preserved, k), getattr(again, k)) for k in ("max_abs_diff", "tolerance")}  # same inputs
        preserved = preserved.model_copy(update=worst)
    reference: Score | None = None
    if ws.recipe.evaluate is not None and ws.eval_batches is not None:
        with ws.clock.stage("evaluate"):
            reference = Score(**ws.score(models.reference.model, result.reference, untie, ws.eval_batches, ws.task))
    universe = Universe(**result.record(), reference=reference)
    return result.merged, universe, result.learned, preserved


def _save_model(ws: Workspace, a: LoadedModel, merged: dict[str, Tensor], untie: bool, folder: Path) -> None:
    """The merged model in A's class, then A's tokenizer and other files as they were (where the
    vocabularies differ: the output's rows, tokenizer and token ids)."""
    rows = ws.rows
    save_merged_model(
        rows.output_template(a.model) if rows is not None else a.model,
        rows.output_state(merged) if rows is not None else merged,
        folder,
        untie=untie,
        max_shard_size=ws.recipe.output.max_shard_size,
        dtype=ws.output_dtype.dtype,
        dtypes=ws.output_dtype.kept,
        progress=writing(ws.progress),
        expert_layout=a.expert_layout,
        leave_out=left_out([lm.initialised for lm in ws.models.all]),
    )
    copy_support_files(ws.inputs.reference.path, folder)  # after save_pretrained
    if rows is not None:
        rows.write(folder)
