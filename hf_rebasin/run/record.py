"""``rebasin.json`` built from a run and written with its card.

The record's types (`RunRecord` and its parts) live in `hf_rebasin.evaluation.record`, torch-free, so the card
reads the same types; here they are filled from the recipe and the resolved models. Local paths
are recorded relative to the recipe's folder: the record is published with the model and must
not show the user's own folder layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PureWindowsPath
from typing import Any

import yaml

from hf_rebasin.core.roles import Roles, TransportRoles
from hf_rebasin.evaluation.evaldata import BUILTIN_DATASETS, LOCAL_BUILDERS
from hf_rebasin.evaluation.record import CacheStats, DatasetEntry, DtypeEntry, Findings, ModelEntry, RunRecord
from hf_rebasin.io.output import write_json, write_text
from hf_rebasin.recipe import Recipe
from hf_rebasin.recipe.limits import echoed_recipe_text
from hf_rebasin.run.card import render_card
from hf_rebasin.run.card.metadata import read_license
from hf_rebasin.run.card.text import leaves_folder
from hf_rebasin.run.resolve import PlannedModel

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
    "shown_recipe_text",
    "write_record",
]

_PATH_KEYS = frozenset({"model", "dir", "data_files", "data_dir", "dataset"})
# as written, a model may be a bare string under its role
_ECHO_PATH_KEYS = _PATH_KEYS | {"models", "base", "finetuned", "target"}


def recipe_dir(recipe: Recipe) -> Path:
    """The recipe's folder (relative paths in it start there); the working folder for recipes built in code."""
    return Path(recipe.source).absolute().parent if Path(recipe.source).is_file() else Path.cwd()


def _relative(value: Any, base: Path) -> Any:
    """A local path as rebasin.json and the card show it: relative to the recipe's folder when it
    lies inside it, else by its own name (a path outside would publish the user's folder layout)."""
    if not isinstance(value, str) or not Path(value).is_absolute():
        return value
    try:
        inside = Path(os.path.relpath(value, base))
    except ValueError:  # another drive (Windows)
        return Path(value).name
    return Path(value).name if ".." in inside.parts else inside.as_posix()


def _relative_paths(data: Any, base: Path, inside: bool = False) -> Any:
    """``data`` (a recipe dump) with every local path under a path key (at any depth below it, as
    in a ``data_files`` mapping) made relative to ``base``."""
    if isinstance(data, dict):
        return {k: _relative_paths(v, base, inside or k in _PATH_KEYS) for k, v in data.items()}
    if isinstance(data, list):
        return [_relative_paths(v, base, inside) for v in data]
    return _relative(data, base) if inside else data


def _private_spans(node: yaml.Node, inside: bool = False) -> Iterator[tuple[int, int, str]]:
    """(start, end, shown) of every scalar under a path key whose path leaves the recipe's folder."""
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            yield from _private_spans(v, inside or (isinstance(k, yaml.ScalarNode) and k.value in _ECHO_PATH_KEYS))
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            yield from _private_spans(v, inside)
    elif isinstance(node, yaml.ScalarNode) and inside and leaves_folder(node.value):
        name = PureWindowsPath(node.value).name or "folder"
        yield node.start_mark.index, node.end_mark.index, json.dumps(name)


def shown_recipe_text(text: str) -> str:
    """The recipe as written, comments kept while they are small (else left out, with a note:
    `echoed_recipe_text`), with each path that leaves the recipe's folder cut to its own name: the
    card is published, the user's folder layout is not."""
    text = echoed_recipe_text(text)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:  # it was parsed once already; be safe rather than echo it raw
        return text
    if root is None:
        return text
    for start, end, shown in sorted(_private_spans(root), reverse=True):
        text = text[:start] + shown + text[end:]
    return text


def recipe_record(recipe: Recipe, output: Path) -> dict[str, Any]:
    """The recipe as run (``--output`` applied), local paths relative to the recipe's folder."""
    dumped: dict[str, Any] = recipe.model_dump(mode="json")
    dumped["output"]["dir"] = str(output)
    relative: dict[str, Any] = _relative_paths(dumped, recipe_dir(recipe))
    return relative


def model_entries(
    recipe: Recipe,
    models: Roles[PlannedModel],
    ignored: Sequence[Mapping[str, str]] = (),
    embedded: Sequence[str | None] = (),
    initialised: Sequence[Mapping[str, str]] = (),
) -> list[ModelEntry]:
    """The input models in the recipe's order, with their roles in a transport, the tensors
    loading dropped from each (``ignored``, in the same order), how each was embedded into a
    wider model's shape (``embedded``) and the tensors its files lacked (``initialised``)."""
    base = recipe_dir(recipe)
    roles = models.names if isinstance(models, TransportRoles) else (None,) * len(models.all)
    dropped = [*ignored, *[{}] * (len(models.all) - len(ignored))]
    grown = [*embedded, *[None] * (len(models.all) - len(embedded))]
    lacked = [*initialised, *[{}] * (len(models.all) - len(initialised))]
    return [
        ModelEntry(
            model=_relative(m.ref.model, base),
            revision=m.ref.revision,
            commit=m.resolved.commit,
            source=m.ref.source,
            folder=_relative(str(m.folder), base) if m.ref.source == "local" else None,
            role=role,
            license=read_license(m.folder) if m.folder is not None else None,
            ignored_tensors=dict(dropped_here),
            label=m.ref.label,
            embedded=grown_here,
            initialised_tensors=dict(lacked_here) or None,
        )
        for m, role, dropped_here, grown_here, lacked_here in zip(
            models.all, roles, dropped, grown, lacked, strict=True
        )
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
        out.append(DatasetEntry(role=role, dataset=dataset, name=spec.name, split=spec.split, source=source))
    return out


def _recipe_text(recipe: Recipe) -> str:
    """The recipe as written (comments and all), or as parsed when it was built in code."""
    if recipe.text is not None:
        return shown_recipe_text(recipe.text).rstrip("\n")
    dumped = _relative_paths(recipe.model_dump(mode="json", exclude_defaults=True), recipe_dir(recipe))
    return yaml.safe_dump(dumped, sort_keys=False).rstrip("\n")


def _command(recipe: Recipe, command: str | None) -> str:
    if command is not None:
        return command
    return f"hf-rebasin {Path(recipe.source).name}" if Path(recipe.source).suffix else "hf-rebasin RECIPE.yaml"


def write_record(folder: Path, record: RunRecord, recipe: Recipe, command: str | None) -> list[str]:
    """Write ``rebasin.json`` and the card into ``folder``; return the folder's file names."""
    data = record.to_json()
    write_json(folder / "rebasin.json", data)
    card = render_card(record, recipe_text=_recipe_text(recipe), command=_command(recipe, command))
    write_text(folder / "README.md", card)
    return sorted(p.name for p in folder.iterdir())
