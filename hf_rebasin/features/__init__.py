"""Features for matching, in two independent halves.

Data-free weight views (``weights``): for a space and the current maps of its neighbours, the
cross correlation of A's and B's weights along the axes bound to it. They read two state dicts
and never run a model.

Activation statistics (``sites``, ``moments``, ``activations``): models A and B see the same
batches; forward hooks on the linear layers read each space's features at a site derived from the
graph (``sites``), a small state machine (``activations.Collector``) pairs A's and B's features per
batch, and float64 running sums (``moments.CrossMoments``) keep memory O(d²) per space whatever the
number of tokens, summed over processes under ``accelerate launch``.
"""

from __future__ import annotations

from .activations import (
    RESIDUAL_MODES,
    ActivationStats,
    Collector,
    CollectorStateError,
    HookPlan,
    Phase,
    ResidualMode,
    activation_stats,
)
from .moments import CrossMoments
from .sites import Site, activation_sites
from .weights import WeightViews, neighbours, spaces_of

__all__ = [
    "RESIDUAL_MODES",
    "ActivationStats",
    "Collector",
    "CollectorStateError",
    "CrossMoments",
    "HookPlan",
    "Phase",
    "ResidualMode",
    "Site",
    "WeightViews",
    "activation_sites",
    "activation_stats",
    "neighbours",
    "spaces_of",
]
