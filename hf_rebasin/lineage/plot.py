"""The per-layer lineage plot: bulk similarity of every layer's spaces, aligned and as stored, one
panel per pair, with the null's level drawn. Agg canvas on a bare Figure (no pyplot state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hf_rebasin.lineage.record import LineageRecord

__all__ = ["plot_lineage"]


def plot_lineage(record: LineageRecord, path: Path, null: float) -> Path:
    """One panel per pair: x the layer, y the bulk similarity, a line per kind of space."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    pairs = record.pairs
    fig = Figure(figsize=(6.4, 3.2 * len(pairs)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(pairs), 1, squeeze=False)[:, 0]
    names = [m.given for m in record.models]
    for ax, pair in zip(axes, pairs, strict=True):
        kinds: dict[str, list[tuple[int, float, float]]] = {}
        for s in pair.spaces:
            if s.layer is None:
                continue
            kind = s.space.replace(str(s.layer), "#", 1)
            kinds.setdefault(kind, []).append((s.layer, s.similarity, s.raw_similarity))
        for kind, points in sorted(kinds.items()):
            points.sort()
            xs = [p[0] for p in points]
            line = ax.plot(xs, [p[1] for p in points], marker="o", markersize=4, label=f"{kind}, aligned")[0]
            ax.plot(xs, [p[2] for p in points], marker="x", markersize=4, linestyle=":", color=line.get_color())
        ax.axhline(null, color="grey", linestyle="--", linewidth=1, label=f"null level ({null:g})")
        ax.set_ylim(-0.1, 1.05)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("bulk similarity")
        ax.set_title(_title(names, pair.a, pair.b, pair.verdict), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def _title(names: Sequence[str], a: int, b: int, verdict: str) -> str:
    return f"{names[a]} vs {names[b]}: {verdict} (dotted: as stored)"
