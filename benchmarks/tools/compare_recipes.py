"""Run every recipe in ``recipes/`` and save or compare the numbers of their ``rebasin.json``.

    python benchmarks/tools/compare_recipes.py --save before.json      # on the old code
    python benchmarks/tools/compare_recipes.py --compare before.json   # on the new code: exit 1 on a difference

A refactor of the run must not change a result: barriers, losses at every λ, metrics, distances,
the preservation check, and the weights written (a SHA-256 of every tensor of every output
``.safetensors`` file, by file and tensor name). The numbers are flattened to ``path → value`` and compared to ``--tol``
(1e-6, absolute); timings, paths, versions and dates are left out. The alignment cache is off
(``cache: false``), so every alignment is computed afresh. Zoo models train on first use.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# keys whose values change from run to run or machine to machine, not with the computation
VOLATILE = ("seconds", "timings", "time", "created", "version", "versions", "path", "folder", "command", "peak_rss")


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": [1, 2]}}`` → ``{"a.b.0": 1, "a.b.1": 2}``, volatile keys dropped."""
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if any(word == key or key.endswith("_" + word) for word in VOLATILE):
                continue
            out.update(flatten(item, f"{prefix}{key}."))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = value
    return out


def run_recipe(recipe: Path, folder: Path) -> dict[str, Any]:
    """The flattened rebasin.json of one recipe, run in process with the alignment cache off.

    The recipe runs as a copy in ``folder`` (beside copies of the files it names, such as a metric
    script), writing into ``folder/<name>``: the paths ``rebasin.json`` records stay the same from run to run.
    """
    import yaml

    from hf_rebasin.cli import main

    shutil.copytree(recipe.parent, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.yaml", "out"))
    spec = yaml.safe_load(recipe.read_text())
    spec["cache"] = False
    spec.pop("push_to_hub", None)
    copy = folder / recipe.name
    copy.write_text(yaml.safe_dump(spec))
    code = main(["run", str(copy), "--output", str(folder / recipe.stem)])
    if code != 0:
        return {"exit": code}
    out = folder / recipe.stem
    return {**flatten(json.loads((out / "rebasin.json").read_text())), **tensor_digests(out)}


def tensor_digests(out: Path) -> dict[str, str]:
    """``files.<file>.<tensor>`` → SHA-256 of the tensor's bytes, for every safetensors file written."""
    import torch
    from safetensors import safe_open

    digests = {}
    for path in sorted(out.rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                tensor = f.get_tensor(name).contiguous()
                data = tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
                digests[f"files.{path.relative_to(out)}.{name}"] = hashlib.sha256(data).hexdigest()
    return digests


def differences(before: dict[str, Any], after: dict[str, Any], tol: float) -> list[str]:
    """One line per key whose value differs (numbers beyond ``tol``), is missing, or is new."""
    lines = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, "<missing>"), after.get(key, "<missing>")
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (old, new))
        if numbers and ((math.isnan(old) and math.isnan(new)) or abs(old - new) <= tol):
            continue
        if not numbers and old == new:
            continue
        lines.append(f"  {key}: {old!r} → {new!r}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", type=Path, help="write the numbers of every recipe here")
    parser.add_argument("--compare", type=Path, help="compare with numbers saved before; exit 1 on a difference")
    parser.add_argument("--tol", type=float, default=1e-6, help="absolute tolerance on numbers (default 1e-6)")
    parser.add_argument("recipes", nargs="*", type=Path, help="recipes (default: every recipes/*.yaml)")
    args = parser.parse_args()
    recipes = args.recipes or sorted((ROOT / "recipes").glob("*.yaml"))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="compare-recipes-") as tmp:
        for recipe in recipes:
            start = time.perf_counter()
            results[recipe.name] = run_recipe(recipe, Path(tmp))
            print(f"{recipe.name}: {len(results[recipe.name])} values, {time.perf_counter() - start:.0f} s", flush=True)
    if args.save:
        args.save.write_text(json.dumps(results, indent=1, sort_keys=True))
        print(f"saved to {args.save}")
    if not args.compare:
        return 0
    before = json.loads(args.compare.read_text())
    failed = 0
    for name in sorted(set(before) | set(results)):
        if name not in results or name not in before:
            print(f"{name}: only {'before' if name in before else 'now'}")
            continue
        diff = differences(before[name], results[name], args.tol)
        numbers = sum(isinstance(v, (int, float)) for v in results[name].values())
        print(f"{name}: {'same' if not diff else f'{len(diff)} differences'} ({numbers} numbers compared)")
        print("\n".join(diff[:20]))
        failed += bool(diff)
    print(f"{len(results) - failed} of {len(results)} recipes give the same numbers (tolerance {args.tol:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
