"""The barrier report: a PNG of the loss curves and Markdown tables for the model card.

Plots are drawn on a bare `matplotlib.figure.Figure` with the Agg canvas, never through pyplot,
so the caller's backend and pyplot state are left alone and nothing needs a display.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .evaluate import Curve, barrier

LOSS_UNIT = "nats"


def _check(curves: Mapping[str, Curve]) -> None:
    if not curves:
        raise ValueError("no curves to report")
    for name, c in curves.items():
        if len(c.lambdas) != len(c.losses) or not c.lambdas:
            raise ValueError(f"curve {name!r} has {len(c.lambdas)} lambdas and {len(c.losses)} losses")


def metric_names(curves: Mapping[str, Curve]) -> list[str]:
    """The metrics of ``curves`` worth a plot panel of their own: all but the perplexities, which
    are the loss again on another scale."""
    names = dict.fromkeys(k for c in curves.values() for k in c.metrics)
    return [k for k in names if "perplexity" not in k]


def plot_curves(
    curves: Mapping[str, Curve],
    path: Path,
    *,
    title: str,
    ylabel: str = "loss (nats)",
    metrics: Sequence[str] = (),
) -> Path:
    """One line per curve, loss against λ (the weight on model A), saved as a PNG at ``path``.

    λ = 0 is model B (aligned), λ = 1 is model A; each evaluated λ carries a marker so a
    coarse sweep is not mistaken for a smooth one. ``metrics`` (names in the curves' metrics, e.g.
    the recipe's ``evaluate.metrics``) get a second panel below, one line per curve and metric.
    Returns ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    _check(curves)
    path = Path(path)
    shown = [m for m in metrics if any(m in c.metrics for c in curves.values())]
    fig = Figure(figsize=(6.4, 6.8 if shown else 4.0), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 1, 1) if shown else fig.add_subplot()
    markers = "osD^v<>ph*"
    for i, (name, c) in enumerate(curves.items()):
        ax.plot(c.lambdas, c.losses, marker=markers[i % len(markers)], markersize=4, linewidth=1.5, label=name)
    ax.set_xlabel("λ (weight on model A; 0 = B, 1 = A)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_xlim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend()
    if shown:
        low = fig.add_subplot(2, 1, 2, sharex=ax)
        styles = ["-", "--", ":", "-."]
        for i, (name, c) in enumerate(curves.items()):
            for j, m in enumerate(x for x in shown if x in c.metrics):
                low.plot(
                    c.lambdas,
                    c.metrics[m],
                    marker=markers[i % len(markers)],
                    linestyle=styles[j % len(styles)],
                    markersize=4,
                    linewidth=1.5,
                    label=f"{name}: {m}",
                )
        low.set_xlabel("λ (weight on model A; 0 = B, 1 = A)")
        low.set_ylabel("metric")
        low.grid(True, alpha=0.3)
        low.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _num(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:,.1f}" if abs(x) >= 1000 else f"{x:.4f}"


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


def _at(curve: Curve, lam: float) -> tuple[int, str]:
    """Index of the λ nearest ``lam`` and a note when it is not exactly ``lam``."""
    i = min(range(len(curve.lambdas)), key=lambda j: abs(curve.lambdas[j] - lam))
    return i, "" if curve.lambdas[i] == lam else f" (λ={curve.lambdas[i]:.2f})"


def _end(curve: Curve, lam: float) -> str:
    return _num(curve.losses[curve.lambdas.index(lam)]) if lam in curve.lambdas else "—"


def markdown_table(curves: Mapping[str, Curve], barriers: Mapping[str, Mapping[str, float]]) -> str:
    """One row per curve: both barriers, the loss and metric at λ = ½, and the losses of A and B.

    A curve missing from ``barriers`` gets its barriers computed from the curve itself. When λ = ½
    was not evaluated, the nearest λ is used and named in the cell.
    """
    _check(curves)
    names = {k for c in curves.values() for k in c.metrics}
    single = next(iter(names)) if len(names) == 1 else None
    metric_head = f"{single} at λ=½" if single else "metric at λ=½"
    u = LOSS_UNIT
    lines = [
        f"| curve | midpoint barrier ({u}) | linear barrier ({u}) | loss at λ=½ ({u}) | {metric_head} "
        f"| loss A, λ=1 ({u}) | loss B, λ=0 ({u}) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in curves.items():
        b = barriers.get(name)
        if b is None:
            b = barrier(c.lambdas, c.losses)
        i, note = _at(c, 0.5)
        if single:
            metric = _num(c.metrics[single][i]) if single in c.metrics else "—"
        else:
            metric = ", ".join(f"{k} {_num(v[i])}" for k, v in sorted(c.metrics.items())) or "—"
        cells = [
            _cell(name),
            _num(b["midpoint"]) if "midpoint" in b else "—",
            _num(b["linear"]) if "linear" in b else "—",
            _num(c.losses[i]) + note,
            metric + (note if metric != "—" else ""),
            _end(c, 1.0),
            _end(c, 0.0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def curve_table(curve: Curve) -> str:
    """Every point of one curve: λ, loss (nats) and each metric."""
    _check({"curve": curve})
    metrics = sorted(curve.metrics)
    lines = [
        "| λ | loss (nats) |" + "".join(f" {m} |" for m in metrics),
        "|---:|---:|" + "---:|" * len(metrics),
    ]
    for i, (lam, loss) in enumerate(zip(curve.lambdas, curve.losses, strict=True)):
        lines.append(f"| {lam:.2f} | {_num(loss)} |" + "".join(f" {_num(curve.metrics[m][i])} |" for m in metrics))
    return "\n".join(lines) + "\n"


def plot_learning(history: Mapping[str, Any], path: Path) -> Path:
    """Learned matching's held-out midpoint barrier against the data it trained on, saved as a PNG.

    ``history`` is the curve `strategies.learned.refine` records: the hard (projected) maps'
    barrier at every score, the soft maps' too when they trained soft, and the mean training loss
    between scores. The best score, the one kept, is marked.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    unit = str(history.get("unit") or "steps")
    x = list(history.get(unit) or history["steps"])
    hard = [float(v) for v in history["barrier"]]
    if not hard or len(x) != len(hard):
        raise ValueError(f"learning history has {len(x)} x values and {len(hard)} barriers")
    fig = Figure(figsize=(6.4, 4.0), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(x, hard, marker="o", markersize=4, linewidth=1.5, label="permutations rounded (kept maps)")
    soft = history.get("soft_barrier")
    if soft:
        ax.plot(x, [float(v) for v in soft], marker="s", markersize=3, linestyle="--", label="soft permutations")
    best = min(range(len(hard)), key=hard.__getitem__)
    ax.scatter([x[best]], [hard[best]], s=80, facecolors="none", edgecolors="black", zorder=3, label="best (kept)")
    ax.set_xlabel(f"{unit} trained on")
    measure = str(history.get("measure") or "midpoint barrier")
    ax.set_ylabel(f"{measure} ({LOSS_UNIT})")
    ax.set_title(f"learned matching on {history.get('held_out', 'held-out data')}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def plot_alignment(similarity: Mapping[str, Any], path: Path, *, title: str = "") -> Path:
    """One pair of bars per space: how alike matched features of A and B are before and after
    alignment (``diagnostics.feature_similarity``), saved as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    spaces = {str(e["space"]): e for e in similarity.get("spaces") or []}
    if not spaces:
        raise ValueError("no spaces to plot")
    names = list(spaces)
    x = list(range(len(names)))
    fig = Figure(figsize=(max(6.4, 0.45 * len(names) + 2), 4.2), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.4
    ax.bar([i - width / 2 for i in x], [spaces[n]["before"] for n in names], width, label="before (B as it is)")
    ax.bar([i + width / 2 for i in x], [spaces[n]["after"] for n in names], width, label="after alignment")
    ax.set_xticks(x, names, rotation=60 if len(names) > 8 else 0, ha="right" if len(names) > 8 else "center")
    ax.set_ylabel(str(similarity.get("measure", "similarity")))
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_title(title or "matched features of A and B, per space")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
