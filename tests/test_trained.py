"""Trained models from different seeds: every alignment strategy lowers the loss barrier, and
generalized-orthogonal at least halves vanilla's linear barrier (slow: trains four tiny models on
first use, cached afterwards)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_barriers import barrier_table, markdown


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "vit"])
def test_alignment_lowers_the_barrier_of_models_trained_from_different_seeds(kind):
    rows = {r["strategy"]: r for r in barrier_table(kind)}
    print("\n" + markdown(kind, list(rows.values())))
    vanilla = rows.pop("vanilla")
    assert vanilla["linear"] > 0.05, "the two seeds should not be linearly connected before alignment"
    for name, row in rows.items():
        assert row["linear"] < vanilla["linear"], name
        assert row["midpoint"] < vanilla["midpoint"], name
    best_go = min(rows["generalized-orthogonal"]["linear"], rows["generalized-orthogonal + learned"]["linear"])
    assert best_go <= 0.5 * vanilla["linear"]
