"""The typed shape of every JSON file hf-rebasin reads from a model folder (torch-free).

A file from a stranger is parsed into one of these schemas before any code uses a value of it, so
that a list where an object belongs, a shape that is a string or a dtype that is a list is an
error naming the file and the key, not a TypeError three modules later. The schemas name only
the keys hf-rebasin or transformers' loaders rely on; other keys pass as they are (``extra``).
Sizes that no machine could hold are refused as what the file claims (`size_problems`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

__all__ = [
    "SAFETENSORS_DTYPES",
    "SCHEMAS",
    "AdapterConfig",
    "ConfigFile",
    "GenerationConfig",
    "HeaderEntry",
    "ShardIndex",
    "TokenizerConfig",
    "TokenizerFile",
    "size_problems",
]

Count = Annotated[StrictInt, Field(ge=0)]
Number = StrictInt | StrictFloat
TokenIds = Count | list[Count] | None

# safetensors dtype names -> bits per element (the format's own list)
SAFETENSORS_DTYPES: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


class _Open(BaseModel):
    """A JSON object whose named keys are typed and whose other keys pass through."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


class ConfigFile(_Open):
    """config.json: the keys that decide which class is built and how large it is. Sizes are
    whole numbers (or null where transformers derives them); `size_problems` bounds them."""

    model_type: StrictStr | None = None
    architectures: list[StrictStr] | None = None
    vocab_size: Count | None = None
    hidden_size: Count | None = None
    n_embd: Count | None = None
    d_model: Count | None = None
    intermediate_size: Count | None = None
    n_inner: Count | None = None
    num_hidden_layers: Count | None = None
    n_layer: Count | None = None
    num_attention_heads: Count | None = None
    n_head: Count | None = None
    num_key_value_heads: Count | None = None
    head_dim: Count | None = None
    num_local_experts: Count | None = None
    num_experts: Count | None = None
    moe_intermediate_size: Count | None = None
    max_position_embeddings: Count | None = None
    n_positions: Count | None = None
    text_config: dict[str, Any] | None = None
    vision_config: dict[str, Any] | None = None


class HeaderEntry(_Open):
    """One tensor of a safetensors header: a known dtype, a shape of non-negative integers and the
    (begin, end) byte offsets of its data."""

    dtype: Literal[tuple(SAFETENSORS_DTYPES)]  # type: ignore[valid-type]
    shape: list[Count]
    data_offsets: Annotated[list[Count], Field(min_length=2, max_length=2)]


class ShardIndex(_Open):
    """model.safetensors.index.json: which shard file holds each tensor."""

    weight_map: Annotated[dict[str, StrictStr], Field(min_length=1)]
    metadata: dict[str, Any] | None = None


class _AddedToken(_Open):
    id: Count
    content: StrictStr


class _TokenizerModel(_Open):
    type: StrictStr | None = None
    vocab: dict[str, Count] | list[Any] | None = None


class TokenizerFile(_Open):
    """tokenizer.json (the `tokenizers` library's file): its model and added tokens with their ids."""

    model: _TokenizerModel
    added_tokens: list[_AddedToken] | None = None


class _DecoderEntry(_Open):
    content: StrictStr


class TokenizerConfig(_Open):
    """tokenizer_config.json: the class to build and the added tokens by id."""

    tokenizer_class: StrictStr | None = None
    added_tokens_decoder: dict[Annotated[str, Field(pattern=r"^[0-9]{1,12}$")], _DecoderEntry] | None = None
    model_max_length: Number | None = None
    chat_template: StrictStr | list[Any] | None = None


class GenerationConfig(_Open):
    """generation_config.json: the token ids generation starts, pads and stops with."""

    bos_token_id: TokenIds = None
    eos_token_id: TokenIds = None
    pad_token_id: TokenIds = None
    decoder_start_token_id: TokenIds = None
    max_length: Count | None = None
    max_new_tokens: Count | None = None


class AdapterConfig(_Open):
    """adapter_config.json of a PEFT adapter: its kind, rank, scaling and the modules it changes."""

    peft_type: StrictStr | None = None
    r: Annotated[StrictInt, Field(ge=1, le=65_536)] | None = None
    lora_alpha: Number | None = None
    target_modules: StrictStr | list[StrictStr] | None = None
    base_model_name_or_path: StrictStr | None = None
    fan_in_fan_out: StrictBool | None = None
    rank_pattern: dict[str, Count] | None = None
    alpha_pattern: dict[str, Number] | None = None


class _AnyObject(_Open):
    """A JSON object (special_tokens_map.json, processor configs): nothing more is relied on."""


# file name -> its schema (a pydantic type): the JSON files a loader reads
SCHEMAS: dict[str, Any] = {
    "config.json": ConfigFile,
    "model.safetensors.index.json": ShardIndex,
    "pytorch_model.bin.index.json": ShardIndex,
    "tokenizer.json": TokenizerFile,
    "tokenizer_config.json": TokenizerConfig,
    "generation_config.json": GenerationConfig,
    "adapter_config.json": AdapterConfig,
    "special_tokens_map.json": _AnyObject,
    "added_tokens.json": dict[str, Count],
    "vocab.json": dict[str, Count],
    "chat_template.json": _AnyObject,
    "preprocessor_config.json": _AnyObject,
    "processor_config.json": _AnyObject,
    "image_processor_config.json": _AnyObject,
    "feature_extractor_config.json": _AnyObject,
    "video_preprocessor_config.json": _AnyObject,
}

# the largest value of each size key that a model any machine holds could have, and why
_WIDTHS = ("hidden_size", "n_embd", "d_model")
_UNITS = ("intermediate_size", "n_inner", "moe_intermediate_size")
_LIMITS: dict[str, int] = {
    **dict.fromkeys(_WIDTHS, 65_536),
    **dict.fromkeys(_UNITS, 1_048_576),
    "vocab_size": 16_777_216,
    "num_attention_heads": 65_536,
    "n_head": 65_536,
    "num_key_value_heads": 65_536,
    "head_dim": 65_536,
    "num_local_experts": 65_536,
    "num_experts": 65_536,
    "num_hidden_layers": 100_000,
    "n_layer": 100_000,
    "max_position_embeddings": 1 << 30,
    "n_positions": 1 << 26,
}
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


def _tib(elements: int) -> str:
    return f"{elements * 4 / 1024**4:,.1f} TiB"


def size_problems(config: dict[str, Any], prefix: str = "") -> list[str]:
    """Sizes in a config that no machine could hold, each said as the file says it
    ("n_embd = 1000000") with what one tensor of that size would take."""
    out: list[str] = []
    width = next((config[k] for k in _WIDTHS if isinstance(config.get(k), int)), None)
    for key, limit in _LIMITS.items():
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= limit:
            continue
        other = value if key in _WIDTHS else (width or 1)
        held = f" (one {value:,}×{other:,} matrix alone is {_tib(value * other)} in float32)" if other > 1 else ""
        out.append(f"`{prefix}{key}` = {value}{held}; the largest value hf-rebasin accepts is {limit:,}")
    for sub in _SUB_CONFIGS:
        if isinstance(config.get(sub), dict):
            out += size_problems(config[sub], f"{prefix}{sub}.")
    return out
