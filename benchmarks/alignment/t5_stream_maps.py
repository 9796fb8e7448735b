"""Which permutation of the residual stream each source of evidence picks on two zoo T5s (``bench-t5``
seeds 0 and 1), and how well each fits the others: the head's columns alone, the input table's alone,
weight matching (every weight), head-perm (the encoder's activations).

    python benchmarks/alignment/t5_stream_maps.py    # a minute on one core, once the pair is trained

Prints, per permutation, the mean correlation of the heads' matched columns under it and the share of
features on which each pair of permutations agrees. One map serves both stacks (one table feeds
them): where the input table and the head want different maps, no permutation fits both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from scipy.optimize import linear_sum_assignment

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_barriers

from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.evaluation.zoo.train import cached_model
from hf_rebasin.io.models import load_model


def _matched(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The permutation of y's columns that best correlates them with x's, and the correlations."""
    x, y = (x - x.mean(0)) / x.std(0), (y - y.mean(0)) / y.std(0)
    corr = (x.T @ y / len(x)).double()
    return torch.as_tensor(linear_sum_assignment(-corr.numpy())[1]), corr


def main() -> None:
    folders = cached_model("bench-t5", 0), cached_model("bench-t5", 1)
    a, b = (load_model(f) for f in folders)
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    perms: dict[str, torch.Tensor] = {}
    for table in ("lm_head.weight", "shared.weight"):
        perms[table], _ = _matched(sd_a[table].double(), sd_b[table].double())
    data = bench_barriers.alignment_data("bench-t5", folders[0], 8)
    for name, options in (("weight-matching", {}), ("head-perm", {"residual": "all"})):
        alignment = align(name, Pair(a.graph, sd_a, sd_b, a.model, b.model, data), options)
        perms[name] = alignment.transform["res"].index
    _, head = _matched(sd_a["lm_head.weight"].double(), sd_b["lm_head.weight"].double())
    rows = torch.arange(head.shape[0])
    print("| permutation from | heads' columns, mean correlation | " + " | ".join(perms) + " |")
    print("|---|---:|" + "---:|" * len(perms))
    for name, p in perms.items():
        agree = " | ".join(f"{float((p == q).double().mean()):.2f}" for q in perms.values())
        print(f"| {name} | {float(head[rows, p].mean()):.3f} | {agree} |")


if __name__ == "__main__":
    main()
