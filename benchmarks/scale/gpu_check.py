"""Every job on ``device: cuda`` against the same job on the CPU, on zoo models: the numbers each
writes (barriers, function preservation, transport losses, the saved weights) and the seconds.

    python benchmarks/scale/gpu_check.py                 # on a machine with CUDA: every check below
    python benchmarks/scale/gpu_check.py --plan          # what it would run (what it does without CUDA)
    python benchmarks/scale/gpu_check.py --device cpu --only merge   # the harness itself, CPU against CPU

Each check runs the real CLI (``python -m hf_rebasin RECIPE --device D``) twice, once on the CPU and
once on the device, into two output folders, and compares their ``rebasin.json`` numbers and the
tensors of their ``model.safetensors``. Without CUDA it prints the plan and exits 0: it skips
cleanly. Zoo models are trained on first use into ``$HF_REBASIN_CACHE``; train them on the CPU
beforehand (``hf-rebasin zoo gpt2 0 1``) and carry the cache to the GPU machine to save its time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
TEXT = {"dataset": "shakespeare", "split": "train", "max_tokens": 16384, "block_size": 64}
EVAL = {"task": "causal-lm", "data": {"dataset": "shakespeare", "split": "test", "max_tokens": 8192}}
PAIR = ["zoo:gpt2-seed0", "zoo:gpt2-seed1"]

# name -> the recipe (without `output`), what each job exercises on the device
CHECKS: dict[str, dict[str, Any]] = {
    "merge": {"job": "merge", "models": PAIR, "strategy": "weight-matching"},
    "merge-head-perm": {"job": "merge", "models": PAIR, "strategy": {"name": "head-perm"}, "data": TEXT},
    "barrier": {
        "job": "barrier",
        "models": PAIR,
        "strategy": "generalized-orthogonal",
        "evaluate": {**EVAL, "points": 5, "compare": ["vanilla"]},
    },
    "transport": {
        "job": "transport",
        "base": "zoo:gpt2-seed0",
        "finetuned": "zoo:gpt2-ft-seed0",
        "target": "zoo:gpt2-seed1",
        "strategy": "transfusion",
        "evaluate": EVAL,
    },
    "align": {"job": "align", "models": PAIR, "strategy": "generalized-orthogonal"},
    "learned": {
        "job": "barrier",
        "models": PAIR,
        "strategy": {"name": "generalized-orthogonal", "learned": True, "budget": 65536, "seed": 0},
        "data": TEXT,
        "evaluate": {**EVAL, "points": 5},
    },
}
BENCH = {  # --bench: the learned benchmark on one pair of the benchmark zoo (trained on first use)
    "learned-bench-gpt2": {
        **CHECKS["learned"],
        "models": ["zoo:bench-gpt2-seed0", "zoo:bench-gpt2-seed1"],
        "data": {"dataset": "shakespeare", "split": "train", "max_tokens": 65536, "block_size": 128},
    }
}


def _numbers(record: Any, prefix: str = "") -> dict[str, float]:
    """Every number of a rebasin.json, by its key path, but the clock's."""
    out: dict[str, float] = {}
    if isinstance(record, dict):
        for key, value in record.items():
            if key not in ("timings", "recipe", "cache", "notes"):
                out.update(_numbers(value, f"{prefix}{key}."))
    elif isinstance(record, list):
        for i, value in enumerate(record):
            out.update(_numbers(value, f"{prefix}{i}."))
    elif isinstance(record, int | float) and not isinstance(record, bool):
        out[prefix.rstrip(".")] = float(record)
    return out


def _weights_gap(a: Path, b: Path) -> float | None:
    """The largest |Δ| between the tensors the two runs saved (None: no model saved)."""
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("**/*.safetensors"))
    if not files:
        return None
    gap = 0.0
    for name in files:
        ta, tb = load_file(str(next(a.glob(f"**/{name}")))), load_file(str(next(b.glob(f"**/{name}"))))
        gap = max(gap, *((ta[k].float() - tb[k].float()).abs().max().item() for k in ta))
    return gap


def _run(recipe: dict[str, Any], device: str, folder: Path) -> float:
    """The recipe through the CLI on ``device`` into ``folder``; its seconds."""
    path = folder.with_suffix(".yaml")
    path.write_text(yaml.safe_dump({**recipe, "output": {"dir": str(folder)}}, sort_keys=False))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hf_rebasin", str(path), "--device", device],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{path.name} on {device} exited {done.returncode}: {done.stderr.strip()[-600:]}")
    return time.perf_counter() - start


def compare(name: str, recipe: dict[str, Any], device: str, work: Path) -> tuple[float, float, float, str]:
    """(CPU seconds, device seconds, largest relative gap of the numbers, what gapped most)."""
    (work / name).mkdir()
    cpu, dev = work / name / "cpu", work / name / "device"
    cpu_s, dev_s = _run(recipe, "cpu", cpu), _run(recipe, device, dev)
    a, b = (_numbers(json.loads((folder / "rebasin.json").read_text())) for folder in (cpu, dev))
    gaps = {k: abs(a[k] - b[k]) / max(1.0, abs(a[k])) for k in a.keys() & b.keys() if math.isfinite(a[k] + b[k])}
    worst = max(gaps, key=lambda k: gaps[k], default="")
    weights = _weights_gap(cpu, dev)
    gap = gaps.get(worst, 0.0)
    shown = f"{worst} ({a[worst]:.5g} vs {b[worst]:.5g})" if gap > 0 else f"all {len(gaps)} numbers identical"
    if weights is not None:
        shown += f"; saved weights max |Δ| {weights:.2e}"
    return cpu_s, dev_s, gap, shown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="the device checked against the CPU (default cuda)")
    parser.add_argument("--only", nargs="*", help=f"checks to run (default all): {', '.join(CHECKS)}")
    parser.add_argument("--bench", action="store_true", help="also the learned benchmark on a bench-gpt2 pair")
    parser.add_argument("--plan", action="store_true", help="print what would run and exit")
    parser.add_argument("--tolerance", type=float, default=1e-2, help="largest relative gap of a number (default 1e-2)")
    args = parser.parse_args()
    checks = {k: v for k, v in {**CHECKS, **(BENCH if args.bench else {})}.items() if not args.only or k in args.only}
    import torch

    if args.plan or (args.device.startswith("cuda") and not torch.cuda.is_available()):
        why = "plan only" if args.plan else "no CUDA device here: skipped"
        print(f"gpu_check: {why}; on {args.device} it runs, each also on the CPU, and compares the results:")
        for name, recipe in checks.items():
            strategy = recipe["strategy"] if isinstance(recipe["strategy"], str) else recipe["strategy"]["name"]
            print(f"  {name}: job {recipe['job']}, {strategy}, models {recipe.get('models') or recipe.get('base')}")
        return 0
    print(f"gpu_check on {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'})")
    print("| check | cpu s | device s | largest relative gap | where |")
    print("|---|---:|---:|---:|---|")
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, recipe in checks.items():
            try:
                cpu_s, dev_s, gap, where = compare(name, recipe, args.device, Path(tmp))
            except RuntimeError as e:
                print(f"| {name} | - | - | failed | {e} |", flush=True)
                failed.append(name)
                continue
            if gap > args.tolerance:
                failed.append(name)
            print(f"| {name} | {cpu_s:.1f} | {dev_s:.1f} | {gap:.1e} | {where} |", flush=True)
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
