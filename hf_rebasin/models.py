"""Loading models from local folders and rebuilding them from transformed state dicts.

Checks happen before transformers sees the files, so that a user mistake becomes a typed error that
names the file or the tensor instead of a load report and a RuntimeError.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .adapters import get_adapter
from .errors import (
    CheckpointError,
    IncompatibleModelsError,
    ModelNotFoundError,
    OutputExistsError,
    PickleRefusedError,
)
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
    expected, tied = _expected_shapes(cls, config)
    # transformers 5 may store legacy parameter names (ViT: `encoder.layer.N.attention.attention.query`)
    # and rename them while loading; then names cannot be compared here and the loading report decides
    same_names = sum(name in shapes for name in expected) >= len(expected) // 2
    if shapes and same_names:
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
        loaded: Any = cls.from_pretrained(str(folder), dtype=dtype, trust_remote_code=False, output_loading_info=True)
        model: PreTrainedModel = loaded[0]
        info: dict[str, Any] = loaded[1]
    except RuntimeError as e:  # size mismatches under renamed keys
        raise CheckpointError(f"{str(folder)!r}: the weights do not match config.json: {e}") from None
    finally:
        logging.getLogger("transformers").setLevel(prev)
    missing = [k for k in info.get("missing_keys", ()) if k not in tied]
    if missing or info.get("mismatched_keys"):
        first = missing[0] if missing else info["mismatched_keys"][0]
        raise CheckpointError(
            f"{str(folder)!r}: tensor {first!r} is missing from the checkpoint or does not match config.json"
        )
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


def check_same_shapes(
    sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], label_a: str = "model A", label_b: str = "model B"
) -> None:
    """Two state dicts of one architecture: same tensor names and shapes, or an error naming the
    first difference (in A's order) and both shapes."""
    for name, t in sd_a.items():
        other = sd_b.get(name)
        if other is None:
            raise IncompatibleModelsError(
                f"tensor {name!r} (shape {tuple(t.shape)}) of {label_a} is missing from {label_b}: "
                "the models have different architectures or heads"
            )
        if other.shape != t.shape:
            raise IncompatibleModelsError(
                f"tensor {name!r} has shape {tuple(t.shape)} in {label_a} but {tuple(other.shape)} in {label_b}: "
                "only models of one architecture and size can be aligned"
            )
    extra = [k for k in sd_b if k not in sd_a]
    if extra:
        raise IncompatibleModelsError(
            f"tensor {extra[0]!r} (shape {tuple(sd_b[extra[0]].shape)}) of {label_b} does not exist in {label_a}: "
            "the models have different architectures or heads"
        )


def check_compatible(a: LoadedModel, b: LoadedModel) -> None:
    """``b`` can be aligned to ``a``: same model type, class and tensor shapes."""
    type_a, type_b = a.model.config.model_type, b.model.config.model_type
    cls_a, cls_b = type(a.model).__name__, type(b.model).__name__
    if type_a != type_b or cls_a != cls_b:
        raise IncompatibleModelsError(
            f"{str(b.path)!r} is a {cls_b} (model_type {type_b!r}) but the reference {str(a.path)!r} is a "
            f"{cls_a} (model_type {type_a!r}): only models of one architecture can be aligned"
        )
    check_same_shapes(a.model.state_dict(), b.model.state_dict(), repr(str(a.path)), repr(str(b.path)))


def check_output_folder(path: str | Path) -> Path:
    """An output folder that does not exist yet (checked before any work is done)."""
    folder = Path(path)
    if folder.exists():
        raise OutputExistsError(f"output folder {str(folder)!r} already exists; choose another or remove it first")
    return folder


def save_model(model: PreTrainedModel, state_dict: dict[str, Tensor], path: str | Path, *, untie: bool = False) -> Path:
    """Write ``state_dict`` as a standard model folder (the class and config of ``model``): into a
    temporary sibling first, renamed when complete, so a failure leaves nothing half-written."""
    folder = check_output_folder(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        rebuild(model, state_dict, untie=untie).save_pretrained(str(tmp))
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
