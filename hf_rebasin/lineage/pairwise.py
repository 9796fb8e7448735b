"""Every pair of a lineage run: each model made ready once (canonical form, signal), each pair
judged at one depth or under a layer map, and the models stacked from two parents or more."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from scipy.stats import norm
from torch import Tensor

from hf_rebasin.core.lazy import zeroed
from hf_rebasin.io.models import LoadedModel, depth_of, stack_depths
from hf_rebasin.lineage.compare import ALPHA, NULL_SIMILARITY, PairLineage, Side, judge, prepare_side
from hf_rebasin.lineage.datamaps import LineageData
from hf_rebasin.lineage.depth import best_map, layer_lists, layer_scores, stream_maps
from hf_rebasin.lineage.layermap import (
    LayerFit,
    LayerStat,
    fit_layers,
    fit_stacks,
    layer_stats,
    orient,
    orient_stacks,
    per_layer,
    to_record,
    unexplained,
)
from hf_rebasin.lineage.record import (
    KIN,
    LayerMap,
    PairRecord,
    describe_stacks,
    kin_words,
    map_step,
    moved_spaces,
    next_step,
    origin,
    stacks_step,
)
from hf_rebasin.lineage.stats import SIGNAL_CAP, SIGNAL_SHARE

__all__ = ["PairRun"]


class PairRun:
    """The pairs of one run. ``keys``: the module list of the layers of each stack where depths
    differ (one; an encoder-decoder's encoder and decoder; None: one depth, no layer map searched
    unless a pair's layers are not all kin)."""

    def __init__(
        self,
        models: Sequence[LoadedModel],
        given: Sequence[str],
        keys: tuple[str, ...] | None,
        *,
        share: float = SIGNAL_SHARE,
        cap: int = SIGNAL_CAP,
        null: float = NULL_SIMILARITY,
        data: LineageData | None = None,
    ) -> None:
        self.models, self.given, self.keys = models, given, keys
        self.depths = [depth_of(lm) for lm in models]
        self.stack_depths = [stack_depths(lm) for lm in models]  # (depth,), or (encoder, decoder)
        self.share, self.cap, self.null, self.data = share, cap, null, data
        self.say: Callable[[str], None] = lambda _stage: None
        self.tokens = 0
        self._sides: dict[int, Side] = {}
        self._scores: dict[tuple[int, int], dict[str, Tensor]] = {}  # (parent, child): per stack, parent × child
        self._streams: dict[tuple[int, int], dict[str, Tensor]] = {}  # (i, j): j's streams in i's basis, aligned
        # tensors some model's files lacked (transformers initialised them): zeros in every model, so no
        # pair compares them and the spaces only they make up carry no evidence
        self.unread: set[str] = set().union(*(lm.initialised for lm in models))

    @property
    def multi(self) -> bool:
        """Whether the models run two stacks of layers (an encoder-decoder): a layer map per stack."""
        return len(self.stack_depths[0]) > 1

    def stack_layers(self, k: int) -> dict[str, int] | None:
        """Model k's layers per stack, by module list (None for one stack)."""
        return dict(zip(self._keys(), self.stack_depths[k], strict=True)) if self.multi else None

    def side(self, k: int) -> tuple[Side, float]:
        """Model k made ready (once per run) and the seconds it took now."""
        if k in self._sides:
            return self._sides[k], 0.0
        start = time.perf_counter()
        lm = self.models[k]
        weights = zeroed(lm.weights, self.unread)
        self._sides[k] = prepare_side(lm.graph, weights, self.given[k], self.say, share=self.share, cap=self.cap)
        return self._sides[k], time.perf_counter() - start

    def scores(self, parent: int, child: int) -> dict[str, Tensor]:
        """The parent's layers × the child's in each stack, scored once per pair (either orientation)."""
        if (child, parent) in self._scores:
            return {k: s.T for k, s in self._scores[(child, parent)].items()}
        if (parent, child) not in self._scores:
            (p, _), (c, _) = self.side(parent), self.side(child)
            maps = self._streams.get((parent, child))
            if maps is None and (child, parent) in self._streams:  # orthogonal: the inverse is the transpose
                maps = {k: m.T for k, m in self._streams[(child, parent)].items()}
            self._scores[(parent, child)] = layer_scores(
                p.graph, p.state, p.signal, c.graph, c.state, c.signal, self._keys(), self.say, maps
            )
        return self._scores[(parent, child)]

    def _keys(self) -> tuple[str, ...]:
        if self.keys is None:  # one depth: found when a pair first needs its layers scored
            lm = self.models[0]
            self.keys = tuple(k or "" for k in layer_lists(lm.weights, lm.graph.stacks, self.stack_depths[0]))
        return self.keys

    def _key(self) -> str:
        return self._keys()[0]

    def pair(self, i: int, j: int) -> PairRecord:
        """Model j against model i: at one depth as always (a layer map searched only where some
        layers are not kin, and then reported beside the verdict), else under the layer map found
        (an encoder-decoder's: one per stack)."""
        start = time.perf_counter()
        (a, split_a), (b, split_b) = self.side(i), self.side(j)
        split = split_a + split_b
        maps: list[LayerMap] = []
        if self.stack_depths[i] == self.stack_depths[j]:
            data = self.data if self.stack_depths[i] == self.stack_depths[0] else None  # the probe runs model 1's depth
            found = judge(a, b, null=self.null, say=self.say, data=data, split=split)
            self.tokens = found.tokens
            if found.transform is not None:
                self._streams[(i, j)] = stream_maps(b.graph, found.transform)
            lmap = self._moved_layers(i, j, found)
        elif self.multi:
            found, maps = self._stack_maps(i, j)
            lmap = None
            found.seconds["split"] = split
        else:
            t = time.perf_counter()
            parent, child = (i, j) if orient(self.scores(i, j)[self._key()]) else (j, i)
            scored = time.perf_counter() - t
            fit = self._fit([parent], child)
            found, lmap = fit.found, to_record(fit, child, [parent], self.given, self.depths)
            found.seconds.update(split=split, layers=scored)
        found.seconds["total"] = time.perf_counter() - start
        return _record(i, j, found, lmap, list(self.given), maps)

    def _stack_maps(self, i: int, j: int) -> tuple[PairLineage, list[LayerMap]]:
        """An encoder-decoder pair of other depths: the model mapped (one for every stack), each
        stack's layer map, and the comparison under all of them."""
        t = time.perf_counter()
        parent, child = (i, j) if orient_stacks(self.scores(i, j)) else (j, i)
        scored = time.perf_counter() - t
        parent_side, child_side = self.side(parent)[0], self.side(child)[0]
        fits = fit_stacks(parent_side, self.scores(parent, child), child_side, null=self.null, say=self.say)
        depths = zip(*self.stack_depths, strict=True)  # each stack's depth in every model
        maps = [to_record(fit, child, [parent], self.given, d) for fit, d in zip(fits, depths, strict=True)]
        fits[0].found.seconds["layers"] = scored
        return fits[0].found, maps

    def _fit(self, parents: list[int], child: int) -> LayerFit:
        scores = [self.scores(p, child)[self._key()] for p in parents]
        sides = [self.side(p)[0] for p in parents]
        return fit_layers(sides, scores, self.side(child)[0], self._key(), null=self.null, say=self.say)

    def _moved_layers(self, i: int, j: int, found: PairLineage) -> LayerMap | None:
        """At one depth, where the pair is related but some layer is not kin to its namesake: the
        best layer map, reported (never used for the verdict) when it is not the identity."""
        if self.multi or found.verdict not in KIN or not self._key() or not _unkin_layers(found):
            return None  # an encoder-decoder at one depth keeps each stack's layers
        chosen, _ = best_map(self.scores(i, j)[self._key()])
        if chosen == list(range(self.depths[j])):
            return None
        return to_record(self._fit([i], j), j, [i], self.given, self.depths)

    def stacks(self, pairs: Sequence[PairRecord]) -> list[LayerMap]:
        """Models stacked from two parents or more (a `passthrough` merge given with its parents):
        each layer mapped to its best match among the related models, kept where it uses two of them,
        every layer is kin to its source, and it beats the best single parent by more than chance
        on the layers where they differ."""
        out: list[LayerMap] = []
        if self.multi:  # a passthrough slices one stack of layers: no encoder-decoder is stacked so
            return out
        for c in range(len(self.models)):
            single = self._single_parents(pairs, c)
            if len(single) < 2:
                continue
            parents = sorted(single)
            fit = self._fit(parents, c)
            used = {parents[s.parent] for s in fit.sources}
            if len(used) < 2 or unexplained(fit):
                continue
            stats = layer_stats(fit.found.spaces)
            mine = [(sim, stats.get(j, LayerStat()).entries) for j, (sim, _) in enumerate(per_layer(fit))]
            if all(_beats(mine, fit, parents, p, sims) for p, sims in single.items()):
                out.append(to_record(fit, c, parents, self.given, self.depths))
        return out

    def _single_parents(self, pairs: Sequence[PairRecord], c: int) -> dict[int, list[float]]:
        """Each model related to model c (and not mapped as its child): the similarity of each of c's
        layers to it, aligned (under the pair's layer map where depths differ)."""
        related = [pr for pr in pairs if c in (pr.a, pr.b) and pr.verdict in KIN]
        if len(related) < 2:  # one related model is no stack: nothing more to compare
            return {}
        out: dict[int, list[float]] = {}
        for pr in related:
            other = pr.b if pr.a == c else pr.a
            if self.depths[other] != self.depths[c]:
                if pr.layer_map is not None and pr.layer_map.model == c:
                    out[other] = [m.similarity for m in pr.layer_map.layers]
                else:  # the pair mapped the other way (part of c matched): c's layers onto the other's
                    out[other] = [sim for sim, _ in per_layer(self._fit([other], c))]
                continue
            stats = layer_stats(pr.spaces)
            out[other] = [stats.get(j, LayerStat()).similarity for j in range(self.depths[c])]
        return out


def _beats(mine: list[tuple[float, int]], fit: LayerFit, parents: list[int], p: int, sims: list[float]) -> bool:
    """Whether the stack's layers are more alike than parent p's alone where p is not their source:
    the gap's z over those layers (each similarity's spread about 1/√entries) passes the one-sided
    bound at ``ALPHA``."""
    gap = spread = 0.0
    for j, s in enumerate(fit.sources):
        if parents[s.parent] != p:
            gap += mine[j][0] - sims[j]
            spread += 2.0 / max(mine[j][1], 1)
    return spread > 0 and gap / math.sqrt(spread) > float(norm.isf(ALPHA))


def _unkin_layers(found: PairLineage) -> bool:
    return any(stat.log10_p >= math.log10(ALPHA) for stat in layer_stats(found.spaces).values())


def _record(
    i: int, j: int, found: PairLineage, lmap: LayerMap | None, given: list[str], maps: list[LayerMap]
) -> PairRecord:
    moved = moved_spaces(found.spaces)
    step = next_step(found.verdict, [e.map for e in found.spaces], moved)
    if lmap is not None and lmap.kind != "identity":
        step = map_step(found.verdict, lmap, given, step)
    if maps:
        step = stacks_step(found.verdict, maps, given, step)
    return PairRecord(
        shared=list(found.shared),
        origin=origin(found.verdict, found.shared, _kin_layers(i, j, found, lmap, maps, given)),
        merge_as=found.verdict if found.verdict in KIN else "independent",
        a=i,
        b=j,
        verdict=found.verdict,
        statistic=found.statistic,
        raw_statistic=found.raw_statistic,
        z=found.z,
        log10_p=found.log10_p,
        raw_z=found.raw_z,
        raw_log10_p=found.raw_log10_p,
        next_step=step,
        moved=moved,
        spaces=found.spaces,
        layer_map=lmap,
        stack_maps=maps,
        seconds=found.seconds,
        passes=found.passes,
    )


def _kin_layers(
    i: int, j: int, found: PairLineage, lmap: LayerMap | None, maps: list[LayerMap], given: list[str]
) -> str | None:
    """Which layers are kin, in words, where not every layer is kin to its namesake (None there)."""
    if maps:
        return describe_stacks(maps, given)
    if lmap is not None:
        return kin_words(lmap, given)
    stats = layer_stats(found.spaces)
    alpha = math.log10(ALPHA)
    kin = sorted(n for n, stat in stats.items() if stat.log10_p < alpha)
    if len(kin) == len(stats):
        return None
    mine = ", ".join(map(str, kin)) or "none"
    return f"layer{'s' * (len(kin) != 1)} {mine} of {given[i]} and {given[j]} kin, the others not"
