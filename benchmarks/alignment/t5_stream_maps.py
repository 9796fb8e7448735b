"""Which permutation of the residual stream each source of evidence picks on two zoo T5s (``bench-t5``
seeds 0 and 1, or ``--kind bench-t5-long``, trained three times as long), how well each fits the others,
and what a map per stream would buy.

    python benchmarks/alignment/t5_stream_maps.py              # a minute on one core, once the pair is trained
    python benchmarks/alignment/t5_stream_maps.py --apart      # + barriers with a map per stream (≈ 5 min)
    python benchmarks/alignment/t5_stream_maps.py --parts      # + each matching's parts alone (≈ 8 min)

First the linear CKA of the two seeds' input tables (``shared``) and heads (``lm_head``): how far the
vocabulary each learned is one vocabulary up to a rotation.

Prints three tables (four with ``--apart``). First, per permutation, the mean correlation of the heads' matched columns under
it and the share of features on which each pair of permutations agrees (the head's columns, the input
table's, weight matching, head-perm). Second, the stream's activations at every layer of each stack
(``enc0`` the input table's output … ``enc4`` the encoder's output, after its final norm; ``dec0`` …
``dec4`` likewise), the same training text through both models: the mean correlation of matched
features at each site under the permutation each site, each stack (summed evidence) and each table
picks. Third, the same layers matched by a permutation, by a rotation per stack, by one rotation for
both stacks and by the head's rotation. One map serves both stacks (one table feeds them); where the
stacks want different permutations, no permutation fits both, though one rotation may. ``--apart`` then measures that: the encoder's stream given a space of its own
(its table stored apart from ``shared``, as transformers 5 reads a checkpoint whose two tables differ),
and the midpoint barrier of each data-free strategy and head-perm, as ``bench_barriers.py`` measures it.
``--parts`` (`bench_barriers.py --parts`) takes weight matching's, head-perm's and generalized-orthogonal's transforms apart: the
midpoint barrier (3 λ) with the whole transform, with its residual map alone and with its heads and
units alone, each a transform of B that keeps its function.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
from scipy.optimize import linear_sum_assignment

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_barriers

from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.evaluation.evaluate import barrier, lambdas, loss_curve, task_of
from hf_rebasin.evaluation.zoo.train import cached_model, held_out_batches
from hf_rebasin.io.models import load_model
from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, SpaceT
from hf_rebasin.symmetry.adapters.t5 import T5

ENCODER_SIDE = ("encoder.", "EncDecAttention.k.", "EncDecAttention.v.")  # tensors reading the encoder's stream


def _corr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Correlations of x's columns (features) with y's."""
    x, y = (x - x.mean(0)) / (x.std(0) + 1e-8), (y - y.mean(0)) / (y.std(0) + 1e-8)
    return (x.T @ y / len(x)).double()


def cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of two tables' rows (1: the same up to a rotation and a scale; about 0: unrelated)."""
    x, y = x.double() - x.double().mean(0), y.double() - y.double().mean(0)
    return float((x.T @ y).norm() ** 2 / ((x.T @ x).norm() * (y.T @ y).norm()))


def _perm(corr: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(linear_sum_assignment(-corr.numpy())[1])


def _maps_table(a: Any, b: Any, data: Any) -> str:
    """The first table: the head's, the table's, weight matching's and head-perm's permutations."""
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    perms = {t: _perm(_corr(sd_a[t].double(), sd_b[t].double())) for t in ("lm_head.weight", "shared.weight")}
    for name, options in (("weight-matching", {}), ("head-perm", {"residual": "all"})):
        alignment = align(name, Pair(a.graph, sd_a, sd_b, a.model, b.model, data), options)
        perms[name] = alignment.transform["res"].index
    head = _corr(sd_a["lm_head.weight"].double(), sd_b["lm_head.weight"].double())
    rows = torch.arange(head.shape[0])
    lines = ["| permutation from | heads' columns, mean correlation | " + " | ".join(perms) + " |"]
    lines.append("|---|---:|" + "---:|" * len(perms))
    for name, p in perms.items():
        agree = " | ".join(f"{float((p == q).double().mean()):.2f}" for q in perms.values())
        lines.append(f"| {name} | {float(head[rows, p].mean()):.3f} | {agree} |")
    return "\n".join(lines)


def _site_activations(a: Any, b: Any, data: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per stream site, A's and B's features at the data's scored positions (rows), in float64."""
    got: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    keys = ("input_ids", "attention_mask", "decoder_input_ids", "labels")
    with torch.no_grad():
        for batch in data.batches:
            batch = {k: v for k, v in batch.items() if k in keys}
            out_a = a.model(**batch, output_hidden_states=True)
            out_b = b.model(**batch, output_hidden_states=True)
            masks = {"enc": batch["attention_mask"].bool(), "dec": batch["labels"] != -100}
            for stack, states in (("enc", "encoder_hidden_states"), ("dec", "decoder_hidden_states")):
                for i, (x, y) in enumerate(zip(getattr(out_a, states), getattr(out_b, states), strict=True)):
                    got.setdefault(f"{stack}{i}", []).append((x[masks[stack]].double(), y[masks[stack]].double()))
    return {site: (torch.cat([x for x, _ in v]), torch.cat([y for _, y in v])) for site, v in got.items()}


def _sites_table(a: Any, b: Any, acts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> str:
    """The second table: each site's fit under each site's, each stack's and each table's permutation."""
    sites = {site: _corr(x, y) for site, (x, y) in acts.items()}
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    perms = {t: _perm(_corr(sd_a[f"{t}.weight"].double(), sd_b[f"{t}.weight"].double())) for t in ("lm_head", "shared")}
    for stack in ("enc", "dec"):
        perms[f"{stack}, all sites"] = _perm(sum(c for s, c in sites.items() if s.startswith(stack)))
    perms.update({s: _perm(c) for s, c in sites.items()})
    rows = torch.arange(next(iter(sites.values())).shape[0])
    lines = ["| permutation from | " + " | ".join(sites) + " |", "|---|" + "---:|" * len(sites)]
    for name, p in perms.items():
        lines.append(f"| {name} | " + " | ".join(f"{float(c[rows, p].mean()):.2f}" for c in sites.values()) + " |")
    return "\n".join(lines)


def _procrustes(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The orthogonal R that brings y's features onto x's: x ≈ y R."""
    u, _, vt = torch.linalg.svd(y.T @ x)
    return u @ vt


def _rotations_table(a: Any, acts: dict[str, tuple[torch.Tensor, torch.Tensor]], b: Any) -> str:
    """The third table: each stack's layers (the table's output left out) matched by a permutation, by a
    rotation of its own, by one rotation for both stacks and by the head's rotation: the mean
    correlation of A's features with B's mapped ones."""
    stacks = {
        s: tuple(torch.cat([v[k] for n, v in acts.items() if n.startswith(s) and n != f"{s}0"]) for k in (0, 1))
        for s in ("enc", "dec")
    }
    joint = _procrustes(*(torch.cat([xy[k] / xy[k].norm() for xy in stacks.values()]) for k in (0, 1)))
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    head = _procrustes(sd_a["lm_head.weight"].double(), sd_b["lm_head.weight"].double())
    fit = {
        "a permutation per stack": lambda x, y: y[:, _perm(_corr(x, y))],
        "a rotation per stack": lambda x, y: y @ _procrustes(x, y),
        "one rotation for both stacks": lambda x, y: y @ joint,
        "the head's rotation (lm_head's Procrustes)": lambda x, y: y @ head,
    }
    lines = ["| map | encoder layers | decoder layers |", "|---|---:|---:|"]
    for name, mapped in fit.items():
        cells = [float(_corr(x, mapped(x, y)).diagonal().mean()) for x, y in stacks.values()]
        lines.append(f"| {name} | {cells[0]:.2f} | {cells[1]:.2f} |")
    return "\n".join(lines)


def streams_apart(spec: ArchitectureSpec) -> ArchitectureSpec:
    """``spec`` with the encoder's stream a space of its own (``enc.res``): every tensor and norm that
    reads or writes the encoder's stream moved to it, its table no longer tied to ``shared``."""

    def moved(template: str, axes: tuple[Any, ...]) -> tuple[Any, ...]:
        side = any(part in template for part in ENCODER_SIDE)
        return tuple("enc.res" if side and axis == "res" else axis for axis in axes)

    table = "{base}encoder.embed_tokens.weight"
    return dataclasses.replace(
        spec,
        spaces=(*spec.spaces, SpaceT("enc.res", "d", "orthogonal", kind="residual")),
        tensors={t: moved(t, axes) for t, axes in spec.tensors.items()},
        norms=tuple(dataclasses.replace(n, space="enc.res") if "encoder." in n.prefix else n for n in spec.norms),
        ties={k: v for k, v in spec.ties.items() if k != table},
        forced_ties=tuple(k for k in spec.forced_ties if k != table),
        last_hidden={"enc.res": "{base}encoder"},
    )


def _apart_table(a: Any, b: Any, data: Any, folder: Path, tokens: int = 16384) -> str:
    """The third table: barriers with the encoder's table stored apart and a map per stream."""
    sd_a, sd_b = dict(a.model.state_dict()), dict(b.model.state_dict())
    for sd in (sd_a, sd_b):
        sd["encoder.embed_tokens.weight"] = sd["encoder.embed_tokens.weight"].clone()
    graph = streams_apart(T5).graph(a.model.config, sd_a.keys())
    model = a.model
    model.encoder.embed_tokens = torch.nn.Embedding.from_pretrained(sd_a["encoder.embed_tokens.weight"], freeze=False)
    model.all_tied_weights_keys = {k: v for k, v in model.all_tied_weights_keys.items() if "encoder." not in k}
    evaluation = bench_barriers.first_tokens(held_out_batches(folder), tokens)
    lines = ["| strategy | midpoint barrier, a map per stream |", "|---|---:|"]
    for name in ("vanilla", "weight-matching", "transfusion", "generalized-orthogonal", "head-perm"):
        options = {"residual": "all"} if name == "head-perm" else {}
        alignment = align(name, Pair(graph, sd_a, sd_b, a.model, b.model, data), options)
        curve = loss_curve(model, dict(alignment.sd_a), alignment.aligned_b(), evaluation, task_of(model), lambdas(11))
        lines.append(f"| {name} | {barrier(curve.lambdas, curve.losses)['midpoint']:.3f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--apart", action="store_true", help="also measure barriers with a map per stream")
    parser.add_argument("--parts", action="store_true", help="also: barriers of each matching's parts (≈ 8 min)")
    parser.add_argument("--kind", default="bench-t5", choices=("bench-t5", "bench-t5-long"), help="the zoo pair")
    args = parser.parse_args(argv)
    folders = cached_model(args.kind, 0), cached_model(args.kind, 1)
    a, b = (load_model(f) for f in folders)
    a.model.eval(), b.model.eval()
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    tables = ", ".join(f"{t} {cka(sd_a[t], sd_b[t]):.3f}" for t in ("shared.weight", "lm_head.weight"))
    print(f"linear CKA of the two seeds' tables: {tables}", end="\n\n")
    data = bench_barriers.alignment_data(args.kind, folders[0], 8)
    print(_maps_table(a, b, data), end="\n\n")
    acts = _site_activations(a, b, data)
    print(_sites_table(a, b, acts), end="\n\n")
    print(_rotations_table(a, acts, b), end="\n\n")
    if args.apart:
        print(_apart_table(a, b, data, folders[0]), end="\n\n")
    if args.parts:
        print(bench_barriers.parts_table(args.kind))


if __name__ == "__main__":
    main()
