"""What one pass of weight matching costs on real-size models, space by space, and what a whole
pass would take: the residual stream, one layer's MLP units, one layer's heads, each timed as the
descent computes them (weight view read tensor by tensor from disk, then the solver).

    python benchmarks/scale/bench_descent_cost.py MODEL_A MODEL_B [--layers 0 15] [--device cpu]

MODEL_A and MODEL_B are local folders (``benchmarks/scale/bench_scale.py`` makes random ones of real
shapes). Prints a table of seconds per space (read + view, solve) and the projected pass:
residual + layers × (MLP + heads), which `hf-rebasin` with ``max_iter: 1`` should take.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch

from hf_rebasin.alignment.features import WeightViews
from hf_rebasin.alignment.solvers import solver_clock
from hf_rebasin.alignment.strategies.engines.descent import space_solver
from hf_rebasin.io.models import load_model, resolve_device
from hf_rebasin.symmetry.spaces import HeadSpace, Space


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def time_space(views: WeightViews, solve, name: str, transform) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(seconds building the view, seconds in the solver) for space ``name``."""
    start = time.perf_counter()
    view = views(transform, name)
    built = time.perf_counter() - start
    with solver_clock() as clock:
        solve(name, view)
    return built, clock.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_a", type=Path)
    parser.add_argument("model_b", type=Path)
    parser.add_argument("--layers", type=int, nargs="+", default=[0], help="layers whose spaces are timed")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = resolve_device(args.device, "--device")
    start = time.perf_counter()
    a = load_model(args.model_a, stream=True, device=device)
    b = load_model(args.model_b, stream=True, device=device)
    assert a.source is not None and b.source is not None, "safetensors checkpoints are streamed"
    opened = time.perf_counter() - start
    graph = a.graph
    views = WeightViews(graph, a.source, b.source)
    solve = space_solver(graph, "permutation")
    transform = graph.identity()
    residual = [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual"]
    heads = [n for n, s in graph.spaces.items() if isinstance(s, HeadSpace)]
    mlps = [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "mlp"]
    rows: list[tuple[str, float, float]] = []
    for name in residual:
        rows.append((name, *time_space(views, solve, name, transform)))
    for i in args.layers:
        for group in (mlps, heads):
            rows.append((group[i], *time_space(views, solve, group[i], transform)))
    print(f"opened both models (finite check, headers) in {opened:.1f} s; {len(mlps)} layers")
    print("| space | view s | solve s | total s |\n|---|---:|---:|---:|")
    for name, built, solved in rows:
        print(f"| {name} | {built:.1f} | {solved:.1f} | {built + solved:.1f} |")
    per_layer = {
        kind: sum(v + s for n, v, s in rows if n in group) / len(args.layers)
        for kind, group in (("mlp", mlps), ("heads", heads))
    }
    res = sum(v + s for n, v, s in rows if n in residual)
    projected = res + len(mlps) * (per_layer["mlp"] + per_layer["heads"])
    print(
        f"projected pass: {projected:.0f} s = residual {res:.0f} s + {len(mlps)} × (MLP {per_layer['mlp']:.1f} s "
        f"+ heads {per_layer['heads']:.1f} s); peak RSS {_peak_gb():.2f} GB; torch threads {torch.get_num_threads()}"
    )


if __name__ == "__main__":
    main()
