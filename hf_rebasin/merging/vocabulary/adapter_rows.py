"""LoRA adapters trained with new tokens: the PEFT guide's "LoRA with additional tokens".

The base was resized before training (``model.resize_token_embeddings(len(tokenizer))``), so the
adapter stores its embedding and LM head whole (``modules_to_save``) with more rows than the base's
checkpoint, or only the rows of chosen tokens (``trainable_token_indices``: PEFT's trainable
tokens, each row's trained value). Such an adapter is merged into the base resized the same way
(new rows at the mean of the old, where the adapter does not give them) and the fine-tune it makes
is moved like any full fine-tune, its rows matched by token with the target's (`layout`); a
transport writes it back as an adapter for the target (`adapter_tokens`).

PEFT trains a copy of each module of ``modules_to_save``: on a model whose LM head is tied to its
embedding (GPT-2), the two copies part, and the merged fine-tune is untied where they differ.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import CheckpointError, IncompatibleModelsError
from hf_rebasin.io.models import LoadedModel, to_device
from hf_rebasin.merging.interpolate import StorageKey, storage_key
from hf_rebasin.merging.lora import PREFIX, LoraAdapter, adapter_config, adapter_from, apply_adapter, read_tensors
from hf_rebasin.merging.vocabulary.files import has_tokenizer
from hf_rebasin.merging.vocabulary.layout import embedding_rows_of, vocab_field, vocab_tensors
from hf_rebasin.symmetry.adapters import graph_for

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "adapter_rows",
    "finetune_with_tokens",
    "merged_with_tokens",
    "saved_tensors",
    "state_name",
    "tokens_note",
    "trainable_tokens",
]

_TOKENS = re.compile(r"(.+)\.token_adapter\.trainable_tokens_delta")
# where the base was resized, PEFT saves the resized embedding (and a tied head) beside the tokens
_BASE_LAYER = ".token_adapter.base_layer."
# beside a resized embedding PEFT also saves the wrapper's own keys: a module_to_save's trained copy
# (``X.modules_to_save.weight``, the same tensor as ``X.weight``) and the base's (``X.original_module.weight``)
_COPY, _ORIGINAL = ".modules_to_save.", ".original_module."


def _stripped(key: str) -> str:
    return key[len(PREFIX) :] if key.startswith(PREFIX) else key


def _name(key: str) -> str:
    """An adapter file key as the base model's state-dict name (a resized layer: its weight)."""
    return _stripped(key).replace(_BASE_LAYER, ".")


def state_name(key: str) -> str:
    """An adapter file key as the state-dict name of the base tensor it stores or adapts the module
    of (a resized layer, a whole base weight saved beside its factors: the weight)."""
    return _name(key).replace(".base_layer.", ".")


def saved_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An adapter's tensors as PEFT loads them: a module_to_save's trained copy under its module's
    own key (``X.weight``, which PEFT writes too), the wrapped base tensors left out (they are the
    base's, which the run has)."""
    out = {k: t for k, t in tensors.items() if _COPY not in k and _ORIGINAL not in k}
    for key, t in tensors.items():
        if _COPY in key:
            out.setdefault(key.replace(_COPY, "."), t)
    return out


def trainable_tokens(config: Mapping[str, Any], tensors: Mapping[str, Tensor]) -> dict[str, tuple[list[int], Tensor]]:
    """Module → (token ids, their trained rows) of PEFT's trainable tokens."""
    given = config.get("trainable_token_indices")
    out: dict[str, tuple[list[int], Tensor]] = {}
    for key, t in tensors.items():
        m = _TOKENS.fullmatch(_stripped(key))
        if not m:
            continue
        module = m.group(1)
        if isinstance(given, Mapping):
            ids = next((v for k, v in given.items() if module == k or module.endswith(f".{k}")), None)
            if ids is None and len(given) == 1:  # a tied LM head: PEFT saves its rows with the embedding's ids
                ids = next(iter(given.values()))
        else:
            ids = given
        if not isinstance(ids, list) or len(ids) != t.shape[0]:
            raise CheckpointError(
                f"the adapter's trainable tokens of {module!r} hold {t.shape[0]} rows but its config lists {ids!r}"
            )
        out[module] = ([int(i) for i in ids], t)
    return out


def adapter_rows(folder: Path, model: nn.Module, allow_pickle: bool = False, where: str = "finetuned") -> int | None:
    """The embedding rows the adapter was trained with, where more than ``model``'s (None: as many)."""
    config, tensors = adapter_config(folder, where, tokens=True), read_tensors(folder, allow_pickle, where)
    return _rows(config, tensors, model)


def _rows(config: Mapping[str, Any], tensors: Mapping[str, Tensor], model: nn.Module) -> int | None:
    """`adapter_rows` of an adapter already read."""
    names = vocab_tensors(model)
    rows = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]
    found = [int(t.shape[0]) for key, t in tensors.items() if _name(key) in names and t.dim() == 2]
    found += [max(ids) + 1 for ids, _ in trainable_tokens(config, tensors).values() if ids]
    top = max(found, default=rows)
    return top if top > rows else None


def _resized(model: nn.Module, rows: int) -> nn.Module:
    """A copy of ``model`` with ``rows`` embedding rows, the new ones the mean of the old (the
    expected value of transformers' mean resizing)."""
    config = copy.deepcopy(model.config)
    owner = vocab_field(config)
    if owner is None:
        raise CheckpointError("the adapter has more embedding rows than its base, whose config names no vocab_size")
    setattr(owner[0], owner[1], rows)
    new = type(model)(config)
    state = {}
    names = vocab_tensors(model)
    for name, t in model.state_dict().items():
        if name in names:
            axis = names[name]
            old = t.movedim(axis, 0)
            grown = torch.cat([old, old.mean(0, keepdim=True).expand(rows - old.shape[0], *old.shape[1:])])
            t = grown.movedim(0, axis).contiguous()
        state[name] = t
    new.load_state_dict(state, strict=True)
    new.to(dtype=next(model.parameters()).dtype)  # type: ignore[call-arg]
    return new.eval()


def merged_with_tokens(folder: Path, model: nn.Module, *, allow_pickle: bool = False, where: str = "finetuned") -> Any:
    """The fine-tune an adapter with new tokens makes of ``model`` (resized first); None for an
    adapter of ``model``'s own rows without trainable tokens (read as any adapter)."""
    config = adapter_config(folder, where, tokens=True)
    tensors = saved_tensors(read_tensors(folder, allow_pickle, where))
    tokens = trainable_tokens(config, tensors)
    rows = _rows(config, tensors, model)
    if rows is None and not tokens:
        return None
    base = _resized(model, rows) if rows is not None else model
    plain = {
        PREFIX + _name(k) if _BASE_LAYER in k else k: v
        for k, v in tensors.items()
        if not _TOKENS.fullmatch(_stripped(k))
    }
    lora_config = {k: v for k, v in config.items() if k != "trainable_token_indices"}
    adapter = adapter_from(folder, lora_config, plain, base, where)
    apart = _parted(adapter, base.state_dict())
    state = apply_adapter(adapter, {n: t.clone() if n in apart else t for n, t in base.state_dict().items()})
    for module, (ids, values) in tokens.items():
        weight = f"{module}.weight"
        if weight not in state:
            raise CheckpointError(f"`{where}`: the adapter's trainable tokens are of {module!r}, which the base lacks")
        grown = state[weight].clone()
        grown[torch.tensor(ids)] = values.to(grown.dtype)
        for name, t in state.items():  # a tied LM head gets the same rows
            if t.data_ptr() == state[weight].data_ptr() and t.shape == grown.shape:
                state[name] = grown
    from hf_rebasin.io.rebuild import rebuild

    return rebuild(base, state, untie=bool(apart))  # type: ignore[arg-type]  # a transformers model: the caller's base


def _parted(adapter: LoraAdapter, state: Mapping[str, Tensor]) -> set[str]:
    """Names one tensor in the base (a tied LM head) that the adapter gives different values: PEFT
    trained a copy of each (``modules_to_save``), so the fine-tune stores them apart."""
    given = {name: t for name, t in adapter.full.values()}
    groups: dict[StorageKey, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(storage_key(t), []).append(name)
    apart: set[str] = set()
    for names in groups.values():
        values = [given.get(n, state[n]) for n in names]
        if any(n in given for n in names) and any(not torch.equal(values[0], v.to(values[0])) for v in values[1:]):
            apart.update(names[1:])
    return apart


def finetune_with_tokens(
    base: LoadedModel, folder: Path, *, allow_pickle: bool = False, where: str = "finetuned.model"
) -> LoadedModel | None:
    """A LoRA adapter trained with new tokens (its embedding and LM head whole in
    ``modules_to_save``, or trainable tokens), merged into its base resized as it was for training:
    a full fine-tune whose rows are matched by token with the target's. None for another adapter."""
    model = merged_with_tokens(folder, base.model, allow_pickle=allow_pickle, where=where)
    if model is None:
        return None
    rows, before = embedding_rows_of(model), embedding_rows_of(base.model)
    if rows != before and not has_tokenizer(folder):
        raise IncompatibleModelsError(
            f"`{where}`: the adapter in {str(folder)!r} was trained with {rows} embedding rows, its base has {before}: "
            "its new tokens can only be matched with the target's by their text, and the adapter's folder has no "
            "tokenizer. Save the tokenizer the adapter was trained with beside it (`tokenizer.save_pretrained(folder)`)"
        )
    to_device(model, next(base.model.parameters()).device)
    graph = graph_for(model.config, model.state_dict().keys())
    # what is written (an adapter for the target, or a full model) the transport decides and notes (`tokens_note`)
    return LoadedModel(model, graph, folder, base.stored_dtype)


def tokens_note(folder: Path, written: str) -> str:
    """The run's note on an adapter trained with new tokens: how it was read, and ``written``, what
    the output is and why."""
    return (
        f"the LoRA adapter {str(folder)!r} was trained with new tokens (modules_to_save or trainable tokens): "
        f"read as the fine-tune it makes of its base resized as for training, moved as such; {written}"
    )
