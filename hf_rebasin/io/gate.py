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
from hf_rebasin.io.files import (
    MIB,
    SUPPORT_LIMIT,
    check_json,
    checked,
    model_root,
    read_config,
    read_header,
    resolve_folder,
)
from hf_rebasin.io.layout import (
    PICKLE,
    PICKLE_INDEX,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    chat_templates,
    index_shards,
    is_support_file,
)
from hf_rebasin.io.schemas import SCHEMAS

__all__ = ["check_file", "check_folder", "read_files", "safetensors_files", "support_files"]

_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# Text a loader reads whole into memory: a chat template (real ones are a few KB), a vocabulary or
# merges list (a 256k-token vocab.txt is a few MB). Other carried files are copied, not read.
TEXT_LIMITS = {".jinja": 16 * MIB, ".txt": 256 * MIB}


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
    return sorted({*_json_names(names), *safetensors, *pickles, *adapter, *support, *chat_templates(folder)})


def support_files(folder: Path) -> dict[str, Path]:
    """The files of ``folder`` an output carries (`layout.is_support_file`: top-level files and the
    named chat templates), each through the gate: its name relative to ``folder`` -> the real path
    that passed, which is what a copy reads (a link out of the model's folder, a FIFO or a device is
    refused, never copied into an output)."""
    folder = Path(folder)
    try:
        names = sorted(e.name for e in os.scandir(folder) if is_support_file(e.name) and not e.is_dir())
    except OSError:
        return {}
    root = model_root(folder.resolve())
    return {name: check_file(folder / name, root) for name in [*names, *chat_templates(folder)]}


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


def check_file(path: Path, root: Path) -> Path:
    """One file through the gate by what it is: config.json typed with its sizes bounded, a JSON file
    a loader reads typed by its schema, a safetensors header checked against its file, a text file
    a loader reads (`TEXT_LIMITS`) or any other file confined, regular and of a bounded size. The
    real path that passed."""
    name = path.name
    if name == "config.json":
        read_config(path.parent)
    elif name in SCHEMAS:
        check_json(path, root)
    elif name.endswith(".safetensors"):
        read_header(path, root)
    else:
        return checked(path, root, limit=TEXT_LIMITS.get(Path(name).suffix.lower(), SUPPORT_LIMIT))
    return checked(path, root)
