"""Activation statistics of models too large for memory: A and B in lockstep, one layer at a time.

The stock forward runs each model up to its first layer (its embeddings, masks and rotary
position embeddings), where a hook keeps the layer's inputs and stops it. Then, layer by layer,
that layer of A and of B is loaded once and every batch's hidden states go through both, with a
`Collector` watching that layer only; its moments are handed to the caller, who solves the layer's
spaces and drops them. Memory: one layer of each model, the hidden states of the alignment data
(tokens × d per model) and one layer's moments, instead of two models and every layer's moments,
as sequential calibration in quantization tools does.

It needs one stack of layers that all take the same keyword arguments (decoder and encoder stacks
of transformers), with every collected space inside a layer; `lockstep_plan` says why not otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from hf_rebasin.alignment.features.batches import process_grid
from hf_rebasin.alignment.features.collector import Collector, Phase
from hf_rebasin.alignment.features.moments import ActivationStats, all_reduce_sum, distributed
from hf_rebasin.alignment.features.sites import HookPlan
from hf_rebasin.core.lazy import give_back_freed
from hf_rebasin.io.offload import loaded, offloaded
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import split_ref

__all__ = ["LayerStats", "LockstepPlan", "StreamHook", "lockstep_plan", "lockstep_stats"]


class StreamHook(Protocol):
    """Called with a layer's index, a batch, and A's and B's hidden states entering that layer."""

    def __call__(self, layer: int, batch: Mapping[str, Any], a: Tensor, b: Tensor) -> None: ...


class _Stop(Exception):
    """Raised by the hook on the first layer: the forward has given what it is run for."""


@dataclass(frozen=True)
class LockstepPlan:
    """The layer stack (its name in the model) and the spaces each layer's statistics solve."""

    stack: str
    layers: int
    spaces: dict[int, list[str]]


@dataclass
class LayerStats:
    """One layer's statistics: the spaces they solve, and the moments of their keys."""

    layer: int
    spaces: list[str]
    stats: ActivationStats


def _stack(model: nn.Module) -> tuple[str, int] | str:
    """The name and length of the model's one layer stack, or why there is none."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None) if config is not None else None
    if not isinstance(n, int):
        return "its config names no layer count"
    found = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(found) != 1:
        return f"it has {len(found)} stacks of {n} layers, not one"
    return found[0], n


def lockstep_plan(graph: SymmetryGraph, model: nn.Module, spaces: Collection[str]) -> LockstepPlan | str:
    """Which layer each space's features come from; a string saying why lockstep cannot run."""
    stack = _stack(model)
    if isinstance(stack, str):
        return stack
    name, n = stack
    prefix = f"{name}."
    by_layer: dict[int, list[str]] = {}
    hooks = HookPlan.of(graph, model, spaces)
    for expert in hooks.experts:  # a MoE layer's experts and router sit inside one layer
        head = expert.experts[len(prefix) :].split(".", 1)[0] if expert.experts.startswith(prefix) else ""
        if not head.isdigit():
            return f"the experts of {expert.space!r} are outside its layers (at {expert.experts!r})"
        by_layer.setdefault(int(head), []).append(expert.space)
    for module, sites in hooks.plain.items():
        head = module[len(prefix) :].split(".", 1)[0] if module.startswith(prefix) else ""
        if not head.isdigit():
            return f"features of {sites[0].key!r} are read outside its layers (at {module!r})"
        for site in sites:
            space = split_ref(site.key)[0]
            if space not in by_layer.setdefault(int(head), []):
                by_layer[int(head)].append(space)
    return LockstepPlan(name, n, by_layer)


def _inputs(
    model: nn.Module,
    state: Mapping[str, Tensor],
    first: nn.Module,
    batches: Sequence[Mapping[str, Any]],
    device: torch.device,
) -> list[list[Any]]:
    """Per batch, ``[hidden states, other positional args, keyword args]`` entering the first layer."""
    captured: list[list[Any]] = []

    def grab(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append([hidden, tuple(args[1:]), kwargs])
        raise _Stop

    config: Any = getattr(model, "config", None)
    cache = getattr(config, "use_cache", None)
    if cache is not None:
        config.use_cache = False  # no key/value cache grows through the layers
    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with offloaded(model, state, device) as m:
            for batch in batches:
                try:
                    m(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items() if k != "labels"})
                except _Stop:
                    continue
                raise RuntimeError("the forward pass never reached the first layer")  # pragma: no cover
    finally:
        handle.remove()
        if cache is not None:
            config.use_cache = cache
    return captured


def _hidden(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _through(
    i: int,
    layers: tuple[nn.Module, nn.Module],
    batches: Sequence[Mapping[str, Any]],
    ins: tuple[list[list[Any]], list[list[Any]]],
    collector: Collector | None,
    on_stream: StreamHook | None,
) -> None:
    """Every batch through layer ``i`` of A, then of B, their inputs replaced by the outputs."""
    for batch, a, b in zip(batches, *ins, strict=True):
        if on_stream is not None:
            on_stream(i, batch, a[0], b[0])
        if collector is not None:
            collector.begin(batch, Phase.FORWARD_A)
        a[0] = _hidden(layers[0](a[0], *a[1], **a[2]))
        if collector is not None:
            collector.to_b()
        b[0] = _hidden(layers[1](b[0], *b[1], **b[2]))
        if collector is not None:
            collector.end_batch()


def lockstep_stats(
    model_a: nn.Module,
    model_b: nn.Module,
    state_a: Mapping[str, Tensor],
    state_b: Mapping[str, Tensor],
    graph: SymmetryGraph,
    plan: LockstepPlan,
    batches: Sequence[Mapping[str, Any]],
    *,
    special_ids: Collection[int] | None = None,
    device: torch.device | None = None,
    progress: Any = None,
    on_stream: StreamHook | None = None,
) -> Iterator[LayerStats]:
    """Each layer's statistics, in order, computed as `activation_stats` computes them for the
    layer's keys (same masking, same moments): yielded one layer at a time, so the caller can solve
    and drop them before the next layer runs. Under ``accelerate launch`` each process takes every
    P-th batch and each layer's sums are reduced over the processes, as `activation_stats` does.
    ``on_stream(layer, batch, a, b)`` sees the hidden states entering each layer (and, with layer =
    the number of layers, leaving the last), for statistics of the stream itself."""
    device = device or torch.device("cpu")
    special = torch.tensor(sorted(set(special_ids)), dtype=torch.long) if special_ids else None
    layers_a, layers_b = model_a.get_submodule(plan.stack), model_b.get_submodule(plan.stack)
    assert isinstance(layers_a, nn.ModuleList) and isinstance(layers_b, nn.ModuleList)
    nproc, rank = process_grid()
    if nproc > 1 and not distributed():
        raise RuntimeError(f"accelerate reports {nproc} processes but torch.distributed is not initialised")
    batches = [b for i, b in enumerate(batches) if i % nproc == rank]
    with torch.no_grad():
        ins_a = _inputs(model_a, state_a, layers_a[0], batches, device)
        ins_b = _inputs(model_b, state_b, layers_b[0], batches, device)
    for i in range(plan.layers):
        give_back_freed()  # the previous layer's weights, moments and activations
        start = time.perf_counter()
        wanted = plan.spaces.get(i, [])
        prefix = f"{plan.stack}.{i}."
        collector = (
            Collector(model_a, model_b, HookPlan.of(graph, model_a, wanted), "none", special) if wanted else None
        )
        with (
            loaded(layers_a[i], state_a, prefix, device) as layer_a,
            loaded(layers_b[i], state_b, prefix, device) as layer_b,
            collector if collector is not None else nullcontext(),
            torch.no_grad(),
        ):
            _through(i, (layer_a, layer_b), batches, (ins_a, ins_b), collector, on_stream)
        if progress is not None:
            progress(i + 1, plan.layers)
        if collector is not None:
            stats = collector.result()
            if nproc > 1:
                for m in stats.moments.values():
                    m.all_reduce()
                stats.tokens = int(all_reduce_sum(torch.tensor(float(stats.tokens), dtype=torch.float64)).item())
            stats.seconds = time.perf_counter() - start
            yield LayerStats(i, wanted, stats)
    if on_stream is not None:
        for batch, a, b in zip(batches, ins_a, ins_b, strict=True):
            on_stream(plan.layers, batch, a[0], b[0])
