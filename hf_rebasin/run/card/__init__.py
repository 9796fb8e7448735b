"""The model card (README.md) of an output folder, rendered from ``model_cards/rebasin.md``.

The card is built from the run record alone (a `RunRecord`, or ``rebasin.json`` read back with
`RunRecord.from_json`), so a card can be re-rendered from an old output folder. Data preparation
lives in this package, one module per part of the card: the Hub metadata (`metadata`), the inputs
and how to load the output (`inputs`), the alignment's numbers (`alignment`), a transport's
(`transport`), and the escaping and number formatting they all use (`text`); layout lives in the
Jinja template. Nothing time- or machine-dependent is added, so the same record always gives the
same card (golden-file tests rely on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from huggingface_hub import ModelCard

from hf_rebasin.core.resources import resource
from hf_rebasin.evaluation.record import RunRecord
from hf_rebasin.evaluation.scores import Transport
from hf_rebasin.run.card.alignment import (
    _alignment_reading,
    _barrier_reading,
    _barrier_table,
    _curves,
    _function_preserved,
    _learned,
    _merged_scores,
    _paper,
    identity,
)
from hf_rebasin.run.card.inputs import _dtype, _inputs, _load, data_source
from hf_rebasin.run.card.metadata import _adapter, _part, _typed, card_metadata, writes_model
from hf_rebasin.run.card.text import _cell, _fence, _value, redact
from hf_rebasin.run.card.transport import (
    _calibration,
    _chosen,
    _moved,
    _scored,
    _tradeoff_reading,
    _tradeoff_table,
    _transport_rows,
)


def render_card(record: RunRecord | Mapping[str, Any], *, recipe_text: str, command: str) -> str:
    """The README.md of an output folder: Hub metadata (YAML front matter) + body.

    ``record`` is the run's record, or ``rebasin.json`` as read (old and partial records too);
    ``recipe_text`` the recipe verbatim and ``command`` the one line that reproduces the run. Both
    are embedded so the card alone is enough to redo the merge.
    """
    record = _typed(record)
    template = resource("model_cards", "rebasin.md")
    card = ModelCard.from_template(
        card_metadata(record), template_path=str(template), **_context(record, recipe_text, command)
    )
    text = str(card)
    return text if text.endswith("\n") else text + "\n"


def _context(record: RunRecord, recipe_text: str, command: str) -> dict[str, Any]:
    """Everything the template shows, already escaped and formatted (names avoid card_data's keys)."""
    job, found = record.job, record.findings
    strategy = found.strategy or "unknown"
    transport = found.transport or Transport()
    inputs = _inputs(record)
    curves = _curves(found.curves, strategy)
    recipe = redact(recipe_text.rstrip("\n"))
    cmd = redact(command.strip())
    part, model = _part(job), writes_model(job)
    context = {
        "job": job,
        "makes_model": model,
        "title": part.title([r["short"] for r in inputs] or ["?"]),
        "inputs": inputs,
        "show_weights": found.merge_weights is not None,
        "strategy_name": strategy,
        "aligns_nothing": identity(strategy),
        "strategy_paper": _paper(strategy),
        "strategy_options": [
            {"name": _cell(str(k)), "value": _cell(_value(v))} for k, v in found.strategy_options.items()
        ],
        "data_sources": [data_source(d) for d in record.datasets],
        "barrier_table": _barrier_table(curves, found.barrier),
        "barrier_reading": _barrier_reading(curves, found.barrier, strategy),
        "learned": _learned(found.diagnostics.get("learned")),
        "alignment_reading": _alignment_reading(found.diagnostics.get("alignment")),
        "merged_scores": _merged_scores(found.merged, strategy, found.universe),
        "transport_rows": _transport_rows(transport, transport),
        "transport_support": _transport_rows(transport.support, transport),
        "chosen": _chosen(transport),
        "tradeoff_table": _tradeoff_table(transport),
        "tradeoff_reading": _tradeoff_reading(transport),
        "tradeoff_missing": _scored(transport) and transport.support is None,
        "adapter": _adapter(found),
        "moved": _moved(transport),
        "calibration": _calibration(transport),
        "function_preserved": _function_preserved(found.function_preserved, part.pair),
        "notes": list(record.notes),
        "canonical": found.canonical and model,
        "canonical_form": found.canonical,  # of the models a job writes in subfolders
        "untied": list(found.untied) if model else [],
        "command": cmd,
        "command_fence": _fence(cmd),
        "recipe_text": recipe,
        "recipe_fence": _fence(recipe),
        "version": record.hf_rebasin_version or "unknown",
        "load": _load(record) if model else None,
        "dtype": _dtype(record, model),
        "job_preserved": part.preserved,
    }
    context["job_intro"] = _render(part.intro, context)
    context["job_why"] = _render(part.why, context)
    return context


def _render(text: str, context: Mapping[str, Any]) -> str:
    """A job's Jinja text of the card, with the card's context."""
    import jinja2

    return jinja2.Template(text).render(**context)
