"""Refusing repository code before any transformers loader sees a folder.

A model folder can name its own Python classes (``auto_map``) in any file a loader reads: the
config, the tokenizer, processor, image-processor, feature-extractor or generation config. Given
such a folder, transformers asks "Do you wish to run the custom code?" on a terminal (behind a
progress bar) or fetches and runs code from another repository. hf-rebasin never runs repository
code, so every such file is checked here, first, and every loader is called with
``trust_remote_code=False``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hf_rebasin.core.errors import FileFormatError, UnsupportedArchitectureError
from hf_rebasin.io.files import read_json

__all__ = ["CODE_KEYS", "LOADER_FILES", "code_references", "refuse_remote_code"]

# files that transformers' loaders read, and which may name code; any other top-level *config*.json too
LOADER_FILES = (
    "config.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "image_processor_config.json",
    "feature_extractor_config.json",
    "video_preprocessor_config.json",
    "generation_config.json",
)
# keys that point at Python code to import: classes for the Auto* loaders, pipelines
CODE_KEYS = ("auto_map", "custom_pipelines")


def _files(folder: Path) -> list[Path]:
    found = {folder / name for name in LOADER_FILES}
    found.update(p for p in folder.glob("*config*.json") if p.name != "adapter_config.json")
    return sorted(p for p in found if os.path.lexists(p) and not p.is_dir())  # a FIFO too: the gate names it


def _references(value: Any, path: str = "") -> list[str]:
    """The dotted paths of ``CODE_KEYS`` entries (non-empty) anywhere in a parsed JSON value."""
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key in CODE_KEYS and item:
                out.append(where)
            else:
                out.extend(_references(item, where))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out.extend(_references(item, f"{path}.{i}"))
    return out


def code_references(folder: Path) -> list[tuple[str, str, str]]:
    """Every reference to repository code in the loader files of ``folder``: (file, key path, what
    it names). A file that is not valid JSON, or not of its schema, is an error naming it."""
    out: list[tuple[str, str, str]] = []
    for path in _files(Path(folder)):
        try:
            data = read_json(path)  # through the gate: confined, regular, of a sane size, typed
        except FileFormatError:  # not JSON: a file no loader reads (loader files were typed by the gate)
            if path.name in LOADER_FILES:
                raise
            continue
        for key in _references(data):
            node: Any = data
            for part in key.split("."):
                node = node[int(part)] if isinstance(node, list) else node[part]
            named = ", ".join(sorted(map(str, node))) if isinstance(node, dict) else str(node)
            out.append((path.name, key, named))
    return out


def refuse_remote_code(folder: Path, where: str | None = None, *, trusted: bool = False) -> None:
    """Raise unless no loader file of ``folder`` names repository code.

    ``trusted`` (the recipe's ``trust_remote_code: true``) accepts the references: the code is
    still never run, the weights go into the stock class of the model_type and the tokenizer or
    processor is loaded with the stock class its file declares (or refused by its loader when it
    declares none).
    """
    if trusted:
        return
    found = code_references(folder)
    if not found:
        return
    name, key, named = found[0]
    others = f" (and {len(found) - 1} more: {', '.join(sorted({f[0] for f in found[1:]}))})" if len(found) > 1 else ""
    label = f"`{where}`: " if where else ""
    raise UnsupportedArchitectureError(
        f"{label}{str(Path(folder))!r} ships its own modeling code: `{key}` in {name} ({named}){others}; "
        "hf-rebasin never runs repository code. In a recipe, `trust_remote_code: true` ignores these "
        "references (the code is still never run): the weights are loaded into the stock class of the "
        "model_type, the tokenizer or processor into the stock class its file declares"
    )
