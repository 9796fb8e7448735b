"""Features for matching, in two independent halves.

Data-free weight views (``weights``): for a space and the current maps of its neighbours, the
cross correlation of A's and B's weights along the axes bound to it. They read two state dicts
and never run a model.

Activation statistics (``sites``, ``batches``, ``collector``, ``moments``, ``activations``): models
A and B see the same batches; forward hooks on the linear layers read each space's features at a
site derived from the graph (``sites``), masked to the positions that count (``batches``), a small
state machine (``collector.Collector``) pairs A's and B's features per batch, and float64 running
sums (``moments.CrossMoments``) keep memory O(d²) per space whatever the number of tokens, summed
over processes under ``accelerate launch`` (``activations.activation_stats`` drives it all).
"""

from __future__ import annotations

from hf_rebasin.alignment.features.activations import activation_stats
from hf_rebasin.alignment.features.collector import Collector, CollectorStateError, Phase
from hf_rebasin.alignment.features.moments import ActivationStats, CrossMoments
from hf_rebasin.alignment.features.sites import RESIDUAL_MODES, HookPlan, ResidualMode, Site, activation_sites
from hf_rebasin.alignment.features.weights import WeightViews, neighbours, spaces_of

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
