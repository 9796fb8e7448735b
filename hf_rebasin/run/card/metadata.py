"""The card's Hub metadata (the YAML front matter: lineage, tags, task, datasets, licence) and what
the record says of the run's kind: its job's part of the card, whether it wrote a model or an adapter.

Lineage names Hub ids only, never local paths; a licence is inherited only when the inputs agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData

from hf_rebasin.evaluation.record import Findings, RunRecord
from hf_rebasin.evaluation.scores import AdapterSummary
from hf_rebasin.recipe.jobs import JOBS, CardPart

TAGS = ("merge", "hf-rebasin", "re-basin")


PIPELINE_TAGS = {
    "causal-lm": "text-generation",
    "masked-lm": "fill-mask",
    "sequence-classification": "text-classification",
    "image-classification": "image-classification",
    "seq2seq": "text2text-generation",
}


# the part of a job this version does not know (a record written by a newer one): a report
_UNKNOWN_JOB = CardPart(
    title=lambda names: "Re-basin run: " + ", ".join(names),
    intro="This folder was written by a job of hf-rebasin (`{{ job }}`) that this version does not know.",
    why="",
    preserved="Aligning a model only re-expresses its weights in another basis; its outputs should not change.",
    pair="a model and its aligned form",
)


def card_metadata(record: RunRecord | Mapping[str, Any]) -> ModelCardData:
    """Hub metadata: lineage (Hub ids only, never local paths), tags, task and datasets."""
    record = _typed(record)
    job, found = record.job, record.findings
    hub_models = [m.model for m in record.models if m.source == "hub"]
    fields: dict[str, Any] = {"tags": _unique([*TAGS, found.strategy])}
    adapter = _adapter(found) is not None
    if adapter:  # an adapter's base is the model it loads onto: the target
        hub_models = [m.model for m in record.models[:1] if m.source == "hub"]
    if hub_models:
        fields["base_model"] = hub_models
        relation = _part(job).relation
        if relation is not None:
            fields["base_model_relation"] = relation
        elif adapter:
            fields["base_model_relation"] = "adapter"
    if writes_model(job):
        fields["library_name"] = "peft" if adapter else "transformers"
        speech = found.speech and found.task == "seq2seq"
        pipeline_tag = "automatic-speech-recognition" if speech else PIPELINE_TAGS.get(found.task)
        if pipeline_tag:
            fields["pipeline_tag"] = pipeline_tag
    hub_datasets = _unique(d.dataset for d in record.datasets if d.source == "hub")
    if hub_datasets:
        fields["datasets"] = hub_datasets
    licenses = _unique(m.license for m in record.models if m.license)
    if len(licenses) == 1:  # the inputs that declare a licence agree: the result inherits it
        fields["license"] = licenses[0]
    return ModelCardData(**fields)


def read_license(folder: Path) -> str | None:
    """The ``license`` a model folder's README.md declares in its metadata, None if none (or no card)."""
    from huggingface_hub.repocard import metadata_load

    path = Path(folder) / "README.md"
    try:
        metadata = metadata_load(path) if path.is_file() else None
    except Exception:  # a broken card (bad YAML, not text): no licence read from it
        return None
    value = (metadata or {}).get("license")
    return value.strip() if isinstance(value, str) and value.strip() else None


def _typed(record: RunRecord | Mapping[str, Any]) -> RunRecord:
    """The record, typed: a JSON object (``rebasin.json`` as read, old or partial) is parsed first."""
    return record if isinstance(record, RunRecord) else RunRecord.from_json(record)


def _adapter(found: Findings) -> AdapterSummary | None:
    """A transported LoRA adapter's entry (rank, modules, ...); None for a full model or a merge."""
    return found.transport.adapter if found.transport is not None else None


def _part(job: str) -> CardPart:
    """The job's part of the card (`jobs.Job.card`)."""
    return JOBS[job].card if job in JOBS else _UNKNOWN_JOB


def writes_model(job: str) -> bool:
    """Whether the job's folder holds a model (the others write a report only)."""
    return job in JOBS and JOBS[job].writes_model


def _unique(items: Iterable[str]) -> list[str]:
    return [x for x in dict.fromkeys(items) if x]
