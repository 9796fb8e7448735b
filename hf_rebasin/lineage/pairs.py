"""Lineage of two models or more: checks that they can be compared, then every pair's verdict."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import combinations

from ..errors import IncompatibleModelsError, RebasinUserError
from ..models import LoadedModel, check_compatible
from ..names import DEFAULT_LINEAGE_STRATEGY
from ..run.memory import InsufficientMemoryError, available_memory
from ..run.widths import to_widest
from .compare import ALPHA, MATCHING, NULL_SIMILARITY, PairLineage, compare
from .record import LineageRecord, ModelRef, PairRecord, next_step
from .stats import SIGNAL_CAP, SIGNAL_SHARE

__all__ = ["PAIR_BYTES_PER_PARAMETER", "check_comparable", "check_count", "check_memory", "lineage_of"]


def _layers(lm: LoadedModel) -> int:
    config = lm.model.config.get_text_config()
    return int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0) or 0)


def check_count(n: int) -> None:
    """Two models or more: checked by the command before it downloads or loads anything."""
    if n < 2:
        raise RebasinUserError("lineage compares two models or more: give MODEL_A MODEL_B [MODEL_C …]")


def check_comparable(models: Sequence[LoadedModel], names: Sequence[str]) -> None:
    """Two models or more of one family and depth; anything else is a user error naming why."""
    check_count(len(models))
    ref, ref_type = models[0], models[0].model.config.model_type
    for lm, name in zip(models[1:], names[1:], strict=True):
        kind = lm.model.config.model_type
        if kind != ref_type:
            raise IncompatibleModelsError(
                f"{name} is a {kind} model but {names[0]} is a {ref_type}: lineage compares models of one family "
                "(a descendant keeps its parent's architecture)"
            )
        if _layers(lm) != _layers(ref):
            raise IncompatibleModelsError(
                f"{name} has {_layers(lm)} layers but {names[0]} has {_layers(ref)}: a depth-pruned descendant is not "
                "matched layer to layer (its layer map is not searched), so the pair is refused rather than "
                "called independent"
            )


# what one pair's comparison holds beside the loaded models, per parameter of the larger: canonical
# and balanced copies, signal and bulk of each, B's moved bulk, the alignment's views (float32), the
# SVDs' float64 blocks. A Qwen3-0.6B-shaped pair (0.75B parameters) passed 24 GB (32 bytes each)
# and was still growing when the kernel killed it.
PAIR_BYTES_PER_PARAMETER = 44


def check_memory(models: Sequence[LoadedModel]) -> None:
    """Refuse (exit 2) a comparison that would not fit, before it starts: the kernel would kill it."""
    params = max(sum(p.numel() for p in lm.model.parameters()) for lm in models)
    need, have = PAIR_BYTES_PER_PARAMETER * params, available_memory()
    if have is not None and need > have:
        raise InsufficientMemoryError(
            f"lineage compares two models in memory, which needs about {need / 2**30:.1f} GB for models of "
            f"{params / 1e9:.2f}B parameters, and {have / 2**30:.1f} GB are available: streamed comparison "
            "(what merges do at this size) is not implemented for lineage yet"
        )


def lineage_of(
    models: Sequence[LoadedModel],
    given: Sequence[str],
    *,
    progress: Callable[[str], None] | None = None,
    share: float = SIGNAL_SHARE,
    cap: int = SIGNAL_CAP,
    null: float = NULL_SIMILARITY,
) -> LineageRecord:
    """Every pair's verdict (A against B, A against C, B against C, …), as ``lineage.json`` holds it.
    Models of different widths are first written into the widest one's shape (exactly)."""
    start = time.perf_counter()
    names = [f"model {i + 1} ({g})" for i, g in enumerate(given)]
    check_comparable(models, names)
    check_memory(models)
    same, embedded = to_widest(list(models), names)
    for lm in same[1:]:
        check_compatible(same[0], lm)
    grown = {e.index: e.note(names) for e in embedded}
    states = [lm.model.state_dict() for lm in same]
    pairs = []
    for i, j in combinations(range(len(same)), 2):
        say = (lambda stage, i=i, j=j: progress(f"{given[i]} vs {given[j]}: {stage}")) if progress else None
        found = compare(same[0].graph, states[i], states[j], share=share, cap=cap, null=null, progress=say)
        pairs.append(_record(i, j, found))
    refs = [
        ModelRef(
            given=g,
            folder=str(lm.path),
            model_type=lm.model.config.model_type,
            layers=_layers(lm),
            embedded=lm.embedded or grown.get(k),
        )
        for k, (g, lm) in enumerate(zip(given, same, strict=True))
    ]
    settings: dict[str, float | int | str] = {
        "signal_share": share,
        "signal_cap": cap,
        "null_similarity": null,
        "alpha": ALPHA,
        "strategy": DEFAULT_LINEAGE_STRATEGY,
        "tol": MATCHING["tol"],
    }
    return LineageRecord(models=refs, settings=settings, pairs=pairs, seconds={"total": time.perf_counter() - start})


def _record(i: int, j: int, found: PairLineage) -> PairRecord:
    return PairRecord(
        a=i,
        b=j,
        verdict=found.verdict,
        statistic=found.statistic,
        raw_statistic=found.raw_statistic,
        z=found.z,
        log10_p=found.log10_p,
        raw_z=found.raw_z,
        raw_log10_p=found.raw_log10_p,
        next_step=next_step(found.verdict, [e.map for e in found.spaces]),
        spaces=found.spaces,
        seconds=found.seconds,
    )
