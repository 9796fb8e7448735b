"""The alignment cache as one run uses it: on or off, keyed by the batching the run actually used,
hits and misses counted for rebasin.json, and every decision written down as a note."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_rebasin.alignment import cache
from hf_rebasin.alignment.strategies import Alignment, Pair, get_strategy
from hf_rebasin.evaluation.record import CacheStats
from hf_rebasin.io.gate import support_files
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.recipe import Recipe
from hf_rebasin.run.clock import Progress, noop
from hf_rebasin.run.data import BatchSpec
from hf_rebasin.run.resolve import ResolvedModel
from hf_rebasin.symmetry.graph import SymmetryGraph

__all__ = ["CacheUse", "RunCache"]


@dataclass
class RunCache:
    """The alignment cache for one run: its switch, notes for the report, hits and misses."""

    recipe: Recipe
    base_dir: Path
    notes: list[str]
    progress: Progress = noop
    stats: CacheStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = CacheStats(enabled=cache.enabled(self.recipe.cache))

    def use(
        self,
        reference: tuple[ResolvedModel, LoadedModel],
        other: ResolvedModel,
        strategy: str,
        options: Any,
        *,
        label: str,
        batching: BatchSpec | None,
        graph: SymmetryGraph | None = None,
    ) -> CacheUse | None:
        """The cache entry for aligning the model ``other`` resolved to, to ``reference`` (None:
        caching is off or pointless).

        ``batching`` is how the run cut the alignment data into batches (None: no data): the key
        holds it whole. ``label`` names the pair in notes ("B to A"); ``graph`` is the graph of the
        `Pair` when it is not the reference's."""
        # a strategy that aligns nothing (the identity) costs less to run than to read back
        if not self.stats.enabled or get_strategy(strategy).identity:
            return None
        ref_res, ref_lm = reference
        parsed = get_strategy(strategy).parse(options)
        spec = self.recipe.data
        try:
            data = None
            if spec is not None and batching is not None and get_strategy(strategy).needs_data(parsed):
                data = cache.data_identity(
                    spec.model_dump(mode="json"),
                    self.base_dir,
                    **batching.identity(),  # with A's config (in its identity): the batches exactly
                    processor=cache.files_identity(
                        [ref_lm.path / n for n in support_files(ref_lm.path)], base=ref_lm.path
                    ),
                )
            key = cache.alignment_key(
                ref_res,
                other,
                strategy,
                parsed,
                data=data,
                graph=graph if graph is not None else ref_lm.graph,
                progress=self.progress,
            )
        except OSError as e:  # a file that cannot be hashed: align without the cache
            self.notes.append(f"alignment cache not used: cannot hash the input files ({e})")
            return None
        return CacheUse(self, key, strategy, label)


@dataclass
class CacheUse:
    """One alignment's entry in the cache: read it, or write it after computing."""

    run: RunCache
    key: str
    strategy: str
    label: str
    hit: bool = False

    def read(self, pair: Pair, name: str) -> Alignment | None:
        """The cached alignment, or None on a miss (a note says why, when there is a reason)."""
        try:
            alignment = cache.read_alignment(self.key, pair, name)
        except cache.CacheMiss as miss:
            self.run.stats.misses += 1
            if miss.reason:
                self.run.notes.append(
                    f"cached alignment of {self.label} ({self.key[:12]}) not used: {miss.reason}; recomputed"
                )
            return None
        self.hit = True
        self.run.stats.hits += 1
        self.run.notes.append(f"{self.strategy} alignment of {self.label} read from the cache ({self.key[:12]})")
        return alignment

    def write(self, alignment: Alignment, pair: Pair) -> None:
        """Store a computed alignment; a cache that cannot be written is a note, not a failure."""
        try:
            cache.save_alignment(self.key, alignment, pair)
        except OSError as e:
            self.run.notes.append(f"alignment of {self.label} not cached: cannot write {cache.cache_dir()} ({e})")
