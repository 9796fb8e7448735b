"""Alignment strategies; each returns one map per space of model B in A's basis.

One explicit registry (no registration by import side effect). Every strategy has the same shape:
a pydantic options model and ``run(pair, options, progress) -> Alignment``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import generalized_orthogonal, head_perm, transfusion, vanilla, weight_matching
from .base import Alignment, AlignmentData, Options, Pair, Progress, Strategy, StrategyRegistry

REGISTRY = StrategyRegistry()
for _module in (vanilla, weight_matching, transfusion, head_perm, generalized_orthogonal):
    REGISTRY.register(_module.STRATEGY)


def get_strategy(name: str) -> Strategy:
    return REGISTRY.get(name)


def align(
    name: str,
    pair: Pair,
    options: Mapping[str, Any] | Options | None = None,
    progress: Progress | None = None,
) -> Alignment:
    """Bring model B of ``pair`` into model A's basis with strategy ``name``."""
    strategy = REGISTRY.get(name)
    return strategy.run(pair, strategy.parse(options), progress)


__all__ = [
    "REGISTRY",
    "Alignment",
    "AlignmentData",
    "Options",
    "Pair",
    "Progress",
    "Strategy",
    "align",
    "get_strategy",
]
