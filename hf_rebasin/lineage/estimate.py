"""How long a lineage run will take on this machine, measured before it starts.

A comparison's cost follows its split (each matrix's top singular directions): the alignment and
the bulk pass cost about twice the split of both models on the benchmarks (TinyLlama's shape: split
101 s, alignment and bulks 157 s; Mistral-7B's: 731 s and 1,668 s). So the estimate splits one layer
of the first model here, as the run will (same threads, same reads), and scales: each model's split
once, then each pair's alignment and bulks. It holds on a busy machine as on an idle one, because it
is measured on the machine as it is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import combinations

from hf_rebasin.core.lazy import dtype_of, shape_of
from hf_rebasin.io.models import LoadedModel, stack_depths
from hf_rebasin.lineage.compare import threads_for
from hf_rebasin.lineage.depth import layer_lists, layer_of
from hf_rebasin.lineage.stats import is_matrix, signal_of, signal_rank

__all__ = ["PAIR_RATIO", "duration", "estimate_seconds"]

PAIR_RATIO = 2.0  # a pair's alignment and bulk pass, in units of the split of both its models
FLOOR = 0.5  # seconds a pair takes whatever its size (reading, canonical form, small solves)


def estimate_seconds(models: Sequence[LoadedModel]) -> tuple[float, float]:
    """The seconds a lineage run of ``models`` is expected to take here, and the seconds one layer's
    split took (what the estimate is scaled from)."""
    ref = models[0]
    stacks = stack_depths(ref)  # an encoder-decoder's layer 0 of each stack is timed, and each counted
    keys = [k for k in layer_lists(ref.weights, ref.graph.stacks, stacks) if k is not None] if all(stacks) else []
    state = ref.weights
    names = [
        n
        for n in state
        if any(layer_of(n, k) == 0 for k in keys) and is_matrix(tuple(shape_of(state, n)), dtype_of(state, n))
    ]
    start = time.perf_counter()
    with threads_for(state):
        for name in names:
            signal_of(state[name].float(), signal_rank(tuple(shape_of(state, name))))
    per_layer = (time.perf_counter() - start) / max(len(keys), 1)
    depths = [sum(stack_depths(lm)) for lm in models]
    split = per_layer * sum(depths)
    pairs = sum(
        per_layer * (depths[i] + depths[j]) * PAIR_RATIO + FLOOR for i, j in combinations(range(len(models)), 2)
    )
    return split + pairs, per_layer


def duration(seconds: float) -> str:
    """``40 s``, ``4 min``, ``1.5 h``: as long waits are read."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
