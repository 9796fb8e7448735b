"""Linear barriers over several seed pairs of the zoo models, as a share of vanilla's: every
strategy and option, median and spread, so one lucky pair does not decide a default.

    python benchmarks/alignment/bench_seeds.py                     # GPT-2 and ViT, pairs (0,1) (1,2) (2,3) (3,0)
    python benchmarks/alignment/bench_seeds.py --kind vit --rows go go-learned
    python benchmarks/alignment/bench_seeds.py --json out.json     # every number, per pair

The zoo trains the 4 seeds of each kind on first use (about 1 min each). Rows whose options the
installed hf-rebasin does not know are printed as "n/a", so the same script measures an older
checkout too (``PYTHONPATH=/path/to/old/checkout python benchmarks/alignment/bench_seeds.py``): that is how
the "before" column of benchmarks/README.md's table was taken. Alignment data: training-split batches
(``--batches`` of 16 × 64 tokens, or of 64 images); evaluation: the held-out split, 11 λ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from bench_barriers import barrier_table

from hf_rebasin.alignment.strategies import get_strategy
from hf_rebasin.core.errors import StrategyOptionError

# key: (row label, strategy, options)
ROWS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "wm": ("weight-matching", "weight-matching", {}),
    "tf": ("transfusion", "transfusion", {}),
    "hp": ("head-perm, residual: all", "head-perm", {"residual": "all"}),
    "hp-identity": ("head-perm (defaults: residual: identity)", "head-perm", {}),
    "hp-last": ("head-perm, residual: last", "head-perm", {"residual": "last"}),
    "hp-shared": ("head-perm, residual: all, qk: shared", "head-perm", {"residual": "all", "qk": "shared"}),
    "go": ("generalized-orthogonal", "generalized-orthogonal", {}),
    "go-inv": ("generalized-orthogonal, inner: invertible", "generalized-orthogonal", {"inner": "invertible"}),
    "go-learned": ("+ learned (defaults)", "generalized-orthogonal", {"learned": True}),
    "go-learned-frozen": (
        "+ learned, head pairings frozen",
        "generalized-orthogonal",
        {"learned": True, "learn_heads": False},
    ),
    "go-learned-soft": (
        "+ learned, sinkhorn (soft, projected once)",
        "generalized-orthogonal",
        {"learned": True, "sinkhorn": True},
    ),
    "go-learned-perm": (
        "+ learned, maps: permutations",
        "generalized-orthogonal",
        {"learned": True, "maps": "permutations"},
    ),
    "go-learned-inv": (
        "+ learned, inner: invertible",
        "generalized-orthogonal",
        {"learned": True, "inner": "invertible"},
    ),
    "go-learned-fixed": (
        "+ learned, sampler: fixed(0.5)",
        "generalized-orthogonal",
        {"learned": True, "sampler": "fixed(0.5)"},
    ),
    "go-learned-long": (
        "+ learned, 1,000 steps, patience 10",
        "generalized-orthogonal",
        {"learned": True, "steps": 1000, "patience": 10},
    ),
    "go-learned-lr01": (
        "+ learned, lr 0.01 (the default before 0.03)",
        "generalized-orthogonal",
        {"learned": True, "lr": 0.01},
    ),
    "go-learned-long-lr01": (
        "+ learned, 1,000 steps, patience 10, lr 0.01",
        "generalized-orthogonal",
        {"learned": True, "steps": 1000, "patience": 10, "lr": 0.01},
    ),
}
PAIRS = ((0, 1), (1, 2), (2, 3), (3, 0))


def supported(strategy: str, options: dict[str, Any]) -> bool:
    """Whether the installed hf-rebasin knows these options (an older checkout may not)."""
    try:
        get_strategy(strategy).parse(options)
    except StrategyOptionError:
        return False
    return True


def measure(kind: str, rows: list[str], pairs: tuple[tuple[int, int], ...], batches: int) -> dict[str, Any]:
    """Per row and pair: linear barrier (nats), its share of vanilla's, and the alignment seconds."""
    runnable = [(key, *ROWS[key]) for key in rows if supported(ROWS[key][1], ROWS[key][2])]
    out: dict[str, Any] = {"kind": kind, "pairs": [list(p) for p in pairs], "rows": {}}
    for pair in pairs:
        start = time.perf_counter()
        table = barrier_table(
            kind,
            seeds=pair,
            points=11,
            strategies=[("vanilla", "vanilla", {})] + [r[1:] for r in runnable],
            batches=batches,
        )
        by_label = {r["strategy"]: r for r in table}
        vanilla = by_label["vanilla"]["linear"]
        out.setdefault("vanilla", []).append(vanilla)
        for key, label, _name, _options in runnable:
            r = by_label[label]
            entry = out["rows"].setdefault(key, {"label": label, "linear": [], "share": [], "seconds": []})
            entry["linear"].append(r["linear"])
            entry["share"].append(r["linear"] / vanilla)
            entry["seconds"].append(r["seconds"])
        print(f"{kind} {pair}: {time.perf_counter() - start:.0f} s", flush=True)
    return out


def markdown(result: dict[str, Any], rows: list[str]) -> str:
    v = result["vanilla"]
    lines = [
        f"**{result['kind']}**, pairs {', '.join(str(tuple(p)) for p in result['pairs'])}; "
        f"vanilla's linear barrier: median {statistics.median(v):.3f} nats (range {min(v):.3f}–{max(v):.3f})",
        "",
        "| strategy | % of vanilla, median | range | per pair | align s (median) |",
        "|---|---:|---:|---|---:|",
    ]
    for key in rows:
        entry = result["rows"].get(key)
        if entry is None:
            lines.append(f"| {ROWS[key][0]} | n/a | | | |")
            continue
        share = [100 * s for s in entry["share"]]
        lines.append(
            f"| {entry['label']} | {statistics.median(share):.1f} % | {min(share):.1f}–{max(share):.1f} % "
            f"| {' / '.join(f'{s:.1f}' for s in share)} | {statistics.median(entry['seconds']):.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("gpt2", "vit", "bert", "both"), default="both", help="both: gpt2 and vit")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--pairs", type=int, default=len(PAIRS), help="how many of the seed pairs to run")
    parser.add_argument("--batches", type=int, default=32, help="alignment batches (16 × 64 tokens or 64 images)")
    parser.add_argument("--json", help="also write every number here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for kind in ("gpt2", "vit") if args.kind == "both" else (args.kind,):
        result = measure(kind, args.rows, PAIRS[: args.pairs], args.batches)
        results.append(result)
        print(markdown(result, args.rows), "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
