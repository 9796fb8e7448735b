"""``rebasin.json``, typed: `RunRecord` is the contract of the file, written once per run.

Pure data and its JSON form, torch-free, so both the runner (`run.record` builds and writes it) and
the card (`card.render_card` reads it) can import it. `RunRecord.from_json` reads a written file
back, including records written by older versions or cut short: a key that is missing takes the
default that meant (a model without ``source`` was a local folder, no ``dtype`` entry means no
output dtype was recorded), and keys this version does not know are ignored.

The job's scores (``curves``, ``merged``, ``transport``, ``universe``, ``function_preserved``)
stay JSON objects: their keys vary with the job, the metric and the options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import __version__

__all__ = ["CacheStats", "DatasetEntry", "DtypeEntry", "Findings", "ModelEntry", "RunRecord"]


@dataclass
class ModelEntry:
    """One input model: reference, revision asked for, commit found, where it came from."""

    model: str
    revision: str | None
    commit: str | None
    source: str  # hub | local | zoo
    folder: str | None  # local models only (caches are not recorded)
    role: str | None = None  # transport: target | base | finetuned (absent from merges)
    license: str | None = None  # absent when the model's card declares none
    # tensors of its files that stock loading drops (legacy buffers) -> why
    ignored_tensors: dict[str, str] = field(default_factory=dict)
    label: str | None = None  # the recipe's name for it, shown instead of ``model`` when given

    def to_json(self) -> dict[str, Any]:
        """As written: ``role``, ``license`` and ``label`` only when known."""
        out = dataclasses.asdict(self)
        return {k: v for k, v in out.items() if v is not None or k not in ("role", "license", "label")}

    @property
    def shown(self) -> str:
        """The name people read: the recipe's label, else the Hub id or the folder's own name."""
        return self.label or self.model

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelEntry:
        """Read back; records written before ``source`` existed only knew local folders."""
        return cls(
            model=str(data.get("model", "?")),  # a damaged record still renders a card
            revision=data.get("revision"),
            commit=data.get("commit"),
            source=str(data.get("source") or "local"),
            folder=data.get("folder"),
            role=data.get("role"),
            license=data.get("license"),
            ignored_tensors=dict(data.get("ignored_tensors") or {}),
            label=data.get("label"),
        )


@dataclass
class DatasetEntry:
    """A data set the run read (the card lists the Hub ones in its metadata)."""

    role: str  # alignment | evaluation | support
    dataset: str
    name: str | None
    split: str | None
    source: str | None  # builtin | local | hub; None only in a record that did not say

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DatasetEntry:
        """Read back; an entry without a role is shown as plain ``data``."""
        return cls(
            role=str(data.get("role") or "data"),
            dataset=str(data.get("dataset", "?")),
            name=data.get("name"),
            split=data.get("split"),
            source=data.get("source"),
        )


@dataclass
class CacheStats:
    """The alignment cache in this run."""

    enabled: bool
    hits: int = 0
    misses: int = 0

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CacheStats:
        """Read back; a record without the entry ran without the cache."""
        return cls(bool(data.get("enabled")), int(data.get("hits") or 0), int(data.get("misses") or 0))


@dataclass
class DtypeEntry:
    """The stored dtype of every input, the output's and where it came from; compute is float32."""

    inputs: dict[str, str]
    output: str | None = None
    source: str | None = None  # ``from`` in JSON: output.dtype | finetuned | the reference's role
    compute: str = "float32"
    kept: dict[str, str] = field(default_factory=dict)  # tensor -> dtype, where it differs from ``output``

    def to_json(self) -> dict[str, Any]:
        """As written: the source is ``from``."""
        return {
            "inputs": self.inputs,
            "output": self.output,
            "from": self.source,
            "compute": self.compute,
            "kept": self.kept,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DtypeEntry:
        """Read back from ``rebasin.json``; an empty entry (an old record) has no output dtype."""
        return cls(
            dict(data.get("inputs") or {}),
            data.get("output"),
            data.get("from"),
            data.get("compute") or "float32",
            dict(data.get("kept") or {}),
        )


@dataclass
class Findings:
    """What a job found: the job's part of the record.

    ``merged`` and ``merge_weights`` belong to merge and barrier records (a barrier's weights are
    null); a transport record has ``transport`` instead and neither of those keys.
    """

    strategy: str
    strategy_options: dict[str, Any]
    task: str
    canonical: bool
    untied: list[str]
    function_preserved: dict[str, Any]
    barrier: dict[str, dict[str, float]] = field(default_factory=dict)
    curves: dict[str, dict[str, Any]] = field(default_factory=dict)
    merged: dict[str, dict[str, Any]] = field(default_factory=dict)
    merge_weights: list[float] | None = None
    universe: dict[str, Any] | None = None  # merge.universe only
    transport: dict[str, Any] | None = None  # job: transport only
    diagnostics: dict[str, Any] = field(default_factory=dict)  # learned: barrier vs steps

    def to_json(self) -> dict[str, Any]:
        """The record's top-level keys for this job (see the class docstring for which are absent)."""
        out = dataclasses.asdict(self)
        if self.transport is None:
            out.pop("transport")
        else:
            out.pop("merged")
            out.pop("merge_weights")
        if self.universe is None:
            out.pop("universe")
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Findings:
        """The findings among a whole record's keys; a missing or null one is empty."""
        weights = data.get("merge_weights")
        return cls(
            strategy=str(data.get("strategy") or ""),
            strategy_options=dict(data.get("strategy_options") or {}),
            task=str(data.get("task") or ""),
            canonical=bool(data.get("canonical")),
            untied=[str(u) for u in data.get("untied") or []],
            function_preserved=dict(data.get("function_preserved") or {}),
            barrier=dict(data.get("barrier") or {}),
            curves=dict(data.get("curves") or {}),
            merged=dict(data.get("merged") or {}),
            merge_weights=list(weights) if weights is not None else None,
            universe=data.get("universe"),
            transport=data.get("transport"),
            diagnostics=dict(data.get("diagnostics") or {}),
        )


@dataclass
class RunRecord:
    """The whole of ``rebasin.json``: the run's inputs, its findings, notes, timings and versions.

    ``recipe`` is the recipe as run, dumped to JSON (the recipe schema of the version that wrote it).
    """

    recipe: dict[str, Any]
    models: list[ModelEntry]
    datasets: list[DatasetEntry]
    findings: Findings
    notes: list[str]
    timings: dict[str, float]
    cache: CacheStats
    dtype: DtypeEntry
    hf_rebasin_version: str = __version__

    @property
    def job(self) -> str:
        """The recipe's job; records written before jobs existed were merges."""
        return str(self.recipe.get("job") or "merge")

    def to_json(self) -> dict[str, Any]:
        """The JSON object written (keys are sorted on write)."""
        return {
            "recipe": self.recipe,
            "models": [m.to_json() for m in self.models],
            "datasets": [dataclasses.asdict(d) for d in self.datasets],
            **self.findings.to_json(),
            "notes": self.notes,
            "timings": self.timings,
            "cache": dataclasses.asdict(self.cache),
            "dtype": self.dtype.to_json(),
            "hf_rebasin_version": self.hf_rebasin_version,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunRecord:
        """A record read back from ``rebasin.json``, this version's or an older, partial one (the
        version of a record that does not say is ``unknown``)."""
        return cls(
            recipe=dict(data.get("recipe") or {}),
            models=[ModelEntry.from_json(m) for m in data.get("models") or []],
            datasets=[DatasetEntry.from_json(d) for d in data.get("datasets") or []],
            findings=Findings.from_json(data),
            notes=[str(n) for n in data.get("notes") or []],
            timings=dict(data.get("timings") or {}),
            cache=CacheStats.from_json(data.get("cache") or {}),
            dtype=DtypeEntry.from_json(data.get("dtype") or {}),
            hf_rebasin_version=str(data.get("hf_rebasin_version") or "unknown"),
        )
