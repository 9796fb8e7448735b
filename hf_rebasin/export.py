"""Writing a result folder: nothing half-written, nothing overwritten unasked (DESIGN.md §6, §8).

Everything goes into a temporary folder beside the target and is renamed into place only when
complete; an existing target is replaced only with ``output.overwrite: true`` (moved aside first,
removed last, so a failure at any point leaves either the old folder or the new one).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import OutputExistsError

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel

DEFAULT_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default: one file unless a model is larger

__all__ = [
    "PREPROCESSOR_FILES",
    "check_output",
    "copy_preprocessor_files",
    "output_folder",
    "save_merged_model",
    "write_json",
    "write_text",
]

# tokenizer, image-processor and processor files that `save_pretrained` of their classes writes
PREPROCESSOR_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "preprocessor_config.json",
    "processor_config.json",
    "image_processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


def check_output(target: Path, overwrite: bool) -> Path:
    """``target`` as an absolute path, refused when it exists and ``overwrite`` is off.

    Called before any work is done, so that a long run never ends by refusing to save.
    """
    target = Path(target).expanduser().absolute()
    if target.exists() and not overwrite:
        raise OutputExistsError(
            f"output folder {str(target)!r} already exists; choose another `output.dir` (or --output), "
            "remove it, or set `output.overwrite: true` to replace it"
        )
    if target.exists() and not target.is_dir():
        raise OutputExistsError(f"output {str(target)!r} is a file, not a folder; choose another `output.dir`")
    return target


@contextmanager
def output_folder(target: Path, *, overwrite: bool) -> Iterator[Path]:
    """A temporary folder beside ``target`` to write into; renamed to ``target`` when the block ends.

    If the block raises, the temporary folder is removed and ``target`` is untouched.
    """
    target = check_output(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _replace(tmp, target, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _replace(tmp: Path, target: Path, overwrite: bool) -> None:
    if not target.exists():
        tmp.rename(target)
        return
    check_output(target, overwrite)  # it may have appeared while we worked
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    old.rmdir()
    target.rename(old)
    try:
        tmp.rename(target)
    except OSError:
        old.rename(target)  # put the previous result back
        raise
    shutil.rmtree(old, ignore_errors=True)


def copy_preprocessor_files(source: Path, dest: Path) -> list[str]:
    """Copy the tokenizer / image-processor files of ``source`` (model A) into ``dest``; their names."""
    copied: list[str] = []
    for name in PREPROCESSOR_FILES:
        src = Path(source) / name
        if src.is_file():
            shutil.copy2(src, Path(dest) / name)
            copied.append(name)
    return copied


def save_merged_model(
    template: PreTrainedModel,
    state_dict: Mapping[str, Tensor],
    dest: Path,
    *,
    untie: bool = False,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
) -> None:
    """``state_dict`` saved as a standard folder of ``template``'s class and config (safetensors).

    ``untie`` stores a tied LM head apart (canonical forms of orthogonal strategies); the folder
    still loads with the stock class, which reads ``tie_word_embeddings: false`` from the config.
    """
    from .models import rebuild

    model = rebuild(template, dict(state_dict), untie=untie)  # rebuilt on the CPU
    model.save_pretrained(str(dest), max_shard_size=max_shard_size)  # safetensors, sharded past the size


def _plain(value: Any) -> Any:
    """JSON-ready: floats as Python floats (NaN / ±inf as null), tuples and paths as lists / strings."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        return _plain(value.item())
    raise TypeError(f"cannot write a {type(value).__name__} to JSON")


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as indented JSON with sorted keys (stable diffs between runs)."""
    Path(path).write_text(json.dumps(_plain(data), indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def write_text(path: Path, text: str) -> None:
    """A UTF-8 text file (Markdown tables)."""
    Path(path).write_text(text, encoding="utf-8")
