"""Lineage of two models or more: checks that they can be compared, then every pair's verdict."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from itertools import combinations

from hf_rebasin.alignment.strategies.base import AlignmentData
from hf_rebasin.alignment.widths import to_widest
from hf_rebasin.core.errors import IncompatibleModelsError, RebasinUserError
from hf_rebasin.core.lazy import shape_of
from hf_rebasin.core.memory import OVERHEAD, InsufficientMemoryError, available_memory
from hf_rebasin.core.names import DEFAULT_LINEAGE_STRATEGY
from hf_rebasin.io.bodies import compared_bodies
from hf_rebasin.io.models import LoadedModel, check_compatible, stack_depths
from hf_rebasin.lineage.compare import (
    ALPHA,
    KEEP_IDENTITY,
    MATCHING_ROUNDS,
    MATCHING_TOL,
    NULL_SIMILARITY,
    SHARED_NULL,
    threads_for,
)
from hf_rebasin.lineage.datamaps import LineageData, data_bytes, data_tokens
from hf_rebasin.lineage.depth import layer_lists, layer_of, renamed
from hf_rebasin.lineage.pairwise import PairRun
from hf_rebasin.lineage.record import LineageRecord, ModelRef, PairRecord
from hf_rebasin.lineage.stats import SIGNAL_CAP, SIGNAL_SHARE, is_matrix, signal_rank
from hf_rebasin.merging.vocabulary.layout import to_shared_rows
from hf_rebasin.symmetry.spaces import Space

__all__ = ["check_comparable", "check_count", "check_depths", "check_memory", "lineage_bytes", "lineage_of"]


def check_count(n: int) -> None:
    """Two models or more: checked by the command before it downloads or loads anything."""
    if n < 2:
        raise RebasinUserError("lineage compares two models or more: give MODEL_A MODEL_B [MODEL_C …]")


def check_comparable(models: Sequence[LoadedModel], names: Sequence[str]) -> None:
    """Two models or more of one family; models of other depths need a layer list lineage can
    read (``model.layers.3``) and layers of one shape. Anything else is a user error naming why."""
    check_count(len(models))
    ref_type = models[0].model.config.model_type
    for lm, name in zip(models[1:], names[1:], strict=True):
        kind = lm.model.config.model_type
        if kind != ref_type:
            raise IncompatibleModelsError(
                f"{name} is a {kind} model but {names[0]} is a {ref_type}: lineage compares models of one family "
                "(a descendant keeps its parent's architecture)"
            )


def check_depths(models: Sequence[LoadedModel], names: Sequence[str]) -> tuple[str, ...] | None:
    """Where depths differ: the module list holding the layers of each stack (one; an
    encoder-decoder's encoder and decoder), after checking that every model's layers have the
    reference's tensors and shapes (a layer map renames layers, nothing else)."""
    depths = [stack_depths(lm) for lm in models]
    if len(set(depths)) == 1:
        return None
    shown = [_depth_words(d) for d in sorted(set(depths) - {depths[0]})]
    others = f"[{', '.join(shown)}]"
    found = {layer_lists(lm.weights, lm.graph.stacks, d) for lm, d in zip(models, depths, strict=True)}
    keys = found.pop() if len(found) == 1 else None
    if keys is None or None in keys:
        raise IncompatibleModelsError(
            f"{names[0]} has {_depth_words(depths[0])} layers and others {others}: lineage maps layers "
            "across depths in a numbered layer list (model.layers.N), which these models' tensors do not have"
        )
    streams = [n for n, sp in models[0].graph.spaces.items() if isinstance(sp, Space) and sp.kind == "residual"]
    if len(keys) == 1 and len(streams) != 1:
        raise IncompatibleModelsError(
            f"{names[0]} has {_depth_words(depths[0])} layers and others {others}: layer maps are "
            f"searched in models with one residual stream, and {models[0].model.config.model_type} has {len(streams)}"
        )
    layer_keys = [k for k in keys if k is not None]

    def template(lm: LoadedModel) -> dict[str, tuple[int, ...]]:
        return {_at_zero(n, layer_keys): tuple(shape_of(lm.weights, n)) for n in lm.weights}

    ref = template(models[0])
    for lm, name in zip(models[1:], names[1:], strict=True):
        own = template(lm)
        if own != ref:
            diff = sorted(set(own.items()) ^ set(ref.items()))[0][0]
            raise IncompatibleModelsError(
                f"{name} and {names[0]} differ in more than depth (tensor {diff!r} in a layer or outside them): "
                "lineage maps the layers of models of one family and width"
            )
    return tuple(layer_keys)


def _depth_words(depths: tuple[int, ...]) -> str:
    """``6``, or an encoder-decoder's ``12+6`` (encoder+decoder)."""
    return "+".join(map(str, depths))


def _at_zero(name: str, keys: Sequence[str]) -> str:
    """The name as layer 0 of its stack holds it (outside the layers: itself)."""
    key = next((k for k in keys if layer_of(name, k) is not None), None)
    return name if key is None else renamed(name, key, 0)


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
    need = OVERHEAD + len(models) * factors  # each model's signal kept for all its pairs
    need += WORK_COPIES * 4 * largest + VIEW_COPIES * 8 * width**2
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
    have (``settings["vocabulary"]`` says so), classifiers whose task heads are over other label
    sets on their bodies (``settings["heads"]``). With
    ``data`` (batches every model reads), each alignment starts from maps fitted on activations."""
    start = time.perf_counter()
    names = [f"model {i + 1} ({g})" for i, g in enumerate(given)]
    check_comparable(models, names)
    models, heads = compared_bodies(models)  # classifiers over other label sets: their bodies
    check_memory(models, data_tokens=0 if data is None else data_tokens(data.batches, models[0].model.config))
    rows, vocabulary = to_shared_rows(list(models))  # a new release is judged on the tokens it shares
    same, embedded = to_widest(rows, names)
    keys = check_depths(same, names)
    if keys is None:
        for lm in same[1:]:
            check_compatible(same[0], lm)
    grown = {e.index: e.note(names) for e in embedded}
    probe = None if data is None else LineageData(data.batches, same[0].model, data.special_ids)
    run = PairRun(same, given, keys, share=share, cap=cap, null=null, data=probe)
    pairs: list[PairRecord] = []
    todo = list(combinations(range(len(same)), 2))
    with threads_for(same[0].weights):
        for k, (i, j) in enumerate(todo):
            head = f"pair {k + 1}/{len(todo)}{_left(pairs, len(todo))}: {given[i]} vs {given[j]}"
            run.say = _prefixed(progress, head)
            pairs.append(run.pair(i, j))
        stacks = run.stacks(pairs)
    refs = [
        ModelRef(
            given=g,
            folder=str(lm.path),
            model_type=lm.model.config.model_type,
            layers=run.depths[k],
            embedded=lm.embedded or grown.get(k),
            stacks=run.stack_layers(k),
        )
        for k, (g, lm) in enumerate(zip(given, same, strict=True))
    ]
    settings = _settings(share, cap, null, data, run.tokens)
    if vocabulary is not None:
        settings["vocabulary"] = vocabulary
    if heads is not None:
        settings["heads"] = heads
    if keys is not None and data is not None:
        settings["data_note"] = "pairs of other depths than the first model's are compared data-free"
    seconds = {"total": time.perf_counter() - start}
    return LineageRecord(models=refs, settings=settings, pairs=pairs, layer_maps=stacks, seconds=seconds)


def _settings(
    share: float, cap: int, null: float, data: AlignmentData | None, tokens: int
) -> dict[str, float | int | str]:
    return {
        "signal_share": share,
        "signal_cap": cap,
        "null_similarity": null,
        "shared_null": SHARED_NULL,
        "alpha": ALPHA,
        "strategy": DEFAULT_LINEAGE_STRATEGY,
        "tol": MATCHING_TOL,
        "max_passes": MATCHING_ROUNDS,
        "keep_identity": KEEP_IDENTITY,
        "data": "none" if data is None else data.description or "given",
        "data_tokens": tokens,
    }


def _prefixed(progress: Callable[[str], None] | None, head: str) -> Callable[[str], None]:
    if progress is None:
        return lambda _stage: None
    return lambda stage: progress(f"{head}: {stage}")


def _left(done: Sequence[PairRecord], total: int) -> str:
    """``, about 40 s left``: the pairs still to compare at the pace of those done on this machine
    (all pairs of a run are of one shape); nothing before the first is done."""
    if not done:
        return ""
    pace = sum(p.seconds.get("total", 0.0) for p in done) / len(done)
    return f", about {pace * (total - len(done)):.0f} s left"
