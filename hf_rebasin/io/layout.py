"""Which files a checkpoint is made of, as stock ``from_pretrained`` reads them, and which of a
model folder's other files an output carries (torch-free).

`model.safetensors`, else `model.safetensors.index.json` and the shards its ``weight_map`` names;
pickles (`pytorch_model.bin` or its index) only where allowed. The Hub download (`hub`) and the
local loader (`models`) read an index with the same rules, so a shard name that could point
outside the folder is refused in both places with the same words.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path, PurePosixPath

from hf_rebasin.core.errors import CheckpointError
from hf_rebasin.io.files import read_json

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
RECORD = "rebasin.json"  # what marks a folder as an hf-rebasin output (the only kind overwrite replaces)

# The one list of what is *not* carried from model A to the output: weights in every format (the
# output's own are written by `save_merged_model`), its config (written with the weights), its card
# and hf-rebasin's own files (the output gets new ones), adapters, code and hidden files. Every
# other top-level file of A (tokenizer, generation config, chat template, processor configs,
# licence texts, ...) reaches the output byte for byte, and so do the named chat templates in
# `CHAT_TEMPLATE_DIR`; `hub` downloads the same set.
WEIGHT_SUFFIXES: tuple[str, ...] = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".gguf",
    ".pkl",
    ".pickle",
    ".npz",
    ".npy",
    ".ot",
    ".tflite",
    ".index.json",  # model.safetensors.index.json, pytorch_model.bin.index.json
)
NOT_CARRIED: tuple[str, ...] = (
    "config.json",
    "README.md",
    RECORD,
    "barrier.png",
    "barrier.md",
    "learned.png",
    "alignment.png",
    "tradeoff.png",
    "tradeoff.md",
)
NOT_CARRIED_PREFIXES: tuple[str, ...] = ("adapter_", ".")
CODE_SUFFIXES: tuple[str, ...] = (".py", ".pyc", ".so", ".dll", ".dylib", ".sh")
# The one sub-folder a loader reads: transformers' tokenizer and processor loaders take every
# ``*.jinja`` in it as a named chat template (``tokenizer.chat_template`` becomes a dict).
CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_GLOB = "additional_chat_templates", "*.jinja"


def is_support_file(name: str) -> bool:
    """Whether the file ``name`` (relative to a model folder, ``/``-separated) is one of model A's
    files that the output keeps as it is: top level, not weights, not config.json, not code; or a
    named chat template."""
    if "\\" in name or not name:
        return False
    if "/" in name:  # sub-folders hold other formats (onnx/, original/) or code; templates are read
        parent, _, base = name.partition("/")
        return parent == CHAT_TEMPLATE_DIR and "/" not in base and fnmatch.fnmatchcase(base, CHAT_TEMPLATE_GLOB)
    lower = name.lower()
    return not (
        name in NOT_CARRIED
        or name.startswith(NOT_CARRIED_PREFIXES)
        or lower.endswith(WEIGHT_SUFFIXES)
        or lower.endswith(CODE_SUFFIXES)
    )


def chat_templates(folder: Path) -> list[str]:
    """The named chat templates a loader reads of ``folder`` (``CHAT_TEMPLATE_DIR/NAME.jinja``, found
    as transformers finds them: every entry of that folder whose name matches, a link or a folder
    too, so that the gate refuses what the loader would open), sorted."""
    sub = Path(folder) / CHAT_TEMPLATE_DIR
    try:
        if not sub.is_dir():
            return []
        names = sorted(e.name for e in os.scandir(sub) if fnmatch.fnmatchcase(e.name, CHAT_TEMPLATE_GLOB))
    except OSError:  # unreadable: the loader finds nothing there either
        return []
    return [f"{CHAT_TEMPLATE_DIR}/{n}" for n in names]


def index_shards(index: Path, where: str) -> list[str]:
    """The shard files the shard index at ``index`` names, sorted, each a plain file name of the
    index's folder with the index's kind of weights (``.safetensors`` / ``.bin``); ``where`` names
    the index in messages."""
    # confined to its folder, a regular file of a sane size, JSON of the index's schema
    weight_map = read_json(index)["weight_map"]
    suffix = ".bin" if Path(index).name.endswith(".bin.index.json") else ".safetensors"
    shards = sorted({str(v) for v in weight_map.values()})
    for shard in shards:
        if not shard or PurePosixPath(shard).is_absolute() or "/" in shard or "\\" in shard or shard in (".", ".."):
            raise CheckpointError(f"{where} names the shard {shard!r}, which is not a file of the checkpoint's folder")
        if not shard.endswith(suffix):
            raise CheckpointError(f"{where} names the shard {shard!r}, which is not a {suffix} file")
    return shards
