"""Time and memory of every strategy on full-size random pairs (BERT-base, GPT-2 small).

    python benchmarks/cost/bench_strategies.py                 # both models, all strategies (~15 min, 2 cores)
    python benchmarks/cost/bench_strategies.py --model gpt2 --layers 2   # quicker

Prints, per strategy: wall seconds, seconds inside the LAP/SVD solvers and their share, the peak
resident memory of the process and, beside it, the size of the two models' weights (each strategy
runs in a fresh process so peaks do not mix; building the random models also counts). Then the activation statistics:
time of the forward passes alone vs. the full collection, and the size of the statistics for two
numbers of tokens (it must not grow with them).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time
from typing import Any

import torch

STRATEGIES = ("weight-matching", "transfusion", "generalized-orthogonal")


def build(model: str, seed: int, layers: int | None) -> Any:
    import transformers as T

    torch.manual_seed(seed)
    if model == "bert":
        cfg = T.BertConfig() if layers is None else T.BertConfig(num_hidden_layers=layers)
        return T.BertForMaskedLM(cfg).eval()
    cfg = T.GPT2Config() if layers is None else T.GPT2Config(n_layer=layers)
    return T.GPT2LMHeadModel(cfg).eval()


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _run_strategy(model: str, layers: int | None, strategy: str, queue: Any) -> None:
    from hf_rebasin.alignment.strategies import Pair, align
    from hf_rebasin.symmetry.adapters import graph_for

    a, b = build(model, 0, layers), build(model, 1, layers)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    graph = graph_for(a.config, sd_a.keys())
    models_mb = sum(t.numel() * t.element_size() for sd in (sd_a, sd_b) for t in sd.values()) / 2**20
    start = time.perf_counter()
    alignment = align(strategy, Pair(graph, sd_a, sd_b))
    seconds = time.perf_counter() - start
    queue.put(
        {
            "strategy": strategy,
            "seconds": seconds,
            "solver": alignment.timings["solver"],
            "peak_mb": _rss_mb(),
            "models_mb": models_mb,
            "rounds": alignment.timings.get("rounds"),
        }
    )


def strategy_rows(model: str, layers: int | None, strategies: tuple[str, ...] = STRATEGIES) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    rows = []
    for strategy in strategies:
        queue = ctx.Queue()
        proc = ctx.Process(target=_run_strategy, args=(model, layers, strategy, queue))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{strategy} on {model} failed (exit code {proc.exitcode}); see the traceback above")
        rows.append(queue.get())
    return rows


def _batches(vocab: int, n: int, batch: int, length: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return out


def stats_rows(model: str, layers: int | None, batches: int, batch: int, length: int) -> dict[str, Any]:
    """Forward passes alone vs. activation statistics (all spaces, every residual site pooled)."""
    from hf_rebasin.alignment.features import activation_stats
    from hf_rebasin.symmetry.adapters import graph_for

    a, b = build(model, 0, layers), build(model, 1, layers)
    graph = graph_for(a.config, a.state_dict().keys())
    data = _batches(a.config.vocab_size, batches, batch, length)
    activation_stats(a, b, graph, data[:1])  # warm-up (allocator, kernels)
    start = time.perf_counter()
    with torch.no_grad():
        for x in data:
            a(**x)
            b(**x)
    forward = time.perf_counter() - start
    start = time.perf_counter()
    stats = activation_stats(a, b, graph, data)
    collect = time.perf_counter() - start
    half = activation_stats(a, b, graph, data[: max(1, batches // 2)])

    def size(s: Any) -> int:
        return sum(t.numel() * t.element_size() for m in s.moments.values() for t in m._fields())

    return {
        "tokens": stats.tokens,
        "forward_s": forward,
        "stats_s": collect,
        "ratio": collect / forward,
        "stats_mb": size(stats) / 2**20,
        "stats_mb_half_tokens": size(half) / 2**20,
        "keys": len(stats.moments),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("bert", "gpt2", "both"), default="both")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run (default: full size)")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--skip-strategies", action="store_true")
    args = parser.parse_args(argv)
    models = ("bert", "gpt2") if args.model == "both" else (args.model,)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for model in models:
        size = "full size" if args.layers is None else f"{args.layers} layers"
        if not args.skip_strategies:
            print(f"\n{model} ({size}), random pair, data-free strategies")
            print("| strategy | seconds | in LAP/SVD | share | peak RSS MB (both models) | rounds |")
            print("|---|---|---|---|---|---|")
            for r in strategy_rows(model, args.layers):
                print(
                    f"| {r['strategy']} | {r['seconds']:.1f} | {r['solver']:.1f} | {r['solver'] / r['seconds']:.0%} "
                    f"| {r['peak_mb']:.0f} ({r['models_mb']:.0f}) | {r['rounds'] or '-'} |"
                )
        s = stats_rows(model, args.layers, args.batches, args.batch, args.length)
        print(f"\n{model} ({size}), activation statistics over {s['tokens']} tokens, {s['keys']} keys")
        print(
            f"forward passes alone {s['forward_s']:.1f} s, with statistics {s['stats_s']:.1f} s "
            f"(ratio {s['ratio']:.2f}); statistics {s['stats_mb']:.0f} MB "
            f"({s['stats_mb_half_tokens']:.0f} MB with half the tokens)"
        )


if __name__ == "__main__":
    main()
