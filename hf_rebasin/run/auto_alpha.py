"""``alpha: auto``: which α of the grid a transport saves, from each α's task gain and support cost.

Pure arithmetic on the trade-off's numbers (no model, no torch), kept apart from the job so the
rule can be read, tested and benchmarked on its own (`benchmarks/transport/bench_transport_zoo.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hf_rebasin.evaluation.scores import Choice


@dataclass(frozen=True)
class _Grid:
    """The grid's α with their gains and costs, and the budget: what every rule of `choose_alpha`
    reads, in one place so each rule is a short function."""

    alphas: Sequence[float]
    gains: Sequence[float]
    costs: Sequence[float]
    budget: float | None

    def pick(self, candidates: list[int], *key: Any) -> int:
        """The best of ``candidates`` by ``key``; ties go to the larger gain, then the smaller cost,
        then the smaller α."""
        gains, costs, alphas = self.gains, self.costs, self.alphas
        return min(candidates, key=lambda i: (*(k(i) for k in key), -gains[i], costs[i], alphas[i]))

    def choice(self, i: int, rule: str, reason: str) -> Choice:
        """The record's ``transport.chosen`` for the α at ``i``."""
        return Choice(
            alpha=float(self.alphas[i]),
            index=i,
            rule=rule,
            gain=float(self.gains[i]),
            cost=float(self.costs[i]),
            reason=reason,
            support_budget=self.budget,
        )


def choose_alpha(
    alphas: Sequence[float], gains: Sequence[float], costs: Sequence[float], budget: float | None = None
) -> Choice:
    """The α ``alpha: auto`` saves, from each α's task gain (L_task(B) − L_task(θ)) and support cost
    (L_sup(θ) − L_sup(B)). Only an α with a positive gain is eligible, and with ``budget`` only
    one whose cost is at most the budget:

    - ``budget``: the eligible α with the largest gain ("budget");
    - else an eligible α at no cost (cost ≤ 0) beats any that costs: the largest gain among them
      ("no-cost"); otherwise the largest gain per nat of cost, gain / cost ("ratio");
    - no α eligible: the α with the smallest support cost ("fallback"), and ``reason`` says what
      to change. An α whose gain or cost is not finite is never picked unless all are.

    Ties go to the larger gain, then the smaller cost, then the smaller α.
    """
    if not (len(alphas) == len(gains) == len(costs)) or not alphas:
        raise ValueError(f"{len(alphas)} alphas, {len(gains)} gains and {len(costs)} costs: give one of each per α")
    grid = _Grid(alphas, gains, costs, budget)
    n = range(len(alphas))
    finite = [i for i in n if math.isfinite(gains[i]) and math.isfinite(costs[i])]
    gaining = [i for i in finite if gains[i] > 0]
    eligible = [i for i in gaining if budget is None or costs[i] <= budget]
    if eligible:
        return _eligible(grid, eligible)
    return _fallback(grid, finite or list(n), finite, gaining)


def _eligible(grid: _Grid, eligible: list[int]) -> Choice:
    """The rules that pick among eligible α: "budget", else "no-cost", else "ratio"."""
    gains, costs, budget = grid.gains, grid.costs, grid.budget
    if budget is not None:
        i = grid.pick(eligible)
        return grid.choice(
            i,
            "budget",
            f"the largest task gain ({gains[i]:.4f} nats) whose support cost ({costs[i]:+.4f}) fits the budget "
            f"of {budget:g} nats",
        )
    free = [i for i in eligible if costs[i] <= 0]
    if free:
        i = grid.pick(free)
        return grid.choice(
            i, "no-cost", f"a task gain of {gains[i]:.4f} nats at no support cost ({costs[i]:+.4f}), the largest such"
        )
    i = grid.pick(eligible, lambda j: -gains[j] / costs[j])
    return grid.choice(
        i,
        "ratio",
        f"the best task gain per nat of support cost: {gains[i]:.4f} nats gained for {costs[i]:.4f} nats of "
        f"support cost ({gains[i] / costs[i]:.2f} per nat)",
    )


def _fallback(grid: _Grid, candidates: list[int], finite: list[int], gaining: list[int]) -> Choice:
    """No α eligible: the α of the smallest support cost, with why none qualified and what to change."""
    alphas, gains, costs, budget = grid.alphas, grid.gains, grid.costs, grid.budget
    i = grid.pick(candidates, lambda j: costs[j] if j in finite else math.inf)
    if not gaining:
        why = "no α of the grid lowers the task loss below B's"
        fix = (
            "the transport does not help this fine-tune on this target: try another strategy (generalized-orthogonal "
            "rotates the residual stream) or keep B"
        )
    else:
        cheapest = min(gaining, key=lambda j: costs[j])
        why = (
            f"no α that lowers the task loss keeps the support cost within the budget of {budget:g} nats "
            f"(the cheapest, α = {alphas[cheapest]:g}, costs {costs[cheapest]:+.4f})"
        )
        fix = f"raise `alpha.support_budget` to {costs[cheapest]:.4g} or more, or add smaller α to `alpha.auto`"
    return grid.choice(
        i, "fallback", f"{why}: saved the α of the smallest support cost ({costs[i]:+.4f}, gain {gains[i]:+.4f}); {fix}"
    )
