"""Vanilla: no alignment. The baseline every report compares against."""

from __future__ import annotations

from hf_rebasin.alignment.strategies.base import Alignment, Pair, Progress, timed
from hf_rebasin.alignment.strategies.options import VANILLA as STRATEGY  # noqa: F401 (re-exported: its registry entry)
from hf_rebasin.alignment.strategies.options import VanillaOptions


def run(pair: Pair, options: VanillaOptions, progress: Progress | None) -> Alignment:
    with timed() as timings:
        transform = pair.graph.identity()
    return Alignment("vanilla", pair.graph, pair.sd_a, pair.sd_b, transform, timings=timings)
