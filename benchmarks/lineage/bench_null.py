"""How far models trained apart agree: the null that lineage's tests are read against.

Every pair of models trained from different seeds on one tokenizer and one corpus, compared by
`hf-rebasin lineage`'s data-free comparison. For each pair: the bulk similarity of the token tables
(`embeddings`: word embeddings and an untied output head), of the learned position tables
(`positions`) and the highest of any layer's space, each aligned and as stored. The highest over
independent pairs is what the null levels (`lineage.compare.NULL_SIMILARITY` for the layers,
`EMBEDDING_NULL`, `POSITION_NULL`) must stay above.

Pairs: the tiny zoo's seeds (characters; one corpus per family), the benchmark zoo's (BPE
vocabularies; trained 3–10× longer), and the teachers and students of `relatives.py` across seeds
(all-MiniLM's WordPiece vocabulary, the same plays). Only models already trained are read.

    python benchmarks/lineage/bench_null.py            # ≈ 1 min on one thread, with what is trained
    python benchmarks/lineage/bench_null.py --related  # the related pairs too (relatives.py's)
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from hf_rebasin.evaluation.zoo.catalogue import is_trained, zoo_folder
from hf_rebasin.io.models import load_model
from hf_rebasin.lineage.pairs import lineage_of
from hf_rebasin.lineage.stats import POSITIONS, RESIDUAL, log10_sf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relatives import ROOT as RELATIVES

KINDS = ("gpt2", "qwen3", "gemma2", "olmo2", "phi3", "pythia", "bert", "vit")
BENCH = ("bench-t5", "bench-t5-long", "bench-mbart", "bench-gpt2", "bench-qwen3", "bench-gemma2")


def zoo_pairs() -> Iterator[tuple[str, str, Path, Path]]:
    for kind in KINDS + BENCH:
        folders = {s: zoo_folder(kind, s) for s in range(6)}
        seeds = [s for s, f in folders.items() if is_trained(f)]
        for s, t in itertools.combinations(seeds, 2):
            yield "independent", f"{kind} seeds {s}, {t}", folders[s], folders[t]


EMBEDDINGS_ONLY = {("s024", "s135"), ("minilm-s024", "minilm-s135")}  # students without a layer in common


def relative_pairs(related: bool) -> Iterator[tuple[str, str, Path, Path]]:
    """The teachers and their students of `relatives.py`: across seeds independent, within one
    related (students that kept no layer in common: by their embeddings only); the MiniLM family,
    as float32 and as bf16."""
    teachers = sorted(p.name for p in RELATIVES.glob("teacher-s*") if p.name.count("-") == 1)
    group = {t: [RELATIVES / t, *sorted(RELATIVES.glob(f"{t}-s[0-9][0-9][0-9]"))] for t in teachers}
    for t, u in itertools.combinations(teachers, 2):
        for a, b in itertools.product(group[t], group[u]):
            yield "independent", f"{a.name}, {b.name}", a, b
    if not related:
        return
    for t in teachers:
        for a, b in itertools.combinations(group[t], 2):
            yield _label(a.name.split("-")[-1], b.name.split("-")[-1]), f"{a.name}, {b.name}", a, b
    names = ("minilm-l6", "minilm-s024", "minilm-s135", "minilm-s123", "minilm-long")
    for suffix in ("", "-bf16"):
        minilm = [RELATIVES / f"{n}{suffix}" for n in names]
        for a, b in itertools.combinations([m for m in minilm if m.exists()], 2):
            yield _label(a.name.removesuffix(suffix), b.name.removesuffix(suffix)), f"{a.name}, {b.name}", a, b


def _label(a: str, b: str) -> str:
    return "embeddings only" if (a, b) in EMBEDDINGS_ONLY else "related"


def measure(a: Path, b: Path) -> dict[str, float | str | None]:
    record = lineage_of([load_model(a, stream=True), load_model(b, stream=True)], ["A", "B"])
    pair = record.pairs[0]
    out: dict[str, float | str | None] = {"verdict": pair.verdict, "origin": pair.origin}
    tables = [e for e in pair.spaces if not e.counted]
    for space in (RESIDUAL, POSITIONS):
        e = next((e for e in tables if e.space == space), None)
        out[space] = None if e is None else max(e.similarity, e.raw_similarity)
    layers = [max(e.similarity, e.raw_similarity) for e in pair.spaces if e.counted]
    out["layers"] = max(layers) if layers else None
    # the evidence of any origin: the strongest of the layers' test and each table's (−log10 p)
    evidence = [-pair.log10_p, -pair.raw_log10_p, *(-log10_sf(max(e.z, e.raw_z)) for e in tables)]
    out["score"] = max(evidence)
    return out


def auc(pos: list[float], neg: list[float]) -> float:
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg)) if pos and neg else float("nan")


def summary(rows: list[dict]) -> list[str]:
    out = []
    for label in ("independent", "related", "embeddings only"):
        mine = [r for r in rows if r["label"] == label]
        if not mine:
            continue
        verdicts = collections.Counter(r["verdict"] for r in mine)
        out.append(f"{label}: {len(mine)} pairs, verdicts {dict(verdicts)}")
        for key in (RESIDUAL, POSITIONS, "layers"):
            values = [r[key] for r in mine if isinstance(r[key], float)]
            if values:
                out.append(f"  {key}: {min(values):.3f}–{max(values):.3f}")
    neg = [r for r in rows if r["label"] == "independent"]
    pos = [r for r in rows if r["label"] != "independent"]
    if neg:
        wrong = sum(r["verdict"] != "independent" for r in neg)
        out.append(f"false-positive rate: {wrong}/{len(neg)} independent pairs called related or shared")
    if pos and neg:
        found = sum(r["verdict"] != "independent" for r in pos)
        score = auc([r["score"] for r in pos], [r["score"] for r in neg])
        out.append(f"related found: {found}/{len(pos)}; AUC {score:.3f}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--related", action="store_true", help="also the related pairs of relatives.py")
    parser.add_argument("--out", type=Path, default=RELATIVES / "null.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(
        "| label | pair | verdict | embeddings | positions | highest layer space | shared |\n|---|---|---|---:|---:|---:|---|"
    )
    for label, name, a, b in itertools.chain(zoo_pairs(), relative_pairs(args.related)):
        row = {"label": label, "pair": name, **measure(a, b)}
        rows.append(row)
        cells = [f"{row[k]:.3f}" if isinstance(row[k], float) else "–" for k in (RESIDUAL, POSITIONS, "layers")]
        print(f"| {label} | {name} | {row['verdict']} | " + " | ".join(cells) + f" | {row['origin']} |", flush=True)
    print("\n".join(summary(rows)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
