"""Time the foundation on full-size random models: graph build, canonical form, apply.

    python benchmarks/cost/bench_apply.py [--arch bert|gpt2|all]

Prints seconds per stage and the max |Δ logits| of the transformed model (float32).
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers as T

from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.canonical import canonicalize

ARCHS = {
    "bert": lambda: T.BertForMaskedLM(T.BertConfig()),  # BERT-base: 12 layers, d=768, MLP 3072, 12 heads
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config()),  # GPT-2 small: 12 layers, d=768, 12 heads
}


def bench(arch: str) -> None:
    torch.manual_seed(0)
    model = ARCHS[arch]().eval()
    n_params = sum(p.numel() for p in model.parameters())
    sd = model.state_dict()
    ids = torch.randint(0, 1000, (2, 64))
    with torch.no_grad():
        ref = model(ids).logits
    for cls in ("permutation", "orthogonal"):
        t0 = time.perf_counter()
        graph = graph_for(model.config, sd.keys())
        t1 = time.perf_counter()
        src, g2, untied = canonicalize(graph, sd) if cls == "orthogonal" else (sd, graph, [])
        t2 = time.perf_counter()
        transform = g2.random_transform(cls, torch.Generator().manual_seed(1))
        t3 = time.perf_counter()
        out = g2.apply(src, transform)
        t4 = time.perf_counter()
        with torch.no_grad():
            diff = (rebuild(model, out, untie=bool(untied))(ids).logits - ref).abs().max().item()
        print(
            f"{arch:5s} {n_params / 1e6:6.1f}M {cls:12s} graph {t1 - t0:6.3f}s  canonical {t2 - t1:6.3f}s  "
            f"sample {t3 - t2:6.3f}s  apply {t4 - t3:6.3f}s  max|Δlogits| {diff:.1e}"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="all", choices=[*ARCHS, "all"])
    args = ap.parse_args()
    for arch in ARCHS if args.arch == "all" else [args.arch]:
        bench(arch)
