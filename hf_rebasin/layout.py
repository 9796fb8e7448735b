"""Which files a checkpoint is made of, as stock ``from_pretrained`` reads them (torch-free).

`model.safetensors`, else `model.safetensors.index.json` and the shards its ``weight_map`` names;
pickles (`pytorch_model.bin` or its index) only where allowed. The Hub download (`hub`) and the
local loader (`models`) read an index with the same rules, so a shard name that could point
outside the folder is refused in both places with the same words.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from .errors import CheckpointError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def index_shards(index: Path, where: str) -> list[str]:
    """The shard files the shard index at ``index`` names, sorted, each a plain file name of the
    index's folder with the index's kind of weights (``.safetensors`` / ``.bin``); ``where`` names
    the index in messages."""
    try:
        data = json.loads(Path(index).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where} is not a valid JSON shard index: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{where} has no `weight_map` (tensor name -> shard file); the shard index is incomplete")
    suffix = ".bin" if Path(index).name.endswith(".bin.index.json") else ".safetensors"
    shards = sorted({str(v) for v in weight_map.values()})
    for shard in shards:
        if not shard or PurePosixPath(shard).is_absolute() or "/" in shard or "\\" in shard or shard in (".", ".."):
            raise CheckpointError(f"{where} names the shard {shard!r}, which is not a file of the checkpoint's folder")
        if not shard.endswith(suffix):
            raise CheckpointError(f"{where} names the shard {shard!r}, which is not a {suffix} file")
    return shards
