"""Weight matching (Ainsworth et al., "Git Re-Basin", ICLR 2023), on the symmetry graph.

Randomized coordinate descent over spaces: for each space, with every other space fixed, pick the
permutation that maximizes ``Σ ⟨W_A, T_out W_B T_inᵀ⟩`` over all tensors touching it (weights,
biases, norm parameters); stop when a full pass improves nothing. Head spaces solve a two-level
assignment so heads never mix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch import Tensor

from hf_rebasin.alignment.experts import center_routers, expert_spaces, fit_router_shifts
from hf_rebasin.alignment.features import WeightViews
from hf_rebasin.alignment.strategies.base import Alignment, Pair, Progress, matching_forms, timed
from hf_rebasin.alignment.strategies.engines.descent import (
    anchor_init,
    descend,
    finish_permutations,
    space_solver,
    view_graph,
)
from hf_rebasin.alignment.strategies.options import WEIGHT_MATCHING as STRATEGY  # noqa: F401 (re-exported: its registry entry)
from hf_rebasin.alignment.strategies.options import WeightMatchingOptions
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import TransformClass
from hf_rebasin.symmetry.sublayers import PER_SUBLAYER_NOTE
from hf_rebasin.symmetry.transforms import Transform


def weight_matching(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    transform_class: TransformClass = "permutation",
    *,
    max_iter: int = 100,
    seed: int = 0,
    init: Transform | None = None,
    progress: Progress | None = None,
) -> Transform:
    """The transform of B's spaces that best matches A's weights (B's state dict must be in the
    same form as A's: both canonical when ``transform_class`` is orthogonal). Softmax routers are
    compared centred, and B's gets A's mean row back (:mod:`hf_rebasin.alignment.experts`)."""
    ca, cb = center_routers(graph, sd_a), center_routers(graph, sd_b)
    vgraph = view_graph(graph, transform_class)
    views = WeightViews(vgraph, ca, cb)
    solve = space_solver(graph, transform_class)
    start = init if init is not None else anchor_init(views, graph.identity(), solve)
    transform, _ = descend(
        vgraph, ca, cb, solve, init=start, max_iter=max_iter, seed=seed, progress=progress, views=views
    )
    return fit_router_shifts(graph, sd_a, sd_b, transform) if expert_spaces(graph) else transform


def run(pair: Pair, options: WeightMatchingOptions, progress: Progress | None) -> Alignment:
    with timed() as timings:
        ma, mb, balanced = matching_forms(pair, pair.sd_a, pair.sd_b, options)
        transform = weight_matching(pair.graph, ma, mb, max_iter=options.max_iter, seed=options.seed, progress=progress)
        matched = dataclasses.replace(pair, sd_a=ma, sd_b=mb)
        graph, transform, notes, sd_b = finish_permutations(pair, matched, balanced, transform, options, progress)
    return Alignment(
        "weight-matching",
        graph,
        pair.sd_a,
        sd_b,
        transform,
        exact=PER_SUBLAYER_NOTE not in notes,  # one global map stays exact
        glu_matched=balanced,
        notes=notes,
        timings=timings,
    )
