"""The transformers config each zoo family is built from: the family's own config class with the
zoo's sizes under the family's names, every dropout at 0, the tokenizer's special ids (or the
digits' labels), then the kind's ``options``.

Kept apart from the recipes that train them (`causal`, `masked`, `images`): building a config
trains nothing, so tests and benchmarks check a family's config without training its model.
"""

from __future__ import annotations

from typing import Any

from hf_rebasin.evaluation.zoo.catalogue import CausalLMTrainConfig, ImageTrainConfig, MaskedLMTrainConfig


def causal_lm_config(config: CausalLMTrainConfig, tokenizer: Any) -> Any:
    """The transformers config of a `CausalLMTrainConfig`'s model for ``tokenizer``: the family's
    config class with the zoo's sizes and the tokenizer's special ids, then ``options``; everything
    else is the family's default, but every dropout is 0 (GPT-2's default is 0.1)."""
    from transformers import AutoConfig

    sizes: dict[str, Any] = {
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
    }
    return AutoConfig.for_model(
        config.family,
        **_no_dropout(config.family),
        vocab_size=len(tokenizer),
        max_position_embeddings=config.block_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=int(tokenizer.pad_token_id),
        **{k: v for k, v in sizes.items() if v is not None},
        **{k: list(v) if isinstance(v, tuple) else v for k, v in config.options},  # tuples: hashable in the key
    )


# sizes a family names otherwise than the zoo's shared names (and its config's attribute_map does not alias)
_RENAMED: dict[str, dict[str, str]] = {"distilbert": {"intermediate_size": "hidden_dim"}}
# families whose learned positions start after padding_idx (RoBERTa's rule): two more rows than a
# block, as the released checkpoints have (514 for 512 tokens) and as a run reads them (`run.data`)
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")


def _no_dropout(family: str) -> dict[str, float]:
    """Every dropout rate of ``family``'s config at 0 (``hidden_dropout_prob``, GPT-2's ``resid_pdrop``, …)."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(family).to_dict()
    return {
        k: 0.0
        for k, v in defaults.items()
        if any(part in k for part in ("dropout", "drop_path", "pdrop")) and isinstance(v, float)
    }


def _family_config(family: str, sizes: dict[str, Any], options: tuple[tuple[str, Any], ...], **fixed: Any) -> Any:
    """``AutoConfig.for_model(family)`` with the zoo's ``sizes`` under the family's own names, every
    dropout of the family at 0, ``fixed`` (special ids, labels), then ``options``.

    Dropout off everywhere: the zoo's models are compared weight by weight and scored as trained,
    and the families' defaults differ (DistilBERT's and XLM-R's 0.1, ModernBERT's and DINOv2's 0).
    """
    from transformers import AutoConfig

    no_dropout = _no_dropout(family)
    named = {_RENAMED.get(family, {}).get(k, k): v for k, v in sizes.items()}
    if family == "dinov2" and "intermediate_size" in named:  # DINOv2 sizes its MLP as a multiple of the width
        ratio = named.pop("intermediate_size") / named["hidden_size"]
        named["mlp_ratio"] = int(ratio) if ratio.is_integer() else ratio
    return AutoConfig.for_model(
        family,
        **no_dropout,
        **named,
        **fixed,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in options},  # tuples: hashable in the key
    )


def masked_lm_config(config: MaskedLMTrainConfig, tokenizer: Any) -> Any:
    """The transformers config of a `MaskedLMTrainConfig`'s model for ``tokenizer``: the family's
    config class with the zoo's sizes, no dropout, the tokenizer's special ids for every special-id
    field the family has (ModernBERT's ``cls_token_id`` too), then ``options``."""
    from transformers import AutoConfig

    fields = AutoConfig.for_model(config.family).to_dict()
    special = {
        f"{name}_token_id": getattr(tokenizer, f"{name}_token_id", None)
        for name in ("pad", "bos", "eos", "cls", "sep")
        if f"{name}_token_id" in fields
    }
    offset = 2 if config.family in _OFFSET_POSITIONS else 0
    sizes = {
        "vocab_size": len(tokenizer),
        "max_position_embeddings": config.block_size + offset,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
    }
    return _family_config(config.family, sizes, config.options, **special)


# families whose image classifier is one tower of a two-tower config: the tower's config key and
# model type (the zoo's sizes, no dropout and ``options`` go there), and the other tower's minimal
# config. SiglipForImageClassification builds the vision tower only: no text weight exists, but
# SiglipConfig keeps a text config (projection_size: the vision width, as a SiglipModel needs it).
_TOWERS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "siglip": (
        "vision_config",
        "siglip_vision_model",
        "text_config",
        {
            "vocab_size": 16,
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "intermediate_size": 16,
            "max_position_embeddings": 8,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
        },
    ),
}


def image_config(config: ImageTrainConfig) -> Any:
    """The transformers config of an `ImageTrainConfig`'s model: the family's config class for the
    8×8 grayscale digits and their 10 labels, the zoo's sizes, no dropout, then ``options``; for a
    two-tower family (SigLIP) the sizes and ``options`` go to the vision tower's config, the other
    tower gets a minimal one."""
    sizes = {
        "image_size": 8,
        "patch_size": config.patch_size,
        "num_channels": 1,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
    }
    labels = {"id2label": {i: str(i) for i in range(10)}, "label2id": {str(i): i for i in range(10)}}
    if config.family in _TOWERS:
        key, tower, other, minimal = _TOWERS[config.family]
        vision = _family_config(tower, sizes, config.options).to_dict()
        text = {**minimal, "projection_size": config.hidden_size}
        from transformers import AutoConfig

        return AutoConfig.for_model(config.family, **{key: vision, other: text}, **labels)
    return _family_config(config.family, sizes, config.options, **labels)
