"""The assignment solvers against scipy's dense `linear_sum_assignment`: `lap` (with its O(n²)
shortcut for scores whose row maxima are strict and distinct) returns the same permutation, and
`lap_sparse` the exact optimum on a related pair's scores and within 1 % of it on unrelated ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from hf_rebasin.alignment.solvers import lap, lap_sparse


def _scores(kind: str, n: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    if kind == "related":  # a permutation under noise: B's units are A's, moved
        s = 0.5 * g.standard_normal((n, n))
        s[np.arange(n), g.permutation(n)] += 1.0
        return s
    if kind == "random":
        return g.standard_normal((n, n))
    if kind == "low-rank":  # unrelated signals: a weight view of rank-16 factors
        return g.standard_normal((n, 16)) @ g.standard_normal((16, n))
    return np.ones((n, n))  # ties everywhere


def _scipy(s: np.ndarray) -> tuple[np.ndarray, float]:
    rows, cols = linear_sum_assignment(s, maximize=True)
    return cols[np.argsort(rows)], float(s[rows, cols].sum())


@pytest.mark.parametrize("kind", ["related", "random", "low-rank", "ties"])
@pytest.mark.parametrize("n", [3, 64, 700])
def test_lap_is_scipys_assignment(kind, n):
    s = _scores(kind, n)
    perm, value = lap(torch.from_numpy(s))
    want, best = _scipy(s)
    assert value == pytest.approx(best, rel=1e-12, abs=1e-9)
    if kind != "ties":  # ties: any optimum
        np.testing.assert_array_equal(perm.numpy(), want)


@pytest.mark.parametrize("kind", ["related", "random", "low-rank"])
def test_lap_sparse_is_a_permutation_at_most_1_percent_below_the_optimum(kind):
    s = _scores(kind, 1000, seed=3)
    perm, value = lap_sparse(torch.from_numpy(s), candidates=32, smallest=256)
    assert sorted(perm.tolist()) == list(range(1000))
    assert value == pytest.approx(float(s[np.arange(1000), perm.numpy()].sum()))
    want, best = _scipy(s)
    if kind == "related":
        np.testing.assert_array_equal(perm.numpy(), want)
    assert value >= best - 0.01 * abs(best)
