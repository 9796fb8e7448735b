"""Seconds and peak memory of `hf-rebasin lineage` on random bf16 models of real Hub shapes, streamed.

    python benchmarks/lineage/bench_lineage_scale.py --shape tinyllama
    python benchmarks/lineage/bench_lineage_scale.py --shape mistral7b --pairs independent moved --timeout 10800
    python benchmarks/lineage/bench_lineage_scale.py --shape mistral-d1024 --pairs independent moved  # a minute a pair
    python benchmarks/lineage/bench_lineage_scale.py --shape mistral-d1024 --pairs moved --moved-noise 0.2 --data 8

The models are `bench_scale.py`'s (written there first if missing, under ``--root``): seeds 0 and 1
and the "fine-tune" of seed 0 (its tensors plus ``0.01 · randn``). This script adds a fourth,
``<shape>-<layout>-moved-n<noise>-seed0``: seed 0 with noise of ``--moved-noise`` (default 5 %) of
each tensor's RMS (a light training on top), in canonical form under a random orthogonal transform
(the residual stream rotated, heads and units permuted, rotations inside the heads), written tensor
by tensor in bfloat16 with seed 0's config. Random models have no learned signal, so the verdicts are the hardest case for the method:
only the bulk tells them apart, and the alignment has only the top of a random spectrum to go by.

Pairs (``--pairs``): ``independent`` (seed 0, seed 1), ``finetune`` (seed 0, its fine-tune: same
basis) and ``moved`` (seed 0, its moved copy: related up to symmetry). Each runs as
``/usr/bin/time -v hf-rebasin lineage A B --json`` in a fresh process; the table gives the verdict,
the statistic, the stage seconds of the record, wall seconds, and peak RSS in GB and as a multiple
of one model's bytes on disk, beside the peak `lineage.pairs.lineage_bytes` expects.

With ``--data N`` each pair runs `lineage.pairs.lineage_of` with alignment data instead (in a fresh
process under the same ``/usr/bin/time -v``): N batches of 8 × 128 token ids drawn uniformly from
the vocabulary (seeded), as a recipe's ``data`` would feed them. Random models have no language, so
uniform tokens reach every embedding row, where text would reach a few.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scale"))  # bench_scale
from bench_scale import SEEDS, make, make_finetune

from hf_rebasin.alignment.strategies import AlignmentData
from hf_rebasin.io.models import load_model
from hf_rebasin.io.tensors import write_safetensors
from hf_rebasin.lineage.pairs import lineage_bytes, lineage_of
from hf_rebasin.symmetry.canonical import canonicalize

GB = 1e9
# the moved model's training on top, as a share of each tensor's RMS. bench_scale's "fine-tune" adds
# 0.01 (45 % of a TinyLlama weight's RMS, 64 % of a Mistral-7B one's): on random weights, which have
# no learned directions to align, that much noise leaves nothing to recover a transform from
MOVED_NOISE = 0.05
PAIRS = ("independent", "finetune", "moved")


def make_moved(base: Path, folder: Path, noise: float, seed: int = 7) -> Path:
    """Seed 0 lightly trained on (each floating tensor plus ``noise`` times its RMS in noise), put in
    canonical form and moved by a random orthogonal transform; written tensor by tensor."""
    if folder.exists():
        return folder
    lm = load_model(base, stream=True)
    canonical, graph, _ = canonicalize(lm.graph, lm.weights)
    moved = graph.apply(canonical, graph.random_transform("orthogonal", torch.Generator().manual_seed(seed)))
    tied = set(getattr(lm.model, "all_tied_weights_keys", None) or {})
    names = [n for n in moved if n not in tied]

    def produce(name: str) -> torch.Tensor:
        t = moved[name]
        if noise and t.is_floating_point() and t.numel() > 1:
            g = torch.Generator().manual_seed(seed + names.index(name))
            t = t + noise * t.pow(2).mean().sqrt() * torch.randn(t.shape, generator=g)
        return t

    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(base / "config.json", tmp / "config.json")
    start = time.perf_counter()
    write_safetensors(tmp / "model.safetensors", [(n, tuple(moved.shape(n)), torch.bfloat16) for n in names], produce)
    tmp.rename(folder)
    print(f"make: {folder.name} ({len(names)} tensors) in {time.perf_counter() - start:.0f}s", flush=True)
    return folder


def random_tokens(vocab: int, batches: int, seed: int = 0) -> AlignmentData:
    """``batches`` batches of 8 × 128 token ids, uniform over the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    made = [torch.randint(0, vocab, (8, 128), generator=g) for _ in range(batches)]
    return AlignmentData(
        [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in made], frozenset(), "random tokens"
    )


def one_pair_with_data(a: Path, b: Path, batches: int) -> None:
    """The child process of ``--data``: both models streamed, lineage with random-token data, the
    record printed as ``hf-rebasin lineage --json`` prints it."""
    models = [load_model(a, stream=True), load_model(b, stream=True)]
    data = random_tokens(models[0].model.config.vocab_size, batches)
    record = lineage_of(models, [str(a), str(b)], data=data)
    print(json.dumps(record.model_dump(mode="json")))


def run_pair(a: Path, b: Path, timeout: float, data: int = 0) -> dict[str, object]:
    """One ``hf-rebasin lineage A B --json`` (with ``data``: `one_pair_with_data`) under ``/usr/bin/time -v``."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "hf_rebasin", "lineage", str(a), str(b), "--json"]
    if data:
        cmd = ["/usr/bin/time", "-v", sys.executable, __file__, "--one", str(a), str(b), "--data", str(data)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    out: dict[str, object] = {
        "exit": proc.returncode,
        "wall": wall,
        "peak": int(peak.group(1)) * 1024 if peak else None,
    }
    if proc.returncode != 0:
        out["error"] = proc.stderr[-2000:]
        return out
    record = json.loads(proc.stdout[proc.stdout.index("{") :])
    pair = record["pairs"][0]
    out.update(
        verdict=pair["verdict"],
        statistic=pair["statistic"],
        raw=pair["raw_statistic"],
        log10_p=pair["log10_p"],
        seconds=pair["seconds"],
    )
    return out


def disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tinyllama")
    p.add_argument("--layout", default="hub")
    p.add_argument("--root", type=Path, default=Path("/tmp/hf-rebasin-bench"))
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=PAIRS)
    p.add_argument("--moved-noise", type=float, default=MOVED_NOISE, help="the moved copy's noise (share of RMS)")
    p.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per pair")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--data", type=int, default=0, metavar="BATCHES", help="alignment data: batches of random tokens")
    p.add_argument("--one", type=Path, nargs=2, default=None, help=argparse.SUPPRESS)  # the --data child process
    args = p.parse_args()
    if args.one is not None:
        one_pair_with_data(*args.one, args.data)
        return
    root = args.root.expanduser().absolute()
    seed0, seed1 = make(args.shape, args.layout, root)
    b_of = {"independent": seed1}
    if "finetune" in args.pairs:
        b_of["finetune"] = make_finetune(args.shape, args.layout, root)
    if "moved" in args.pairs:
        name = f"{args.shape}-{args.layout}-moved-n{args.moved_noise:g}-seed{SEEDS[0]}"
        b_of["moved"] = make_moved(seed0, seed0.with_name(name), args.moved_noise)
    lm = load_model(seed0, stream=True)
    expected = lineage_bytes([lm, lm], data_tokens=8 * 128 * args.data)
    model = disk_bytes(seed0)
    rows = []
    for name in args.pairs:
        print(f"{name}: {seed0.name} vs {b_of[name].name}", flush=True)
        found = run_pair(seed0, b_of[name], args.timeout, args.data)
        found["pair"] = name
        rows.append(found)
        print(json.dumps(found), flush=True)
    print(f"\none model: {model / GB:.2f} GB on disk ({args.shape}); expected peak {expected / GB:.2f} GB\n")
    data = f", alignment data: {args.data} batches of random tokens" if args.data else ", data-free"
    print(
        f"| pair{data} | verdict | statistic (aligned / as stored) | split | activations | align | bulks | wall s | peak RSS |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if r["exit"] != 0:
            print(f"| {r['pair']} | exit {r['exit']} | | | | | | {r['wall']:.0f} | |")
            continue
        s = r["seconds"]
        assert isinstance(s, dict)
        peak = r["peak"]
        assert isinstance(peak, int)
        print(
            f"| {r['pair']} | {r['verdict']} | {r['statistic']:.3f} / {r['raw']:.3f} | {s['split']:.0f} | "
            f"{s.get('activations', 0):.0f} | {s['align']:.0f} | {s['evidence']:.0f} | {r['wall']:.0f} | "
            f"{peak / GB:.2f} GB ({peak / model:.2f}×) |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
