"""Lineage: are two models of one family related, up to every symmetry hf-rebasin models?

`compare` gives one pair's verdict (same basis, related up to symmetry, shared embeddings,
independent) with its
statistic, p-value and the evidence per layer and space; `pairs.lineage_of` every pair of several
models, as ``lineage.json`` holds it (`record`); `table` and `plot` show it. Models of other depths
(pruned, up-scaled, stacked from two parents; an encoder-decoder stack by stack) are mapped layer by
layer: `depth` scores the layers,
`layermap` tests the map, `pairwise` runs the pairs and finds the stacks; `estimate` times a run.

Imports `core`, `symmetry`, `io`, `alignment` and below; never the recipe, the run or the CLI.
"""

from __future__ import annotations

from hf_rebasin.lineage.compare import NULL_SIMILARITY, PairLineage, Verdict, compare
from hf_rebasin.lineage.record import SpaceRecord

__all__ = ["NULL_SIMILARITY", "PairLineage", "SpaceRecord", "Verdict", "compare"]
