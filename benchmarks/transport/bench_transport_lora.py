"""A zoo LoRA adapter moved onto another base by `hf-rebasin transport`, scored as a user loads it.

For each data-free strategy, a recipe moves ``<kind>-ft-lora`` of seed A (an adapter on ``<kind>``
seed A) onto ``<kind>`` seed B with ``calibrate: false`` (``--calibrate``: then distilled from the
fine-tune on the sources of its training split, never the held-out text scored here); the written
adapter is loaded with PEFT on B's stock model (``AutoModelForSeq2SeqLM`` or ``AutoModelForCausalLM``) and scored on the fine-tune's
held-out text (the task) and B's (the support), as the zoo scores them. The naive row applies the
adapter unmoved. Gap closed = (L_B − L_moved) / (L_B − L_fine-tune on A), on the task.

    python benchmarks/transport/bench_transport_lora.py --kind bench-t5 --pairs 0:1
    python benchmarks/transport/bench_transport_lora.py --kind bench-t5 --pairs 0:1 --calibrate
    python benchmarks/transport/bench_transport_lora.py --kind bench-gpt2 --pairs 0:1 0:2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "alignment"))  # bench_barriers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # calibration_recipe
from bench_barriers import first_tokens
from calibration_recipe import calibrate_section, transport_body

from hf_rebasin.evaluation.evaluate import evaluate_loss, task_of
from hf_rebasin.evaluation.zoo.train import cached_model, held_out_batches

STRATEGIES = ("vanilla", "weight-matching", "transfusion", "generalized-orthogonal")


def _base(folder: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = AutoConfig.from_pretrained(str(folder)).is_encoder_decoder
    return (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(str(folder)).eval()


def _with_adapter(base: Path, adapter: Path) -> Any:
    import peft

    return peft.PeftModel.from_pretrained(_base(base), str(adapter)).eval()


def _moved(kind: str, seeds: tuple[int, int], strategy: str, root: Path, calibrate: bool) -> tuple[Path, float]:
    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run.pipeline import run_recipe

    adapter = cached_model(f"{kind}-ft-lora", seeds[0])  # type: ignore[arg-type]
    section = calibrate_section(adapter, root, calibrate)
    body = transport_body(kind, f"{kind}-ft-lora", seeds, strategy, root / strategy, section)
    recipe = root / f"{strategy}.yaml"
    recipe.write_text(yaml.safe_dump(body), encoding="utf-8")
    start = time.perf_counter()
    run_recipe(load_recipe(recipe))
    return root / strategy, time.perf_counter() - start


def pair_rows(kind: str, seeds: tuple[int, int], tokens: int, calibrate: bool = False) -> list[str]:
    a, b = (cached_model(kind, s) for s in seeds)  # type: ignore[arg-type]
    adapter = cached_model(f"{kind}-ft-lora", seeds[0])  # type: ignore[arg-type]
    task = first_tokens(held_out_batches(adapter, 32), tokens)
    support = first_tokens(held_out_batches(b, 32), tokens)

    def losses(model: Any) -> tuple[float, float]:
        scored = task_of(model.get_base_model() if hasattr(model, "get_base_model") else model)
        return evaluate_loss(model, task, scored).loss, evaluate_loss(model, support, scored).loss

    b_task, b_support = losses(_base(b))
    ft_task, _ = losses(_with_adapter(a, adapter))
    rows = [f"| {seeds[0]} → {seeds[1]} | target B | {b_task:.3f} | 0 % | {b_support:.3f} | |"]
    rows.append(f"| | fine-tune on A | {ft_task:.3f} | 100 % | | |")
    naive_task, naive_support = losses(_with_adapter(b, adapter))
    gap = b_task - ft_task
    rows.append(
        f"| | naive (unmoved) | {naive_task:.3f} | {100 * (b_task - naive_task) / gap:.0f} % | {naive_support:.3f} | |"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in STRATEGIES[1:]:
            folder, seconds = _moved(kind, seeds, strategy, Path(tmp), calibrate)
            t, s = losses(_with_adapter(b, folder))
            rows.append(f"| | {strategy} | {t:.3f} | {100 * (b_task - t) / gap:.0f} % | {s:.3f} | {seconds:.0f} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="bench-t5", choices=["bench-t5", "bench-t5-long", "bench-gpt2"])
    parser.add_argument("--pairs", nargs="+", default=["0:1"], help="A:B seed pairs (A's adapter moves)")
    parser.add_argument("--tokens", type=int, default=32768, help="held-out tokens scored per data set")
    parser.add_argument(
        "--calibrate", action="store_true", help="calibrate each moved adapter on its training split's sources"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        "| A → B | adapter on B | task loss | gap closed | support loss | run s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for pair in args.pairs:
        a, b = (int(s) for s in pair.split(":"))
        lines += pair_rows(args.kind, (a, b), args.tokens, args.calibrate)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
