"""Barrier report: the plot is a PNG drawn without pyplot, tables have one row per curve / point."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hf_rebasin.evaluation.evaluate import Curve, barrier, lambdas
from hf_rebasin.evaluation.report import curve_table, markdown_table, plot_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _curve(height: float, end_a: float = 2.0, end_b: float = 2.5, metric: str = "perplexity") -> Curve:
    lam = lambdas(21)
    loss = [x * end_a + (1 - x) * end_b + height * 4 * x * (1 - x) for x in lam]
    acc = [2.718281828**v for v in loss] if metric == "perplexity" else [1 / (1 + v) for v in loss]
    return Curve(lambdas=lam, losses=loss, metrics={metric: acc})


def test_plot_is_png_and_leaves_pyplot_alone(tmp_path: Path) -> None:
    had_pyplot = "matplotlib.pyplot" in sys.modules
    path = plot_curves(
        {"vanilla": _curve(1.5), "weight-matching": _curve(0.2)}, tmp_path / "out" / "barrier.png", title="GPT-2"
    )
    assert path == tmp_path / "out" / "barrier.png"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot
    with pytest.raises(ValueError, match="no curves"):
        plot_curves({}, tmp_path / "empty.png", title="nothing")


def test_markdown_table_one_row_per_curve() -> None:
    curves = {"vanilla": _curve(1.5, end_a=2.0, end_b=2.2), "head-perm": _curve(0.25), "a|b": _curve(0.0)}
    barriers = {name: barrier(c.lambdas, c.losses) for name, c in curves.items() if name != "a|b"}
    table = markdown_table(curves, barriers)
    lines = table.strip().splitlines()
    assert len(lines) == 2 + len(curves)
    head = lines[0]
    assert "midpoint barrier (nats)" in head and "linear barrier (nats)" in head and "perplexity at λ=½" in head
    vanilla = [c.strip() for c in lines[2].strip("|").split("|")]
    # the maximum is at λ=½ (2.1 + 1.5); midpoint and linear barrier both subtract the ends' mean 2.1
    assert vanilla == ["vanilla", "1.5000", "1.5000", "3.6000", f"{2.718281828**3.6:.4f}", "2.0000", "2.2000"]
    assert lines[4].startswith("| a\\|b | 0.2500 | 0.0000 |")  # computed when not given: B is 0.25 above the ends' mean


def test_markdown_table_mixed_metrics_and_missing_midpoint() -> None:
    odd = Curve(lambdas=[0.0, 0.4, 0.8, 1.0], losses=[1.0, 1.5, 1.25, 1.0], metrics={"accuracy": [0.9, 0.6, 0.7, 0.95]})
    table = markdown_table({"cls": odd, "lm": _curve(0.5)}, {})
    lines = table.strip().splitlines()
    assert "metric at λ=½" in lines[0]
    assert "accuracy 0.6000 (λ=0.40)" in lines[2] and "1.5000 (λ=0.40)" in lines[2]
    assert "perplexity" in lines[3]


def test_curve_table_lists_every_point() -> None:
    c = _curve(1.0, metric="accuracy")
    lines = curve_table(c).strip().splitlines()
    assert lines[0] == "| λ | loss (nats) | accuracy |"
    assert len(lines) == 2 + 21
    assert lines[2] == f"| 0.00 | 2.5000 | {1 / 3.5:.4f} |"
    assert lines[12].startswith("| 0.50 | 3.2500 |")
