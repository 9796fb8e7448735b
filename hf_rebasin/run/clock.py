"""Progress reports and the stage clock: every second a run spends is counted in one place."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hf_rebasin.core.lazy import give_back_freed

__all__ = ["STAGES", "Progress", "StageClock", "noop"]

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: the CLI turns each stage into a progress bar (total 0: unknown)."""

STAGES = ("load", "align", "evaluate", "save")  # rebasin.json's ``timings``; ``train`` only when a zoo model trains,
# ``check`` when the function-preservation check runs (forward passes of B and aligned B), ``calibrate``
# when a transport calibrates


def noop(stage: str, done: int, total: int) -> None:
    """A progress callback that reports nothing (the Python API without a callback)."""
    return None


class StageClock:
    """Seconds per stage (``rebasin.json``'s ``timings``), added up over every ``with clock.stage(...)``.

    One clock replaces hand-timed ``perf_counter`` pairs: a stage entered twice (each alignment,
    each curve) accumulates, and no stage can be forgotten or counted twice.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block into ``name`` (a new name, such as ``train``, is added after the others).

        Each stage starts with the heap its predecessor freed given back (`give_back_freed`), so a
        run's peak is its largest stage's, not the sum of every stage's leftovers."""
        give_back_freed()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
