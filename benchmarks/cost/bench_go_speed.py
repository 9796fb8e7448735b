"""Seconds of generalized-orthogonal on two random GPT-2-small-shaped models (124M parameters,
nothing downloaded): the descent's solvers in turn, on worker threads, and with ``tol``.

    python benchmarks/cost/bench_go_speed.py                 # 12 layers, torch on 2 threads
    python benchmarks/cost/bench_go_speed.py --layers 4 --threads 1

Prints per run: seconds, rounds, seconds inside the solvers (LAP, SVD) and the matching objective
Σ⟨A, T(B)⟩, which the threads must leave as it is.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.alignment.strategies.engines import descent
from hf_rebasin.symmetry.adapters import graph_for


def run(pair: Pair, options: dict[str, Any], threads: bool) -> str:
    init = descent._SolverThreads.__init__

    def configured(self: descent._SolverThreads) -> None:
        init(self)
        if not threads:
            self.workers = 0

    descent._SolverThreads.__init__ = configured  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        alignment = align("generalized-orthogonal", pair, options)
        seconds = time.perf_counter() - start
    finally:
        descent._SolverThreads.__init__ = init  # type: ignore[method-assign]
    objective = descent.matching_objective(alignment.graph, alignment.sd_a, alignment.sd_b, alignment.transform)
    timings = alignment.timings
    return (
        f"{seconds:.1f} s, {timings.get('rounds')} rounds, solvers {timings.get('solver', 0.0):.1f} s, "
        f"objective {objective:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2, help="torch's threads")
    parser.add_argument("--tol", type=float, default=1e-3, help="the tol of the last run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=args.layers)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(GPT2LMHeadModel(config).eval())
    sd_a, sd_b = models[0].state_dict(), models[1].state_dict()
    pair = Pair(graph_for(config, sd_a.keys()), sd_a, sd_b)
    print(f"solvers in turn: {run(pair, {}, threads=False)}", flush=True)
    print(f"solvers on threads: {run(pair, {}, threads=True)}", flush=True)
    print(f"solvers on threads, tol {args.tol:g}: {run(pair, {'tol': args.tol}, threads=True)}", flush=True)


if __name__ == "__main__":
    main()
