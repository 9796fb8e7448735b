"""rebasin.json as real runs write it, read back with `RunRecord.from_json`: a merge (a universe merge,
scored with a vanilla comparison), a barrier, a transport (support data, ``alpha: auto``) and an
align run on tiny GPT-2, each round-tripping to the very JSON written, and each folder's card
rendered again from its rebasin.json alone has the lines of the card the run wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import tiny
from helpers import run_main
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from hf_rebasin.evaluation.record import RunRecord
from hf_rebasin.evaluation.scores import Preservation, Transport, Universe
from hf_rebasin.run.card import render_card
from hf_rebasin.run.record import shown_recipe_text

EVALUATE = {
    "task": "causal-lm",
    "data": {"dataset": "text", "data_files": "task.txt", "max_tokens": 512},
    "points": 3,
    "compare": ["vanilla"],
}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three tiny GPT-2 of different seeds with one character tokenizer, and two text files."""
    root = tmp_path_factory.mktemp("record-runs")
    text = shakespeare_text(["hamlet"])[:3000].lower()
    tok = char_tokenizer(text)
    for seed in range(3):
        tiny.gpt2(seed).save_pretrained(str(root / f"gpt2-{seed}"))
        tok.save_pretrained(str(root / f"gpt2-{seed}"))
    (root / "task.txt").write_text(text[:1500], encoding="utf-8")
    (root / "support.txt").write_text(text[1500:], encoding="utf-8")
    return root


def _run(project: Path, name: str, body: dict[str, Any]) -> tuple[dict[str, Any], RunRecord]:
    """Run the recipe in process; rebasin.json as written, and as read back."""
    path = project / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**body, "output": {"dir": name}}, sort_keys=False), encoding="utf-8")
    proc = run_main(str(path), env={"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(project / "ds")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data: dict[str, Any] = json.loads((project / name / "rebasin.json").read_text(encoding="utf-8"))
    record = RunRecord.from_json(data)
    assert record.to_json() == data  # the same keys, values and absent keys, nothing lost or added
    text = shown_recipe_text(path.read_text(encoding="utf-8")).rstrip("\n")
    card = render_card(data, recipe_text=text, command=f"hf-rebasin {path.name}")
    written = (project / name / "README.md").read_text(encoding="utf-8")
    # the card needs the record only: the same lines (the strategy's options follow the file's sorted keys)
    assert sorted(card.splitlines()) == sorted(written.splitlines())
    return data, record


def test_a_universe_merge_record_round_trips(project: Path) -> None:
    body = {
        "job": "merge",
        "models": ["./gpt2-0", "./gpt2-1", "./gpt2-2"],
        "strategy": "weight-matching",
        "merge": {"universe": {"iterations": 2}},
        "evaluate": EVALUATE,
    }
    data, record = _run(project, "merge", body)
    found = record.findings
    assert isinstance(found.universe, Universe) and found.universe.reference is not None
    assert set(found.merged) == {"weight-matching", "vanilla"} and found.merged["vanilla"].count
    assert isinstance(found.function_preserved, Preservation) and found.function_preserved.max_abs_diff is not None
    assert "transport" not in data and data["merge_weights"] == found.merge_weights


def test_a_barrier_record_round_trips(project: Path) -> None:
    body = {"job": "barrier", "models": ["./gpt2-0", "./gpt2-1"], "strategy": "weight-matching", "evaluate": EVALUATE}
    data, record = _run(project, "barrier", body)
    assert data["merge_weights"] is None and data["merged"] == {} and "universe" not in data
    assert set(record.findings.curves) == {"weight-matching", "vanilla"}


def test_a_transport_record_round_trips(project: Path) -> None:
    body = {
        "job": "transport",
        "base": "./gpt2-0",
        "finetuned": "./gpt2-1",
        "target": "./gpt2-2",
        "strategy": "weight-matching",
        "alpha": {"auto": [1.0, 0.5]},
        "calibrate": False,
        "evaluate": {**EVALUATE, "support": {"dataset": "text", "data_files": "support.txt", "max_tokens": 512}},
    }
    data, record = _run(project, "transport", body)
    moved = record.findings.transport
    assert isinstance(moved, Transport) and moved.alphas == [1.0, 0.5]
    assert moved.loss is not None and moved.loss.naive is not None and moved.support is not None
    assert moved.tradeoff is not None and moved.chosen is not None and moved.chosen.alpha in moved.alphas
    assert not {"merged", "merge_weights", "universe"} & set(data)


def test_an_align_record_round_trips(project: Path) -> None:
    body = {"job": "align", "models": ["./gpt2-0", "./gpt2-1"], "strategy": "weight-matching"}
    _, record = _run(project, "align", body)
    preserved = record.findings.function_preserved
    assert preserved is not None and preserved.written is not None and set(preserved.written) == {"A", "B"}
    assert all(g.max_abs_diff is not None and g.max_abs_diff <= (g.tolerance or 0) for g in preserved.written.values())
