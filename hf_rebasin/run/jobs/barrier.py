"""job: barrier: align B to A, check that B's function is preserved, draw the loss curves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from hf_rebasin.alignment.diagnostics import feature_similarity
from hf_rebasin.alignment.strategies import Alignment
from hf_rebasin.core.roles import MergeRoles
from hf_rebasin.evaluation.evaluate import Curve
from hf_rebasin.evaluation.record import Findings
from hf_rebasin.evaluation.report import markdown_table, metric_names, plot_alignment, plot_curves, plot_learning
from hf_rebasin.evaluation.scores import Preservation, Score, Universe
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.io.output import write_text
from hf_rebasin.run.load import Workspace
from hf_rebasin.run.result import JobOutput
from hf_rebasin.run.stages import (
    align_others,
    check_inputs,
    curves,
    filled,
    job_result,
    options_as_run,
    preservation,
)

__all__ = ["alignment_diagnostics", "findings_of", "run", "save_curves", "save_diagnostics", "title"]


def run(ws: Workspace) -> JobOutput:
    """The loss barrier between A and B, before and after alignment (no weights written)."""
    models = ws.models
    assert isinstance(models, MergeRoles)  # the recipe's job
    alignments = align_others(ws, models)
    aligned: list[Mapping[str, Tensor]] = [al.aligned_b() for al in alignments]
    preserved = aligned_preservation(ws, models, alignments, aligned)
    primary, aligned = filled(ws, alignments[0], aligned)
    found, barriers = curves(ws, models, primary, aligned[0])
    findings = findings_of(ws, primary, preserved, found, barriers)
    result = job_result(ws, findings, found, saved_model=False, written="report")
    return JobOutput(result, lambda folder: save_curves(ws, folder, found, barriers, findings.diagnostics))


def aligned_preservation(
    ws: Workspace,
    models: MergeRoles[LoadedModel],
    alignments: list[Alignment],
    aligned: Sequence[Mapping[str, Tensor]],
) -> Preservation:
    """``function_preserved`` of every aligned model, on real inputs when the run has data."""
    real = [ws.eval_batches, ws.align_batches]
    inputs = check_inputs(models.reference, real, ws.device)
    with ws.clock.stage("check"):
        return preservation(ws.recipe.strategy.name, models.others, alignments, aligned, inputs, real=any(real))


def findings_of(
    ws: Workspace,
    primary: Alignment,
    preserved: Preservation,
    found: dict[str, Curve],
    barriers: dict[str, dict[str, float]],
    *,
    merged: dict[str, Score] | None = None,
    merge_weights: list[float] | None = None,
    universe: Universe | None = None,
    learned: dict[str, Any] | None = None,
) -> Findings:
    """The record's findings of a barrier, or with the merged scores and weights, of a merge;
    ``learned``: the curve of the maps merged, when a universe merge refined them (learned matching)."""
    diagnostics = alignment_diagnostics(ws, primary)
    return Findings(
        strategy=ws.recipe.strategy.name,
        strategy_options=options_as_run(ws, primary),
        task=ws.task,
        speech=ws.speech,
        canonical=primary.canonical,
        untied=list(primary.untied),
        function_preserved=preserved,
        barrier=barriers,
        curves={k: c.as_dict() for k, c in found.items()},
        merged=merged or {},
        merge_weights=merge_weights,
        universe=universe,
        diagnostics=diagnostics if learned is None else {**diagnostics, "learned": learned},
    )


def title(ws: Workspace) -> str:
    """The plot's title: the task, and A and B by name."""
    inputs = ws.inputs
    assert isinstance(inputs, MergeRoles)
    a, b = (Path(m.ref.model).name or m.ref.model for m in (inputs.reference, inputs.others[0]))
    return f"{ws.task}: {a} (λ=1) ↔ {b} (λ=0), loss in nats"


def save_curves(
    ws: Workspace,
    folder: Path,
    found: dict[str, Curve],
    barriers: dict[str, dict[str, float]],
    diagnostics: dict[str, Any] | None = None,
) -> None:
    """barrier.png and barrier.md when there are curves; learned.png when learned matching ran."""
    save_diagnostics(folder, diagnostics or {})
    if not found:
        return
    shown = metric_names(found) if ws.score.metrics else []  # a metric panel when the recipe asks for metrics
    plot_curves(found, folder / "barrier.png", title=title(ws), metrics=shown)
    write_text(folder / "barrier.md", markdown_table(found, barriers))


def save_diagnostics(folder: Path, diagnostics: dict[str, Any]) -> None:
    """The alignment's own plots: ``alignment.png`` (matched features per space, before and after)
    and ``learned.png`` (learned matching's held-out barrier against steps)."""
    if diagnostics.get("alignment", {}).get("spaces"):
        plot_alignment(diagnostics["alignment"], folder / "alignment.png")
    if diagnostics.get("learned"):
        plot_learning(diagnostics["learned"], folder / "learned.png")


def alignment_diagnostics(ws: Workspace, alignment: Alignment) -> dict[str, Any]:
    """The alignment's diagnostics for the record: its own (learned matching's curve; head-perm's
    activation correlation of matched features) and, unless it gave them, the weight similarity of
    matched features per space (part of the ``check`` stage)."""
    if (alignment.diagnostics.get("alignment") or {}).get("spaces"):
        return dict(alignment.diagnostics)
    with ws.clock.stage("check"):
        similarity = feature_similarity(alignment.graph, alignment.sd_a, alignment.sd_b, alignment.transform)
    return {**alignment.diagnostics, "alignment": similarity}
