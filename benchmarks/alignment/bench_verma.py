"""Verma & Elbayad's Tables 1 and 2 on zoo BERT pairs (masked LM on Shakespeare characters, seeds
trained apart): how attention heads are matched, and which residual features give the residual
permutation.

    python benchmarks/alignment/bench_verma.py                  # pairs (0,1) (2,3) (0,2) (1,3); trains 4 BERTs on first use
    python benchmarks/alignment/bench_verma.py --pairs 1 --rows vanilla hp hp-shared
    python benchmarks/alignment/bench_verma.py --json out.json  # every number, per pair

Barriers are measured against the ORIGINAL end points (model A and model B as trained), so a
variant that changes B's function (``ignore-heads``, ``residual: separate``) pays for it: midpoint
barrier = L(½) − ½(L_A + L_B), linear barrier = max_λ L(λ) − (λ·L_A + (1−λ)·L_B), 11 λ, held-out
masked-LM loss (fixed masks). Alignment data: training-split text (``--batches`` of 16 × 64
characters). Table 1 aligns MLP units and heads (``components: [ff, attn]``, residual left as it
is); Table 2 adds the residual stream with head permutation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from bench_barriers import barrier_table

FF_ATTN = {"components": ["ff", "attn"], "residual": "identity"}
# key: (table, row label, strategy, options)
ROWS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "vanilla": ("both", "vanilla averaging", "vanilla", {}),
    "ff": ("1", "MLP units only", "head-perm", {"components": ["ff"]}),
    "ignore": ("1", "+ attention, ignore-heads", "head-perm", {**FF_ATTN, "heads": "ignore-heads"}),
    "mono": ("1", "+ attention, monotonic heads", "head-perm", {**FF_ATTN, "heads": "monotonic", "qk": "shared"}),
    "hp-shared": ("1", "+ attention, head-perm (Q/K/V shared)", "head-perm", {**FF_ATTN, "qk": "shared"}),
    "hp-sep": ("1", "+ attention, head-perm (Q/K separate)", "head-perm", {**FF_ATTN, "qk": "separate"}),
    "res-identity": ("2", "residual: identity", "head-perm", {"residual": "identity", "qk": "shared"}),
    "res-first": ("2", "residual: first", "head-perm", {"residual": "first", "qk": "shared"}),
    "res-last": ("2", "residual: last", "head-perm", {"residual": "last", "qk": "shared"}),
    "res-all": ("2", "residual: all", "head-perm", {"residual": "all", "qk": "shared"}),
    "res-separate": ("2", "residual: separate", "head-perm", {"residual": "separate", "qk": "shared"}),
    "res-first-sep": ("2", "residual: first, Q/K separate", "head-perm", {"residual": "first"}),
    "res-last-sep": ("2", "residual: last, Q/K separate", "head-perm", {"residual": "last"}),
    "res-all-sep": ("2", "residual: all, Q/K separate", "head-perm", {"residual": "all"}),
}
PAIRS = ((0, 1), (2, 3), (0, 2), (1, 3))


def measure(rows: list[str], pairs: tuple[tuple[int, int], ...], batches: int) -> dict[str, Any]:
    """Per row and pair: both barriers against the original end points (vanilla's curve ends: A and
    B as trained), loss at λ = ½, seconds."""
    out: dict[str, Any] = {"pairs": [list(p) for p in pairs], "rows": {}, "ends": []}
    runs = [(key, ROWS[key][2], ROWS[key][3]) for key in ["vanilla", *(k for k in rows if k != "vanilla")]]
    for seeds in pairs:
        start = time.perf_counter()
        table = {r["strategy"]: r for r in barrier_table("bert", seeds, points=11, strategies=runs, batches=batches)}
        loss_a, loss_b = table["vanilla"]["loss_a"], table["vanilla"]["loss_b"]
        out["ends"].append([loss_a, loss_b])
        for key in rows:
            r = table[key]
            line = [x * loss_a + (1 - x) * loss_b for x in r["lambdas"]]
            entry = out["rows"].setdefault(
                key, {"label": ROWS[key][1], "midpoint": [], "linear": [], "mid_loss": [], "seconds": []}
            )
            entry["midpoint"].append(max(r["losses"]) - 0.5 * (loss_a + loss_b))
            entry["linear"].append(max(v - w for v, w in zip(r["losses"], line, strict=True)))
            entry["mid_loss"].append(r["loss_mid"])
            entry["seconds"].append(r["seconds"])
        print(f"bert {seeds}: {time.perf_counter() - start:.0f} s", flush=True)
    return out


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def markdown(result: dict[str, Any], rows: list[str]) -> str:
    ends = result["ends"]
    lines = [
        f"**bert (masked LM)**, pairs {', '.join(str(tuple(p)) for p in result['pairs'])}; end points "
        + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in ends),
        "",
        "| table | variant | midpoint barrier, median (range) | linear barrier, median (range) | loss at λ=½ | align s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key in rows:
        e = result["rows"][key]
        lines.append(
            f"| {ROWS[key][0]} | {e['label']} | {_cell(e['midpoint'])} | {_cell(e['linear'])} "
            f"| {statistics.median(e['mid_loss']):.3f} | {statistics.median(e['seconds']):.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--pairs", type=int, default=len(PAIRS), help="how many of the seed pairs to run")
    parser.add_argument("--batches", type=int, default=16, help="alignment batches (16 × 64 characters)")
    parser.add_argument("--json", help="also write every number here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result = measure(args.rows, PAIRS[: args.pairs], args.batches)
    print(markdown(result, args.rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
