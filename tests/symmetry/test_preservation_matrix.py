"""benchmarks/symmetry/preservation_matrix.py on two small factories: one row per (model, class), every row
within tolerance, every applicable negative control far above it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "symmetry"))

import preservation_matrix as pm

MODELS = ("gpt2", "llama-gqa")


def _table(text: str, heading: str) -> list[list[str]]:
    """The body rows of the Markdown table after ``heading`` (cells stripped)."""
    blocks = text.split(heading, 1)[1].split("\n\n")
    block = next(b.strip() for b in blocks if b.strip().startswith("|"))
    lines = block.splitlines()[2:]  # after the header and the separator
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def test_matrix_and_negative_controls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "matrix.json"
    assert pm.main(["--only", *MODELS, "--seeds", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = _table(text, "## Function preservation")
    assert [(r[0], r[2]) for r in rows] == [(m, c) for m in MODELS for c in pm.CLASSES]
    assert all(r[-1] == "yes" for r in rows), rows
    residual = {(r[0], r[2]): r[3] for r in rows}
    assert residual["gpt2", "orthogonal"] == "orthogonal (fixing 1)"
    assert residual["gpt2", "signed-permutation"] == "permutation"  # LayerNorm: a sign flip moves 1
    assert residual["llama-gqa", "signed-permutation"] == "signed-permutation"
    assert residual["llama-gqa", "orthogonal"] == "orthogonal"

    controls = _table(text, "## Negative controls")
    assert {(c[0], c[1]) for c in controls} == {
        ("gpt2", "residual rotation"),  # centered: a rotation must fix 1
        ("gpt2", "mlp rotation"),
        ("gpt2", "residual signs"),
        ("llama-gqa", "mlp rotation"),
        ("llama-gqa", "qk rotation"),  # rotary: only plane rotations
    }
    assert all(c[-1] == "yes" for c in controls), controls

    data = json.loads(out.read_text())
    assert data["seeds"] == [0] and len(data["rows"]) == len(MODELS) * len(pm.CLASSES)
    for row in data["rows"]:
        assert len(row["deltas"]) == 1 and row["max_delta"] <= pm.TOLERANCE, row
    for control in data["controls"]:
        assert control["deltas"] and all(d is not None and d > pm.BROKEN for d in control["deltas"].values()), control
