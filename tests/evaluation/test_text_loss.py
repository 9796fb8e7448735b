"""Text files are scored on the text they hold, line breaks included.

The end point (λ = 1, model A) of a barrier run through the real CLI must equal the loss plain
transformers gives on the same file: tokenize the whole text, cut it into consecutive blocks of the
block size hf-rebasin uses (the last partial block kept when it holds two tokens or more), and take
the token-weighted mean of ``model(input_ids=block, labels=block).loss``. A ``.jsonl`` and a
``.csv`` holding the same text (one record per paragraph, each keeping its line breaks, records
joined with nothing between them as run_clm joins them) must give the same loss.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml

from helpers import run_cli
from hf_rebasin.evaluation import data
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.run.data import MAX_BLOCK

TOLERANCE = 0.005  # relative


@pytest.fixture(scope="module")
def zoo() -> tuple[Path, Path]:
    """The two zoo GPT-2s (trained on first use, cached afterwards)."""
    return train.cached_model("gpt2", 0), train.cached_model("gpt2", 1)


@pytest.fixture(scope="module")
def text() -> str:
    """Held-out Shakespeare, line-broken as the zoo GPT-2 was trained on it (speeches apart by a blank line)."""
    return data.shakespeare_text(["hamlet"], split="test")[:6000]


def plain_transformers_loss(folder: Path, text: str, block: int | None = None) -> float:
    """Token-weighted mean loss of the model in ``folder`` on ``text`` in blocks of ``block`` tokens
    (default: hf-rebasin's), computed by transformers alone."""
    tokenizer = T.AutoTokenizer.from_pretrained(str(folder))
    model = T.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    block = block or min(MAX_BLOCK, model.config.n_positions)
    ids = tokenizer(text)["input_ids"]
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), block):
            chunk = ids[start : start + block]
            if len(chunk) < 2:
                continue  # one token predicts nothing
            x = torch.tensor([chunk])
            total += float(model(input_ids=x, labels=x).loss) * (len(chunk) - 1)
            count += len(chunk) - 1
    return total / count


def _paragraphs(text: str) -> list[str]:
    """``text`` cut after every blank line: each piece keeps its own line breaks, so they join back into ``text``."""
    pieces = [p for p in re.split(r"(?<=\n\n)", text) if p]
    assert "".join(pieces) == text and len(pieces) > 10
    return pieces


def _end_point_losses(tmp_path: Path, zoo: tuple[Path, Path], sections: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The λ = 1 (model A) loss of a barrier run per data section, each recipe run by the CLI's `main`
    (one process for all: the imports are paid once)."""
    paths = []
    for name, section in sections.items():
        recipe = {
            "job": "barrier",
            "models": [str(zoo[0]), str(zoo[1])],
            "strategy": "vanilla",
            "evaluate": {"task": "causal-lm", "data": section, "points": 2, "compare": []},
            "output": {"dir": f"out-{name}"},
        }
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    code = "import sys; from hf_rebasin.cli import main; sys.exit(max(main([p]) for p in sys.argv[1:]))"
    env = {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds-cache")}
    proc = run_cli(*map(str, paths), code=code, env=env)
    assert proc.returncode == 0, proc.stderr
    out = {}
    for name in sections:
        curve = json.loads((tmp_path / f"out-{name}" / "rebasin.json").read_text(encoding="utf-8"))["curves"]["vanilla"]
        out[name] = float(curve["loss"][curve["lambdas"].index(1.0)])  # λ = 1 is model A
    return out


@pytest.mark.slow  # trains the two zoo GPT-2s on an empty cache (about 2 minutes)
def test_txt_jsonl_csv_score_the_text_as_transformers_does(tmp_path: Path, zoo: tuple[Path, Path], text: str) -> None:
    expected = plain_transformers_loss(zoo[0], text)
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    pieces = _paragraphs(text)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces), encoding="utf-8")
    with (tmp_path / "corpus.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        writer.writerows([p] for p in pieces)
    sections = {
        "txt": {"dataset": "text", "data_files": "corpus.txt"},
        "jsonl": {"dataset": "json", "data_files": "corpus.jsonl"},
        "csv": {"dataset": "csv", "data_files": "corpus.csv"},
        "txt-block-24": {"dataset": "text", "data_files": "corpus.txt", "block_size": 24},
    }
    got = _end_point_losses(tmp_path, zoo, sections)
    short = plain_transformers_loss(zoo[0], text, block=24)
    print(
        f"plain transformers {expected:.4f} nats ({short:.4f} in 24-token blocks); hf-rebasin "
        + ", ".join(f"{k} {v:.4f}" for k, v in got.items())
    )
    for name, loss in got.items():
        want = short if name == "txt-block-24" else expected
        assert abs(loss - want) <= TOLERANCE * want, (name, loss, want)
    assert short > expected * (1 + 2 * TOLERANCE)  # shorter context, higher loss: block_size was used
