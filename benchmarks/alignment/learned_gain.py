"""Where learned matching's gain comes from, on a zoo pair (seeds 0 → 1): a better correspondence
between the two models, or a map under which their average happens to work.

    python benchmarks/alignment/learned_gain.py --kind bench-t5-long   # ≈ 6 min on one core
    python benchmarks/alignment/learned_gain.py --kind bench-mbart

Generalized-orthogonal is run data-free (``glu: balance``, as learned matching balances gated units)
and with ``learned: true`` (150 steps, lr 0.01, ``bench_barriers.py``'s row). Printed:

1. each space's two maps compared: tr(M_GOᵀ M_learned) / n for a residual or unit space (1: the same
   map), the share of heads sent to the same place for a head space;
2. each group of tensors' mean cosine to A's, with B mapped by either transform: how far each
   map makes B's weights *look like* A's (data-free strategies maximize exactly that);
3. the loss at λ = ¼, ½, ¾ (A's weight) above the ends' mean, for each transform and for the hybrids (learned
   residual maps with generalized-orthogonal's heads and units, and the converse), each a transform
   of B that keeps its function.

Where learned matching lowers the barrier while every group's cosine falls, its maps are not a better
correspondence: no similarity-driven (data-free) matching would choose them.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_barriers

from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.evaluation.evaluate import lambdas, loss_curve, task_of
from hf_rebasin.evaluation.zoo.train import cached_model, held_out_batches
from hf_rebasin.io.models import load_model
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.spaces import Space
from hf_rebasin.symmetry.transforms import AxisMap, HeadMap

LEARNED = {"learned": True, "steps": 150, "lr": 0.01}


def agreement(m: Any, m0: Any) -> str:
    """How alike two maps of one space are (see the module's docstring)."""
    if isinstance(m, AxisMap):
        return f"{(m0.matrix() * m.matrix()).sum().item() / m.size:.3f}"
    if isinstance(m, HeadMap):
        same = (m.kv_perm == m0.kv_perm).float().mean().item()
        return f"{same:.2f} of heads"
    return type(m).__name__


def group(name: str) -> str:
    """A tensor's group: its name with layer numbers and the weight/bias suffix dropped."""
    return re.sub(r"\.\d+\.", ".*.", name).removesuffix(".weight").removesuffix(".bias")


def cosines(sd_a: Any, sd_b: Any) -> dict[str, float]:
    """Mean cosine of each group's tensors, A's against B's."""
    got: dict[str, list[float]] = defaultdict(list)
    for k, x in sd_a.items():
        if x.is_floating_point() and x.numel() > 1:
            x, y = x.double().flatten(), sd_b[k].double().flatten()
            got[group(k)].append((x @ y / (x.norm() * y.norm()).clamp_min(1e-30)).item())
    return {g: sum(v) / len(v) for g, v in got.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="bench-t5-long", choices=bench_barriers.KINDS, help="the zoo pair")
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens scored")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    folders = cached_model(args.kind, 0), cached_model(args.kind, 1)  # type: ignore[arg-type]
    a, b = (load_model(f) for f in folders)
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    data = bench_barriers.alignment_data(args.kind, folders[0], 8)
    pair = Pair(a.graph, sd_a, sd_b, a.model, b.model, data)
    go = align("generalized-orthogonal", pair, {"glu": "balance"})
    learned = align("generalized-orthogonal", pair, LEARNED)
    graph, lt, gt = learned.graph, learned.transform, go.transform
    print(f"**{args.kind}**: maps of generalized-orthogonal against learned matching", "", sep="\n")
    print("| space | kind | agreement |", "|---|---|---|", sep="\n")
    for name, m in lt.items():
        print(f"| {name} | {getattr(graph.spaces[name], 'kind', 'heads')} | {agreement(m, gt[name])} |")
    streams = {n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual"}
    transforms = {  # all applied to learned matching's B (its gated units balanced and rescaled)
        "generalized-orthogonal": gt,
        "learned": lt,
        "learned residual maps, GO heads and units": {n: lt[n] if n in streams else gt[n] for n in lt},
        "GO residual maps, learned heads and units": {n: gt[n] if n in streams else lt[n] for n in lt},
    }
    mapped = {k: graph.apply(learned.sd_b, t) for k, t in transforms.items()}
    cos = {k: cosines(learned.sd_a, sd) for k, sd in mapped.items()}
    print("", "| tensors | cosine to A, GO | cosine to A, learned |", "|---|---:|---:|", sep="\n")
    for g in cos["learned"]:
        print(f"| {g} | {cos['generalized-orthogonal'][g]:.3f} | {cos['learned'][g]:.3f} |")
    model = rebuild(a.model, dict(learned.sd_a), untie=bool(learned.untied))
    evaluation = bench_barriers.first_tokens(held_out_batches(folders[0]), args.tokens)
    print("", "| transform of B | λ = ¼ | λ = ½ | λ = ¾ |", "|---|---:|---:|---:|", sep="\n")
    for label, sd in mapped.items():
        curve = loss_curve(model, learned.sd_a, sd, evaluation, task_of(model), lambdas(5))
        ends = (curve.losses[0] + curve.losses[-1]) / 2
        print(f"| {label} | " + " | ".join(f"{x - ends:.3f}" for x in curve.losses[1:4]) + " |", flush=True)


if __name__ == "__main__":
    main()
