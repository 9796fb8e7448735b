"""The barrier report: a PNG of the loss curves and Markdown tables for the model card.

Plots are drawn on a bare `matplotlib.figure.Figure` with the Agg canvas, never through pyplot,
so the caller's backend and pyplot state are left alone and nothing needs a display.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_rebasin.evaluation.evaluate import Curve, barrier

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

    ``history`` is the curve `strategies.engines.learned.refine` records: the hard (projected) maps'
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


# ---------------------------------------------------------------------------------------------
# Transport: task gain against support cost

TRADEOFF_METHODS = {"naive": "naive B + α·τ", "transported": "B + α·π(τ)"}


def tradeoff(transport: Mapping[str, Any]) -> dict[str, Any] | None:
    """A transport's trade-off from its scores (``rebasin.json``'s ``transport``): for every α,
    task gain = L_task(B) − L_task(θ) and support cost = L_sup(θ) − L_sup(B), per method
    (``transported`` B + α·π(τ), ``naive`` B + α·τ), and the fine-tune's own point: its gain over
    A on the task, L_task(A) − L_task(A_ft), and its cost over A on the support data,
    L_sup(A_ft) − L_sup(A). None without support scores (nothing to weigh the gain against)."""
    task = transport.get("loss") or {}
    support = (transport.get("support") or {}).get("loss") or {}
    if "target" not in task or "target" not in support:
        return None
    b_task, b_support = float(task["target"]), float(support["target"])
    out: dict[str, Any] = {"alphas": [float(a) for a in transport.get("alphas") or []]}
    for method in TRADEOFF_METHODS:
        if method in task and method in support:
            out[method] = {
                "gain": [b_task - float(x) for x in task[method]],
                "cost": [float(x) - b_support for x in support[method]],
            }
    if all(k in scores for scores in (task, support) for k in ("base", "finetuned")):
        out["finetuned"] = {
            "gain": float(task["base"]) - float(task["finetuned"]),
            "cost": float(support["finetuned"]) - float(support["base"]),
        }
    return out


def _signed(x: float) -> str:
    return _num(x) if math.isnan(x) or math.isinf(x) else f"{x:+.4f}"


def tradeoff_table(transport: Mapping[str, Any], saved: float | None = None) -> str | None:
    """The trade-off as a Markdown table: one row per model (B, A, the fine-tune, then naive and
    transported per α) with its task and support loss, task gain and support cost (nats; B's
    for every row but the fine-tune's, which is over its own base A). ``saved``: the α written,
    its transported row marked. None without support scores."""
    points = tradeoff(transport)
    if points is None:
        return None
    task, support = transport["loss"], transport["support"]["loss"]
    u = LOSS_UNIT
    lines = [
        f"| model | α | task loss ({u}) | support loss ({u}) | task gain ({u}) | support cost ({u}) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| target B | — | {_num(float(task['target']))} | {_num(float(support['target']))} | 0 | 0 |",
    ]
    if "base" in task and "base" in support:
        lines.append(f"| old base A | — | {_num(float(task['base']))} | {_num(float(support['base']))} | — | — |")
    own = points.get("finetuned")
    gain, cost = (_signed(own["gain"]) + " (over A)", _signed(own["cost"]) + " (over A)") if own else ("—", "—")
    lines.append(
        f"| fine-tune A + τ | — | {_num(float(task['finetuned']))} | {_num(float(support['finetuned']))} "
        f"| {gain} | {cost} |"
    )
    for i, alpha in enumerate(points["alphas"]):
        for method, label in TRADEOFF_METHODS.items():
            if method not in points:
                continue
            if method == "transported" and saved is not None and alpha == saved:
                label = f"**this model**: {label}"
            p = points[method]
            lines.append(
                f"| {label} | {alpha:g} | {_num(float(task[method][i]))} | {_num(float(support[method][i]))} "
                f"| {_signed(p['gain'][i])} | {_signed(p['cost'][i])} |"
            )
    return "\n".join(lines) + "\n"


def plot_tradeoff(
    points: Mapping[str, Any],
    path: Path,
    *,
    title: str = "",
    saved: float | None = None,
    budget: float | None = None,
) -> Path:
    """Task gain (y) against support cost (x), both in nats over the target B, saved as a PNG: one
    line per method through its α (each point labelled with its α), B at the origin, the
    fine-tune's own point (its gain and cost over its base A) as a star, ``saved`` α ringed and
    ``budget`` (`alpha: auto`'s support budget) a dashed line. ``points`` is `tradeoff`'s result.
    Returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    alphas = [float(a) for a in points["alphas"]]
    methods = [m for m in TRADEOFF_METHODS if m in points]
    if not alphas or not methods:
        raise ValueError("no trade-off points to plot")
    fig = Figure(figsize=(6.4, 4.8), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.axvline(0.0, color="black", linewidth=0.6)
    ax.scatter([0.0], [0.0], marker="s", color="black", zorder=3, label="target B")
    if budget is not None:
        ax.axvline(budget, color="gray", linestyle="--", linewidth=1, label=f"support budget ({budget:g})")
    for method in methods:
        _plot_method(ax, method, alphas, points[method], saved)
    own = points.get("finetuned")
    if own is not None:
        _plot_own_finetune(ax, own)
    ax.set_xlabel(f"support cost: support loss − B's ({LOSS_UNIT}; right = forgets more)")
    ax.set_ylabel(f"task gain: B's task loss − task loss ({LOSS_UNIT}; up = better)")
    ax.set_title(title or "transport: task gain against support cost", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _plot_method(ax: Any, method: str, alphas: list[float], point: Mapping[str, Any], saved: float | None) -> None:
    """One method's line of `plot_tradeoff` through its α in increasing order, each point labelled
    with its α, and the ``saved`` α ringed on the transported line: the α a run chose stands out."""
    markers = {"naive": "s", "transported": "o"}
    cost, gain = point["cost"], point["gain"]
    order = sorted(range(len(alphas)), key=alphas.__getitem__)  # the line runs along α
    (line,) = ax.plot(
        [cost[i] for i in order],
        [gain[i] for i in order],
        marker=markers[method],
        markersize=5,
        linewidth=1.5,
        label=TRADEOFF_METHODS[method],
    )
    for i in order:
        ax.annotate(
            f"α={alphas[i]:g}",
            (cost[i], gain[i]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=7,
            color=line.get_color(),
        )
    if method == "transported" and saved is not None and saved in alphas:
        i = alphas.index(saved)
        ax.scatter([cost[i]], [gain[i]], s=160, facecolors="none", edgecolors="black", zorder=4, label="saved")


def _plot_own_finetune(ax: Any, own: Mapping[str, Any]) -> None:
    """The fine-tune's own point of `plot_tradeoff` (its gain and cost over its base A) as a labelled
    star, with a legend entry: what transport is measured against."""
    ax.scatter([own["cost"]], [own["gain"]], marker="*", s=180, color="tab:red", zorder=4)
    ax.annotate(
        "fine-tune on A",
        (own["cost"], own["gain"]),
        textcoords="offset points",
        xytext=(6, -10),
        fontsize=7,
        color="tab:red",
    )
    ax.plot([], [], marker="*", linestyle="", color="tab:red", markersize=10, label="fine-tune's own (over A)")
