"""Loss barriers of two tiny mixtures of experts (zoo kind ``mixtral``: 2 layers, 4 experts of 48
units, top 2, character-level Shakespeare) trained from different seeds: vanilla, a dense-style
matching that leaves the experts in their order (only the units inside each expert, the heads and
the residual stream are matched), and every strategy with expert matching.

    python benchmarks/alignment/bench_moe.py                 # trains the two models on first use (~1 min each)
    python benchmarks/alignment/bench_moe.py --seeds 1 2     # another pair
    python benchmarks/alignment/bench_moe.py --usage         # also how often each expert is routed to

Prints a Markdown table (midpoint and linear barrier, nats, held-out text, 21 λ; alignment seconds)
and, per MoE layer, which of B's experts each of A's experts was paired with.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent))  # bench_barriers
sys.path.insert(0, str(Path(__file__).parents[2]))  # benchmarks.alignment.bench_moe, where the strategy's run is

from bench_barriers import barrier_table, markdown, pair_table

from hf_rebasin.alignment.experts import unit_blocks
from hf_rebasin.alignment.features import WeightViews
from hf_rebasin.alignment.solvers import best_inners
from hf_rebasin.alignment.strategies import REGISTRY, Alignment, Pair, Progress
from hf_rebasin.alignment.strategies.base import matching_forms
from hf_rebasin.alignment.strategies.engines.descent import anchor_init, descend, space_solver, view_graph
from hf_rebasin.alignment.strategies.options import WEIGHT_MATCHING, WeightMatchingOptions
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.spaces import ExpertSpace
from hf_rebasin.symmetry.transforms import ExpertMap, SpaceMap

IN_PLACE = "experts-in-place"


def units_in_place(space: ExpertSpace, views: Mapping[str | None, Tensor]) -> ExpertMap:
    """Expert e of B stays expert e; only its units are matched to A's expert e's (the dense view
    of a MoE layer: what matching that ignores the experts can do without breaking the model)."""
    E, f = space.num_experts, space.units
    block = unit_blocks(views["units"], E, f)
    inner = torch.stack([best_inners(block(e, e)[None], "perm")[0] for e in range(E)])
    return ExpertMap(torch.arange(E), inner)


def run(pair: Pair, options: WeightMatchingOptions, progress: Progress | None) -> Alignment:
    """Weight matching (its `glu` option included) with every expert space solved in place."""
    graph = pair.graph
    plain = space_solver(graph, "permutation")

    def solve(name: str, views: Mapping[str | None, Tensor]) -> SpaceMap:
        sp = graph.spaces[name]
        return units_in_place(sp, views) if isinstance(sp, ExpertSpace) else plain(name, views)

    ma, mb, balanced = matching_forms(pair, pair.sd_a, pair.sd_b, options)  # routers centred, units balanced
    vgraph = view_graph(graph, "permutation")
    views = WeightViews(vgraph, ma, mb)
    start = anchor_init(views, graph.identity(), solve)
    transform, _ = descend(vgraph, ma, mb, solve, init=start, max_iter=options.max_iter, seed=options.seed, views=views)
    sd_b = glu.match_scales(graph, pair.sd_a, pair.sd_b, transform) if balanced else pair.sd_b
    return Alignment(IN_PLACE, graph, pair.sd_a, sd_b, transform, glu_matched=balanced)


STRATEGIES: list[tuple[str, str, dict[str, Any]]] = [
    ("vanilla", "vanilla", {}),
    ("experts in place (units, heads, residual matched)", IN_PLACE, {}),
    ("experts in place, glu: balance", IN_PLACE, {"glu": "balance"}),
    ("weight-matching", "weight-matching", {}),
    ("weight-matching, glu: balance", "weight-matching", {"glu": "balance"}),
    ("transfusion", "transfusion", {}),
    ("generalized-orthogonal", "generalized-orthogonal", {}),
    ("head-perm", "head-perm", {"residual": "all"}),
    (
        "generalized-orthogonal, learned (experts kept)",
        "generalized-orthogonal",
        {"learned": True, "steps": 150, "lr": 0.01},
    ),
]


def usage(folder: Path) -> list[list[float]]:
    """Per MoE layer, the share of top-k slots each expert takes on the held-out text."""
    from hf_rebasin.evaluation.zoo.train import held_out_batches
    from hf_rebasin.io.models import load_model

    model = load_model(folder).model
    counts: dict[int, Tensor] = {}

    def hook(layer: int) -> Any:
        def record(_module: Any, _inputs: Any, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            top = logits.topk(model.config.num_experts_per_tok, dim=-1).indices.reshape(-1)
            counts[layer] = counts.get(layer, torch.zeros(logits.shape[-1])) + torch.bincount(
                top, minlength=logits.shape[-1]
            )

        return record

    handles = [m.mlp.gate.register_forward_hook(hook(i)) for i, m in enumerate(model.model.layers)]
    with torch.no_grad():
        for batch in held_out_batches(folder)[:8]:
            model(**{k: v for k, v in batch.items() if k != "labels"})
    for h in handles:
        h.remove()
    return [(c / c.sum()).tolist() for _, c in sorted(counts.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs=2, default=(0, 1))
    parser.add_argument("--pairs", nargs="*", default=[], help="seed pairs as A:B (e.g. 0:1 2:3): the median table")
    parser.add_argument("--usage", action="store_true")
    parser.add_argument("--skip", nargs="*", default=[], help="strategy names left out")
    args = parser.parse_args()
    REGISTRY.register(dataclasses.replace(WEIGHT_MATCHING, name=IN_PLACE, module="benchmarks.alignment.bench_moe"))
    strategies = [s for s in STRATEGIES if s[1] not in args.skip]
    if args.pairs:
        pairs = [(int(a), int(b)) for a, b in (p.split(":") for p in args.pairs)]
        print(pair_table("mixtral", pairs, strategies, tokens=None))
        return
    rows = barrier_table("mixtral", tuple(args.seeds), points=21, strategies=strategies)
    print(markdown("mixtral", rows))
    if args.usage:
        from hf_rebasin.evaluation.zoo.train import cached_model

        for seed in args.seeds:
            shares = usage(cached_model("mixtral", seed))
            print(f"seed {seed} expert usage per layer: " + "; ".join(", ".join(f"{s:.2f}" for s in u) for u in shares))


if __name__ == "__main__":
    main()
