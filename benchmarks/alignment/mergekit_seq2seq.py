"""mergekit on the folders `job: align` writes for encoder-decoders, checked against an independent
SLERP and loaded with the stock class.

For each family (two tiny random models of ``tests/tiny.py`` from different seeds): `hf-rebasin`
aligns them (weight matching) and writes ``a/``, ``b/`` and ``mergekit.yaml``; mergekit 0.1.5, in a
virtual environment of its own, runs that file; the merged tensors are compared with a SLERP at
t = ½ computed here from ``a/`` and ``b/`` with mergekit's published formula (lerp where the two
tensors are nearly parallel), and the result is loaded with ``AutoModelForSeq2SeqLM`` (Whisper:
``AutoModelForSpeechSeq2Seq``). A family mergekit cannot merge prints mergekit's own error (ReLU T5:
its definition lists only the gated feed-forward; Whisper: its decoder prefix ``model.decoder`` lacks
a dot, so it asks for ``model.decoderembed_tokens.weight``).

    python benchmarks/alignment/mergekit_seq2seq.py                   # venv in ~/.cache/hf-rebasin/mergekit-0.1.5
    python benchmarks/alignment/mergekit_seq2seq.py --venv /work/mkvenv --families bart t5
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vocabularies"))
from bench_vocab_mergekit import ensure_venv

FAMILIES = ("bart", "t5", "t5-relu", "whisper")


def slerp(t: float, v0: torch.Tensor, v1: torch.Tensor, eps: float = 1e-8, parallel: float = 0.9995) -> torch.Tensor:
    """mergekit's SLERP of two tensors (flattened directions; a lerp where they are nearly parallel)."""
    a, b = v0.double(), v1.double()
    na, nb = a.flatten() / (a.norm() + eps), b.flatten() / (b.norm() + eps)
    dot = float((na * nb).sum())
    if abs(dot) > parallel:
        return (1 - t) * a + t * b
    theta = torch.arccos(torch.tensor(dot, dtype=torch.float64))
    return (torch.sin(theta * (1 - t)) * a + torch.sin(theta * t) * b) / torch.sin(theta)


def check(family: str, exe: Path, root: Path) -> str:
    import transformers as T
    from safetensors.torch import load_file

    import tiny
    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run.pipeline import run_recipe

    folders = []
    for seed in (0, 1):
        folder = root / f"{family}-{seed}"
        tiny.FACTORIES[family](seed).save_pretrained(str(folder))
        folders.append(str(folder))
    recipe = root / f"{family}.yaml"
    body = {"job": "align", "models": folders, "strategy": "weight-matching", "output": {"dir": str(root / family)}}
    recipe.write_text(yaml.safe_dump(body), encoding="utf-8")
    run_recipe(load_recipe(recipe))
    out = root / family
    done = subprocess.run([str(exe), "mergekit.yaml", "merged"], cwd=out, capture_output=True, text=True)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:]
        return f"| {family} | mergekit fails: {last[0] if last else done.returncode} | | |"
    a, b, merged = (load_file(str(out / d / "model.safetensors")) for d in ("a", "b", "merged"))
    gap = max(float((slerp(0.5, a[k], b[k]).float() - merged[k]).abs().max()) for k in a)
    auto = T.AutoModelForSpeechSeq2Seq if family == "whisper" else T.AutoModelForSeq2SeqLM
    model = auto.from_pretrained(str(out / "merged"))
    same = set(merged) == set(a)
    return f"| {family} | merged ({type(model).__name__}) | {gap:.1e} | {'yes' if same else 'no'} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "hf-rebasin" / "mergekit-0.1.5")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    args = parser.parse_args()
    exe = ensure_venv(args.venv)
    rows = [
        "| family | mergekit 0.1.5 | max abs diff to an independent SLERP | same tensors as `a/` |",
        "|---|---|---:|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        rows += [check(family, exe, Path(tmp)) for family in args.families]
    print("\n".join(rows))


if __name__ == "__main__":
    main()
