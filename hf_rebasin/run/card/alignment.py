"""The card's account of the alignment: the strategy (its paper, whether it aligns at all), the
barrier table and one sentence reading it, the merged model's scores, learned matching's curve,
the alignment diagnostics and function preservation.

Each reading is one sentence from the record; a record from another version or a damaged one gives
no sentence rather than a wrong one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hf_rebasin.evaluation.scores import Preservation, Score, Universe
from hf_rebasin.run.card.text import _cell, _float


def identity(name: str) -> bool:
    """Whether the strategy aligns nothing (its curve is the plain average); False for a name this
    version does not know (a record from a newer one)."""
    from hf_rebasin.alignment.strategies import REGISTRY

    return name in REGISTRY.names and REGISTRY.get(name).identity


def _identity_name() -> str:
    """The registered strategy that aligns nothing, as a recipe names it."""
    from hf_rebasin.alignment.strategies import REGISTRY

    return next(name for name in REGISTRY.names if REGISTRY.get(name).identity)


def _paper(name: str) -> str:
    """The strategy's paper from the registry; a record from a newer version may name an unknown one."""
    from hf_rebasin.alignment.strategies import get_strategy
    from hf_rebasin.core.errors import StrategyOptionError

    try:
        return get_strategy(name).paper
    except StrategyOptionError:
        return ""


def _curves(raw: Mapping[str, Any], strategy: str) -> dict[str, Any]:
    """``Curve`` objects from ``rebasin.json``'s ``curves``, the strategy's own curve first."""
    from hf_rebasin.evaluation.evaluate import Curve

    names = sorted(raw, key=lambda n: n != strategy)  # stable: the rest keep the record's order
    return {
        n: Curve(
            lambdas=[float(x) for x in raw[n]["lambdas"]],
            losses=[float(x) for x in raw[n]["loss"]],
            metrics={k: [float(x) for x in v] for k, v in (raw[n].get("metric") or {}).items()},
        )
        for n in names
    }


def _barrier_table(curves: Mapping[str, Any], barriers: Mapping[str, Mapping[str, float]]) -> str | None:
    if not curves:
        return None
    from hf_rebasin.evaluation.report import markdown_table

    return markdown_table(curves, barriers).rstrip("\n")


def _linear(curves: Mapping[str, Any], barriers: Mapping[str, Mapping[str, float]], name: str) -> float | None:
    if name in barriers and "linear" in barriers[name]:
        return float(barriers[name]["linear"])
    if name in curves:
        from hf_rebasin.evaluation.evaluate import barrier

        try:
            return barrier(curves[name].lambdas, curves[name].losses)["linear"]
        except ValueError:  # a curve without its end points has no barrier
            return None
    return None


def _barrier_reading(
    curves: Mapping[str, Any], barriers: Mapping[str, Mapping[str, float]], strategy: str
) -> str | None:
    """One sentence that reads the table: what alignment did to the linear barrier."""
    if not curves:
        return None
    ours = _linear(curves, barriers, strategy)
    if ours is None or not math.isfinite(ours):
        return None
    if identity(strategy):
        return f"The plain average (no alignment) has a linear barrier of {ours:.3f} nats."
    plain = next((name for name in curves if identity(name)), None)
    base = _linear(curves, barriers, plain) if plain is not None else None
    if base is None or not math.isfinite(base):
        return (
            f"`{strategy}` leaves a linear barrier of {ours:.3f} nats; add `{_identity_name()}` to "
            "`evaluate.compare` to see the barrier without alignment."
        )
    if ours == base:
        return f"`{strategy}` leaves the linear barrier unchanged at {ours:.3f} nats."
    verb = "lowers" if ours < base else "raises"
    change = ""
    if base > 0:
        pct = (ours - base) / base * 100
        change = f" ({'−' if pct < 0 else '+'}{abs(pct):.0f} %)"
    return f"`{strategy}` {verb} the linear barrier from {base:.3f} to {ours:.3f} nats{change}."


def _merged_scores(
    merged: Mapping[str, Score], strategy: str, universe: Universe | None = None
) -> list[dict[str, str]]:
    """Rows of the merged-model table: this merge first, then (universe) the merge it started
    from, then the unaligned average if scored."""
    scored = [(f"this model (`{strategy}`)", merged[strategy])] if strategy in merged else []
    if universe is not None and universe.reference is not None:
        before = f"every model aligned to A only (before the {universe.rounds} universe rounds)"
        scored.append((before, universe.reference))
    scored += [(f"the same weights without alignment (`{k}`)", v) for k, v in merged.items() if k != strategy]
    rows = []
    for name, score in scored:
        metric = ", ".join(f"{k} {float(v):.4f}" for k, v in score.metric.items()) or "—"
        rows.append({"model": _cell(name), "loss": f"{_float(score.loss):.4f}", "metric": _cell(metric)})
    return rows


def _alignment_reading(similarity: Mapping[str, Any] | None) -> str | None:
    """One sentence for ``alignment.png``: where matched features are least alike after alignment,
    and how much the alignment did on average; None when the record has no such diagnostics."""
    try:
        spaces = {str(e["space"]): (float(e["before"]), float(e["after"])) for e in (similarity or {})["spaces"]}
        measure = str((similarity or {}).get("measure") or "weight cosine").removesuffix(" of matched features")
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not spaces:
        return None
    name = min(spaces, key=lambda n: spaces[n][1])
    before, after = (round(x, 2) + 0.0 for x in spaces[name])  # + 0.0: no "-0.00"
    gain = sum(a - b for b, a in spaces.values()) / len(spaces)
    return (
        f"The alignment is weakest in `{_cell(name)}`: its matched features have a mean {measure} of "
        f"{after:.2f} after alignment ({before:.2f} before); over all {len(spaces)} spaces alignment raised "
        f"it by {gain:+.2f} on average."
    )


def _learned(history: Mapping[str, Any] | None) -> str | None:
    """One sentence on learned matching's curve (``learned.png``): where it started, where the kept
    maps are, after how much data, and why it stopped; None when it did not run."""
    if not history or not history.get("barrier"):
        return None
    try:
        unit = str(history.get("unit") or "steps")
        barriers = [float(v) for v in history["barrier"]]
        seen = [int(v) for v in history.get(unit) or history["steps"]]
        steps = [int(v) for v in history["steps"]]
    except (TypeError, ValueError, KeyError):
        return None  # a damaged record still renders a card
    best = min(range(len(barriers)), key=barriers.__getitem__)
    where = _cell(str(history.get("held_out") or "held-out data"))
    measure = _cell(str(history.get("measure") or "midpoint barrier"))
    text = (
        f"{measure[:1].upper()}{measure[1:]} on {where}: {barriers[0]:.4f} nats at the data-free start, "
        f"{barriers[best]:.4f} for the maps kept (step {steps[best]:,}, {seen[best]:,} {unit}), "
        f"over {steps[-1]:,} steps and {seen[-1]:,} {unit} in all."
    )
    if best == 0:
        text += " Training never beat the start, so the data-free maps were kept."
    return text


def _function_preserved(entry: Preservation | None, pair: str) -> str:
    if entry is None:
        return "Function preservation was not recorded for this run."
    if entry.max_abs_diff is None:
        return f"max |Δ logits| between {pair} was not measured: {entry.reason or 'no reason recorded'}."
    where = f" (on {entry.inputs})" if entry.inputs else ""
    tol = f", within the tolerance {entry.tolerance:.1e}" if entry.tolerance is not None else ""
    return f"max |Δ logits| between {pair}: {entry.max_abs_diff:.2e}{where}{tol}."
