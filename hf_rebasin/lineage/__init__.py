"""Lineage: are two models of one family related, up to every symmetry hf-rebasin models?

`compare` gives one pair's verdict (same basis, related up to symmetry, independent) with its
statistic, p-value and the evidence per layer and space; `report` turns verdicts into
``lineage.json``, a table and a plot.
"""

from __future__ import annotations

from .compare import NULL_SIMILARITY, PairLineage, SpaceEvidence, Verdict, compare

__all__ = ["NULL_SIMILARITY", "PairLineage", "SpaceEvidence", "Verdict", "compare"]
