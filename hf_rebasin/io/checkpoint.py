"""What a model folder's checkpoint files hold, read without loading a weight.

Every tensor's shape, stored dtype and file, from safetensors headers (or an allowed pickle), so
that the checks of `io.checks` can compare them with the config before transformers sees the files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from hf_rebasin.core.errors import CheckpointError, ModelNotFoundError, PickleRefusedError
from hf_rebasin.io.files import read_header
from hf_rebasin.io.layout import PICKLE, PICKLE_INDEX, SAFETENSORS, SAFETENSORS_INDEX, index_shards
from hf_rebasin.io.tensors import DTYPES, StackedKeys

PICKLE_FILES = (PICKLE, PICKLE_INDEX)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how rebasin.json, the card and config.json name a dtype."""
    return str(dtype).removeprefix("torch.")


def _main_dtype(sizes: Mapping[torch.dtype, int]) -> torch.dtype | None:
    """The floating dtype holding the most values (a bf16 model may keep a few float32 tensors)."""
    if not sizes:
        return None
    return max(sizes.items(), key=lambda kv: (kv[1], kv[0] == torch.float32))[0]


@dataclass
class Checkpoint:
    """What the checkpoint files say without loading a weight: tensor shapes and where each is."""

    shapes: dict[str, tuple[int, ...]]
    files: dict[str, str]  # tensor -> file name
    dtypes: dict[str, torch.dtype | None] = field(default_factory=dict)  # tensor -> stored dtype (None: unknown)
    dropped: set[str] = field(default_factory=set)  # model names of the tensors stock loading drops
    stacks: dict[str, StackedKeys] = field(default_factory=dict)  # model name -> its experts' keys, stored apart
    fused: set[str] = field(default_factory=set)  # model names of expert tensors stored stacked
    # model names of tensors the files lack and the class makes on load (Marian's sinusoidal tables)
    made: set[str] = field(default_factory=set)
    # model names of tensors the files lack that transformers initialises (a pooler, a task head), with why
    initialised: dict[str, str] = field(default_factory=dict)

    @property
    def expert_layout(self) -> str | None:
        """How the experts of a mixture-of-experts model are stored: ``per-expert`` (one tensor per
        expert and projection, as ``save_pretrained`` writes), ``fused`` (the model's 3-D tensors),
        None for a model without experts."""
        return "per-expert" if self.stacks else "fused" if self.fused else None

    def keys_of(self, names: Mapping[str, str]) -> list[str]:
        """The checkpoint keys holding the model tensors of ``names`` (every expert of a stacked one)."""
        return [k for name, key in names.items() for k in (self.stacks[name].keys if name in self.stacks else [key])]

    def floating(self, names: Mapping[str, str]) -> dict[str, torch.dtype]:
        """Model name -> stored dtype of each floating tensor that loading keeps."""
        found = {name: self.dtypes.get(key) for name, key in names.items()}
        return {name: d for name, d in found.items() if d is not None and d.is_floating_point}

    def stored_dtype(self, keys: Iterable[str] | None = None) -> torch.dtype | None:
        """The dtype most floating values (of ``keys``, default all) are stored in (None: no floating tensor)."""
        sizes: dict[torch.dtype, int] = {}
        for key in self.dtypes if keys is None else keys:
            dtype = self.dtypes.get(key)
            if dtype is not None and dtype.is_floating_point:
                sizes[dtype] = sizes.get(dtype, 0) + math.prod(self.shapes[key])
        return _main_dtype(sizes)


def _read_index(path: Path) -> list[Path]:
    """The shard files a ``*.index.json`` names, each inside the folder, or an error naming the index."""
    return [path.parent / shard for shard in index_shards(path, repr(str(path)))]


def checkpoint_shapes(folder: Path, allow_pickle: bool) -> Checkpoint:
    """Tensor shapes read from safetensors headers (no weights loaded), or from an allowed pickle."""
    from safetensors import safe_open

    if (folder / SAFETENSORS).is_file():
        files = [folder / SAFETENSORS]
    elif (folder / SAFETENSORS_INDEX).is_file():
        files = _read_index(folder / SAFETENSORS_INDEX)
    elif any((folder / f).is_file() for f in PICKLE_FILES):
        if not allow_pickle:
            raise PickleRefusedError(
                f"{str(folder)!r} holds only pickle weights (pytorch_model.bin), which can run code when "
                "loaded; convert them to safetensors, or set `allow_pickle: true` if you trust the source"
            )
        return _pickle_shapes(folder)
    else:
        raise ModelNotFoundError(f"no weights in {str(folder)!r}: expected model.safetensors (or a sharded index)")
    out = Checkpoint({}, {})
    for f in files:
        if not f.is_file():
            raise ModelNotFoundError(f"weight shard {str(f)!r} named in the index is missing")
        read_header(f)  # through the gate: confined, regular, typed, spans inside the file
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    piece = h.get_slice(k)
                    out.shapes[k] = tuple(piece.get_shape())
                    out.files[k] = f.name
                    out.dtypes[k] = DTYPES.get(piece.get_dtype())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{str(f)!r} is not a readable safetensors file: {e}") from None
    return out


def _pickle_shapes(folder: Path) -> Checkpoint:
    if (folder / PICKLE).is_file():
        files = [folder / PICKLE]
    else:
        files = _read_index(folder / PICKLE_INDEX)
    out = Checkpoint({}, {})
    for f in files:
        if not f.is_file():
            raise ModelNotFoundError(f"weight shard {str(f)!r} named in the index is missing")
        try:
            sd = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises several types for corrupt or unsafe pickles
            raise CheckpointError(f"{str(f)!r} is not a readable PyTorch checkpoint: {e}") from None
        if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
            raise CheckpointError(f"{str(f)!r} is not a state dict (tensor name -> tensor)")
        for k, v in sd.items():
            out.shapes[str(k)] = tuple(v.shape)
            out.files[str(k)] = f.name
            out.dtypes[str(k)] = v.dtype
    return out
