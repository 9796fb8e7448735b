"""Loading models from local folders and rebuilding them from transformed state dicts.

Checks happen before transformers sees the files, so that a user mistake becomes a typed error that
names the file or the tensor instead of a load report and a RuntimeError.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .adapters import get_adapter
from .errors import CheckpointError, ModelNotFoundError, PickleRefusedError
from .symmetry import SymmetryGraph

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    graph: SymmetryGraph
    path: Path


def read_config(folder: Path) -> Any:
    """The transformers config of ``folder``, with typed errors for the usual mistakes."""
    from transformers import AutoConfig

    if not folder.exists():
        raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ModelNotFoundError(f"{str(folder)!r} is a file; give the folder that holds config.json")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ModelNotFoundError(
            f"{str(cfg)!r} not found: a model folder needs a config.json (save_pretrained writes one)"
        )
    try:
        raw = json.loads(cfg.read_text())
    except ValueError as e:
        raise ModelNotFoundError(f"{str(cfg)!r} is not valid JSON: {e}") from None
    # check support before transformers parses it, so an unknown type lists what is supported
    get_adapter(raw.get("model_type") if isinstance(raw, dict) else None)
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError) as e:
        raise ModelNotFoundError(f"{str(cfg)!r} is not a valid transformers config: {e}") from None


def model_class(config: Any) -> type[PreTrainedModel]:
    """The stock transformers class named in ``config.architectures`` (AutoModel otherwise)."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls  # type: ignore[no-any-return]
    mapping = transformers.AutoModel._model_mapping  # type: ignore[attr-defined]
    found: type[PreTrainedModel] = mapping[type(config)]  # type: ignore[assignment]  # lazy mapping
    return found


def _checkpoint_shapes(folder: Path, allow_pickle: bool) -> dict[str, tuple[int, ...]]:
    """Tensor shapes read from safetensors headers (no weights loaded), or from an allowed pickle."""
    from safetensors import safe_open

    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif (folder / "model.safetensors.index.json").is_file():
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        files = [folder / f for f in sorted(set(index["weight_map"].values()))]
    elif any((folder / f).is_file() for f in PICKLE_FILES):
        if not allow_pickle:
            raise PickleRefusedError(
                f"{str(folder)!r} holds only pickle weights (pytorch_model.bin), which can run code when "
                "loaded; convert them to safetensors, or set `allow_pickle: true` if you trust the source"
            )
        return _pickle_shapes(folder)
    else:
        raise ModelNotFoundError(f"no weights in {str(folder)!r}: expected model.safetensors (or a sharded index)")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        if not f.is_file():
            raise ModelNotFoundError(f"weight shard {str(f)!r} named in the index is missing")
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    shapes[k] = tuple(h.get_slice(k).get_shape())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{str(f)!r} is not a readable safetensors file: {e}") from None
    return shapes


def _pickle_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    if (folder / "pytorch_model.bin").is_file():
        files = [folder / "pytorch_model.bin"]
    else:
        index = json.loads((folder / "pytorch_model.bin.index.json").read_text())
        files = [folder / f for f in sorted(set(index["weight_map"].values()))]
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            sd = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises several types for corrupt or unsafe pickles
            raise CheckpointError(f"{str(f)!r} is not a readable PyTorch checkpoint: {e}") from None
        shapes.update({k: tuple(v.shape) for k, v in sd.items()})
    return shapes


def _expected_shapes(cls: type[PreTrainedModel], config: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    with torch.device("meta"):
        skeleton = cls(config)
    tied = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
    return {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}, tied


def load_model(path: str | Path, *, allow_pickle: bool = False, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a model folder with its stock class, after checking every tensor against the config."""
    folder = Path(path)
    config = read_config(folder)
    spec = get_adapter(getattr(config, "model_type", None))
    cls = model_class(config)
    shapes = _checkpoint_shapes(folder, allow_pickle)
    if shapes:
        expected, tied = _expected_shapes(cls, config)
        for name, want in expected.items():
            got = shapes.get(name)
            if got is None:
                if name in tied:
                    continue
                raise CheckpointError(f"{str(folder)!r}: tensor {name!r} (shape {want}) is missing from the checkpoint")
            if got != want:
                raise CheckpointError(
                    f"{str(folder)!r}: tensor {name!r} has shape {got} in the checkpoint, but config.json "
                    f"implies {want}; the config and the weights come from different models"
                )
    prev = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        model = cls.from_pretrained(str(folder), dtype=dtype, trust_remote_code=False)
    finally:
        logging.getLogger("transformers").setLevel(prev)
    model.eval()
    state_dict = model.state_dict()
    graph = spec.graph(model.config, state_dict.keys())
    graph.check(state_dict, source=str(folder))
    return LoadedModel(model, graph, folder)


def rebuild(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], *, untie: bool = False) -> PreTrainedModel:
    """A fresh model of the same stock class holding ``state_dict`` (untied when asked)."""
    config = copy.deepcopy(model.config)
    if untie:
        config.tie_word_embeddings = False
    new = type(model)(config)
    new.load_state_dict(state_dict, strict=True)
    new.to(dtype=next(model.parameters()).dtype)  # type: ignore[call-arg]  # transformers wraps .to
    return new.eval()
