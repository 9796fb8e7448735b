"""The coordinate descent solves spaces that share no tensor on worker threads while it builds the
next view, and stops rotating once a round gains little: both must leave results as they were."""

from __future__ import annotations

import itertools

import pytest
import torch

import tiny
from hf_rebasin.alignment.features import neighbours
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.alignment.strategies.engines import descent as D
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.transforms import HeadMap

CASES = {"gpt2": tiny.gpt2, "llama": tiny.llama, "bert": tiny.bert_mlm}


def _pair(case: str) -> Pair:
    a, b = CASES[case](0), CASES[case](1)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    return Pair(graph_for(a.config, sd_a.keys()), sd_a, sd_b)


def _same(t1: dict, t2: dict) -> bool:
    for name, m in t1.items():
        other = t2[name]
        parts = (
            [(m.kv_perm, other.kv_perm), (m.q_perm, other.q_perm), (m.qk, other.qk), (m.vo, other.vo)]
            if isinstance(m, HeadMap)
            else [(m.index, other.index), (m.blocks, other.blocks)]
        )
        for x, y in parts:
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                return False
    return True


def test_runs_hold_spaces_that_share_no_tensor_in_their_order() -> None:
    graph = _pair("gpt2").graph
    near = neighbours(graph)
    names = list(graph.spaces)
    runs = D.independent_runs(names, near)
    assert [n for run in runs for n in run] == names
    for run in runs:
        assert all(not (near[x] & set(run)) for x in run)
    for left, right in itertools.pairwise(runs):
        assert near[right[0]] & set(left)  # a run ends only where the next space needs it
    residual = [n for n, s in graph.spaces.items() if getattr(s, "kind", "") == "residual"]
    assert any(len(run) > 1 for run in runs) and all([r] in runs for r in residual)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strategy", ["weight-matching", "transfusion", "generalized-orthogonal"])
def test_solving_on_threads_gives_the_maps_solving_in_turn_gives(
    case: str, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = _pair(case)
    monkeypatch.setattr(D, "PIPELINE_MIN_ELEMENTS", 0)  # every view on a thread, tiny as they are
    threaded = align(strategy, pair, {})
    init = D._SolverThreads.__init__

    def in_turn(self: D._SolverThreads) -> None:
        init(self)
        self.workers = 0

    monkeypatch.setattr(D._SolverThreads, "__init__", in_turn)
    sequential = align(strategy, pair, {})
    assert _same(dict(threaded.transform), dict(sequential.transform))


def test_threads_are_used_and_large_views_are_solved_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D.os, "cpu_count", lambda: 8)
    seen: list[str] = []
    original = D._SolverThreads.submit

    def submit(self, name, view, solve, accept):  # type: ignore[no-untyped-def]
        original(self, name, view, solve, accept)
        seen.append("pipelined" if self.pending else "in turn")

    monkeypatch.setattr(D._SolverThreads, "submit", submit)
    with D._SolverThreads() as threads:
        assert threads.workers == 4 and threads.pool is None  # no thread before a view is worth one
    align("weight-matching", _pair("gpt2"), {})
    assert seen and set(seen) == {"in turn"}  # a tiny model's views are cheaper solved in turn
    monkeypatch.setattr(D, "PIPELINE_MIN_ELEMENTS", 0)
    seen.clear()
    align("weight-matching", _pair("gpt2"), {})
    assert "pipelined" in seen
    monkeypatch.setattr(D, "PIPELINE_MAX_ELEMENTS", 0)
    seen.clear()
    align("weight-matching", _pair("gpt2"), {})
    assert set(seen) == {"in turn"}
    monkeypatch.setattr(D.os, "cpu_count", lambda: 1)
    with D._SolverThreads() as threads:
        assert threads.workers == 0


def test_a_tolerance_stops_the_rotations_once_a_round_gains_little() -> None:
    pair = _pair("gpt2")
    full = align("generalized-orthogonal", pair, {"tol": 0.0, "iterations": 50})
    early = align("generalized-orthogonal", pair, {"tol": 0.1, "iterations": 50})
    assert early.timings["rounds"] < full.timings["rounds"]
    graph = full.graph
    kept = D.matching_objective(graph, early.sd_a, early.sd_b, early.transform)
    best = D.matching_objective(graph, full.sd_a, full.sd_b, full.transform)
    assert kept <= best + 1e-6 * abs(best) and kept >= 0.9 * best
