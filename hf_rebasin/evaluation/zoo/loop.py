"""The training loop every zoo family shares: seeding and thread count, AdamW with warm-up and cosine
decay, the held-out score, and the folder written as ``save_pretrained`` writes it with its
``training.json`` record.

A family's module (`causal`, `masked`, `images`; `train` for the fine-tunes) says how its model is
built and what data it sees; it hands both to `_run` here, so every kind is trained, scored and
saved the same way and its weights depend only on its config, seed and thread count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.core.names import Kind, Task
from hf_rebasin.evaluation.evaluate import evaluate_loss
from hf_rebasin.evaluation.zoo.catalogue import (
    DEFAULT_CONFIGS,
    RECIPE_VERSION,
    TRAINING_FILE,
    GPT2TrainConfig,
    ImageTrainConfig,
    MaskedLMTrainConfig,
    Seq2SeqFineTuneConfig,
    Seq2SeqTrainConfig,
    TrainConfig,
    ViTTrainConfig,
    check_kind,
    config_hash,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Progress = Callable[[int, float], None]
_C = TypeVar("_C", GPT2TrainConfig, ViTTrainConfig)

# the loss a zoo kind is trained and scored with (every kind not named here is a causal LM)
TASKS: dict[Kind, Task] = {
    **{kind: "image-classification" for kind, config in DEFAULT_CONFIGS.items() if isinstance(config, ViTTrainConfig)},
    "bert": "masked-lm",
    **{kind: "masked-lm" for kind, config in DEFAULT_CONFIGS.items() if isinstance(config, MaskedLMTrainConfig)},
    **{
        kind: "image-classification" for kind, config in DEFAULT_CONFIGS.items() if isinstance(config, ImageTrainConfig)
    },
    **{
        kind: "seq2seq"
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, Seq2SeqTrainConfig | Seq2SeqFineTuneConfig)
    },
}


@contextlib.contextmanager
def _training_context(seed: int, threads: int | None) -> Iterator[None]:
    """Seed torch's RNG and pin the intra-op thread count, restoring both afterwards.

    One thread by default: these models are too small to gain much from more, and on a shared
    machine spinning OpenMP threads slow a step down ten-fold or worse. A fixed count also keeps
    the floating-point summation order, hence the weights, the same from run to run.
    """
    previous = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No transformers warnings or progress bars while the zoo trains and saves its own models.

    Library code does not print: progress goes to the caller's callback instead.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(level)


def _schedule(step: int, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak rate."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))


def _endless(make: Callable[[int], Iterator[dict[str, Tensor]]], seed: int) -> Iterator[dict[str, Tensor]]:
    """Epoch after epoch, each in a fresh order drawn from (seed, epoch)."""
    epoch = 0
    while True:
        yield from make(seed * 100_003 + epoch)
        epoch += 1


def _fit(
    model: torch.nn.Module,
    stream: Iterator[dict[str, Tensor]],
    *,
    steps: int,
    lr: float,
    warmup: int,
    weight_decay: float,
    progress: Progress | None,
) -> float:
    """AdamW on the model's own loss; returns the mean loss of the last 50 steps."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; not biases, norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, warmup, steps))
    model.train()
    recent: list[float] = []
    for step in range(steps):
        loss = model(**next(stream)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = float(loss.detach())
        recent = [*recent[-49:], value]
        if progress is not None:
            progress(step, value)
    model.eval()
    return sum(recent) / max(1, len(recent))


def _save(model: PreTrainedModel, out_dir: Path, record: dict[str, Any], processor: Any = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))  # safetensors by default
    if processor is not None:
        processor.save_pretrained(str(out_dir))
    (out_dir / TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out_dir


def _record(
    kind: Kind, seed: int, config: TrainConfig, seconds: float, train_loss: float, **held_out: Any
) -> dict[str, Any]:
    return {
        "kind": kind,
        "seed": seed,
        "config": dataclasses.asdict(config),
        "config_hash": config_hash(kind, config),
        "recipe_version": RECIPE_VERSION,
        "train_seconds": round(seconds, 2),
        "train_loss": train_loss,
        "held_out": held_out,
    }


def _run(
    kind: Kind,
    seed: int,
    cfg: TrainConfig,
    out_dir: Path,
    build: Callable[[], PreTrainedModel],
    epoch: Callable[[int], Iterator[dict[str, Tensor]]],
    held_out: Iterable[dict[str, Tensor]],
    *,
    progress: Progress | None,
    threads: int | None,
    processor: Any = None,
) -> Path:
    """Build (seeded), train, score on held-out data, save with a ``training.json`` record.

    ``processor`` (tokenizer or image processor) is saved beside the model, so a recipe can read
    data for it like for any user's folder.
    """
    losses: list[float] = []

    def track(step: int, loss: float) -> None:
        losses.append(loss)
        if progress is not None:
            progress(step, loss)

    with _quiet_transformers(), _training_context(seed, threads):
        model = build()
        start = time.perf_counter()
        train_loss = _fit(
            model,
            _endless(epoch, seed),
            steps=cfg.steps,
            lr=cfg.lr,
            warmup=cfg.warmup,
            weight_decay=cfg.weight_decay,
            progress=track,
        )
        seconds = time.perf_counter() - start
        task = TASKS.get(kind, "causal-lm")
        result = evaluate_loss(model, held_out, task)
        count = {"examples" if task == "image-classification" else "tokens": result.count}
        record = _record(kind, seed, cfg, seconds, train_loss, loss=result.loss, **count, **result.metric)
        record["train_curve"] = _tenths(losses)
        return _save(model, Path(out_dir), record, processor)


def _tenths(losses: list[float]) -> list[float]:
    """Mean training loss over each tenth of the steps: whether the loss had flattened by the end."""
    n = len(losses)
    cuts = [round(i * n / 10) for i in range(11)]
    return [round(sum(losses[a:b]) / (b - a), 4) for a, b in itertools.pairwise(cuts) if b > a]


def default_config(kind: Kind, cls: type[_C]) -> _C:
    """Zoo kind ``kind``'s default config, checked to be a ``cls``: a trainer called with a kind it
    does not train fails here rather than building the wrong model."""
    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, cls):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained from a {cls.__name__}")
    return default


def on_zoo_base(folder: Path, base: str, seed: int) -> Path:
    """``folder``'s adapter names its base as a recipe does (``zoo:KIND-seedN``), not a cache path."""
    adapter_config = folder / "adapter_config.json"
    written = json.loads(adapter_config.read_text())
    written["base_model_name_or_path"] = f"zoo:{base}-seed{seed}"
    adapter_config.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return folder
