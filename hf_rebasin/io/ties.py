"""Tied tensors as transformers 5 reads them: a tie holds only where the files agree with it.

A config may tie the LM head to the embeddings (``tie_word_embeddings: true``) while the
checkpoint stores both with different values. Stock ``from_pretrained`` then keeps the two apart
(``PreTrainedModel.tie_weights``: "both are present in the checkpoints with different values, so
we will NOT tie them"), with a warning, and config.json still says ``true``. hf-rebasin reads such
a checkpoint the same way on both paths (loaded whole or streamed): the model's config is set to
``tie_word_embeddings: false``, so that its symmetry graph, the models rebuilt from it and the
config an output is written with all see two tensors, and the run says so in a note. Equal values
stored twice (a legacy export) stay tied, as transformers ties them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.core.lazy import ROW_BLOCK_ELEMENTS, LazyState, shape_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["forced_ties", "keep_forced_ties", "read_ties", "stored_apart", "untied_note"]


def _same(state: Mapping[str, Tensor], a: str, b: str) -> bool:
    """``torch.equal`` of tensors ``a`` and ``b`` of ``state`` (float32, as loaded), a block of rows at
    a time where both can be read so: two embeddings of a large vocabulary are never held whole."""
    shape = shape_of(state, a)
    if shape != shape_of(state, b):
        return False
    rows_a = state.rows(a) if isinstance(state, LazyState) else None
    rows_b = state.rows(b) if isinstance(state, LazyState) else None
    if rows_a is None or rows_b is None or not shape:
        return torch.equal(state[a], state[b])
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))
    return all(
        torch.equal(rows_a(start, min(start + step, shape[0])), rows_b(start, min(start + step, shape[0])))
        for start in range(0, shape[0], step)
    )


def stored_apart(tied: Mapping[str, str], stored: Collection[str], state: Mapping[str, Tensor]) -> dict[str, str]:
    """The tied pairs (alias -> source) the checkpoint stores both of, with values that differ:
    transformers' rule (both present and not equal: not tied), on the values as loaded."""
    return {
        alias: source
        for alias, source in tied.items()
        if alias in stored and source in stored and not _same(state, alias, source)
    }


def _configs(model: PreTrainedModel) -> list[Any]:
    """The model's config and its text config (one object for a language model), each once."""
    configs = [model.config]
    text = model.config.get_text_config()
    return configs if text is model.config else [*configs, text]


def read_ties(model: PreTrainedModel, stored: Collection[str], state: Mapping[str, Tensor]) -> dict[str, str]:
    """Untie ``model`` where its checkpoint stores a tied pair with other values (``stored``: the
    model names the files hold; ``state``: their values). Its configs then say
    ``tie_word_embeddings: false`` and it declares no tie, as a model built from that config would:
    the symmetry graph, rebuilt models and the written config follow from it. Returns the pairs."""
    apart = stored_apart(model.get_expanded_tied_weights_keys(all_submodels=True), stored, state)
    if not apart:
        return {}
    for config in _configs(model):
        if getattr(config, "tie_word_embeddings", None) is not None:
            config.tie_word_embeddings = False
    forced = forced_ties(model)
    model.all_tied_weights_keys = {a: s for a, s in model.all_tied_weights_keys.items() if a in forced}
    return apart


def forced_ties(model: Any) -> dict[str, str]:
    """The ties (alias -> source) ``model``'s config class makes whatever ``tie_word_embeddings``
    says (T5's stacks' ``embed_tokens`` on ``shared``), by the model's names: the adapter's
    ``forced_ties``; none for a model type hf-rebasin does not support."""
    from hf_rebasin.core.errors import UnsupportedArchitectureError
    from hf_rebasin.symmetry.adapters import get_adapter

    try:
        spec = get_adapter(getattr(model.config, "model_type", None))
    except UnsupportedArchitectureError:
        return {}
    if not spec.forced_ties:
        return {}
    names = set(model.state_dict())
    base = spec.base_prefix if any(n.startswith(spec.base_prefix) for n in names) else ""
    out = {}
    for alias in spec.forced_ties:
        a, s = alias.replace("{base}", base), spec.ties[alias].replace("{base}", base)
        if a in names and s in names:
            out[a] = s
    return out


def keep_forced_ties(model: Any) -> None:
    """Tie again what ``model``'s config class ties on load whatever ``tie_word_embeddings`` says
    (T5's stacks' ``embed_tokens`` on ``shared``), in a model built from a config that unties its
    LM head: built from it, transformers unties them all, and the model would be written with
    three vocabulary tables where `from_pretrained` reads one (and a head apart)."""
    forced = forced_ties(model)
    if not forced:
        return
    for alias, source in forced.items():
        module, _, name = alias.rpartition(".")
        setattr(model.get_submodule(module), name, model.get_parameter(source))
    model.all_tied_weights_keys = {**(getattr(model, "all_tied_weights_keys", None) or {}), **forced}


def untied_note(model: str, apart: Mapping[str, str]) -> str:
    """What the run says about a tie its files contradict (the model, then each tensor)."""
    pairs = "; ".join(f"{alias} differs from {source}" for alias, source in sorted(apart.items()))
    return (
        f"{model}: its config ties the head to the embeddings (tie_word_embeddings: true, or a config class "
        "that forces the tie, as T5's does), but its files store "
        f"the two with different values ({pairs}); read untied, as transformers 5 loads it (a model written "
        "from it says tie_word_embeddings: false)"
    )
