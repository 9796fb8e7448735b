"""config.json to a transformers config and its model class, with typed errors (the gate first).

config.json is read through the gate (`files.read_config`: confined, a regular file, typed, sizes
bounded), then checked for what transformers would accept and fail on later: an unsupported
model_type, a quantized checkpoint, impossible dimensions, and `architectures` naming anything
other than a model class of its own model_type.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_rebasin.core.errors import CheckpointError, ConfigError, ModelNotFoundError
from hf_rebasin.io.files import read_config as read_config_json
from hf_rebasin.io.files import read_json, resolve_folder
from hf_rebasin.symmetry.adapters import get_adapter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["config_dtype", "model_class", "read_config", "require_config"]


def config_dtype(folder: Path) -> torch.dtype | None:
    """config.json's ``dtype`` (``torch_dtype`` before transformers 5): a fallback only, since
    configs often say float32 for bf16 weights or name no dtype at all."""
    try:
        raw = read_json(folder / "config.json")
    except (OSError, ValueError):
        return None
    value = (raw.get("dtype") or raw.get("torch_dtype")) if isinstance(raw, dict) else None
    found = getattr(torch, value, None) if isinstance(value, str) else None
    return found if isinstance(found, torch.dtype) and found.is_floating_point else None


def require_config(folder: Path) -> Path:
    """``folder``'s config.json path; a missing folder, a file, a link loop or a folder without
    config.json is a user error naming it."""
    if not folder.exists() and not folder.is_symlink():
        raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist")
    if folder.is_file():
        raise ModelNotFoundError(f"{str(folder)!r} is a file; give the folder that holds config.json")
    resolve_folder(folder)  # a link loop, or a link to nothing, named as such
    cfg = folder / "config.json"
    if not os.path.lexists(cfg):
        raise ModelNotFoundError(
            f"{str(cfg)!r} not found: a model folder needs a config.json (save_pretrained writes one)"
        )
    return cfg


def read_config(folder: Path) -> Any:
    """The transformers config of ``folder``, with typed errors for the usual mistakes."""
    from transformers import AutoConfig

    cfg = require_config(folder)
    raw = read_config_json(folder)  # through the gate: confined, regular, typed, sizes bounded
    # check support before transformers parses it, so an unknown type lists what is supported
    get_adapter(raw.get("model_type") if isinstance(raw, dict) else None)
    _refuse_quantized(raw, cfg)
    _check_dimensions(raw, cfg)
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelNotFoundError(f"{str(cfg)!r} is not a valid transformers config: {e}") from None
    except Exception as e:  # huggingface_hub's strict dataclasses raise their own (non-ValueError) type
        if type(e).__name__.startswith("StrictDataclass"):
            raise ConfigError(f"{str(cfg)!r} is not a valid transformers config: {e}") from None
        raise


def _refuse_quantized(raw: Any, cfg: Path) -> None:
    """A quantized checkpoint (``quantization_config``: bitsandbytes, GPTQ, AWQ, ...) stores packed
    integers and scales, not the matrices a symmetry acts on: refused before a weight is read."""
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method is None and isinstance(quant, dict) and (quant.get("load_in_4bit") or quant.get("load_in_8bit")):
        method = "bitsandbytes"
    raise CheckpointError(
        f"{str(cfg)!r} has a `quantization_config` (method {str(method or 'unknown')!r}): the checkpoint stores "
        "quantized weights (packed integers and scales), which cannot be permuted, rotated or averaged. Use the "
        "unquantized release of the model (the repository it was quantized from; its config.json has no "
        "`quantization_config`), and quantize the merged result afterwards if you need to"
    )


# sizes a config states; each must be a whole number >= 1 (None: the model's default), or >= 0 for
# the counts in _MAY_BE_ZERO (DeBERTa-v3's `type_vocab_size: 0`: no token-type table at all)
_MAY_BE_ZERO = frozenset({"type_vocab_size"})
_DIMENSIONS = (
    "n_embd",
    "n_head",
    "n_layer",
    "n_inner",
    "n_positions",
    "n_ctx",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "image_size",
    "patch_size",
    "num_channels",
    "head_dim",
    "projection_dim",
)


def _check_dimensions(raw: Any, cfg: Path, prefix: str = "") -> None:
    """Sizes in config.json that no model can have (negative, fractional, heads that do not divide
    the width), named as written, before any class is built from them."""
    if not isinstance(raw, dict):
        return
    for key in _DIMENSIONS:
        value = raw.get(key)
        if value is None:
            continue
        values = value if key == "image_size" and isinstance(value, list) else [value]
        least = 0 if key in _MAY_BE_ZERO else 1
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= least for v in values):
            raise ConfigError(
                f"{str(cfg)!r}: `{prefix}{key}` is {value!r}; a size must be a whole number of at least {least}"
            )
    width_key = next((k for k in ("n_embd", "hidden_size") if raw.get(k) is not None), None)
    heads_key = next((k for k in ("n_head", "num_attention_heads") if raw.get(k) is not None), None)
    if width_key and heads_key and raw.get("head_dim") is None and raw[width_key] % raw[heads_key]:
        raise ConfigError(
            f"{str(cfg)!r}: `{prefix}{width_key}` = {raw[width_key]} is not divisible by `{prefix}{heads_key}` = "
            f"{raw[heads_key]}; every attention head needs the same width"
        )
    kv = raw.get("num_key_value_heads")
    if heads_key and kv is not None and raw[heads_key] % kv:
        raise ConfigError(
            f"{str(cfg)!r}: `{prefix}{heads_key}` = {raw[heads_key]} is not a multiple of "
            f"`{prefix}num_key_value_heads` = {kv}"
        )
    for sub in ("text_config", "vision_config"):
        _check_dimensions(raw.get(sub), cfg, f"{prefix}{sub}.")


def model_class(config: Any) -> type[PreTrainedModel]:
    """The stock transformers class named in ``config.architectures`` (AutoModel otherwise).

    Only a model class of the config's own model_type is accepted: the name comes from a file, and
    any other attribute of ``transformers`` (a tokenizer, another architecture, a module) would be
    called with the config. A name transformers does not know is the repository's own class when
    the config has ``auto_map`` (accepted only with ``trust_remote_code``): its stock counterpart.
    """
    import transformers
    from transformers import PreTrainedModel

    model_type = getattr(config, "model_type", None)
    names = getattr(config, "architectures", None) or []
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"config.json: `architectures` is {names!r}; it must be a list of model class names")
    mapping: Any = transformers.AutoModel._model_mapping  # type: ignore[attr-defined]  # lazy mapping
    auto_map = getattr(config, "auto_map", None) or {}
    for name in names:
        cls = getattr(transformers, name, None) if name.isidentifier() and not name.startswith("_") else None
        if cls is None and auto_map:
            return _stock_for_custom(config, name, auto_map)
        config_class = getattr(cls, "config_class", None)
        if not (
            isinstance(cls, type)
            and issubclass(cls, PreTrainedModel)
            and getattr(config_class, "model_type", None) == model_type
        ):
            try:
                example = f" (such as {mapping[type(config)].__name__})"
            except KeyError:
                example = ""
            raise ConfigError(
                f"config.json: `architectures` names {name!r}, which is not a transformers model class of "
                f"model_type {model_type!r}{example}; the config was edited or comes from another model"
            )
        return cls  # type: ignore[no-any-return]
    found: type[PreTrainedModel] = mapping[type(config)]  # type: ignore[assignment]
    return found


def _stock_for_custom(config: Any, name: str, auto_map: Any) -> type[PreTrainedModel]:
    """The stock class standing in for the repository's own ``name``: the one the Auto class that
    ``auto_map`` lists for it would pick for this model_type, else AutoModel's."""
    import transformers

    if isinstance(auto_map, dict):
        for auto_name, target in auto_map.items():
            targets = target if isinstance(target, list) else [target]
            if not str(auto_name).startswith("AutoModel") or not any(str(t).endswith(f".{name}") for t in targets):
                continue
            auto = getattr(transformers, str(auto_name), None)
            try:
                return auto._model_mapping[type(config)]  # type: ignore[union-attr,no-any-return]
            except (AttributeError, KeyError):
                continue
    mapping: Any = transformers.AutoModel._model_mapping  # type: ignore[attr-defined]  # lazy mapping
    found: type[PreTrainedModel] = mapping[type(config)]
    return found
