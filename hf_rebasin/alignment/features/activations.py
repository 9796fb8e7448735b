"""Activation statistics: models A and B see the same batches, forward hooks read each site's features.

`activation_stats` drives one collection: it plans the hooks (:class:`~.sites.HookPlan`), runs
each process's share of the batches through both models under a :class:`~.collector.Collector`,
which pairs A's and B's features into streamed moments (:mod:`~.moments`), and sums the moments
over processes under ``accelerate launch``. Models too large for memory go layer by layer instead
(`lockstep`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.alignment.features.batches import process_grid
from hf_rebasin.alignment.features.collector import Collector, Phase
from hf_rebasin.alignment.features.moments import (
    ActivationStats,
    CrossMoments,
    ExpertMoments,
    all_reduce_sum,
    distributed,
)
from hf_rebasin.alignment.features.sites import RESIDUAL_MODES, HookPlan, ResidualMode
from hf_rebasin.symmetry.adapters.base import as_choices
from hf_rebasin.symmetry.graph import SymmetryGraph


def _within_sites(moments: dict[str, CrossMoments | ExpertMoments]) -> None:
    """``residual: all``: each space's per-site keys (``res@0``, ``res@1``, …) become one key whose
    moments are centred at every site's own mean (the average of the sites' covariances, as Verma
    & Elbayad's code computes it) rather than pooled under one mean across sites."""
    sites: dict[str, list[str]] = {}
    for key in moments:
        space, at, index = key.rpartition("@")
        if at and index.isdigit():
            sites.setdefault(space, []).append(key)
    for space, keys in sites.items():
        parts = [moments.pop(k) for k in keys]
        moments[space] = CrossMoments.within([p for p in parts if isinstance(p, CrossMoments)])


def _device_of(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def _run(model: torch.nn.Module, batch: Mapping[str, Any], device: torch.device) -> None:
    """``model`` on ``batch`` moved to ``device`` (a multiple-choice head reads its rows as choices)."""
    model(**as_choices(model, {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}))


def _probe(col: Collector, batch: Mapping[str, Any], device: torch.device) -> None:
    """Run A once without keeping features, to learn firing order and residual groups."""
    col.begin(batch, Phase.PROBE)
    _run(col.model_a, batch, device)
    col.end_batch()


def activation_stats(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    graph: SymmetryGraph,
    batches: Iterable[Mapping[str, Tensor]],
    *,
    spaces: Collection[str] | None = None,
    residual: ResidualMode = "all",
    special_ids: Collection[int] | None = None,
    progress: Callable[[int], None] | None = None,
    device: torch.device | None = None,
) -> ActivationStats:
    """Correlation statistics of A's and B's features on the same batches, for every site.

    Per batch A runs first and its hooks keep the (masked, float32) features of each site; B's
    hooks then add (A, B) pairs into float64 :class:`~.moments.CrossMoments` and free A's copy:
    extra memory is one batch of A's features plus O(d²) per key. Padded positions
    (``attention_mask == 0``) and, when ``special_ids`` is given, special tokens are dropped
    wherever an activation's leading dims are the batch's ``[batch, seq]``.

    ``residual`` picks the residual sites, under the space's name: ``first`` the first readers'
    input; ``last`` the stream as the encoder leaves it, at every position (the output of the
    adapter's ``last_hidden`` module: BERT's final encoder LayerNorm, GPT-2's ``ln_f``; else the
    last readers' input); ``all`` every site inside the encoder (the readers' inputs before the
    final state, and that state), each centred at its own mean (`CrossMoments.within`);
    ``separate`` one key per readers' group (``"res@0"``, …); ``none`` no residual key.

    Under ``accelerate launch`` process p takes batches p, p + P, p + 2P, … and the sums are
    reduced over processes, so every process returns the same statistics as one process would.
    ``device`` is where the batches go (default: where each model's parameters are; give it for
    models whose parameters are on the meta device, run by `offload.offloaded`).
    """
    if residual not in RESIDUAL_MODES:
        raise ValueError(f"residual must be one of {RESIDUAL_MODES}, got {residual!r}")
    start = time.perf_counter()
    nproc, rank = process_grid()
    plan = HookPlan.of(graph, model_a, spaces)
    special = torch.tensor(sorted(set(special_ids)), dtype=torch.long) if special_ids else None
    dev_a, dev_b = (device, device) if device is not None else (_device_of(model_a), _device_of(model_b))
    with Collector(model_a, model_b, plan, residual, special) as col, torch.no_grad():
        _run_batches(col, batches, nproc, rank, (dev_a, dev_b), progress)
    stats = col.result()
    if nproc > 1:
        _sum_over_processes(stats, nproc)
    if residual == "all":
        _within_sites(stats.moments)
    stats.seconds = time.perf_counter() - start
    return stats


def _run_batches(
    col: Collector,
    batches: Iterable[Mapping[str, Tensor]],
    nproc: int,
    rank: int,
    devices: tuple[torch.device, torch.device],
    progress: Callable[[int], None] | None,
) -> None:
    """Feed this process's share of the batches (p, p + P, …) through the collector; a process
    with no batch still probes the first, so that every process holds the same keys."""
    dev_a, dev_b = devices
    first: Mapping[str, Tensor] | None = None
    for i, batch in enumerate(batches):
        if i == 0:
            first = batch
        if i % nproc != rank:
            continue
        _pair_batch(col, batch, dev_a, dev_b)
        if progress is not None:
            progress(col.tokens)
    if not col.sealed and first is not None:
        # fewer batches than processes: learn the structure so all processes hold the same keys
        _probe(col, first, dev_a)


def _pair_batch(col: Collector, batch: Mapping[str, Tensor], dev_a: torch.device, dev_b: torch.device) -> None:
    """One batch through A then B (or once through the one model compared with itself)."""
    if col.same:
        if not col.sealed:
            _probe(col, batch, dev_a)  # one hook does A and B: it must know the keys first
        col.begin(batch, Phase.FORWARD_AB)
        _run(col.model_a, batch, dev_a)
    else:
        col.begin(batch, Phase.FORWARD_A)
        _run(col.model_a, batch, dev_a)
        col.to_b()
        _run(col.model_b, batch, dev_b)
    col.end_batch()


def _sum_over_processes(stats: ActivationStats, nproc: int) -> None:
    """Sum every key's moments and the token count over the processes, in place, so that every
    process holds the statistics of all the batches."""
    if not distributed():
        raise RuntimeError(
            f"accelerate reports {nproc} processes but torch.distributed is not initialised: "
            "the statistics of the other processes' batches cannot be summed"
        )
    for m in stats.moments.values():
        m.all_reduce()
    stats.tokens = int(all_reduce_sum(torch.tensor(float(stats.tokens), dtype=torch.float64)).item())
