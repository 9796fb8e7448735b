"""Generalized linear mode connectivity (Theus et al., "Generalized Linear Mode Connectivity for
Transformers", 2025): orthogonal maps of the residual stream, heads matched by their circuits.

Both models are first brought to canonical form (norm scales folded into their readers, LayerNorm
writers centered), where any orthogonal map of the residual stream (fixing 1 under LayerNorm) is
exact. Then, for a few rounds: the residual map by Procrustes over every residual-indexed tensor,
heads by a LAP on QK-circuit (W_Qᵀ W_K) and OV-circuit (W_O W_V) similarity with orthogonal maps
inside each head, MLP units by LAP. Post-norm models (BERT) keep a permuted residual.
Optionally (``learned: true``, needs data) the maps are refined on the loss of the interpolated
model (see :mod:`hf_rebasin.alignment.strategies.engines.learned`), with ``learn_glu_scales`` B's gated-unit scales too;
in a universe merge of 3+ models, every model's map then again, together (`refine_universe`).

B's gated units are rescaled at most once, in float64, by the product of the scales ``glu: balance``
gives them (A's scale and sign) and the learned ones; the alignment carries that product
(``Alignment.glu_scales``), so a cache rebuilds B exactly without rerunning anything.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from hf_rebasin.alignment.features import WeightViews
from hf_rebasin.alignment.strategies.base import (
    Alignment,
    Pair,
    Progress,
    Refinement,
    UniverseMaps,
    matching_forms,
    require_data,
    timed,
)
from hf_rebasin.alignment.strategies.engines.descent import per_sublayer_descent, space_solver, view_graph
from hf_rebasin.alignment.strategies.engines.invertible import invertible_inner
from hf_rebasin.alignment.strategies.engines.learned import LearnedSettings, refine, refine_many
from hf_rebasin.alignment.strategies.engines.orthogonal import permutation_start, space_order
from hf_rebasin.alignment.strategies.engines.orthogonal import rotate as rotate_spaces
from hf_rebasin.alignment.strategies.options import GENERALIZED_ORTHOGONAL as STRATEGY  # noqa: F401 (re-exported: its registry entry)
from hf_rebasin.alignment.strategies.options import LEARNED_ONLY as LEARNED_ONLY  # re-exported, as before
from hf_rebasin.alignment.strategies.options import GeneralizedOrthogonalOptions, default_learned_lr, parse_sampler
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import HeadSpace
from hf_rebasin.symmetry.sublayers import PER_SUBLAYER_NOTE, PER_SUBLAYER_STACKS_NOTE
from hf_rebasin.symmetry.transforms import Transform


def run(pair: Pair, options: GeneralizedOrthogonalOptions, progress: Progress | None) -> Alignment:
    """Align ``pair`` in canonical form: data-free orthogonal maps, then optionally learned ones."""
    if options.learned:
        require_data(pair, "generalized-orthogonal", "with `learned: true` optimizes the loss of the merged model")
    with timed() as timings:
        sd_a, graph, untied = canonicalize(pair.graph, pair.sd_a)
        sd_b: Mapping[str, Tensor]
        sd_b, _, _ = canonicalize(pair.graph, pair.sd_b)
        canonical_b = sd_b
        # matching compares balanced gated MLPs (after the fold: γ changes up's rows)
        ma, mb, balanced = matching_forms(pair, sd_a, sd_b, options)
        rotations = not (options.learned and options.maps == "permutations")
        graph, transform, split_notes = _data_free(graph, ma, mb, options, rotations, progress, timings)
        notes = (
            split_notes
            + (
                graph.fallbacks("orthogonal")
                if rotations
                else ["learned matching of permutations only (`maps: permutations`)"]
            )
            + graph.pinned()
        )
        scales: dict[str, Tensor] | None = None  # applied to canonical B: what the cache stores
        if balanced:  # B's units take the scale and sign of the A unit they land on (exact)
            scales = glu.matched_unit_scales(graph, sd_a, canonical_b, transform)
            sd_b = glu.apply_unit_scales(graph, canonical_b, scales)
        diagnostics: dict[str, Any] = {}
        resolved: dict[str, Any] = {}
        if options.learned:
            transform, sd_b, scales, diagnostics, resolved = _learn(
                pair, options, graph, (sd_a, sd_b, canonical_b), transform, scales, untied, notes, progress
            )
    return Alignment(
        "generalized-orthogonal",
        graph,
        sd_a,
        sd_b,
        transform,
        exact=PER_SUBLAYER_NOTE not in split_notes,  # one global map stays exact
        canonical=True,
        glu_matched=balanced,
        glu_scales=scales,
        untied=untied,
        notes=notes,
        timings=timings,
        diagnostics=diagnostics,
        resolved=resolved,
    )


def _data_free(
    graph: SymmetryGraph,
    ma: Mapping[str, Tensor],
    mb: Mapping[str, Tensor],
    options: GeneralizedOrthogonalOptions,
    rotations: bool,
    progress: Progress | None,
    timings: dict[str, float],
) -> tuple[SymmetryGraph, Transform, list[str]]:
    """The maps found without data, on the matching forms ``ma``, ``mb``: a permutation start, then
    (with ``rotations``) orthogonal rounds, least-squares inner maps (``inner: invertible``) and
    per-sublayer residual maps (rounds go into ``timings``); returns (graph, transform, the
    per-sublayer note if any)."""
    vgraph = view_graph(graph, "orthogonal")
    views = WeightViews(vgraph, ma, mb)
    start, _ = permutation_start(graph, views, seed=options.seed, progress=progress, stage="generalized-orthogonal")
    order = space_order(graph)
    heads = [n for n, s in graph.spaces.items() if isinstance(s, HeadSpace)]

    def rotate(init: Transform, spaces: list[str], stage: str) -> tuple[Transform, int]:
        return rotate_spaces(
            graph,
            views,
            init,
            spaces,
            iterations=options.iterations,
            tol=options.tol,
            progress=progress,
            stage=f"generalized-orthogonal: {stage}",
        )

    transform, passes = rotate(start, order, "rotations") if rotations else (start, 0)
    timings["rounds"] = passes
    if options.inner == "invertible":
        # the inner maps by least squares, then the other spaces again against the unsheared
        # heads, until neither moves (sheared heads pull the residual map off otherwise)
        others = [n for n in order if n not in heads]
        for _ in range(options.iterations):
            transform = invertible_inner(graph, ma, mb, transform)
            before = dict(transform)
            transform, _ = rotate(transform, others, "invertible heads")
            if all(transform[n] is before[n] for n in others):
                break
    if options.residual_maps != "per-sublayer":
        return graph, transform, []
    if len(graph.stacks) > 1:
        return graph, transform, [PER_SUBLAYER_STACKS_NOTE]
    graph, transform = per_sublayer_descent(
        graph,
        ma,
        mb,
        transform,
        functools.partial(space_solver, cls="orthogonal", ranking="circuit"),
        cls="orthogonal",
        keep=heads if options.inner == "invertible" else (),  # least-squares inner maps stay as fitted
        max_iter=options.iterations,
        progress=progress,
        stage="generalized-orthogonal: per-sublayer",
    )
    return graph, transform, [PER_SUBLAYER_NOTE]


def _learn(
    pair: Pair,
    options: GeneralizedOrthogonalOptions,
    graph: SymmetryGraph,
    forms: tuple[Mapping[str, Tensor], Mapping[str, Tensor], Mapping[str, Tensor]],
    transform: Transform,
    scales: dict[str, Tensor] | None,
    untied: list[str],
    notes: list[str],
    progress: Progress | None,
) -> tuple[Transform, Mapping[str, Tensor], dict[str, Tensor] | None, dict[str, Any], dict[str, Any]]:
    """Learned matching on top of the data-free maps; ``forms`` is (A, B as matched, canonical B).
    Returns (transform, B with the product of matched and learned unit scales, that product,
    diagnostics, resolved settings); its notes go onto ``notes``."""
    sd_a, sd_b, canonical_b = forms
    diagnostics: dict[str, Any] = {}
    resolved: dict[str, Any] = {}
    assert pair.data is not None
    settings = learned_settings(options, pair.data.batches)
    if options.lr is None:  # unset: chosen by what the model reads
        resolved["lr"] = settings.lr
        audio = any("input_features" in b for b in pair.data.batches)  # speech: the text rate, unmeasured there
        reads = "images" if _reads_images(pair.data.batches) else "audio (the text rate)" if audio else "text"
        notes.append(f"lr: {settings.lr:g} (unset in the recipe; the model reads {reads})")
    learned = refine(pair, graph, sd_a, sd_b, transform, untied, settings, progress)
    transform = learned.transform
    notes += learned.notes
    diagnostics["learned"] = learned.history
    if options.learn_glu_scales and not graph.glus and "learn_glu_scales" in options.model_fields_set:
        notes.append("learn_glu_scales: the model has no gated MLP, so no unit scales were learned")
    if options.glu is None and graph.glus:
        resolved["glu"] = "balance"
        notes.append(
            "glu: balance (unset in the recipe; learned matching balances gated units, then learns their scales)"
        )
    if learned.unit_scales:  # learned on top of the start's: their product, applied once
        matched = scales or {}
        scales = {
            **matched,
            **{sp: s * matched[sp] if sp in matched else s for sp, s in learned.unit_scales.items()},
        }
        sd_b = glu.apply_unit_scales(graph, canonical_b, scales)
    return transform, sd_b, scales, diagnostics, resolved


def _reads_images(batches: Sequence[Mapping[str, Any]]) -> bool:
    return any("pixel_values" in batch for batch in batches)


def learned_settings(options: GeneralizedOrthogonalOptions, batches: Sequence[Mapping[str, Any]]) -> LearnedSettings:
    """The learned-matching settings of these options (also the universe merge's refinement); an
    unset rate is chosen by what the alignment ``batches`` feed the model (images or text)."""
    return LearnedSettings(
        steps=options.steps,
        lr=options.lr if options.lr is not None else default_learned_lr(_reads_images(batches)),
        sinkhorn=options.sinkhorn,
        temperature=options.temperature,
        seed=options.seed,
        sampler=parse_sampler(options.sampler),
        heads=options.learn_heads,
        budget=options.budget,
        holdout=options.holdout,
        eval_every=options.eval_every,
        patience=options.patience,
        invertible=options.inner == "invertible",
        glu_scales=options.learn_glu_scales,
        rotations=options.rotations,
        straight_through=options.straight_through,
        warmup=options.warmup,
    )


def refine_universe(maps: UniverseMaps, options: GeneralizedOrthogonalOptions, progress: Progress | None) -> Refinement:
    """Theus et al.'s multi-model learned matching: every map of a universe merge refined together,
    on the loss of merges with Dirichlet weights, starting from the universe's maps."""
    transforms, notes, history = refine_many(
        maps.template,
        maps.graph,
        maps.state_dicts,
        maps.transforms,
        maps.weights,
        maps.untied,
        maps.data.batches,
        learned_settings(options, maps.data.batches),
        float(options.dirichlet),
        progress,
    )
    return Refinement(transforms, notes, history)
