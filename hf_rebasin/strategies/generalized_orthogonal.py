"""Generalized linear mode connectivity (Theus et al., "Generalized Linear Mode Connectivity for
Transformers", 2025): orthogonal maps of the residual stream, heads matched by their circuits.

Both models are first brought to canonical form (norm scales folded into their readers, LayerNorm
writers centered), where any orthogonal map of the residual stream (fixing 1 under LayerNorm) is
exact. Then, for a few rounds: the residual map by Procrustes over every residual-indexed tensor,
heads by a LAP on QK-circuit (W_Qᵀ W_K) and OV-circuit (W_O W_V) similarity with orthogonal maps
inside each head, MLP units by LAP. Post-norm models (BERT) keep a permuted residual.
Optionally (``learned: true``, needs data) the maps are refined on the loss of the interpolated
model (see :mod:`hf_rebasin.strategies.learned`).
"""

from __future__ import annotations

from ..canonical import canonicalize
from ..features import WeightViews
from ..symmetry import HeadSpace, Space
from .base import Alignment, Pair, Progress, require_data, timed
from .descent import anchor_init, descend, space_solver, view_graph
from .learned import LearnedSettings, refine
from .options import GENERALIZED_ORTHOGONAL as STRATEGY  # noqa: F401 (re-exported: its registry entry)
from .options import LEARNED_ONLY as LEARNED_ONLY  # re-exported, as before
from .options import GeneralizedOrthogonalOptions


def run(pair: Pair, options: GeneralizedOrthogonalOptions, progress: Progress | None) -> Alignment:
    if options.learned:
        require_data(pair, "generalized-orthogonal", "with `learned: true` optimizes the loss of the merged model")
    with timed() as timings:
        sd_a, graph, untied = canonicalize(pair.graph, pair.sd_a)
        sd_b, _, _ = canonicalize(pair.graph, pair.sd_b)
        vgraph = view_graph(graph, "orthogonal")
        views = WeightViews(vgraph, sd_a, sd_b)
        # Permutations first: their discrete search escapes the poor optima a rotation started
        # at the identity falls into; every permutation is an allowed orthogonal map, so the
        # monotone descent below ends at least as well matched as weight matching.
        by_lap = space_solver(graph, "permutation")
        start, _ = descend(
            vgraph,
            sd_a,
            sd_b,
            by_lap,
            init=anchor_init(views, graph.identity(), by_lap),
            seed=options.seed,
            progress=progress,
            stage="generalized-orthogonal: permutations",
            views=views,
        )
        residual = [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual"]
        heads = [n for n, s in graph.spaces.items() if isinstance(s, HeadSpace)]
        order = residual + heads + [n for n in graph.spaces if n not in residual and n not in heads]
        transform, passes = descend(
            vgraph,
            sd_a,
            sd_b,
            space_solver(graph, "orthogonal", ranking="circuit"),
            init=start,
            max_iter=options.iterations,
            order=order,
            progress=progress,
            stage="generalized-orthogonal: rotations",
            views=views,
        )
        timings["rounds"] = passes
        notes = graph.fallbacks("orthogonal")
        if options.learned:
            settings = LearnedSettings(
                steps=options.steps,
                lr=options.lr,
                sinkhorn=options.sinkhorn,
                temperature=options.temperature,
                seed=options.seed,
            )
            transform, learned_notes = refine(pair, graph, sd_a, sd_b, transform, untied, settings, progress)
            notes += learned_notes
    return Alignment(
        "generalized-orthogonal",
        graph,
        sd_a,
        sd_b,
        transform,
        canonical=True,
        untied=untied,
        notes=notes,
        timings=timings,
    )
