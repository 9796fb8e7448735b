"""Cost of a barrier sweep against the forward passes it must do.

    python benchmarks/cost/bench_sweep.py                     # tiny random GPT-2, 21 points
    python benchmarks/cost/bench_sweep.py --layers 4 --embd 256 --profile

A 21-point `loss_curve` should cost little more than 21 evaluation passes over the same batches
(the requirement: ≤ 1.2 × 21 × one `evaluate_loss`); everything else it does (interpolating the
state dicts, loading them into the model) is overhead. Prints both times and the ratio, and with
``--profile`` (or when over the limit) the functions that take the time inside `loss_curve`.

On a shared machine single passes vary several-fold from one second to the next, so the sweep is
also timed against the evaluation passes *inside it* (``evaluate_loss`` wrapped with a timer while
the sweep runs): that in-run ratio sees the same load as the sweep and is the one judged.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_rebasin.evaluation import evaluate as ev
from hf_rebasin.evaluation.evaluate import evaluate_loss, lambdas, loss_curve

LIMIT = 1.2


def _model(seed: int, args: argparse.Namespace) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=args.vocab,
        n_embd=args.embd,
        n_layer=args.layers,
        n_head=4,
        n_positions=args.block,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


def _batches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.batches):
        ids = torch.randint(args.vocab, (args.batch_size, args.block), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--points", type=int, default=21)
    p.add_argument("--repeats", type=int, default=5, help="single passes timed (the median is used)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="profile loss_curve (always done when over the limit)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    model_a, model_b = _model(0, args), _model(1, args)
    sd_a = {k: v.detach().clone() for k, v in model_a.state_dict().items()}
    sd_b = {k: v.detach().clone() for k, v in model_b.state_dict().items()}
    data = _batches(args)
    n_params = sum(p.numel() for p in model_a.parameters())
    tokens = args.batches * args.batch_size * args.block

    def single_passes(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            evaluate_loss(model_a, data, "causal-lm")
            times.append(time.perf_counter() - t0)
        return times

    evaluate_loss(model_a, data, "causal-lm")  # warm-up (allocator, kernels)
    # single passes are timed before and after the sweep: on a shared machine the load drifts
    before = single_passes((args.repeats + 1) // 2)
    lam = lambdas(args.points)
    inside: list[float] = []

    def timed(*a: Any, **k: Any) -> ev.EvalResult:
        t = time.perf_counter()
        result = evaluate_loss(*a, **k)
        inside.append(time.perf_counter() - t)
        return result

    ev.evaluate_loss = timed  # loss_curve looks the function up at call time
    try:
        t0 = time.perf_counter()
        loss_curve(model_a, sd_a, sd_b, data, "causal-lm", lam)
        sweep = time.perf_counter() - t0
    finally:
        ev.evaluate_loss = evaluate_loss
    singles = before + single_passes(args.repeats // 2 + 1)
    one = statistics.median(singles)
    ratio = sweep / (len(lam) * one)
    in_run = sweep / sum(inside)
    overhead = (sweep - sum(inside)) / len(lam)

    print(f"GPT-2: {args.layers} layers, d={args.embd}, vocab {args.vocab}, {n_params / 1e6:.2f} M parameters")
    print(f"data: {args.batches} batches × {args.batch_size} × {args.block} = {tokens} tokens; {args.threads} threads")
    print(
        f"one evaluate_loss pass (median of {len(singles)}, range {min(singles) * 1e3:.0f}–{max(singles) * 1e3:.0f}): {one * 1e3:.1f} ms"
    )
    print(f"{len(lam)}-point loss_curve: {sweep:.3f} s = {sweep / len(lam) * 1e3:.1f} ms per point")
    print(f"ratio sweep / ({len(lam)} × one pass timed apart): {ratio:.3f}")
    print(
        f"ratio sweep / its own {len(inside)} evaluate_loss passes: {in_run:.3f} (limit {LIMIT}) -> "
        f"{'OK' if in_run <= LIMIT else 'OVER'}; overhead {overhead * 1e3:.1f} ms per point "
        "(in-place interpolation of the weights)"
    )

    if args.profile or in_run > LIMIT:
        prof = cProfile.Profile()
        prof.enable()
        loss_curve(model_a, sd_a, sd_b, data, "causal-lm", lam)
        prof.disable()
        print("\nloss_curve profile (cumulative time, top 15):")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(15)


if __name__ == "__main__":
    main()
