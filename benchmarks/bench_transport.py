"""Transport of a fine-tune onto another base (issue 6's real transfer): A and B are zoo GPT-2
trained from different seeds on five tragedies; the fine-tune of A is a full one
(``zoo:gpt2-ft-seedN``) or a PEFT LoRA adapter (``zoo:gpt2-lora-seedN``), both trained on
*The Merry Wives of Windsor*. Task loss (nats, that play's held-out text) at α = 1 of

- B, the naive B + τ (and the LoRA loaded on B unmoved),
- B + π(τ) for generalized-orthogonal (GO) and transfusion, and for the LoRA also GO with the
  residual stream matched by permutation only.

LoRA numbers are those of the moved adapter written by ``save_adapter`` and loaded with
``PeftModel.from_pretrained(B, folder)``, as a user would.

    python benchmarks/bench_transport.py                     # pairs 0→1 1→0 0→2 2→0 (~4 min, trains the zoo on first use)
    python benchmarks/bench_transport.py --pairs 0:1
    python benchmarks/bench_transport.py --lora-lr 3e-3 --lora-rank 8 --lora-alpha 16   # a LoRA that moved further
    python benchmarks/bench_transport.py --rerelease   # B = zoo:gpt2-next-seedA, A's training continued

``tests/test_trained.py`` runs the same code on 0 → 1 and checks the claims.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.adapters import graph_for
from hf_rebasin.evaluate import evaluate_loss
from hf_rebasin.lora import apply_adapter, lora_graph, read_adapter, save_adapter, transport_adapter
from hf_rebasin.models import rebuild
from hf_rebasin.strategies import Alignment, Pair, align
from hf_rebasin.train import GPT2LoraConfig, cached_model, held_out_batches
from hf_rebasin.transport import add_task_vector, task_vector

COLUMNS = [
    ("target", "B"),
    ("full_naive", "full: naive"),
    ("full_go", "full: GO"),
    ("full_transfusion", "full: transfusion"),
    ("lora_naive", "LoRA: naive"),
    ("lora_go", "LoRA: GO"),
    ("lora_go_perm", "LoRA: GO, residual permuted"),
    ("lora_transfusion", "LoRA: transfusion"),
]


def _gpt2(folder: Path) -> Any:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(str(folder))


def _full_loss(template: Any, alignment: Alignment, graph: Any, sd_ft: dict[str, Tensor], batches: list) -> float:
    theta = add_task_vector(alignment.sd_a, task_vector(alignment, graph, sd_ft), 1.0)
    return evaluate_loss(rebuild(template, theta, untie=bool(alignment.untied)), batches, "causal-lm").loss


def _adapter_loss(folder: Path, target_folder: Path, batches: list) -> float:
    from peft import PeftModel

    return evaluate_loss(PeftModel.from_pretrained(_gpt2(target_folder), str(folder)), batches, "causal-lm").loss


def _moved_adapter_loss(
    adapter: Any, graph: Any, alignment: Alignment, a: Any, b: Any, b_folder: Path, batches: list
) -> float:
    sd_a, sd_b = a.state_dict(), b.state_dict()
    canonical = alignment.graph if alignment.canonical else None
    tensors, whole = transport_adapter(adapter, graph, alignment.transform, sd_a, sd_b, canonical_graph=canonical)
    with tempfile.TemporaryDirectory() as tmp:
        save_adapter(adapter, tensors, Path(tmp), base_model=str(b_folder), target=sd_b, whole=whole)
        return _adapter_loss(Path(tmp), b_folder, batches)


def transport_row(
    seed_a: int, seed_b: int, lora: GPT2LoraConfig | None = None, target_kind: str = "gpt2"
) -> dict[str, Any]:
    """Task losses at α = 1 of one A → B pair (keys of ``COLUMNS``, plus the fine-tunes on A);
    ``target_kind="gpt2-next"``: B is the re-release of the GPT-2 of ``seed_b``."""
    a_folder, b_folder = cached_model("gpt2", seed_a), cached_model(target_kind, seed_b)
    ft_folder, lora_folder = cached_model("gpt2-ft", seed_a), cached_model("gpt2-lora", seed_a, config=lora)
    batches = held_out_batches(ft_folder, 32)
    a, b, ft = _gpt2(a_folder), _gpt2(b_folder), _gpt2(ft_folder)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    graph = graph_for(b.config, sd_b.keys())
    adapter = read_adapter(lora_folder, a)
    sd_lora = apply_adapter(adapter, sd_a)

    start = time.perf_counter()
    vanilla = align("vanilla", Pair(graph, sd_b, sd_a))
    go = align("generalized-orthogonal", Pair(graph, sd_b, sd_a))
    transfusion = align("transfusion", Pair(graph, sd_b, sd_a))
    perm_graph = lora_graph(graph)[0]  # what an adapter follows when it cannot take the canonical form
    go_perm = align("generalized-orthogonal", Pair(perm_graph, sd_b, sd_a))
    transfusion_lora = align("transfusion", Pair(perm_graph, sd_b, sd_a))
    seconds = time.perf_counter() - start

    label = f"{seed_a} → {seed_b}" if target_kind == "gpt2" else f"{seed_a} → {target_kind}-seed{seed_b}"
    row: dict[str, Any] = {"pair": label, "align_s": seconds}
    row["target"] = evaluate_loss(b, batches, "causal-lm").loss
    row["full_ft"] = evaluate_loss(ft, batches, "causal-lm").loss
    row["lora_ft"] = _adapter_loss(lora_folder, a_folder, batches)
    row["lora_dense_ft"] = evaluate_loss(rebuild(a, sd_lora), batches, "causal-lm").loss
    row["full_naive"] = _full_loss(b, vanilla, graph, ft.state_dict(), batches)
    row["full_go"] = _full_loss(b, go, graph, ft.state_dict(), batches)
    row["full_transfusion"] = _full_loss(b, transfusion, graph, ft.state_dict(), batches)
    row["lora_naive"] = _adapter_loss(lora_folder, b_folder, batches)
    row["lora_go"] = _moved_adapter_loss(adapter, graph, go, a, b, b_folder, batches)
    row["lora_go_perm"] = _moved_adapter_loss(adapter, perm_graph, go_perm, a, b, b_folder, batches)
    row["lora_transfusion"] = _moved_adapter_loss(adapter, perm_graph, transfusion_lora, a, b, b_folder, batches)
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| A → B | " + " | ".join(label for _, label in COLUMNS) + " | A_ft on A: full / LoRA |"
    lines = [head, "|---|" + "---:|" * (len(COLUMNS) + 1)]
    for r in rows:
        best = min(r[k] for k, _ in COLUMNS)
        cells = [f"**{r[k]:.3f}**" if r[k] == best else f"{r[k]:.3f}" for k, _ in COLUMNS]
        lines.append(f"| {r['pair']} | " + " | ".join(cells) + f" | {r['full_ft']:.3f} / {r['lora_ft']:.3f} |")
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
            f"{r['pair']}: aligned in {r['align_s']:.1f} s; LoRA on A {r['lora_ft']:.4f} (dense {r['lora_dense_ft']:.4f})"
        )
    print(f"\nLoRA: rank {lora.rank}, lora_alpha {lora.lora_alpha}, lr {lora.lr}, {lora.steps} steps\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
