"""Seconds and peak memory of `hf-rebasin lineage` across depths at TinyLlama width, streamed.

    python benchmarks/lineage/bench_lineage_depth.py                      # 32 layers vs a 48-layer up-scaled copy
    python benchmarks/lineage/bench_lineage_depth.py --pairs related independent

Random bf16 models of TinyLlama's widths (d 2,048, 5,632 units, 32 heads over 4 KV heads, 32,000
tokens) with 32 layers, seeds 0 and 1, written under ``--root``; and SOLAR-style up-scaled copies
of each: layers 0–23 then 8–31 (48 layers), every tensor plus 5 % of its RMS in noise (a light
training on top). Pairs: ``related`` (seed 0, its up-scaled copy) and ``independent`` (seed 0, seed
1's up-scaled copy). Each runs as ``/usr/bin/time -v hf-rebasin lineage A B --json`` in a fresh
process; printed: the verdict, whether the layer map is the one the copy was built with, the
record's stage seconds, wall seconds, and peak RSS in GB and as a multiple of the 32-layer model's
bytes on disk.
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
import transformers as T
from safetensors import safe_open

from hf_rebasin.io.tensors import write_safetensors

GB = 1e9
KEEP = [*range(0, 24), *range(8, 32)]  # SOLAR 10.7B's recipe on a 32-layer model: 48 layers
NOISE = 0.05


def config(layers: int) -> T.LlamaConfig:
    return T.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def make_base(folder: Path, seed: int) -> Path:
    """A random 32-layer model: norms 1, every other tensor N(0, 0.02²), in bfloat16."""
    if folder.exists():
        return folder
    cfg = config(32)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in T.LlamaForCausalLM(cfg).state_dict().items()}
    names = list(shapes)

    def produce(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name])
        g = torch.Generator().manual_seed(seed * 100_000 + names.index(name))
        return 0.02 * torch.randn(shapes[name], generator=g)

    return _write(folder, cfg, [(n, shapes[n], torch.bfloat16) for n in names], produce)


def make_upscaled(base: Path, folder: Path, seed: int = 7) -> Path:
    """``base``'s layers ``KEEP`` in that order, every tensor plus ``NOISE`` of its RMS in noise."""
    if folder.exists():
        return folder
    cfg = config(len(KEEP))
    pattern = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        stored = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # a safe_open handle
    entries = []
    source: dict[str, str] = {}
    for name in stored:
        found = pattern.match(name)
        if found is None:
            entries.append((name, stored[name], torch.bfloat16))
            source[name] = name
            continue
    for j, i in enumerate(KEEP):
        for name in stored:
            found = pattern.match(name)
            if found is not None and int(found.group(1)) == i:
                new = f"model.layers.{j}.{found.group(2)}"
                entries.append((new, stored[name], torch.bfloat16))
                source[new] = name
    order = [e[0] for e in entries]

    def produce(name: str) -> torch.Tensor:
        with safe_open(str(base / "model.safetensors"), "pt") as f:
            t = f.get_tensor(source[name]).float()
        if t.numel() > 1:
            g = torch.Generator().manual_seed(seed * 100_000 + order.index(name))
            t = t + NOISE * t.pow(2).mean().sqrt() * torch.randn(t.shape, generator=g)
        return t

    return _write(folder, cfg, entries, produce)


def _write(folder: Path, cfg: T.LlamaConfig, entries: list, produce) -> Path:
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg.save_pretrained(str(tmp))
    start = time.perf_counter()
    write_safetensors(tmp / "model.safetensors", entries, produce)
    tmp.rename(folder)
    print(f"make: {folder.name} ({len(entries)} tensors) in {time.perf_counter() - start:.0f}s", flush=True)
    return folder


def run_pair(a: Path, b: Path, timeout: float) -> dict[str, object]:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "hf_rebasin", "lineage", str(a), str(b), "--json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    said = re.search(r"about (.+?) on this machine", proc.stderr)
    if proc.returncode != 0:
        return {"exit": proc.returncode, "error": proc.stderr[-2000:]}
    pair = json.loads(proc.stdout[proc.stdout.index("{") :])["pairs"][0]
    lmap = pair["layer_map"] or {"layers": []}
    return {
        "verdict": pair["verdict"],
        "statistic": pair["statistic"],
        "map": [m["source"] for m in lmap["layers"]],
        "mapped": lmap.get("model"),
        "seconds": pair["seconds"],
        "wall": wall,
        "peak": int(peak.group(1)) * 1024 if peak else None,
        "estimate": said.group(1) if said else "?",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/tmp/hf-rebasin-bench/depth"))
    p.add_argument("--pairs", nargs="+", default=["related"], choices=["related", "independent"])
    p.add_argument("--timeout", type=float, default=7200)
    args = p.parse_args()
    bases = {s: make_base(args.root / f"tinyllama32-seed{s}", s) for s in (0, 1)}
    ups = {s: make_upscaled(bases[s], args.root / f"tinyllama48-up-seed{s}") for s in (0, 1)}
    one = (bases[0] / "model.safetensors").stat().st_size
    print(
        f"one 32-layer model: {one / GB:.2f} GB; the 48-layer copy: {(ups[0] / 'model.safetensors').stat().st_size / GB:.2f} GB"
    )
    for name in args.pairs:
        b = ups[0] if name == "related" else ups[1]
        r = run_pair(bases[0], b, args.timeout)
        if "error" in r:
            print(f"{name}: exit {r['exit']}\n{r['error']}")
            continue
        exact = r["map"] == KEEP and r["mapped"] == 1
        kin = sum(m is not None for m in r["map"])  # type: ignore[union-attr]
        secs = " / ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items())  # type: ignore[union-attr]
        peak = r["peak"] or 0
        print(
            f"{name}: {r['verdict']} (aligned {r['statistic']:.3f}); layer map "
            f"{'exact' if exact else 'not the built one'} ({kin} of {len(r['map'])} layers with a kin source); seconds {secs}; wall {r['wall']:.0f} s "
            f"(estimated before: {r['estimate']}); "
            f"peak RSS {peak / GB:.2f} GB ({peak / one:.2f}× one model)",
            flush=True,
        )


if __name__ == "__main__":
    main()
