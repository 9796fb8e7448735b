"""Learned matching's variants that follow Theus et al.'s code, each measured alone against our
defaults in benchmarks/README.md: rotations read through their polar factor (gradient through the
projection), the identity straight-through gradient for permutations, and a linear warm-up."""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from scipy.optimize import linear_sum_assignment

import tiny
from hf_rebasin.alignment.solvers import polar
from hf_rebasin.alignment.strategies import Pair
from hf_rebasin.alignment.strategies.engines.learned import _lr_factor, refine
from hf_rebasin.alignment.strategies.engines.maps import LearnedMaps, LearnedSettings
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.transforms import AxisMap, ones_complement_basis


def _skew_exp(n: int, angle: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, n, generator=g, dtype=torch.float64)
    s = s - s.T
    return torch.linalg.matrix_exp(angle * s / torch.linalg.matrix_norm(s, 2))


def test_the_polar_factor_is_the_nearest_orthogonal_matrix_and_its_gradient_is_exact():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(6, 6, generator=g, dtype=torch.float64)
    u, _s, vh = torch.linalg.svd(m)  # an independent computation of U Vᵀ
    torch.testing.assert_close(polar(m), u @ vh)
    stack = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    rotation = _skew_exp(6, 0.5, 1)  # singular values all 1: autograd through an SVD divides by 0 here
    for x, centered in ((m, False), (stack, False), (m, True), (rotation, False)):
        x = x.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda t, c=centered: polar(t, fix_ones=c), (x,))
    centered = polar(m, fix_ones=True)
    torch.testing.assert_close(centered @ centered.T, torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(centered @ torch.ones(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64))
    # inside the complement of 1 it is the plain polar factor of the projected matrix
    q = ones_complement_basis(6)
    torch.testing.assert_close(q.T @ centered @ q, polar(q.T @ m @ q))


def _settings(**over) -> LearnedSettings:
    base = {"steps": 40, "lr": 0.05, "sinkhorn": False, "temperature": 0.05, "seed": 0, "eval_every": 10}
    return LearnedSettings(**{**base, **over})


def test_the_identity_straight_through_passes_the_gradient_to_the_scores_unchanged():
    model = tiny.FACTORIES["gpt2"](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 5, generator=g, requires_grad=True)
    upstream = torch.randn(5, 5, generator=g)
    for straight, expect_same in (("identity", True), ("sinkhorn", False)):
        maps = LearnedMaps(graph, graph.identity(), _settings(straight_through=straight))
        p = maps._permutation(scores, soft=False)
        best = torch.as_tensor(linear_sum_assignment(scores.detach().numpy(), maximize=True)[1])
        torch.testing.assert_close(
            p.detach(), torch.eye(5)[best], atol=1e-6, rtol=0
        )  # the forward pass is the Hungarian permutation
        scores.grad = None
        (p * upstream).sum().backward()
        assert torch.equal(scores.grad, upstream) == expect_same


def test_warm_up_rises_linearly_then_decays_on_the_cosine():
    rates = [_lr_factor(s, 100, 0.1) for s in range(100)]
    assert rates[:10] == pytest.approx([(s + 1) / 11 for s in range(10)])
    assert rates[10] == pytest.approx(1.0) and rates[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(x >= y for x, y in itertools.pairwise(rates[10:]))
    assert [_lr_factor(s, 100) for s in range(100)] == [_lr_factor(s, 100, 0.0) for s in range(100)]


ANGLE = 1.5


def _rotated_pair() -> tuple:
    """One batch of text, a tiny GPT-2 A fitted on it and B = A with its residual stream rotated (in
    canonical form): a known transform that a learned residual map must undo from the identity.
    Fitted once per test process (the fit is seeded, so every call would fit the same model); each
    caller gets its own copy, and the global RNG as the fit leaves it (for what the caller draws next)."""
    pair, rng = _rotated_pair_once()
    torch.set_rng_state(rng)
    return copy.deepcopy(pair)


@functools.cache
def _rotated_pair_once() -> tuple:
    from test_strategies import _fitted, _text_data

    data = _text_data(1)  # one batch, fitted and scored on: the search is tested, not generalisation
    a = _fitted("gpt2", data)
    cref, cgraph, untied = canonicalize(graph_for(a.config, a.state_dict().keys()), a.state_dict())
    n = cgraph.ref_size("res")
    q = ones_complement_basis(n)
    turn = q @ _skew_exp(n - 1, ANGLE, 2) @ q.T + torch.full((n, n), 1.0 / n, dtype=torch.float64)
    planted = {**cgraph.identity(), "res": AxisMap(n, blocks=turn[None])}
    cb = cgraph.apply(cref, planted)
    return (data, a, rebuild(a, cb, untie=bool(untied)), cgraph, cref, cb, untied), torch.get_rng_state()


@pytest.mark.parametrize("variant", [{}, {"rotations": "polar"}, {"warmup": 0.2}])
def test_each_variant_undoes_a_planted_residual_rotation(variant):
    data, a, model_b, cgraph, cref, cb, untied = _rotated_pair()
    n = cgraph.ref_size("res")  # learn the residual map only, from the identity (dense: a rotation)
    start = {"res": AxisMap(n, blocks=torch.eye(n, dtype=torch.float64)[None])}
    pair = Pair(cgraph, cref, cb, a, model_b, data)
    result = refine(pair, cgraph, cref, cb, start, untied, _settings(patience=0, lr=0.01, **variant), None)
    history = result.history
    assert history["best"] < 0.3 * history["barrier"][0], (variant, history["barrier"])
    res = result.transform["res"].matrix()
    torch.testing.assert_close(res @ res.T, torch.eye(res.shape[0], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        res @ torch.ones(res.shape[0], dtype=torch.float64),
        torch.ones(res.shape[0], dtype=torch.float64),
        atol=1e-6,
        rtol=0,
    )
