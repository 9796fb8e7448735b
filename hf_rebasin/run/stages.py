"""Steps every job shares: alignment through the cache on the stage clock, the function
preservation check, and loss curves along λ."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.alignment.strategies import Alignment, Pair, align, get_strategy
from hf_rebasin.alignment.strategies.options import sampler_for
from hf_rebasin.alignment.verify import check_preserved, example_inputs, logits_gap, tolerance
from hf_rebasin.core.errors import RebasinUserError
from hf_rebasin.core.roles import MergeRoles, letter
from hf_rebasin.evaluation.evaluate import Curve, Metric, Task, barrier, lambdas, loss_curve
from hf_rebasin.evaluation.record import Findings
from hf_rebasin.evaluation.scores import Preservation
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.io.rebuild import rebuilt, running
from hf_rebasin.merging.initialised import fill_initialised
from hf_rebasin.run.alignment_cache import CacheUse
from hf_rebasin.run.clock import Progress
from hf_rebasin.run.load import Workspace, weights
from hf_rebasin.run.result import RunResult
from hf_rebasin.symmetry.adapters import get_adapter
from hf_rebasin.symmetry.sublayers import is_per_sublayer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "SWEEP_STAGE",
    "align_others",
    "check_inputs",
    "curves",
    "function_gap",
    "job_result",
    "merge_fill",
    "preservation",
    "timed_align",
    "writing",
]

SWEEP_STAGE = "λ sweep"
CHECK_ROWS = 4  # examples on which function preservation is measured


def timed_align(ws: Workspace, name: str, options: Any, pair: Pair, *, cache: CacheUse | None = None) -> Alignment:
    """Align B of ``pair`` to A on the ``align`` clock. With ``cache`` (see `RunCache.use`) the
    alignment is read from the alignment cache when it is there (``align`` ≈ 0) and stored when not."""
    with ws.clock.stage("align"):
        alignment = cache.read(pair, name) if cache is not None else None
        if alignment is None:
            alignment = align(name, pair, options, ws.progress)
    if cache is not None and not cache.hit:
        cache.write(alignment, pair)
    return alignment


def _label(ws: Workspace, reference: LoadedModel, other: LoadedModel) -> str:
    """The pair's name in notes, "B to A": the models' letters in the recipe (by folder: a model given twice gets its first)."""
    folders = [m.folder for m in ws.inputs.all]
    found = {p: letter(folders.index(p)) for p in (reference.path, other.path) if p in folders}
    return f"{found.get(other.path, 'B')} to {found.get(reference.path, 'A')}"


def options_as_run(ws: Workspace, alignment: Alignment) -> dict[str, Any]:
    """The strategy's options as the run used them, for the record: the recipe's, with what the
    strategy settled itself where the recipe left a choice open (head-perm's `residual`, learned
    matching's `lr`)."""
    return {**ws.recipe.strategy.options.model_dump(mode="json"), **alignment.resolved}


def align_pair(ws: Workspace, models: MergeRoles[LoadedModel], i: int, name: str, options: Any) -> Alignment:
    """The ``i``-th other model aligned to the reference A with strategy ``name`` (cached)."""
    a, other = models.reference, models.others[i]
    inputs = ws.inputs
    assert isinstance(inputs, MergeRoles)
    pair = Pair(a.graph, weights(a), weights(other), a.model, other.model, ws.data)
    options = learned_sampler(ws, options, a, other)
    cached = ws.cache.use(
        (inputs.reference.resolved, a),
        inputs.others[i].resolved,
        name,
        options,
        label=_label(ws, a, other),
        batching=ws.align.spec if ws.align is not None else None,
    )
    return timed_align(ws, name, options, pair, cache=cached)


def learned_sampler(ws: Workspace, options: Any, a: LoadedModel, b: LoadedModel) -> Any:
    """``options`` with learned matching's λ sampler for this pair: toward the wider model when
    one of them was embedded into the other's shape (said in a note)."""
    if not getattr(options, "learned", False):
        return options
    wide = "b" if a.embedded else "a" if b.embedded else None
    try:
        text, note = sampler_for(options.sampler, wide, explicit="sampler" in options.model_fields_set)
    except ValueError as e:
        raise RebasinUserError(f"`strategy.sampler`: {e}") from None
    if note is not None and note not in ws.notes:
        ws.notes.append(note)
    return options.model_copy(update={"sampler": text})


def align_others(ws: Workspace, models: MergeRoles[LoadedModel]) -> list[Alignment]:
    """Every other model aligned to A with the recipe's strategy; their notes, once each."""
    strategy = ws.recipe.strategy
    alignments = [align_pair(ws, models, i, strategy.name, strategy.options) for i in range(len(models.others))]
    ws.notes.extend(dict.fromkeys(n for al in alignments for n in al.notes))
    return alignments


def check_inputs(
    loaded: LoadedModel, batches: Sequence[Sequence[Mapping[str, Tensor]] | None], device: torch.device
) -> dict[str, Tensor]:
    """A few real inputs (evaluation or alignment data), else the fixed random ones of `verify`."""
    for group in batches:
        if group:
            return {k: v[:CHECK_ROWS].to(device) for k, v in group[0].items() if k != "labels"}
    spec = get_adapter(loaded.model.config.model_type)
    inputs = example_inputs(spec, loaded.model.config, torch.Generator().manual_seed(0))
    return {k: v.to(device) for k, v in inputs.items()}


def function_gap(
    b: LoadedModel, alignment: Alignment, aligned: Mapping[str, Tensor], inputs: Mapping[str, Tensor]
) -> tuple[float, float]:
    """max |Δ logits| between B and B in A's basis (rebuilt from ``aligned``) on ``inputs``, and
    max |logits| of B (the scale float32 rounding grows with). A streamed B runs offloaded: one
    submodule's weights in memory at a time."""
    device = next(iter(inputs.values())).device
    with ExitStack() as stack:
        before = b.model if b.source is None else stack.enter_context(running(b.model, b.source, device=device))
        after = stack.enter_context(running(b.model, aligned, untie=bool(alignment.untied), device=device))
        return logits_gap(before, after, dict(inputs), (alignment.graph, alignment.transform))


def preservation(
    strategy: str,
    others: Sequence[LoadedModel],
    alignments: Sequence[Alignment],
    aligned: Sequence[Mapping[str, Tensor]],
    inputs: Mapping[str, Tensor],
    *,
    real: bool,
) -> Preservation:
    """The ``function_preserved`` entry: worst max |Δ logits| over the aligned models, or why not measured."""
    if any(is_per_sublayer(al.graph) for al in alignments):
        return Preservation(
            reason="residual maps per sublayer move the task vector only; no aligned model is built to check"
        )
    if not all(al.exact for al in alignments):
        return Preservation(
            reason=f"strategy {strategy!r} with these options does not preserve B's function (experimental)"
        )
    gaps = [function_gap(lm, al, sd, inputs) for lm, al, sd in zip(others, alignments, aligned, strict=True)]
    for (gap, scale), lm in zip(gaps, others, strict=True):
        check_preserved(gap, scale, f"aligned, {str(lm.path)!r}")
    return Preservation(
        max_abs_diff=max(g for g, _ in gaps),
        tolerance=max(tolerance(scale) for _, scale in gaps),
        inputs="evaluation or alignment data" if real else "random example inputs",
    )


WRITE_STAGE = "writing the model"


def writing(report: Progress) -> Callable[[int, int], None]:
    """``progress(done, total)`` of a streamed save, as a stage of the run's progress."""

    def step(done: int, total: int) -> None:
        report(WRITE_STAGE, done, total)

    return step


def _sweep_progress(report: Progress, stage: str, total: int) -> Callable[[int, float, Any], None]:
    def step(i: int, _lam: float, _result: Any) -> None:
        report(stage, i + 1, total)

    return step


def curve(
    template: PreTrainedModel,
    alignment: Alignment,
    aligned_b: Mapping[str, Tensor],
    batches: Sequence[Mapping[str, Tensor]],
    task: Task,
    points: int,
    name: str,
    report: Progress,
    metrics: Sequence[Metric] = (),
) -> Curve:
    """The loss along λ between A and aligned B, in the form (original or canonical) of the alignment."""
    grid = lambdas(points)
    stage = f"{SWEEP_STAGE}: {name}"
    report(stage, 0, len(grid))
    return loss_curve(
        rebuilt(template, alignment.sd_a, bool(alignment.untied)),  # holds both ends, untied when canonical
        alignment.sd_a,
        aligned_b,
        batches,
        task,
        grid,
        progress=_sweep_progress(report, stage, len(grid)),
        metrics=metrics,
    )


def curves(
    ws: Workspace, models: MergeRoles[LoadedModel], primary: Alignment, aligned_b: Mapping[str, Tensor]
) -> tuple[dict[str, Curve], dict[str, dict[str, float]]]:
    """The strategy's curve between A and B and one per ``evaluate.compare`` entry, on the same
    batches, with their barriers (none without ``evaluate``)."""
    ev, found, barriers = ws.recipe.evaluate, {}, {}
    if ev is None or ws.eval_batches is None:
        return {}, {}
    name = ws.recipe.strategy.name
    if len(models.others) > 1:
        inputs = ws.inputs
        assert isinstance(inputs, MergeRoles)
        ws.notes.append(f"curves are between A and B ({inputs.others[0].ref.model}); the other models are merged only")
    for curve_name in dict.fromkeys([name, *ev.compare]):
        al, aligned = primary, aligned_b
        if curve_name != name:
            al = align_pair(ws, models, 0, curve_name, get_strategy(curve_name).parse(None))
            al, (aligned,) = filled(ws, al, [al.aligned_b()])
        with ws.clock.stage("evaluate"):
            found[curve_name] = curve(
                models.reference.model, al, aligned, ws.eval_batches, ws.task, ev.points, curve_name, ws.progress,
                ws.score.metrics,
            )  # fmt: skip
            barriers[curve_name] = barrier(found[curve_name].lambdas, found[curve_name].losses)
    return found, barriers


def filled(
    ws: Workspace, primary: Alignment, aligned: Sequence[Mapping[str, Tensor]]
) -> tuple[Alignment, list[Mapping[str, Tensor]]]:
    """A and the aligned models with the rows each lacks filled in A's basis, where the models'
    vocabularies differ (`merging.vocabulary.fill`), and the tensors transformers initialised on
    load taken from the models that have them (`merging.initialised`); as they are otherwise. After
    the preservation check: that compares each model with itself, its own rows only."""
    states = merge_fill(ws)([primary.sd_a, *aligned])
    return dataclasses.replace(primary, sd_a=states[0]), list(states[1:])


def merge_fill(ws: Workspace) -> Callable[[Sequence[Mapping[str, Tensor]]], list[Mapping[str, Tensor]]]:
    """What `filled` does to the states of every model of a merge (A first), for a universe merge too."""
    initialised = [set(lm.initialised) for lm in ws.models.all]

    def fill(states: Sequence[Mapping[str, Tensor]]) -> list[Mapping[str, Tensor]]:
        states = ws.rows.fill_merge(states) if ws.rows is not None else list(states)
        return fill_initialised(states, initialised[: len(states)]) if any(initialised) else list(states)

    return fill


def job_result(
    ws: Workspace, findings: Findings, found: dict[str, Curve], *, saved_model: bool, written: str
) -> RunResult:
    """The run's result around a job's findings (the pipeline adds the files and the push);
    ``written`` says what the folder holds ("merged model and report")."""
    return RunResult(ws.output, ws.recipe.job, saved_model, findings, written, found, ws.timings, ws.notes)
