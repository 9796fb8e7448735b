"""``rebasin.json``, typed: `RunRecord` is the contract of the file, written once per run.

The card (`card.render_card`) is rendered from it, and `RunRecord.from_json` reads a written file
back. Local paths are recorded relative to the recipe's folder: the record is published with the
model and must not show the user's own folder layout.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import __version__
from ..card import read_license, render_card
from ..evaldata import BUILTIN_DATASETS, LOCAL_BUILDERS
from ..export import write_json, write_text
from ..recipe import Recipe
from .resolve import PlannedModel
from .roles import Roles, TransportRoles

__all__ = [
    "CacheStats",
    "DatasetEntry",
    "DtypeEntry",
    "Findings",
    "ModelEntry",
    "RunRecord",
    "dataset_entries",
    "model_entries",
    "recipe_dir",
    "recipe_record",
    "write_record",
]

_PATH_KEYS = frozenset({"model", "dir", "data_files", "data_dir", "dataset"})


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

    def to_json(self) -> dict[str, Any]:
        """As written: ``role`` and ``license`` only when known."""
        out = dataclasses.asdict(self)
        return {k: v for k, v in out.items() if v is not None or k not in ("role", "license")}


@dataclass
class DatasetEntry:
    """A data set the run read (the card lists the Hub ones in its metadata)."""

    role: str  # alignment | evaluation | support
    dataset: str
    name: str | None
    split: str | None
    source: str  # builtin | local | hub


@dataclass
class CacheStats:
    """The alignment cache in this run."""

    enabled: bool
    hits: int = 0
    misses: int = 0


@dataclass
class DtypeEntry:
    """The stored dtype of every input, the output's and where it came from; compute is float32."""

    inputs: dict[str, str]
    output: str | None = None
    source: str | None = None  # ``from`` in JSON: output.dtype | finetuned | the reference's role
    compute: str = "float32"

    def to_json(self) -> dict[str, Any]:
        """As written: the source is ``from``."""
        return {"inputs": self.inputs, "output": self.output, "from": self.source, "compute": self.compute}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DtypeEntry:
        """Read back from ``rebasin.json``."""
        return cls(dict(data["inputs"]), data.get("output"), data.get("from"), data.get("compute", "float32"))


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
        """The findings among a whole record's keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class RunRecord:
    """The whole of ``rebasin.json``: the run's inputs, its findings, notes, timings and versions."""

    recipe: dict[str, Any]
    models: list[ModelEntry]
    datasets: list[DatasetEntry]
    findings: Findings
    notes: list[str]
    timings: dict[str, float]
    cache: CacheStats
    dtype: DtypeEntry
    hf_rebasin_version: str = __version__

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
        """A record read back from ``rebasin.json`` (as this version writes it)."""
        return cls(
            recipe=dict(data["recipe"]),
            models=[ModelEntry(**m) for m in data["models"]],
            datasets=[DatasetEntry(**d) for d in data["datasets"]],
            findings=Findings.from_json(data),
            notes=list(data["notes"]),
            timings=dict(data["timings"]),
            cache=CacheStats(**data["cache"]),
            dtype=DtypeEntry.from_json(data["dtype"]),
            hf_rebasin_version=str(data["hf_rebasin_version"]),
        )


def recipe_dir(recipe: Recipe) -> Path:
    """The recipe's folder (relative paths in it start there); the working folder for recipes built in code."""
    return Path(recipe.source).absolute().parent if Path(recipe.source).is_file() else Path.cwd()


def _relative(value: Any, base: Path) -> Any:
    """A local path as rebasin.json records it: relative to the recipe's folder."""
    if not isinstance(value, str) or not Path(value).is_absolute():
        return value
    try:
        return Path(os.path.relpath(value, base)).as_posix()
    except ValueError:  # another drive (Windows)
        return Path(value).name


def _relative_paths(data: Any, base: Path, key: str | None = None) -> Any:
    """``data`` (a recipe dump) with every local path under a path key made relative to ``base``."""
    if isinstance(data, dict):
        return {k: _relative_paths(v, base, k) for k, v in data.items()}
    if isinstance(data, list):
        return [_relative_paths(v, base, key) for v in data]
    return _relative(data, base) if key in _PATH_KEYS else data


def recipe_record(recipe: Recipe, output: Path) -> dict[str, Any]:
    """The recipe as run (``--output`` applied), local paths relative to the recipe's folder."""
    dumped: dict[str, Any] = recipe.model_dump(mode="json")
    dumped["output"]["dir"] = str(output)
    relative: dict[str, Any] = _relative_paths(dumped, recipe_dir(recipe))
    return relative


def model_entries(recipe: Recipe, models: Roles[PlannedModel]) -> list[ModelEntry]:
    """The input models in the recipe's order, with their roles in a transport."""
    base = recipe_dir(recipe)
    roles = models.names if isinstance(models, TransportRoles) else (None,) * len(models.all)
    return [
        ModelEntry(
            model=_relative(m.ref.model, base),
            revision=m.ref.revision,
            commit=m.resolved.commit,
            source=m.ref.source,
            folder=_relative(str(m.folder), base) if m.ref.source == "local" else None,
            role=role,
            license=read_license(m.folder) if m.folder is not None else None,
        )
        for m, role in zip(models.all, roles, strict=True)
    ]


def dataset_entries(recipe: Recipe) -> list[DatasetEntry]:
    """Which data sets the run read, and whether each is a Hub id."""
    ev = recipe.evaluate
    sections = [
        ("alignment", recipe.data),
        ("evaluation", ev.data if ev else None),
        ("support", ev.support if ev else None),
    ]
    out = []
    for role, spec in sections:
        if spec is None:
            continue
        local = spec.dataset in LOCAL_BUILDERS or Path(spec.dataset).is_absolute()
        source = "builtin" if spec.dataset in BUILTIN_DATASETS else "local" if local else "hub"
        dataset = _relative(spec.dataset, recipe_dir(recipe))
        out.append(DatasetEntry(role, dataset, spec.name, spec.split, source))
    return out


def _recipe_text(recipe: Recipe) -> str:
    """The recipe as written (comments and all), or as parsed when it was built in code."""
    if recipe.text is not None:
        return recipe.text.rstrip("\n")
    return yaml.safe_dump(recipe.model_dump(mode="json", exclude_defaults=True), sort_keys=False).rstrip("\n")


def _command(recipe: Recipe, command: str | None) -> str:
    if command is not None:
        return command
    return f"hf-rebasin {Path(recipe.source).name}" if Path(recipe.source).suffix else "hf-rebasin RECIPE.yaml"


def write_record(folder: Path, record: RunRecord, recipe: Recipe, command: str | None) -> list[str]:
    """Write ``rebasin.json`` and the card into ``folder``; return the folder's file names."""
    data = record.to_json()
    write_json(folder / "rebasin.json", data)
    card = render_card(data, recipe_text=_recipe_text(recipe), command=_command(recipe, command))
    write_text(folder / "README.md", card)
    return sorted(p.name for p in folder.iterdir())
