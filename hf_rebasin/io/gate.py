"""`check_folder`: every file of a model folder that a run reads, through the gate at once.

Called first wherever a model folder enters: the plan (before the repository-code scan, the
tokenizer comparison and the memory estimate), the load step for models downloaded or trained
after the plan, and `models.load_model` (``verify``, ``align``, ``embed``). What it checks is
in `files`; which files a run reads is decided here (torch-free).
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_rebasin.core.errors import named
from hf_rebasin.io.files import SUPPORT_LIMIT, check_json, checked, model_root, read_config, read_header, resolve_folder
from hf_rebasin.io.layout import PICKLE, PICKLE_INDEX, SAFETENSORS, SAFETENSORS_INDEX, index_shards, is_support_file
from hf_rebasin.io.schemas import SCHEMAS

__all__ = ["check_file", "check_folder", "read_files", "safetensors_files"]

_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def _json_names(names: list[str]) -> list[str]:
    """The JSON files of a folder that some loader parses (each has a schema); other JSON files
    an output carries are checked as files (`check_file`), not parsed."""
    return [n for n in names if n in SCHEMAS]


def _weights(folder: Path, names: set[str], allow_pickle: bool) -> tuple[list[str], list[str]]:
    """(safetensors files, pickle files) that loading reads, as stock ``from_pretrained`` picks them."""
    if SAFETENSORS in names:
        return [SAFETENSORS], []
    if SAFETENSORS_INDEX in names:
        return index_shards(folder / SAFETENSORS_INDEX, repr(str(folder / SAFETENSORS_INDEX))), []
    if not allow_pickle:
        return [], []
    if PICKLE in names:
        return [], [PICKLE]
    if PICKLE_INDEX in names:
        return [], index_shards(folder / PICKLE_INDEX, repr(str(folder / PICKLE_INDEX)))
    return [], []


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files loading reads of ``folder`` (the single file, or the index's shards)."""
    names = {e.name for e in os.scandir(folder)}
    return [Path(folder) / name for name in _weights(Path(folder), names, allow_pickle=False)[0]]


def read_files(folder: Path, *, allow_pickle: bool = False) -> list[str]:
    """The names of the files of ``folder`` that a run reads: loader JSON files, the weights that
    loading picks, an adapter's, and every file an output carries (`layout.is_support_file`)."""
    names = sorted(e.name for e in os.scandir(folder) if not e.name.startswith("."))
    present = set(names)
    safetensors, pickles = _weights(folder, present, allow_pickle)
    adapter = [n for n in _ADAPTER_WEIGHTS if n in present and (allow_pickle or n.endswith(".safetensors"))]
    support = [n for n in names if is_support_file(n) and not (folder / n).is_dir()]  # a link loop: False
    return sorted({*_json_names(names), *safetensors, *pickles, *adapter, *support})


def check_folder(folder: Path | str, *, allow_pickle: bool = False, where: str | None = None) -> Path:
    """Pass every file a run reads of ``folder`` through the gate (`files`): confined to the model's
    folder, regular, of a sane size; JSON parsed into its schema, config sizes bounded, safetensors
    headers checked against their files. Returns the folder resolved. ``where`` (a recipe field)
    starts every message."""
    with named(where):
        real = resolve_folder(folder)
        root = model_root(real)
        for name in read_files(real, allow_pickle=allow_pickle):
            check_file(real / name, root)
    return real


def check_file(path: Path, root: Path) -> None:
    """One file through the gate by what it is: config.json typed with its sizes bounded, a JSON file
    a loader reads typed by its schema, a safetensors header checked against its file, any other
    file confined, regular and at most `SUPPORT_LIMIT` bytes."""
    name = path.name
    if name == "config.json":
        read_config(path.parent)
    elif name in SCHEMAS:
        check_json(path, root)
    elif name.endswith(".safetensors"):
        read_header(path, root)
    else:
        checked(path, root, limit=SUPPORT_LIMIT)
