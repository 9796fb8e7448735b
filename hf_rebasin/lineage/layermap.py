"""Lineage across depths: a pair of models of other depths (or one whose layers moved at one depth)
compared under the layer map `depth` finds, and a model stacked from two parents or more.

The map is found on the layers' circuits (`depth.layer_scores`); the pair is then compared once
more as for equal depths, the parents' layers renamed into the mapped model's depth (nothing
copied): the bulk test per space gives each matched layer its p-value and the pair its verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from hf_rebasin.lineage.compare import ALPHA, NULL_SIMILARITY, PairLineage, Side, judge
from hf_rebasin.lineage.depth import (
    ScalesView,
    Source,
    Stacks,
    best_map,
    layer_of,
    signals_view,
    space_keys,
    state_view,
    with_spaces,
)
from hf_rebasin.lineage.record import LayerMap, LayerMatch, SpaceRecord
from hf_rebasin.lineage.stats import combined_z, log10_sf

__all__ = [
    "LayerFit",
    "LayerStat",
    "fit_layers",
    "fit_stacks",
    "layer_stats",
    "mapped_view",
    "orient",
    "orient_stacks",
    "per_layer",
    "to_record",
    "unexplained",
]

UNEXPLAINED = 0.5  # a layer whose best score is below this share of the other side's median best has no source


@dataclass
class LayerFit:
    """One model's layers mapped onto its parents' (indices into the parents given) and what the
    comparison under that map found."""

    sources: list[Source]
    scores: list[float]  # each layer's score against its source
    increasing: bool
    found: PairLineage
    candidates: int  # the layers each of its layers was chosen from (for the Bonferroni bound)
    stack: str | None = None  # an encoder-decoder's stack: its module list (``model.decoder.layers``)
    spaces: str | None = None  # how the graph names that stack's spaces (``dec`` in ``dec.3.mlp``)


def orient(scores: Tensor) -> bool:
    """Whether the columns' model (B) is the one to map (else A, the rows'): the child of a pruning
    is the shallower model, the child of an up-scaling the deeper one. A deeper model is mapped
    unless some of its layers score far below what the other model's layers reach (a pruned child
    leaves the parent's dropped layers without a match)."""
    rows, cols = scores.shape
    deep_cols = cols > rows
    deep, shallow = (scores.max(dim=0).values, scores.max(dim=1).values)
    if not deep_cols:
        deep, shallow = shallow, deep
    gaps = bool((deep < UNEXPLAINED * float(shallow.median())).any())
    return deep_cols != gaps


def orient_stacks(scores: Mapping[str, Tensor]) -> bool:
    """`orient` over an encoder-decoder's stacks of other depths (one mapped model for all of them):
    the majority's, a tie the first stack's."""
    votes = [orient(s) for s in scores.values() if s.shape[0] != s.shape[1]]
    return 2 * sum(votes) > len(votes) or (2 * sum(votes) == len(votes) and votes[0])


def mapped_view(parents: Sequence[Side], child: Side, stacks: Stacks) -> Side:
    """The parents' layers at the child's depth as a `Side` (states, signals and unit scales
    renamed, nothing computed again)."""
    names = list(child.state)
    spaces = list(child.graph.spaces)
    return Side(
        state=state_view([p.state for p in parents], child.state, stacks),
        graph=child.graph,
        untie=parents[0].untie,
        scales=ScalesView([p.scales for p in parents], spaces, with_spaces(child.graph, stacks)),
        signal=signals_view([p.signal for p in parents], names, stacks),
    )


def fit_layers(
    parents: Sequence[Side],
    scores: Sequence[Tensor],
    child: Side,
    key: str,
    *,
    null: float = NULL_SIMILARITY,
    say: Callable[[str], None] = lambda _stage: None,
) -> LayerFit:
    """The child's layers mapped onto its parents' (``scores[p]``: parent p's layers × the child's)
    and the child compared with the parents' layers under that map."""
    if len(parents) == 1:
        chosen, increasing = best_map(scores[0])
        sources = [Source(0, i) for i in chosen]
    else:  # each layer its best match among every parent's layers
        sources = []
        for j in range(scores[0].shape[1]):
            best = max(range(len(parents)), key=lambda p: float(scores[p][:, j].max()))
            sources.append(Source(best, int(scores[best][:, j].argmax())))
        increasing = False
    picked = [float(scores[s.parent][s.layer, j]) for j, s in enumerate(sources)]
    found = judge(mapped_view(parents, child, {key: sources}), child, null=null, say=say)
    return LayerFit(sources, picked, increasing, found, sum(int(s.shape[0]) for s in scores))


def fit_stacks(
    parent: Side,
    scores: Mapping[str, Tensor],
    child: Side,
    *,
    null: float = NULL_SIMILARITY,
    say: Callable[[str], None] = lambda _stage: None,
) -> list[LayerFit]:
    """An encoder-decoder's layers mapped stack by stack (``scores[key]``: the parent's layers × the
    child's in the stack ``key``; a stack of one depth in both keeps the identity), and the child
    compared once with the parent's layers under every stack's map: one fit per stack, sharing
    that comparison."""
    maps: dict[str, tuple[list[Source], bool, int]] = {}
    for key, s in scores.items():
        if s.shape[0] == s.shape[1]:
            maps[key] = [Source(0, j) for j in range(s.shape[1])], True, 1  # nothing chosen: no Bonferroni
        else:
            chosen, increasing = best_map(s)
            maps[key] = [Source(0, i) for i in chosen], increasing, int(s.shape[0])
    found = judge(mapped_view([parent], child, {k: m[0] for k, m in maps.items()}), child, null=null, say=say)
    names = space_keys(child.graph, scores)
    return [
        LayerFit(
            sources,
            [float(scores[key][s.layer, j]) for j, s in enumerate(sources)],
            increasing,
            found,
            candidates,
            stack=key,
            spaces=names.get(key),
        )
        for key, (sources, increasing, candidates) in maps.items()
    ]


@dataclass(frozen=True)
class LayerStat:
    """One layer's evidence from its counted spaces: their mean bulk similarity, log10 p of 'kin'
    (Stouffer over them) and their bulk entries; aligned, or as stored where that is stronger (as
    the pair's test: a layer in place can read less aligned, where a rotation fitted to the other
    layers' signals moved the stream)."""

    similarity: float = 0.0
    log10_p: float = log10_sf(0.0)
    entries: int = 0


def layer_stats(spaces: Sequence[SpaceRecord], stack: str | None = None) -> dict[int, LayerStat]:
    """Each layer's `LayerStat` (layers without a counted space are absent); ``stack``: of that
    stack's spaces alone (as the graph names them: ``dec``)."""
    by: dict[int, list[SpaceRecord]] = {}
    for e in spaces:
        if e.counted and e.layer is not None and (stack is None or layer_of(e.space, stack) is not None):
            by.setdefault(e.layer, []).append(e)
    return {j: _layer_stat(es) for j, es in by.items()}


def _layer_stat(spaces: list[SpaceRecord]) -> LayerStat:
    aligned, stored = combined_z([e.z for e in spaces]), combined_z([e.raw_z for e in spaces])
    pick = (lambda e: e.similarity) if aligned >= stored else (lambda e: e.raw_similarity)
    return LayerStat(
        sum(pick(e) for e in spaces) / len(spaces), log10_sf(max(aligned, stored)), sum(e.entries for e in spaces)
    )


def per_layer(fit: LayerFit) -> list[tuple[float, float]]:
    """Each mapped layer's mean bulk similarity and log10 p of 'kin' (Stouffer over its spaces,
    Bonferroni over the candidate layers it was picked from)."""
    stats = layer_stats(fit.found.spaces, fit.spaces)
    out = []
    for j in range(len(fit.sources)):
        stat = stats.get(j, LayerStat())
        out.append((stat.similarity, min(0.0, stat.log10_p + math.log10(fit.candidates))))
    return out


def unexplained(fit: LayerFit) -> list[int]:
    """The layers no parent layer is kin to (their p-value does not pass at ``ALPHA``)."""
    return [j for j, (_, lp) in enumerate(per_layer(fit)) if lp >= math.log10(ALPHA)]


def to_record(
    fit: LayerFit, model: int, parents: Sequence[int], given: Sequence[str], depths: Sequence[int]
) -> LayerMap:
    """The fit as ``lineage.json`` holds it (``parents``, ``given``, ``depths``: the models'
    indices, names and depths; an encoder-decoder's fit: in its stack)."""
    alpha = math.log10(ALPHA)
    layers = [
        LayerMatch(
            layer=j,
            parent=parents[s.parent],
            source=s.layer if lp < alpha else None,
            score=score,
            similarity=similarity,
            log10_p=lp,
        )
        for j, (s, score, (similarity, lp)) in enumerate(zip(fit.sources, fit.scores, per_layer(fit), strict=True))
    ]
    kind = _kind(layers, depths[model], [depths[p] for p in parents])
    if fit.stack is not None and depths[model] == depths[parents[0]]:
        kind = "identity"  # a stack of one depth keeps its layers: nothing was searched
    return LayerMap(
        model=model,
        parents=list(parents),
        kind=kind,
        layers=layers,
        increasing=fit.increasing,
        mergekit=_mergekit(layers, given) if fit.stack is None else "",
        stack=fit.stack,
    )


def _kind(layers: list[LayerMatch], depth: int, parent_depths: list[int]) -> str:
    sources = [(m.parent, m.source) for m in layers]
    if len({p for p, _ in sources}) > 1:
        return "stacked from several parents"
    known = [s for _, s in sources if s is not None]
    if known and len(known) < len(sources):
        return "layers in common"  # students of one teacher that kept other layers, or layers trained anew
    if depth == parent_depths[0]:
        return "identity" if known == list(range(depth)) else "layers moved"
    if depth < parent_depths[0]:
        return "depth-pruned" if known == sorted(set(known)) else "depth-pruned, layers reordered"
    return "depth up-scaled" if len(set(known)) < len(known) else "deeper, layers from the parent"


def _mergekit(layers: list[LayerMatch], given: Sequence[str]) -> str:
    """A mergekit passthrough config whose slices take each layer's source in order (a layer without
    one: its own position's layer of the first parent, which the comment says)."""
    runs: list[list[int]] = []  # [parent, start, stop)
    for m in layers:
        parent, source = m.parent, m.source if m.source is not None else m.layer
        if runs and runs[-1][0] == parent and runs[-1][2] == source:
            runs[-1][2] += 1
        else:
            runs.append([parent, source, source + 1])
    lines = ["slices:"]
    for parent, start, stop in runs:
        lines += ["  - sources:", f"      - model: {given[parent]}", f"        layer_range: [{start}, {stop}]"]
    lines += ["merge_method: passthrough", "dtype: bfloat16"]
    if any(m.source is None for m in layers):
        lines.insert(0, "# layers without a kin source take their own position's layer; check them")
    return "\n".join(lines)
