"""Models of a template's stock class rebuilt from transformed state dicts, to run or to write.

A state dict in memory is loaded into a fresh model of the template's class; a `LazyState` runs
in a meta-device module that reads each submodule's tensors when it runs (`io.offload`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.core.lazy import LazyState
from hf_rebasin.io.models import to_device
from hf_rebasin.io.ties import keep_forced_ties

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def output_config(template: PreTrainedModel, untie: bool) -> Any:
    """A copy of ``template``'s config for a model built from transformed weights: with a tied LM
    head stored apart when ``untie`` (canonical forms)."""
    config = copy.deepcopy(template.config)
    if untie or _head_apart(template):
        config.tie_word_embeddings = False
    return config


def _head_apart(template: PreTrainedModel) -> bool:
    """A head the config ties that the model holds apart: transformers 5 reads a head stored with other
    values untied ("by value") and leaves the config saying tied (T5 v1.1 and Flan-T5 loaded with the
    stock class); built from that config, the new model would tie it again and lose the head."""
    if not getattr(template.config, "tie_word_embeddings", False):
        return False
    head, table = template.get_output_embeddings(), template.get_input_embeddings()
    if head is None or table is None or head.weight.is_meta:  # a streamed model's skeleton ties nothing
        return False
    return head.weight is not table.weight


def rebuild(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], *, untie: bool = False) -> PreTrainedModel:
    """A fresh model of the same stock class holding ``state_dict`` (untied when asked), in
    ``model``'s dtype (the caller casts for writing)."""
    new = type(model)(output_config(model, untie))
    keep_forced_ties(new)
    new.load_state_dict(state_dict, strict=True)
    cast_as_loaded(new, next(model.parameters()).dtype)
    return new.eval()


def float32_tensors(model: PreTrainedModel, dtype: torch.dtype) -> set[str]:
    """The floating tensors `from_pretrained` keeps in float32 when it loads ``model``'s class in
    ``dtype``: those of ``_keep_in_fp32_modules`` (T5's ``wo``) under float16 only, of
    ``_keep_in_fp32_modules_strict`` under float16 and bfloat16; a module counts when its name has
    one of them as a component."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not keep:
        return set()
    return {
        name for name, t in model.state_dict().items() if t.is_floating_point() and keep & set(name.split(".")[:-1])
    }


def cast_as_loaded(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """``model`` cast to ``dtype`` but for the tensors `float32_tensors` names, as `from_pretrained`
    would load it in ``dtype``."""
    model.to(dtype=dtype)  # type: ignore[call-arg]  # transformers wraps .to
    keep = float32_tensors(model, dtype)
    for name, t in model.state_dict(keep_vars=True).items():
        if name in keep and t.dtype != torch.float32:
            t.data = t.data.to(torch.float32)


@contextmanager
def running(
    template: PreTrainedModel, state: Mapping[str, Tensor], *, untie: bool = False, device: torch.device | None = None
) -> Iterator[PreTrainedModel]:
    """A model of ``template``'s class that computes with ``state``, for forward passes: rebuilt in
    memory beside ``template``, or for a `LazyState`, a meta-device module that reads each
    submodule's tensors when it runs (`offload.offloaded`, on ``device``)."""
    from hf_rebasin.io.offload import empty_model, offloaded

    if not isinstance(state, LazyState):
        yield rebuilt(template, state, untie)
        return
    with offloaded(
        empty_model(type(template), output_config(template, untie)), state, device or torch.device("cpu")
    ) as model:
        yield model  # type: ignore[misc]  # offloaded yields the module it was given


def rebuilt(template: PreTrainedModel, sd: Mapping[str, Tensor], untie: bool) -> PreTrainedModel:
    """`rebuild` on ``template``'s device: a model of its class holding ``sd`` (a tied head stored
    apart when ``untie``), ready to run beside it."""
    model = rebuild(template, dict(sd), untie=untie)
    to_device(model, next(template.parameters()).device)
    return model
