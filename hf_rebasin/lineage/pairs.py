"""Lineage of two models or more: checks that they can be compared, then every pair's verdict."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from itertools import combinations

from hf_rebasin.alignment.strategies.base import AlignmentData
from hf_rebasin.alignment.widths import to_widest
from hf_rebasin.core.errors import IncompatibleModelsError, RebasinUserError
from hf_rebasin.core.memory import OVERHEAD, InsufficientMemoryError, available_memory
from hf_rebasin.core.names import DEFAULT_LINEAGE_STRATEGY
from hf_rebasin.io.models import LoadedModel, check_compatible
from hf_rebasin.io.rows import to_shared_rows
from hf_rebasin.lineage.compare import ALPHA, MATCHING_ROUNDS, MATCHING_TOL, NULL_SIMILARITY, PairLineage, compare
from hf_rebasin.lineage.datamaps import LineageData, data_bytes, data_tokens
from hf_rebasin.lineage.record import LineageRecord, ModelRef, PairRecord, moved_spaces, next_step
from hf_rebasin.lineage.stats import SIGNAL_CAP, SIGNAL_SHARE, is_matrix, signal_rank
from hf_rebasin.symmetry.spaces import Space

__all__ = ["check_comparable", "check_count", "check_memory", "lineage_bytes", "lineage_of"]


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
                f"{name} has {_layers(lm)} layers but {names[0]} has {_layers(ref)}: models of other depths (a "
                f"{'depth-pruned' if _layers(lm) < _layers(ref) else 'depth up-scaled or stacked'} descendant) are not "
                "matched layer to layer yet (no layer map is searched), so the pair is refused rather than called "
                "independent"
            )


# what a comparison holds beside what it reads, measured on bench_scale.py's random bf16 models
# (benchmarks/README.md, "Lineage at scale"): float32 copies of the largest tensor while a matrix is
# split or its bulks compared, float64 copies of the widest space's n × n view in the assignment
# problems (views, solver input, solver work), and for models loaded in memory (models of different
# widths) float32 bytes per parameter of both models: loaded, canonical and balanced
WORK_COPIES = 8
VIEW_COPIES = 5
IN_MEMORY_BYTES_PER_PARAMETER = 24


def lineage_bytes(
    models: Sequence[LoadedModel], share: float = SIGNAL_SHARE, cap: int = SIGNAL_CAP, data_tokens: int = 0
) -> int:
    """The peak a comparison of two of ``models`` is expected to reach, from shapes alone: both
    signals as factors, the working copies of the largest tensor and the widest space's views; with
    models in memory, their copies too; with data (``data_tokens`` > 0), what reading activations
    adds (`datamaps.data_bytes`)."""
    largest = factors = params = 0
    for lm in models:
        tensors = [t for t in lm.model.state_dict().values() if t.is_floating_point()]
        shapes = [tuple(t.shape) for t in tensors]
        matrices = [s for s, t in zip(shapes, tensors, strict=True) if is_matrix(s, t.dtype)]  # what is split
        kept = sum(signal_rank(s, share, cap) * (s[-2] + s[-1]) * math.prod(s[:-2]) for s in matrices)
        factors = max(factors, 4 * kept)
        params = max(params, sum(math.prod(s) for s in shapes))
        largest = max([largest, *(math.prod(s) for s in shapes)])
    width = max(sp.size for lm in models for sp in lm.graph.spaces.values() if isinstance(sp, Space))
    need = OVERHEAD + 2 * factors + WORK_COPIES * 4 * largest + VIEW_COPIES * 8 * width**2
    if any(lm.source is None for lm in models):
        need += IN_MEMORY_BYTES_PER_PARAMETER * params
    if data_tokens:
        need += max(data_bytes(lm, data_tokens) for lm in models)
    return need


def check_memory(models: Sequence[LoadedModel], data_tokens: int = 0) -> None:
    """Refuse (exit 2) a comparison that would not fit, before it starts: the kernel would kill it."""
    need, have = lineage_bytes(models, data_tokens=data_tokens), available_memory()
    if have is not None and need > have:
        streamed = all(lm.source is not None for lm in models)
        how = "read from their files tensor by tensor" if streamed else "loaded in memory (models of different widths)"
        drop = ""
        if data_tokens and lineage_bytes(models) <= have:
            extra = max(data_bytes(lm, data_tokens) for lm in models)
            drop = f" (reading the activations of `data` takes {extra / 2**30:.1f} GB of it: without `data` it fits)"
        raise InsufficientMemoryError(
            f"lineage of these models ({how}) needs about {need / 2**30:.1f} GB and {have / 2**30:.1f} GB are "
            f"available{drop}: free memory or run it on a larger machine"
        )


def lineage_of(
    models: Sequence[LoadedModel],
    given: Sequence[str],
    *,
    progress: Callable[[str], None] | None = None,
    share: float = SIGNAL_SHARE,
    cap: int = SIGNAL_CAP,
    null: float = NULL_SIMILARITY,
    data: AlignmentData | None = None,
) -> LineageRecord:
    """Every pair's verdict (A against B, A against C, B against C, …), as ``lineage.json`` holds it.
    Models of different widths are first written into the widest one's shape (exactly), models
    whose vocabularies differ (added tokens, an extended release) compared on the tokens they all
    have (``settings["vocabulary"]`` says so). With
    ``data`` (batches every model reads), each alignment starts from maps fitted on activations."""
    start = time.perf_counter()
    names = [f"model {i + 1} ({g})" for i, g in enumerate(given)]
    check_comparable(models, names)
    check_memory(models, data_tokens=0 if data is None else data_tokens(data.batches, models[0].model.config))
    rows, vocabulary = to_shared_rows(list(models))  # a new release is judged on the tokens it shares
    same, embedded = to_widest(rows, names)
    for lm in same[1:]:
        check_compatible(same[0], lm)
    grown = {e.index: e.note(names) for e in embedded}
    states = [lm.weights for lm in same]  # a streamed model's read from its files as used
    probe = None if data is None else LineageData(data.batches, same[0].model, data.special_ids)
    pairs: list[PairRecord] = []
    tokens = 0
    todo = list(combinations(range(len(same)), 2))
    for k, (i, j) in enumerate(todo):
        head = f"pair {k + 1}/{len(todo)}{_left(pairs, len(todo))}: {given[i]} vs {given[j]}"
        say = (lambda stage, head=head: progress(f"{head}: {stage}")) if progress else None
        found = compare(same[0].graph, states[i], states[j], share=share, cap=cap, null=null, progress=say, data=probe)
        pairs.append(_record(i, j, found))
        tokens = found.tokens
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
        "tol": MATCHING_TOL,
        "max_passes": MATCHING_ROUNDS,
        "data": "none" if data is None else data.description or "given",
        "data_tokens": tokens,
    }
    if vocabulary is not None:
        settings["vocabulary"] = vocabulary
    return LineageRecord(models=refs, settings=settings, pairs=pairs, seconds={"total": time.perf_counter() - start})


def _left(done: Sequence[PairRecord], total: int) -> str:
    """``, about 40 s left``: the pairs still to compare at the pace of those done on this machine
    (all pairs of a run are of one shape); nothing before the first is done."""
    if not done:
        return ""
    pace = sum(p.seconds.get("total", 0.0) for p in done) / len(done)
    return f", about {pace * (total - len(done)):.0f} s left"


def _record(i: int, j: int, found: PairLineage) -> PairRecord:
    moved = moved_spaces(found.spaces)
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
        next_step=next_step(found.verdict, [e.map for e in found.spaces], moved),
        moved=moved,
        spaces=found.spaces,
        seconds=found.seconds,
        passes=found.passes,
    )
