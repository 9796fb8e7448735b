"""The transport benchmarks' recipes: the section that moves a zoo fine-tune, and with ``--calibrate``
the ``calibrate`` section that distills it on the fine-tune's *training* split (its sources, for an
encoder-decoder, noised as it was pretrained), never the held-out text the benchmarks score on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["calibrate_section", "transport_body"]

MAX_CHARS = 2_000_000  # of training text written for calibration: far more than `samples` blocks need


def calibrate_section(finetune: Path, work: Path, calibrate: bool) -> dict[str, Any] | bool:
    """``False`` (the data-free transport), or calibration on the training split of the text the zoo
    fine-tune in ``finetune`` was trained on (its ``training.json`` names the corpus), written to ``work``."""
    if not calibrate:
        return False
    from hf_rebasin.evaluation import data
    from hf_rebasin.evaluation.zoo.train import training_record

    cfg = training_record(finetune)["config"]
    plays = tuple(cfg["plays"]) if "plays" in cfg else None
    corpus = cfg.get("corpus", "shakespeare")
    path = Path(work) / f"calibrate-{corpus}-train.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data.corpus_text(corpus, plays, split="train")[:MAX_CHARS], encoding="utf-8")
    return {"data": {"dataset": "text", "data_files": str(path)}}


def transport_body(
    kind: str, finetune: str, seeds: tuple[int, int], strategy: str, output: Path, calibrate: dict[str, Any] | bool
) -> dict[str, Any]:
    """The recipe moving ``finetune`` (a zoo kind on ``kind`` seed A) onto ``kind`` seed B."""
    a, b = seeds
    return {
        "job": "transport",
        "base": f"zoo:{kind}-seed{a}",
        "finetuned": f"zoo:{finetune}-seed{a}",
        "target": f"zoo:{kind}-seed{b}",
        "strategy": strategy,
        "calibrate": calibrate,
        "output": {"dir": str(output)},
    }
