"""Lineage on a busy machine: a fair share of the cores, not a collapse.

    python benchmarks/lineage/bench_lineage_busy.py            # 5 runs idle, 5 beside two busy processes
    python benchmarks/lineage/bench_lineage_busy.py --runs 9 --busy 2

Two random 4-layer, d = 128 GPT-2 models (written once under ``--root``) compared by
``hf-rebasin lineage A B --json`` in a fresh process each time, first with nothing else running, then
beside ``--busy`` processes that spin (``while True: pass``) on the same cores. Prints each run's
``seconds`` (split, align, evidence, total) from the record and the medians, and the ratio of the
busy median to the idle one: a fair share of 2 cores beside two spinning processes is about 2×.
Run it on an otherwise idle machine: the idle runs are the baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers as T


def make(root: Path) -> tuple[Path, Path]:
    folders = (root / "gpt2-4x128-seed0", root / "gpt2-4x128-seed1")
    for seed, folder in enumerate(folders):
        if not (folder / "config.json").is_file():
            torch.manual_seed(seed)
            config = T.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=128)
            T.GPT2LMHeadModel(config).save_pretrained(str(folder))
    return folders


def one(a: Path, b: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-m", "hf_rebasin", "lineage", str(a), str(b), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {k: float(v) for k, v in json.loads(done.stdout)["pairs"][0]["seconds"].items()}


def runs(a: Path, b: Path, n: int, label: str) -> list[dict[str, float]]:
    out = []
    for _ in range(n):
        found = one(a, b)
        out.append(found)
        print(f"{label}: " + ", ".join(f"{k} {v:.2f} s" for k, v in found.items()), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/tmp/hf-rebasin-bench/lineage-busy"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--busy", type=int, default=2, help="spinning processes beside the busy runs")
    args = p.parse_args()
    a, b = make(args.root)
    idle = runs(a, b, args.runs, "idle")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        time.sleep(1)
        busy = runs(a, b, args.runs, f"beside {args.busy} busy")
    finally:
        for s in spinners:
            s.kill()
    print("\n| | split | align | evidence | total |\n|---|---:|---:|---:|---:|")
    for label, found in (("idle", idle), (f"beside {args.busy} busy processes", busy)):
        med = {k: statistics.median(r[k] for r in found) for k in found[0]}
        print(f"| {label} (median of {len(found)}) | " + " | ".join(f"{med[k]:.2f} s" for k in found[0]) + " |")
    ratio = statistics.median(r["total"] for r in busy) / statistics.median(r["total"] for r in idle)
    print(f"\nbusy / idle (median total): {ratio:.1f}×")


if __name__ == "__main__":
    main()
