"""job: lineage: every pair's verdict (`lineage.pairs.lineage_of`), written as lineage.json and a
per-layer plot beside the record and the card."""

from __future__ import annotations

import json
from pathlib import Path

from ...lineage.pairs import lineage_of
from ...lineage.plot import plot_lineage
from ...names import DEFAULT_LINEAGE_STRATEGY
from ...output import write_text
from ...recipe.jobs.lineage import LineageRecipe
from ...record import Findings
from ...roles import MergeRoles
from ..load import Workspace
from ..result import JobOutput
from ..stages import job_result

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
    ws.notes.extend(f"{given[p.a]} vs {given[p.b]}: {p.verdict} ({p.next_step})" for p in record.pairs)
    result = job_result(ws, findings, {}, saved_model=False, written="lineage report")
    null = float(record.settings["null_similarity"])

    def save(folder: Path) -> None:
        write_text(folder / "lineage.json", json.dumps(record.model_dump(mode="json"), indent=1) + "\n")
        plot_lineage(record, folder / "lineage.png", null)

    return JobOutput(result, save)
