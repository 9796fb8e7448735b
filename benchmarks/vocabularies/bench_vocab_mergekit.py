"""mergekit as an independent oracle for merges of models whose vocabularies differ.

Builds mergekit's own three tokenizer-test models (tests/vocab_models.py: a base, a ChatML variant
with 2 added tokens and 2 more rows, a "padded" one whose tokenizer lists 4 placeholders past its
rows), merges them with hf-rebasin (strategy vanilla: same basis, weights 1/3 each) and with
mergekit 0.1.5's ``linear`` merge of the same models and settings (``base_model``: the base), once
with ``tokenizer.source: union`` and once with ``base``, and compares the two outputs: the
tokenizer (every token and its id, the added tokens), config.json's ``vocab_size`` and every
tensor. mergekit is installed from PyPI into a virtual environment of its own (never a dependency
of hf-rebasin):

    python benchmarks/vocabularies/bench_vocab_mergekit.py                 # venv in ~/.cache/hf-rebasin/mergekit-0.1.5
    python benchmarks/vocabularies/bench_vocab_mergekit.py --golden        # also store mergekit's outputs as test references

``--golden`` writes tests/golden/vocab_mergekit/ (mergekit's merged tensors as safetensors, its
vocabulary, and a digest of the inputs), which tests/run/test_vocabularies.py compares hf-rebasin
with on every run, without mergekit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

MERGEKIT = "mergekit==0.1.5"
SOURCES = ("union", "base")
GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden" / "vocab_mergekit"


def ensure_venv(venv: Path) -> Path:
    """``venv``'s mergekit-yaml, installing torch (the CPU wheel) and mergekit first if missing."""
    exe = venv / "bin" / "mergekit-yaml"
    if exe.exists():
        return exe
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # first: an unpinned torch pulls a CUDA build
    subprocess.run([*pip, MERGEKIT], check=True)
    return exe


def mergekit_config(cases: dict[str, Path], source: str) -> str:
    models = "".join(
        f"  - model: {cases[k]}\n    parameters:\n      weight: 1.0\n" for k in ("base", "padded", "chatml")
    )
    return (
        f"merge_method: linear\nbase_model: {cases['base']}\nmodels:\n{models}dtype: float32\n"
        f"tokenizer:\n  source: {source}\n"
    )


def run_mergekit(exe: Path, cases: dict[str, Path], source: str, out: Path) -> float:
    import time

    config = out.parent / f"mergekit-{source}.yml"
    config.write_text(mergekit_config(cases, source), encoding="utf-8")
    start = time.perf_counter()
    subprocess.run([str(exe), str(config), str(out), "--no-lazy-unpickle"], check=True, capture_output=True)
    return time.perf_counter() - start


def run_ours(cases: dict[str, Path], source: str, root: Path) -> float:
    import time

    import yaml

    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run.pipeline import run_recipe

    body = {
        "job": "merge",
        "models": [str(cases[k]) for k in ("base", "padded", "chatml")],
        "strategy": "vanilla",
        "merge": {"weight": [1 / 3, 1 / 3, 1 / 3]},
        "tokenizer": {"source": source},
        "output": {"dir": f"ours-{source}"},
        "device": "cpu",
        "cache": False,
    }
    recipe = root / f"ours-{source}.yaml"
    recipe.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    start = time.perf_counter()
    run_recipe(load_recipe(recipe))
    return time.perf_counter() - start


def read_output(folder: Path) -> dict[str, Any]:
    """What is compared: the tokenizer as AutoTokenizer reads it, the config's rows, the tensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    tensors: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return {
        "vocab": dict(sorted(tok.get_vocab().items(), key=lambda kv: kv[1])),
        "added": sorted(str(t.content) for t in tok.added_tokens_decoder.values()),
        "vocab_size": AutoConfig.from_pretrained(str(folder)).vocab_size,
        "tensors": tensors,
    }


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Where the two outputs agree: tokenizer, rows, and the largest |Δ| over every tensor."""
    names = sorted(set(ours["tensors"]) | set(theirs["tensors"]))
    missing = [n for n in names if n not in ours["tensors"] or n not in theirs["tensors"]]
    worst = 0.0
    for n in names:
        if n in missing:
            continue
        a, b = ours["tensors"][n].float(), theirs["tensors"][n].float()
        worst = max(worst, float("inf") if a.shape != b.shape else float((a - b).abs().max()))
    return {
        "same_vocab": ours["vocab"] == theirs["vocab"],
        "same_added": ours["added"] == theirs["added"],
        "vocab_size": (ours["vocab_size"], theirs["vocab_size"]),
        "tokens": (len(ours["vocab"]), len(theirs["vocab"])),
        "tensors": len(names),
        "missing": missing,
        "max_abs_diff": worst,
    }


def input_digest(cases: dict[str, Path]) -> str:
    """sha256 over the inputs' weight files: a stored reference holds for these inputs only."""
    h = hashlib.sha256()
    for k in ("base", "padded", "chatml"):
        h.update((cases[k] / "model.safetensors").read_bytes())
    return h.hexdigest()


def store_golden(cases: dict[str, Path], outputs: dict[str, dict[str, Any]]) -> None:
    from safetensors.torch import save_file

    if GOLDEN.exists():
        shutil.rmtree(GOLDEN)
    GOLDEN.mkdir(parents=True)
    meta: dict[str, Any] = {"mergekit": MERGEKIT, "inputs_sha256": input_digest(cases), "sources": {}}
    for source, out in outputs.items():
        save_file({k: v.contiguous() for k, v in out["tensors"].items()}, str(GOLDEN / f"{source}.safetensors"))
        meta["sources"][source] = {"vocab": out["vocab"], "added": out["added"], "vocab_size": out["vocab_size"]}
    (GOLDEN / "mergekit.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    home = Path(os.environ.get("HF_REBASIN_CACHE", Path.home() / ".cache" / "hf-rebasin"))
    parser.add_argument("--venv", type=Path, default=home / "mergekit-0.1.5")
    parser.add_argument("--golden", action="store_true", help="store mergekit's outputs in tests/golden")
    args = parser.parse_args()
    from vocab_models import mergekit_cases

    exe = ensure_venv(args.venv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = mergekit_cases(root / "models")
        theirs_all: dict[str, dict[str, Any]] = {}
        print(f"{'source':7} {'tokens (ours, mergekit)':>24} {'vocab_size':>12} {'same vocab':>10} "
              f"{'same added':>10} {'tensors':>7} {'max |Δ|':>9} {'ours s':>7} {'mergekit s':>10}")  # fmt: skip
        for source in SOURCES:
            t_theirs = run_mergekit(exe, cases, source, root / f"mergekit-{source}")
            t_ours = run_ours(cases, source, root)
            theirs = read_output(root / f"mergekit-{source}")
            found = compare(read_output(root / f"ours-{source}"), theirs)
            theirs_all[source] = theirs
            print(
                f"{source:7} {found['tokens']!s:>24} {found['vocab_size']!s:>12} {found['same_vocab']!s:>10} "
                f"{found['same_added']!s:>10} {found['tensors']:>7} {found['max_abs_diff']:>9.2g} {t_ours:>7.1f} "
                f"{t_theirs:>10.1f}" + (f"  missing: {found['missing']}" if found["missing"] else "")
            )
        if args.golden:
            store_golden(cases, theirs_all)
            print(f"stored mergekit's outputs in {GOLDEN}")


if __name__ == "__main__":
    main()
