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

from pydantic import Field, model_validator

from ..canonical import canonicalize
from ..features import WeightViews
from ..symmetry import HeadSpace, Space
from .base import Alignment, Options, Pair, Progress, Strategy, require_data, timed
from .descent import anchor_init, descend, space_solver, view_graph

LEARNED_ONLY = ("steps", "lr", "sinkhorn", "temperature")


class GeneralizedOrthogonalOptions(Options):
    iterations: int = Field(10, ge=1, description="alternating rounds at most (stops early when stable)")
    learned: bool = Field(False, description="refine on the loss of the interpolated model (needs data)")
    steps: int = Field(200, ge=1, description="learned: optimisation steps")
    lr: float = Field(1e-2, gt=0, description="learned: Adam learning rate")
    sinkhorn: bool = Field(False, description="learned: soft (Sinkhorn) permutations during optimisation")
    temperature: float = Field(0.05, gt=0, description="learned + sinkhorn: temperature of the soft permutations")
    seed: int = Field(0, description="seed of the permutation stage's visiting order and of learned λ samples")

    @model_validator(mode="after")
    def _learned_options_need_learned(self) -> GeneralizedOrthogonalOptions:
        stray = [k for k in LEARNED_ONLY if k in self.model_fields_set]
        if stray and not self.learned:
            raise ValueError(f"{', '.join(stray)} only apply with `learned: true`")
        return self


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
            from .learned import refine

            assert pair.data is not None and pair.model_a is not None
            transform, learned_notes = refine(pair, graph, sd_a, sd_b, transform, untied, options, progress)
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


STRATEGY = Strategy(
    name="generalized-orthogonal",
    paper="Theus et al., Generalized Linear Mode Connectivity for Transformers (2025)",
    options=GeneralizedOrthogonalOptions,
    run=run,
    needs_data=lambda o: bool(o.learned),
    summary="data-free: orthogonal residual map (canonical form), heads by QK/OV circuits, units by LAP",
)
