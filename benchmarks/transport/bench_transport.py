"""Transport of a fine-tune onto another base (issue 6's real transfer): A and B are zoo GPT-2
trained from different seeds on five tragedies; the fine-tune of A is a full one
(``zoo:gpt2-ft-seedN``) or a PEFT LoRA adapter (``zoo:gpt2-lora-seedN``), both trained on
*The Merry Wives of Windsor*. At α = 1, the task loss (nats, that play's held-out text), the
support loss (B's own held-out pretraining text) and the share of the task-loss gap between B and
the fine-tune on A that is closed, for

- B, the naive B + τ (and the LoRA loaded on B unmoved),
- B + π(τ) for weight matching, transfusion and generalized-orthogonal (GO), each with one
  residual map (`global`) and with one map per stream between sublayers (`per-sublayer`,
  TransFusion's Step 3); for the LoRA also GO with the residual stream matched by permutation only.

LoRA numbers are those of the moved adapter written by ``save_adapter`` and loaded with
``PeftModel.from_pretrained(B, folder)``, as a user would.

    python benchmarks/transport/bench_transport.py                     # pairs 0→1 1→0 0→2 2→0 (~3 min, trains the zoo on first use)
    python benchmarks/transport/bench_transport.py --pairs 0:1
    python benchmarks/transport/bench_transport.py --lora-lr 3e-3 --lora-rank 8 --lora-alpha 16   # a LoRA that moved further
    python benchmarks/transport/bench_transport.py --rerelease   # B = zoo:gpt2-next-seedA, A's training continued

``tests/evaluation/test_trained.py`` runs the same code on 0 → 1 and checks the claims.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hf_rebasin.alignment.strategies import Alignment, Pair, align
from hf_rebasin.evaluation.evaluate import evaluate_loss
from hf_rebasin.evaluation.zoo.catalogue import GPT2LoraConfig
from hf_rebasin.evaluation.zoo.train import cached_model, held_out_batches
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.lora import apply_adapter, lora_graph, read_adapter, save_adapter, transport_adapter
from hf_rebasin.merging.transport import add_task_vector, task_vector
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.sublayers import per_sublayer

FULL = [  # (key, label, strategy, residual maps)
    ("full_naive", "naive", "vanilla", "global"),
    ("full_wm", "weight-matching", "weight-matching", "global"),
    ("full_wm_sub", "weight-matching, per-sublayer", "weight-matching", "per-sublayer"),
    ("full_transfusion", "transfusion, global", "transfusion", "global"),
    ("full_transfusion_sub", "transfusion, per-sublayer", "transfusion", "per-sublayer"),
    ("full_go", "GO", "generalized-orthogonal", "global"),
    ("full_go_sub", "GO, per-sublayer", "generalized-orthogonal", "per-sublayer"),
]
LORA = [  # (key, label, strategy, residual maps); the permutation graph where the canonical form is not followed
    ("lora_naive", "naive (unmoved)", None, None),
    ("lora_go", "GO (canonical form)", "generalized-orthogonal", "global"),
    ("lora_go_perm", "GO, residual permuted", "generalized-orthogonal", "global"),
    ("lora_transfusion", "transfusion, global", "transfusion", "global"),
    ("lora_transfusion_sub", "transfusion, per-sublayer", "transfusion", "per-sublayer"),
]
COLUMNS = [
    ("target", "B"),
    *((k, f"full: {label}") for k, label, *_ in FULL),
    *((k, f"LoRA: {label}") for k, label, *_ in LORA),
]


def _gpt2(folder: Path) -> Any:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(str(folder))


def _losses(model: Any, batches: list, support: list) -> tuple[float, float]:
    return evaluate_loss(model, batches, "causal-lm").loss, evaluate_loss(model, support, "causal-lm").loss


def _adapter(folder: Path, target_folder: Path, batches: list, support: list) -> tuple[float, float]:
    from peft import PeftModel

    return _losses(PeftModel.from_pretrained(_gpt2(target_folder), str(folder)), batches, support)


def _moved_adapter(
    adapter: Any, graph: Any, alignment: Alignment, a: Any, b: Any, b_folder: Path, batches: list, support: list
) -> tuple[float, float]:
    sd_a, sd_b = a.state_dict(), b.state_dict()
    canonical = alignment.graph if alignment.canonical else None
    tensors, whole = transport_adapter(adapter, graph, alignment.transform, sd_a, sd_b, canonical_graph=canonical)
    with tempfile.TemporaryDirectory() as tmp:
        save_adapter(adapter, tensors, Path(tmp), base_model=str(b_folder), target=sd_b, whole=whole)
        return _adapter(Path(tmp), b_folder, batches, support)


def transport_row(
    seed_a: int, seed_b: int, lora: GPT2LoraConfig | None = None, target_kind: str = "gpt2"
) -> dict[str, Any]:
    """Task losses at α = 1 of one A → B pair (keys of ``COLUMNS``; ``key:support`` the loss on B's
    held-out pretraining text; plus the fine-tunes on A); ``target_kind="gpt2-next"``: B is the
    re-release of the GPT-2 of ``seed_b``."""
    a_folder, b_folder = cached_model("gpt2", seed_a), cached_model(target_kind, seed_b)
    ft_folder, lora_folder = cached_model("gpt2-ft", seed_a), cached_model("gpt2-lora", seed_a, config=lora)
    batches, support = held_out_batches(ft_folder, 32), held_out_batches(b_folder, 32)
    a, b, ft = _gpt2(a_folder), _gpt2(b_folder), _gpt2(ft_folder)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    graph = graph_for(b.config, sd_b.keys())
    perm_graph = lora_graph(graph)[0]  # what an adapter follows when it cannot take the canonical form
    adapter = read_adapter(lora_folder, a)
    sd_lora = apply_adapter(adapter, sd_a)

    label = f"{seed_a} → {seed_b}" if target_kind == "gpt2" else f"{seed_a} → {target_kind}-seed{seed_b}"
    row: dict[str, Any] = {"pair": label}
    row["target"], row["target:support"] = _losses(b, batches, support)
    row["full_ft"], row["full_ft:support"] = _losses(ft, batches, support)
    row["lora_ft"], _ = _adapter(lora_folder, a_folder, batches, support)
    row["lora_dense_ft"] = evaluate_loss(rebuild(a, sd_lora), batches, "causal-lm").loss
    start = time.perf_counter()
    for key, _label, strategy, maps in FULL:
        options = {} if strategy == "vanilla" else {"residual_maps": maps}
        alignment = align(strategy, Pair(graph, sd_b, sd_a), options)
        theta = add_task_vector(alignment.sd_a, task_vector(alignment, graph, ft.state_dict()), 1.0)
        row[key], row[f"{key}:support"] = _losses(rebuild(b, theta, untie=bool(alignment.untied)), batches, support)
    for key, _label, strategy, maps in LORA:
        if strategy is None:
            row[key], row[f"{key}:support"] = _adapter(lora_folder, b_folder, batches, support)
            continue
        g = graph if key == "lora_go" else perm_graph
        alignment = align(strategy, Pair(g, sd_b, sd_a), {"residual_maps": maps})
        g = per_sublayer(g) if maps == "per-sublayer" else g  # the factors follow their own sublayers' maps
        row[key], row[f"{key}:support"] = _moved_adapter(adapter, g, alignment, a, b, b_folder, batches, support)
    row["seconds"] = time.perf_counter() - start
    return row


def gap_closed(row: dict[str, Any], key: str) -> float:
    """The share of the task-loss gap between B and the fine-tune on A that B + π(τ) closes."""
    ft = row["lora_ft" if key.startswith("lora") else "full_ft"]
    return (row["target"] - row[key]) / (row["target"] - ft)


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per pair and method: task loss, support loss, share of the gap closed."""
    lines = ["| A → B | method | task loss | support loss | gap closed |", "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['pair']} | B | {r['target']:.3f} | {r['target:support']:.3f} | 0 % |")
        lines.append(f"| {r['pair']} | full fine-tune on A | {r['full_ft']:.3f} | {r['full_ft:support']:.3f} | 100 % |")
        for key, label in COLUMNS[1:]:
            lines.append(
                f"| {r['pair']} | {label} | {r[key]:.3f} | {r[key + ':support']:.3f} | {100 * gap_closed(r, key):.0f} % |"
            )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per method, over the pairs: median gap closed and the median support loss above B."""
    lines = ["| method | gap closed, median (range) | support − B, median (range) |", "|---|---:|---:|"]
    for key, label in COLUMNS[1:]:
        gaps = sorted(100 * gap_closed(r, key) for r in rows)
        costs = sorted(r[key + ":support"] - r["target:support"] for r in rows)
        lines.append(
            f"| {label} | {statistics.median(gaps):.0f} % ({gaps[0]:.0f} to {gaps[-1]:.0f}) "
            f"| {statistics.median(costs):+.3f} ({costs[0]:+.3f} to {costs[-1]:+.3f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=None, help="A:B seed pairs (default 0:1 1:0 0:2 2:0)")
    parser.add_argument(
        "--rerelease",
        action="store_true",
        help="B is zoo:gpt2-next (A's training continued); default pairs 0:0 1:1 2:2",
    )
    parser.add_argument("--lora-lr", type=float, default=None, help="train the LoRA at this rate instead")
    parser.add_argument("--lora-rank", type=int, default=None)
    parser.add_argument("--lora-alpha", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    changes = {"lr": args.lora_lr, "rank": args.lora_rank, "lora_alpha": args.lora_alpha}
    lora = dataclasses.replace(GPT2LoraConfig(), **{k: v for k, v in changes.items() if v is not None})
    pairs = args.pairs or (["0:0", "1:1", "2:2"] if args.rerelease else ["0:1", "1:0", "0:2", "2:0"])
    rows = []
    for pair in pairs:
        seed_a, seed_b = (int(s) for s in pair.split(":"))
        rows.append(transport_row(seed_a, seed_b, lora, "gpt2-next" if args.rerelease else "gpt2"))
        r = rows[-1]
        print(
            f"{r['pair']}: {r['seconds']:.1f} s; LoRA on A {r['lora_ft']:.4f} (dense {r['lora_dense_ft']:.4f})",
            flush=True,
        )
    print(f"\nLoRA: rank {lora.rank}, lora_alpha {lora.lora_alpha}, lr {lora.lr}, {lora.steps} steps\n")
    print(markdown(rows))
    print()
    print(summary(rows))


if __name__ == "__main__":
    main()
