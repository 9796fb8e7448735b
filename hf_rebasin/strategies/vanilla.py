"""Vanilla: no alignment. The baseline every report compares against."""

from __future__ import annotations

from .base import Alignment, Options, Pair, Progress, Strategy, timed


class VanillaOptions(Options):
    pass


def run(pair: Pair, options: VanillaOptions, progress: Progress | None) -> Alignment:
    with timed() as timings:
        transform = pair.graph.identity()
    return Alignment("vanilla", pair.graph, pair.sd_a, pair.sd_b, transform, timings=timings)


STRATEGY = Strategy(
    name="vanilla",
    paper="no alignment (plain weight averaging)",
    options=VanillaOptions,
    run=run,
    summary="identity transform: interpolate the weights as they are",
)
