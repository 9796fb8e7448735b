"""job: lineage: every pair's verdict (`lineage.pairs.lineage_of`), written as lineage.json and a
per-layer plot beside the record and the card."""

from __future__ import annotations

import json
from pathlib import Path

from hf_rebasin.core.names import DEFAULT_LINEAGE_STRATEGY
from hf_rebasin.core.roles import MergeRoles
from hf_rebasin.evaluation.record import Findings
from hf_rebasin.io.output import write_text
from hf_rebasin.lineage.pairs import lineage_of
from hf_rebasin.lineage.plot import plot_lineage
from hf_rebasin.lineage.record import describe_layers
from hf_rebasin.recipe.jobs.lineage import LineageRecipe
from hf_rebasin.run.load import Workspace
from hf_rebasin.run.result import JobOutput
from hf_rebasin.run.stages import job_result

__all__ = ["run"]


def run(ws: Workspace) -> JobOutput:
    """Each pair of the recipe's models compared; nothing aligned is kept, no weights written."""
    models = ws.models
    assert isinstance(models, MergeRoles)  # the recipe's job
    recipe = ws.recipe
    assert isinstance(recipe, LineageRecipe)
    given = [m.model for m in recipe.models]
    with ws.clock.stage("lineage"):
        record = lineage_of(list(models.all), given, progress=lambda stage: ws.progress(stage, 0, 1), data=ws.data)
    verdicts = {f"{models.names[p.a]}-{models.names[p.b]}": p.verdict for p in record.pairs}
    findings = Findings(strategy=DEFAULT_LINEAGE_STRATEGY, diagnostics={"lineage": verdicts})
    if ws.data is not None:
        ws.notes.append(
            f"each alignment started from maps fitted on both models' activations ({record.settings['data_tokens']:,} "
            f"tokens of {record.settings['data']}), then refined on their weights' learned directions"
        )
    if "vocabulary" in record.settings:
        ws.notes.append(f"vocabularies differ: {record.settings['vocabulary']}")
    if "heads" in record.settings:
        ws.notes.append(f"label counts differ: {record.settings['heads']}")
    ws.notes.extend(f"{given[p.a]} vs {given[p.b]}: {p.verdict}, {p.origin} ({p.next_step})" for p in record.pairs)
    ws.notes.extend(
        f"{given[s.model]} is stacked from {' and '.join(given[p] for p in s.parents)}: {describe_layers(s, given)}"
        for s in record.layer_maps
    )
    result = job_result(ws, findings, {}, saved_model=False, written="lineage report")
    null = float(record.settings["null_similarity"])

    def save(folder: Path) -> None:
        write_text(folder / "lineage.json", json.dumps(record.model_dump(mode="json"), indent=1) + "\n")
        plot_lineage(record, folder / "lineage.png", null)

    return JobOutput(result, save)
