"""Loss barriers between zoo models of different widths, and a transport from a narrow base's
fine-tune onto a wider target, through the same runs a recipe makes (`hf_rebasin.run`): the
narrower model is embedded into the wider shape, then every strategy aligns them.

    python benchmarks/alignment/bench_widths.py                                  # GPT-2 d 64 vs d 128, seeds 0:1
    python benchmarks/alignment/bench_widths.py --wide gpt2-d96 --pairs 0:1 1:0
    python benchmarks/alignment/bench_widths.py --narrow vit --wide vit-d128     # digits, image classification
    python benchmarks/alignment/bench_widths.py --transport                      # gpt2-ft-seed0 onto gpt2-d128-seed1
    python benchmarks/alignment/bench_widths.py --learned                        # add learned matching (its default λ)
    python benchmarks/alignment/bench_widths.py --learned --samplers "wide(0.5, 0.9)" "uniform(0.4, 0.6)" "wide(0.1, 0.5)"

Zoo models are trained on first use (about a minute each). Prints Markdown tables: per strategy the
linear and midpoint barriers (nats, held-out data, 21 λ) per pair and their median, then the losses
near the narrow end (λ = A's weight: 1 is the narrow model, 0 the wide one).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from hf_rebasin.recipe import load_recipe
from hf_rebasin.run.pipeline import run_recipe

STRATEGIES = ["vanilla", "weight-matching", "transfusion", "generalized-orthogonal", "head-perm"]
TEXT = {
    "evaluate": {"task": "causal-lm", "data": {"dataset": "shakespeare", "split": "test"}, "batch_size": 32},
    "data": {"dataset": "shakespeare", "split": "train", "max_tokens": 65536, "block_size": 64},
}
IMAGES = {
    "evaluate": {"task": "image-classification", "data": {"dataset": "digits", "split": "test"}},
    "data": {"dataset": "digits", "split": "train"},
}
LEARNED = {"name": "generalized-orthogonal", "learned": True, "steps": 300, "eval_every": 50, "patience": 4}


def run(body: dict[str, Any]) -> Any:
    """One recipe run in a temporary folder; its `RunResult`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        body = {**body, "cache": False, "output": {"dir": str(Path(tmp) / "out")}}
        path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
        return run_recipe(load_recipe(path), check_memory=False)


def barriers(
    narrow: str, wide: str, pair: tuple[int, int], learned: bool, samplers: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Every strategy's curve for zoo:``narrow``-seed A against zoo:``wide``-seed B (A embedded)."""
    setting = IMAGES if narrow.startswith("vit") else TEXT
    models = [f"zoo:{narrow}-seed{pair[0]}", f"zoo:{wide}-seed{pair[1]}"]
    evaluate = {**setting["evaluate"], "points": 21, "compare": STRATEGIES[:-1]}
    body = {"job": "barrier", "models": models, "strategy": {"name": "head-perm", "residual": "all"}}
    start = time.perf_counter()
    result = run({**body, "evaluate": evaluate, "data": setting["data"]})
    out = {name: {**result.barriers[name], "curve": result.findings.curves[name]} for name in result.barriers}
    print(f"<!-- {models[0]} vs {models[1]}: {time.perf_counter() - start:.0f} s; notes: {result.notes} -->")
    for sampler in (samplers or [None]) if learned else []:
        strategy = {**LEARNED, "sampler": sampler} if sampler else LEARNED
        result = run({**body, "strategy": strategy, "evaluate": {**evaluate, "compare": []}, "data": setting["data"]})
        name = "generalized-orthogonal"
        label = f"learned, sampler {sampler or 'unset (the default for different widths)'}"
        out[label] = {**result.barriers[name], "curve": result.findings.curves[name]}
        print(f"<!-- {label} notes: {[n for n in result.notes if 'λ' in n or 'learned' in n]} -->")
    return out


def table(found: dict[tuple[int, int], dict[str, dict[str, Any]]], key: str) -> str:
    pairs = list(found)
    names = list(next(iter(found.values())))
    head = "| strategy | " + " | ".join(f"{a}:{b}" for a, b in pairs) + " | median | % of vanilla |"
    lines = [head, "|---" * (len(pairs) + 3) + "|"]
    vanilla = statistics.median(found[p]["vanilla"][key] for p in pairs)
    for name in names:
        values = [found[p][name][key] for p in pairs]
        median = statistics.median(values)
        cells = " | ".join(f"{v:.3f}" for v in values)
        lines.append(f"| {name} | {cells} | {median:.3f} | {100 * median / vanilla:.0f} % |")
    return "\n".join(lines)


def narrow_end(found: dict[tuple[int, int], dict[str, dict[str, Any]]]) -> str:
    """Loss at λ = 1 (the narrow model), 0.9, 0.75, 0.5 and 0 (the wide model), first pair."""
    pair = next(iter(found))
    points = (1.0, 0.9, 0.75, 0.5, 0.25, 0.0)
    lines = ["| strategy | " + " | ".join(f"λ={p:g}" for p in points) + " |", "|---" * (len(points) + 1) + "|"]
    for name, row in found[pair].items():
        curve = row["curve"]
        lam = [round(x, 6) for x in curve["lambdas"]]
        cells = " | ".join(f"{curve['loss'][lam.index(p)]:.3f}" for p in points)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def transport(base: str, finetuned: str, target: str, strategies: list[str]) -> str:
    """Task loss (the fine-tune's held-out plays) of the target, the naive embedding + τ and each
    aligned transport, and the target's own held-out loss (what it should keep)."""
    body = {"job": "transport", "base": base, "finetuned": finetuned, "target": target, "alpha": 1.0}
    evaluate = {
        "task": "causal-lm",
        "data": {"dataset": "shakespeare", "name": "the-merry-wives-of-windsor", "split": "test"},
        "support": {"dataset": "shakespeare", "split": "test", "max_tokens": 32768},
        "batch_size": 32,
        "compare": ["vanilla"],
    }
    rows = []
    for name in strategies:
        strategy: Any = {"name": name, "residual": "all"} if name == "head-perm" else name
        extra = {"data": TEXT["data"]} if name == "head-perm" else {}
        moved = run({**body, **extra, "strategy": strategy, "evaluate": evaluate}).findings.transport
        task, support = moved.loss, moved.support.loss
        if not rows:  # the same in every run
            rows.append(("fine-tune, on its own base", task.finetuned, support.finetuned))
            rows.append(("target alone", task.target, support.target))
            rows.append(("naive: target + τ (embedded where the target is wider)", task.naive[0], support.naive[0]))
        rows.append((f"{name}: target + π(τ)", task.transported[0], support.transported[0]))
    lines = [f"{finetuned} (fine-tune of {base}) onto {target}, α = 1", "", "| model | task loss | support loss |"]
    lines.append("|---|---:|---:|")
    lines += [f"| {label} | {t:.3f} | {s:.3f} |" for label, t, s in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--narrow", default="gpt2")
    parser.add_argument("--wide", default="gpt2-d128")
    parser.add_argument("--pairs", nargs="*", default=["0:1"], help="seed pairs A:B (A narrow, B wide)")
    parser.add_argument("--learned", action="store_true")
    parser.add_argument("--samplers", nargs="*", default=None, help="learned: λ samplers to compare")
    parser.add_argument("--transport", action="store_true")
    parser.add_argument("--target", default=None, help="transport: the target's zoo kind (default: --wide)")
    args = parser.parse_args()
    if args.transport:
        print(transport("zoo:gpt2-seed0", "zoo:gpt2-ft-seed0", f"zoo:{args.target or args.wide}-seed1", STRATEGIES))
        return
    pairs = [(int(a), int(b)) for a, b in (p.split(":") for p in args.pairs)]
    found = {pair: barriers(args.narrow, args.wide, pair, args.learned, args.samplers) for pair in pairs}
    print(f"**{args.narrow} (A) vs {args.wide} (B)**, linear barrier (nats)\n")
    print(table(found, "linear"))
    print("\nmidpoint barrier (nats)\n")
    print(table(found, "midpoint"))
    print("\nloss along the path, first pair\n")
    print(narrow_end(found))


if __name__ == "__main__":
    main()
