"""job: align: every other model aligned to A, each checked to compute what it did, and every model
written as a stock model folder in A's basis (A in canonical form where the strategy uses one)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import Tensor

from hf_rebasin.alignment.strategies.base import Alignment, relative_distance
from hf_rebasin.core.roles import MergeRoles
from hf_rebasin.evaluation.record import Findings
from hf_rebasin.evaluation.scores import WrittenGap
from hf_rebasin.io.checkpoint import dtype_name
from hf_rebasin.io.export import copy_support_files, save_merged_model
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.io.output import write_text
from hf_rebasin.merging.basis import Gap, check_gaps, function_gap, mergekit_config, mergekit_limit, written_dtype
from hf_rebasin.recipe.jobs.align import folder_name, mergekit_method
from hf_rebasin.run.jobs.barrier import aligned_preservation, alignment_diagnostics, save_diagnostics
from hf_rebasin.run.load import Workspace
from hf_rebasin.run.result import JobOutput
from hf_rebasin.run.stages import align_others, job_result, options_as_run

__all__ = ["run"]


def run(ws: Workspace) -> JobOutput:
    """Every model in A's basis, written side by side (nothing averaged, nothing scored)."""
    models = ws.models
    assert isinstance(models, MergeRoles)  # the recipe's job
    alignments = align_others(ws, models)
    primary = alignments[0]
    untie = bool(primary.untied)
    states = [dict(primary.sd_a), *(al.aligned_b() for al in alignments)]
    preserved = aligned_preservation(ws, models, alignments, states[1:])
    with ws.clock.stage("check"):  # A too, in the form written (canonical or not)
        gaps = _written_gaps(models, states, alignments, untie) if primary.exact else {}
    check_gaps(gaps)
    limit = mergekit_limit(models.reference.model.config)
    if limit is not None:
        ws.notes.append(limit)
    diagnostics = alignment_diagnostics(ws, primary)
    diagnostics["distance"] = {
        names: {"before": relative_distance(primary.sd_a, al.sd_b), "after": relative_distance(primary.sd_a, state)}
        for names, al, state in zip(models.names[1:], alignments, states[1:], strict=True)
    }
    findings = Findings(
        strategy=ws.recipe.strategy.name,
        strategy_options=options_as_run(ws, primary),
        task=ws.task,
        speech=ws.speech,
        canonical=primary.canonical,
        untied=list(primary.untied),
        function_preserved=preserved.model_copy(update={"written": {k: _gap_entry(g) for k, g in gaps.items()}}),
        diagnostics=diagnostics,
    )
    folders = ", ".join(f"{folder_name(i)}/" for i in range(len(models.all)))
    result = job_result(ws, findings, {}, saved_model=False, written=f"models in one basis ({folders}) and report")

    def save(folder: Path) -> None:
        rows = ws.rows
        for i, (loaded, state) in enumerate(zip(models.all, states, strict=True)):
            if rows is not None:  # each in its own vocabulary: its tokens at its ids
                own = rows.own(i)
                loaded = dataclasses.replace(loaded, model=rows.output_template(loaded.model, own))
                state = dict(rows.output_state(state, own))  # the align job holds its models in memory
            _save_model(loaded, state, untie, folder / folder_name(i))
        dtype = dtype_name(written_dtype(models.reference))
        config = _mergekit(len(models.all), dtype)
        if rows is not None:  # the folders' vocabularies differ: mergekit matches their rows by token
            config += "tokenizer:\n  source: base\n"
        write_text(folder / "mergekit.yaml", config)
        save_diagnostics(folder, findings.diagnostics)

    return JobOutput(result, save)


def _written_gaps(
    models: MergeRoles[LoadedModel], states: list[dict[str, Tensor]], alignments: list[Alignment], untie: bool
) -> dict[str, Gap]:
    """max |Δ logits| of every model as it is written against the model as it was given (a model
    without a head: its hidden states, carried into A's basis by its map)."""
    bases = [None, *((al.graph, al.transform) for al in alignments)]
    return {
        name: function_gap(loaded.model, state, untie, basis)
        for name, loaded, state, basis in zip(models.names, models.all, states, bases, strict=True)
    }


def _gap_entry(gap: Gap) -> WrittenGap:
    return WrittenGap(max_abs_diff=gap.max_abs_diff, tolerance=gap.tolerance)


def _save_model(loaded: LoadedModel, state: dict[str, Tensor], untie: bool, folder: Path) -> None:
    """One model folder in its input's stored dtype, with the input's tokenizer and support files."""
    dtype = written_dtype(loaded)
    cpu = {k: v.detach().cpu() for k, v in state.items()}
    save_merged_model(
        loaded.model if loaded.model.device.type == "meta" else loaded.model.cpu(),
        cpu,
        folder,
        untie=untie,
        dtype=dtype,
        dtypes=loaded.own_dtypes(dtype),
        expert_layout=loaded.expert_layout,
        leave_out=set(loaded.initialised),  # as its files did: loading initialises them again
    )
    copy_support_files(loaded.path, folder)


def _mergekit(n_models: int, dtype: str) -> str:
    """mergekit's configuration for the folders (``./``: mergekit asks the Hub about bare names)."""
    if mergekit_method(n_models) == "slerp":
        return mergekit_config(dtype)
    models = "".join(f"  - model: ./{folder_name(i)}\n    parameters:\n      weight: 1.0\n" for i in range(n_models))
    return f"merge_method: linear\nmodels:\n{models}dtype: {dtype}\n"
