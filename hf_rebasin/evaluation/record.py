"""``rebasin.json``, typed: `RunRecord` is the contract of the file, written once per run.

Pure data and its JSON form (pydantic models, see `lenient.Part`), torch-free, so both the runner
(`run.record` builds and writes it) and the card (`card.render_card` reads it) can import it.
`RunRecord.from_json` reads a written file back, including records written by older versions or
cut short: a key that is missing, null or unreadable takes the default that meant (a model
without ``source`` was a local folder, no ``dtype`` entry means no output dtype was recorded, a
damaged model entry is model ``?``), and keys this version does not know are ignored, except
inside the job's score blocks (`scores`), which keep them. ``curves``, ``barrier`` and
``diagnostics`` stay JSON objects: their keys vary with the strategy and its options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from hf_rebasin import __version__
from hf_rebasin.core.lenient import Part, reading
from hf_rebasin.evaluation.scores import Preservation, Score, Transport, Universe

__all__ = ["CacheStats", "DatasetEntry", "DtypeEntry", "Findings", "ModelEntry", "RunRecord"]


class _Entry(Part):
    """An entry of a list: read back, one that is not even an object is an entry of defaults, so the
    rest of the list still reads."""

    @model_validator(mode="before")
    @classmethod
    def _damaged(cls, data: Any) -> Any:
        return {} if reading() and not isinstance(data, Mapping | BaseModel) else data


class ModelEntry(_Entry):
    """One input model: reference, revision asked for, commit found, where it came from."""

    _omit_none = frozenset({"role", "license", "label", "embedded", "initialised_tensors"})

    model: str = "?"  # a damaged record still renders a card
    revision: str | None = None
    commit: str | None = None
    source: str = "local"  # hub | local | zoo; records written before ``source`` only knew local folders
    folder: str | None = None  # local models only (caches are not recorded)
    role: str | None = None  # transport: target | base | finetuned (absent from merges)
    license: str | None = None  # absent when the model's card declares none
    # tensors of its files that stock loading drops (legacy buffers) -> why
    ignored_tensors: dict[str, str] = Field(default_factory=dict)
    label: str | None = None  # the recipe's name for it, shown instead of ``model`` when given
    # models of different widths: how this one was written into the widest one's shape (absent: as it is)
    embedded: str | None = None
    # tensors its files lack that transformers initialises on load (a pooler, a task head) -> what (absent: none)
    initialised_tensors: dict[str, str] | None = None

    @property
    def shown(self) -> str:
        """The name people read: the recipe's label, else the Hub id or the folder's own name."""
        return self.label or self.model


class DatasetEntry(_Entry):
    """A data set the run read (the card lists the Hub ones in its metadata)."""

    role: str = "data"  # alignment | evaluation | support; an entry without one is plain ``data``
    dataset: str = "?"
    name: str | None = None
    split: str | None = None
    source: str | None = None  # builtin | local | hub; None only in a record that did not say


class CacheStats(Part):
    """The alignment cache in this run (a record without the entry ran without it)."""

    enabled: bool = False
    hits: int = 0
    misses: int = 0


class DtypeEntry(Part):
    """The stored dtype of every input, the output's and where it came from; compute is float32.
    An empty entry (an old record) has no output dtype."""

    inputs: dict[str, str] = Field(default_factory=dict)
    output: str | None = None
    # ``from`` in JSON: output.dtype | finetuned | the reference's role
    source: str | None = Field(default=None, validation_alias="from", serialization_alias="from")
    compute: str = "float32"
    kept: dict[str, str] = Field(default_factory=dict)  # tensor -> dtype, where it differs from ``output``


class Findings(Part):
    """What a job found: the job's part of the record (its top-level keys), complete when built.

    ``merged`` and ``merge_weights`` belong to merge and barrier records (a barrier's weights are
    null); a transport record has ``transport`` instead and neither of those keys. ``universe`` is
    written only with ``merge.universe``; ``function_preserved`` is None (``{}``) when not recorded.
    """

    model_config = ConfigDict(frozen=True)

    strategy: str = ""
    strategy_options: dict[str, Any] = Field(default_factory=dict)
    task: str = ""
    canonical: bool = False
    untied: list[str] = Field(default_factory=list)
    function_preserved: Preservation | None = None
    barrier: dict[str, dict[str, Any]] = Field(default_factory=dict)
    curves: dict[str, dict[str, Any]] = Field(default_factory=dict)
    merged: dict[str, Score] = Field(default_factory=dict)
    merge_weights: list[float] | None = None
    universe: Universe | None = None  # merge.universe only
    transport: Transport | None = None  # job: transport only
    diagnostics: dict[str, Any] = Field(default_factory=dict)  # learned: barrier vs steps
    speech: bool = False  # the models read audio (Whisper): written only when true

    @field_validator("function_preserved", mode="before")
    @classmethod
    def _recorded(cls, value: Any) -> Any:
        return value or None  # an empty entry: not recorded

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        out["function_preserved"] = out["function_preserved"] or {}
        drop = {"merged", "merge_weights"} if self.transport is not None else {"transport"}
        if not self.speech:
            drop.add("speech")
        return {k: v for k, v in out.items() if k not in drop and (k != "universe" or v is not None)}


class RunRecord(Part):
    """The whole of ``rebasin.json``: the run's inputs, its findings, notes, timings and versions.

    ``recipe`` is the recipe as run, dumped to JSON (the recipe schema of the version that wrote
    it). The findings' keys are top-level keys of the file. The version of a record that does not
    say is ``unknown``.
    """

    recipe: dict[str, Any] = Field(default_factory=dict)
    models: list[ModelEntry] = Field(default_factory=list)
    datasets: list[DatasetEntry] = Field(default_factory=list)
    findings: Findings = Field(default_factory=Findings)
    notes: list[str] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)
    cache: CacheStats = Field(default_factory=CacheStats)
    dtype: DtypeEntry = Field(default_factory=DtypeEntry)
    hf_rebasin_version: str = __version__

    @property
    def job(self) -> str:
        """The recipe's job; records written before jobs existed were merges."""
        return str(self.recipe.get("job") or "merge")

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: Any) -> Any:
        """Read from the file's form: the findings among the top-level keys."""
        if not reading() or not isinstance(data, Mapping):
            return data
        return {**data, "findings": data, "hf_rebasin_version": data.get("hf_rebasin_version") or "unknown"}

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        findings = out.pop("findings")
        return {**out, **findings}
