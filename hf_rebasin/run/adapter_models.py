"""A PEFT LoRA adapter given where a model is expected (lineage): compared as the fine-tune it
makes, its base with the adapter merged in. ``adapter_config.json`` names the base
(``base_model_name_or_path``); an adapter trained with new tokens merges into its base resized as
for training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hf_rebasin.core.errors import CheckpointError, RebasinUserError, unprefixed
from hf_rebasin.io.models import LoadedModel, load_model
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.lora import ADAPTER_CONFIG, LoraAdapter, adapter_config, apply_adapter, is_adapter, read_adapter
from hf_rebasin.merging.vocabulary.adapter_rows import finetune_with_tokens

__all__ = ["adapter_base", "is_bare_adapter", "merged_adapter", "merged_into"]


def is_bare_adapter(folder: Path) -> bool:
    """A PEFT adapter folder without a model of its own (no config.json)."""
    return is_adapter(folder) and not (Path(folder) / "config.json").is_file()


def adapter_base(folder: Path, where: str) -> str:
    """The base ``adapter_config.json`` names, or a user error saying how to compare the adapter."""
    base = adapter_config(folder, where, tokens=True).get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        raise CheckpointError(
            f"{where}: {str(folder)!r} is a PEFT LoRA adapter whose {ADAPTER_CONFIG} names no base "
            "(base_model_name_or_path): merge it into its base (`model.merge_and_unload()`, then `save_pretrained`) "
            "and compare that folder"
        )
    return base


def merged_adapter(
    folder: Path, resolve: Callable[[str], str], *, allow_pickle: bool = False, where: str = "MODEL"
) -> tuple[LoadedModel, str]:
    """The adapter in ``folder`` merged into its base (found by ``resolve``: a folder, a zoo model
    or a Hub id as elsewhere), in memory, and a note saying so."""
    base_ref = adapter_base(folder, where)
    try:
        base_folder = resolve(base_ref)
        base = load_model(base_folder, allow_pickle=allow_pickle)
    except RebasinUserError as e:
        raise type(e)(
            f"{where}: {str(folder)!r} is a PEFT LoRA adapter, compared as its base with the adapter merged in, and "
            f"its base {base_ref!r} ({ADAPTER_CONFIG}: base_model_name_or_path) could not be read: "
            + unprefixed(str(e), where)  # named once, at the start
        ) from None
    merged, _ = merged_into(base, Path(folder), allow_pickle=allow_pickle, where=where)
    return merged, f"{where} is a LoRA adapter: compared as its base {base_ref} with the adapter merged in"


def merged_into(
    base: LoadedModel, folder: Path, *, allow_pickle: bool = False, where: str = "finetuned.model"
) -> tuple[LoadedModel, LoraAdapter | None]:
    """The fine-tune a bare adapter makes of ``base``: merged into the base resized as for training
    where it has new tokens (then no adapter is returned: its factors are of the resized base), else
    its factors applied to the base's weights (and the adapter, for a run that keeps it)."""
    grown = finetune_with_tokens(base, folder, allow_pickle=allow_pickle, where=where)
    if grown is not None:
        return grown, None
    adapter = read_adapter(folder, base.model, allow_pickle=allow_pickle, where=where)
    merged = rebuild(base.model, apply_adapter(adapter, base.weights))
    return LoadedModel(merged, base.graph, folder, adapter.dtype), adapter
