"""Alignment strategies; each returns one map per space of model B in A's basis.

One explicit registry (no registration by import side effect). Every strategy has the same shape:
a pydantic options model and registry entry in `options` (torch-free: recipes, the JSON Schema and
dry runs read them) and a module of its own whose ``run(pair, options, progress) -> Alignment``
does the work, imported when the strategy runs. The entry declares the strategy's capabilities
(`Strategy`: ``identity``, ``canonical``, ``memory``, ``universe_refinement``…): the rest of the
package asks those, never a strategy's name, so a strategy registered from outside (its module a
dotted name) is cached, estimated and compared like these. The optimisation machinery several
strategies share lives in `engines`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_rebasin.alignment.strategies.base import (
    Alignment,
    AlignmentData,
    MemoryProfile,
    Options,
    Pair,
    Progress,
    Refinement,
    Strategy,
    StrategyRegistry,
    UniverseMaps,
)
from hf_rebasin.alignment.strategies.options import (
    GENERALIZED_ORTHOGONAL,
    HEAD_PERM,
    TRANSFUSION,
    VANILLA,
    WEIGHT_MATCHING,
)

REGISTRY = StrategyRegistry()
for _strategy in (VANILLA, WEIGHT_MATCHING, TRANSFUSION, HEAD_PERM, GENERALIZED_ORTHOGONAL):
    REGISTRY.register(_strategy)


def get_strategy(name: str) -> Strategy:
    """The registered strategy ``name``; an unknown name is a user error listing the known ones."""
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
    "MemoryProfile",
    "Options",
    "Pair",
    "Progress",
    "Refinement",
    "Strategy",
    "StrategyRegistry",
    "UniverseMaps",
    "align",
    "get_strategy",
]
