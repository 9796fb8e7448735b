"""Weight matching (Ainsworth et al., "Git Re-Basin", ICLR 2023), on the symmetry graph.

Randomized coordinate descent over spaces: for each space, with every other space fixed, pick the
permutation that maximizes ``Σ ⟨W_A, T_out W_B T_inᵀ⟩`` over all tensors touching it (weights,
biases, norm parameters); stop when a full pass improves nothing. Head spaces solve a two-level
assignment so heads never mix.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ..features import WeightViews
from ..symmetry import SymmetryGraph, Transform, TransformClass
from .base import Alignment, Pair, Progress, timed
from .descent import anchor_init, descend, permutation_streams, space_solver, view_graph
from .options import WEIGHT_MATCHING as STRATEGY  # noqa: F401 (re-exported: its registry entry)
from .options import WeightMatchingOptions


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
    same form as A's: both canonical when ``transform_class`` is orthogonal)."""
    vgraph = view_graph(graph, transform_class)
    views = WeightViews(vgraph, sd_a, sd_b)
    solve = space_solver(graph, transform_class)
    start = init if init is not None else anchor_init(views, graph.identity(), solve)
    transform, _ = descend(
        vgraph, sd_a, sd_b, solve, init=start, max_iter=max_iter, seed=seed, progress=progress, views=views
    )
    return transform


def run(pair: Pair, options: WeightMatchingOptions, progress: Progress | None) -> Alignment:
    with timed() as timings:
        transform = weight_matching(
            pair.graph, pair.sd_a, pair.sd_b, max_iter=options.max_iter, seed=options.seed, progress=progress
        )
        graph, transform, notes = permutation_streams(pair, transform, options, progress)
    return Alignment(
        "weight-matching", graph, pair.sd_a, pair.sd_b, transform, exact=not notes, notes=notes, timings=timings
    )
