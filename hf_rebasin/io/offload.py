"""Forward passes of a model that is never whole in memory.

A model of a stock class is built with its parameters on the ``meta`` device and its buffers real
(accelerate's ``init_empty_weights(include_buffers=False)``: rotary frequencies and position ids
are computed by the class, not stored). `offloaded` then runs it with weights from any state dict,
a `LazyState` read from disk included: each submodule's own parameters are read just before its
forward and dropped right after, so a forward pass holds one submodule's weights (the largest is
the embedding) plus activations, as accelerate's disk offload does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["empty_model", "loaded", "materialized", "offloaded"]


def empty_model(cls: type[PreTrainedModel], config: Any) -> PreTrainedModel:
    """``cls(config)`` with parameters on ``meta`` (no memory) and buffers computed as usual; the
    ties its config class forces kept (`ties.keep_forced_ties`)."""
    from accelerate import init_empty_weights

    from hf_rebasin.io.ties import keep_forced_ties

    with init_empty_weights(include_buffers=False):
        model = cls(config)
    keep_forced_ties(model)
    return model.eval()


def materialized(
    cls: type[PreTrainedModel],
    config: Any,
    state: Mapping[str, Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """A whole model of ``cls`` holding ``state``'s tensors (a `LazyState` read one tensor at a
    time), in ``dtype`` where given (floating tensors), on ``device``: built on ``meta`` and
    filled, so neither a random initialisation (minutes at 7B) nor a second copy is ever made.
    A parameter the class ties (an LM head on its embedding) is read once and stays tied."""
    model = empty_model(cls, config)
    model.tie_weights()  # on meta: a tied head is then one parameter, read once
    device = torch.device(device)
    persistent = set(model.state_dict(keep_vars=True))
    filled: dict[int, tuple[Any, nn.Parameter]] = {}  # id(meta parameter) -> (it, its replacement)
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for n, meta in list(module._parameters.items()):
            if meta is None:
                continue
            if id(meta) not in filled:
                value = state[f"{prefix}{n}"]
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                filled[id(meta)] = (meta, nn.Parameter(value.to(device), requires_grad=False))
            module._parameters[n] = filled[id(meta)][1]
        for n, b in list(module._buffers.items()):
            if f"{prefix}{n}" in persistent and n not in module._non_persistent_buffers_set:
                module._buffers[n] = state[f"{prefix}{n}"].to(device)
            elif b is not None:
                module._buffers[n] = b.to(device)
    return model


def _assign(module: nn.Module, name: str, value: Tensor, device: torch.device) -> Any:
    """Put ``value`` on ``device`` as ``module``'s parameter ``name``; the parameter it replaces."""
    previous = module._parameters[name]
    module._parameters[name] = nn.Parameter(value.to(device), requires_grad=False)
    return previous


@contextmanager
def loaded(module: nn.Module, state: Mapping[str, Tensor], prefix: str, device: torch.device) -> Iterator[nn.Module]:
    """``module`` (meta parameters) with every parameter of its subtree read from ``state`` once,
    for many forward passes; the meta parameters are put back when the block ends."""
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for name, sub in module.named_modules():
            for p in [n for n, t in sub._parameters.items() if t is not None]:
                full = f"{prefix}{name}.{p}" if name else f"{prefix}{p}"
                saved.append((sub, p, _assign(sub, p, state[full], device)))
        yield module
    finally:
        for sub, p, meta in reversed(saved):
            sub._parameters[p] = meta


def _hook(
    prefix: str,
    module: nn.Module,
    whole: bool,
    state: Mapping[str, Tensor],
    device: torch.device,
    persistent: set[str],
) -> list[Any]:
    """The hooks that give ``module`` its own weights from ``state`` just before its forward and
    take them back right after (so that one submodule's weights are held at a time); their handles.

    ``whole``: the module reads its children's weights itself (nn.MultiheadAttention passes
    out_proj.weight to a functional call and never runs out_proj), so load them with it.
    """
    owners = module.named_modules() if whole else [("", module)]
    params = [
        (sub, n, f"{prefix}{name}.{n}" if name else f"{prefix}{n}")
        for name, sub in owners
        for n, p in sub._parameters.items()
        if p is not None
    ]
    buffers = [
        n for n in module._buffers if f"{prefix}{n}" in persistent and n not in module._non_persistent_buffers_set
    ]
    if not params and not buffers:
        return []
    saved: dict[str, Any] = {}

    def load(_module: nn.Module, _args: Any, _kwargs: Any = None) -> None:
        for sub, n, full in params:
            saved.setdefault(full, _assign(sub, n, state[full], device))
        for n in buffers:
            saved.setdefault(f"buffer:{n}", module._buffers[n])
            module._buffers[n] = state[f"{prefix}{n}"].to(device)

    def drop(_module: nn.Module, _args: Any, _output: Any) -> None:
        for sub, n, full in params:
            sub._parameters[n] = saved[full]
        for n in buffers:
            module._buffers[n] = saved[f"buffer:{n}"]

    return [module.register_forward_pre_hook(load), module.register_forward_hook(drop, always_call=True)]


@contextmanager
def offloaded(model: nn.Module, state: Mapping[str, Tensor], device: torch.device | str = "cpu") -> Iterator[nn.Module]:
    """``model`` (built by `empty_model`) running with the tensors of ``state``, read per submodule.

    Parameters and persistent buffers are looked up by their full names, a tied parameter by the
    name of the module that uses it (a `LazyState` resolves the alias). The hooks are removed and the
    meta parameters put back when the block ends, whatever happens inside it.
    """
    device = torch.device(device)
    persistent = set(model.state_dict(keep_vars=True))
    handles: list[Any] = []
    moved: list[tuple[nn.Module, str, Tensor]] = []  # buffers the class computed, on the device for the run
    wholes: list[str] = []  # prefixes of modules loaded with their children
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if not any(prefix.startswith(w) for w in wholes):
            whole = isinstance(module, nn.MultiheadAttention)
            if whole:
                wholes.append(prefix)
            handles.extend(_hook(prefix, module, whole, state, device, persistent))
        for n, b in module._buffers.items():
            if b is not None and b.device != device and b.device.type != "meta":
                moved.append((module, n, b))
                module._buffers[n] = b.to(device)
    try:
        with torch.no_grad():
            yield model
    finally:
        for h in handles:
            h.remove()
        for module, n, b in moved:
            module._buffers[n] = b
