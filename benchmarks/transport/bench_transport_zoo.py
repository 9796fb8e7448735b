"""Transport on the benchmark zoo: the fine-tune of ``bench-gpt2`` seed A on the King James Bible
moved onto ``bench-gpt2`` seed B by every data-free strategy, with one residual map (`global`) or
one per sublayer, at every α of ``alpha: auto``'s grid.

    python benchmarks/transport/bench_transport_zoo.py                  # pairs 0:1 0:2 (trains the zoo first: benchmarks/zoo/bench_zoo.py)
    python benchmarks/transport/bench_transport_zoo.py --pairs 0:1 --tokens 65536
    python benchmarks/transport/bench_transport_zoo.py --kind bench-t5 --pairs 0:1   # the T5's, span corruption
    python benchmarks/transport/bench_transport_zoo.py --kind bench-t5 --pairs 0:1 --calibrate

``--kind bench-t5``: the encoder-decoder pair and its fine-tune ``bench-t5-ft``, scored on held-out text
noised as it was trained (per-sublayer maps do not apply to two stacks: those rows are left out).
``--calibrate`` (bench-t5): each global method also moves the fine-tune with `hf-rebasin transport`
at α = 1, calibrated on the sources of the fine-tune's training split (never the held-out text),
and a second table scores what it writes.

For each pair, method and α: the task loss (held-out Bible text), the share of the task-loss gap
between B and the fine-tune on A that is closed, the support loss (B's held-out Shakespeare) and
its cost over B; then per method the α that ``alpha: auto`` saves (no budget, and a budget of
``--budget`` nats), and a summary over pairs at α = 1 and at the auto α.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "alignment"))  # bench_barriers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # calibration_recipe
from bench_barriers import first_tokens
from calibration_recipe import calibrate_section, transport_body

from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.evaluation.evaluate import evaluate_loss, task_of
from hf_rebasin.evaluation.zoo.train import cached_model, held_out_batches
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.transport import add_task_vector, task_vector
from hf_rebasin.recipe import AUTO_ALPHAS
from hf_rebasin.run.auto_alpha import choose_alpha
from hf_rebasin.symmetry.adapters import graph_for

METHODS = [  # (label, strategy, residual maps)
    ("naive", "vanilla", "global"),
    ("weight-matching", "weight-matching", "global"),
    ("weight-matching, per-sublayer", "weight-matching", "per-sublayer"),
    ("transfusion", "transfusion", "global"),
    ("transfusion, per-sublayer", "transfusion", "per-sublayer"),
    ("generalized-orthogonal", "generalized-orthogonal", "global"),
    ("generalized-orthogonal, per-sublayer", "generalized-orthogonal", "per-sublayer"),
]


def _model(folder: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = AutoConfig.from_pretrained(str(folder)).is_encoder_decoder
    return (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(str(folder)).eval()


def pair_rows(seed_a: int, seed_b: int, tokens: int, budget: float, kind: str = "bench-gpt2") -> list[dict[str, Any]]:
    a_folder, b_folder = cached_model(kind, seed_a), cached_model(kind, seed_b)  # type: ignore[arg-type]
    ft_folder = cached_model(f"{kind}-ft", seed_a)  # type: ignore[arg-type]
    task = first_tokens(held_out_batches(ft_folder, 32), tokens)
    support = first_tokens(held_out_batches(b_folder, 32), tokens)
    a, b, ft = _model(a_folder), _model(b_folder), _model(ft_folder)
    scored = task_of(a)

    def losses(model: Any) -> tuple[float, float]:
        return evaluate_loss(model, task, scored).loss, evaluate_loss(model, support, scored).loss

    b_task, b_support = losses(b)
    ft_task, ft_support = losses(ft)
    a_task, a_support = losses(a)
    print(
        f"{seed_a} → {seed_b}: B task {b_task:.3f} support {b_support:.3f}; fine-tune task {ft_task:.3f} "
        f"support {ft_support:.3f} (its base A: {a_task:.3f}, {a_support:.3f})",
        flush=True,
    )
    sd_a, sd_b, sd_ft = a.state_dict(), b.state_dict(), ft.state_dict()
    graph = graph_for(b.config, sd_b.keys())
    rows = []
    for label, strategy, maps in METHODS:
        if maps == "per-sublayer" and len(graph.stacks) > 1:
            continue  # one chain of sublayers per stream: not an encoder-decoder's
        start = time.perf_counter()
        options = {} if strategy == "vanilla" else {"residual_maps": maps}
        alignment = align(strategy, Pair(graph, sd_b, sd_a), options)  # B is the reference
        tau = task_vector(alignment, graph, sd_ft)
        align_s = time.perf_counter() - start
        model = rebuild(b, dict(alignment.sd_a), untie=bool(alignment.untied))
        task_losses, support_losses = [], []
        for alpha in AUTO_ALPHAS:
            theta = add_task_vector(alignment.sd_a, tau, alpha)
            model.load_state_dict(dict(theta), strict=False)
            t, s = losses(model)
            task_losses.append(t)
            support_losses.append(s)
        gains = [b_task - t for t in task_losses]
        costs = [s - b_support for s in support_losses]
        auto = choose_alpha(AUTO_ALPHAS, gains, costs)
        capped = choose_alpha(AUTO_ALPHAS, gains, costs, budget)
        rows.append(
            {
                "pair": f"{seed_a} → {seed_b}",
                "method": label,
                "task": task_losses,
                "support": support_losses,
                "gap": [(b_task - t) / (b_task - ft_task) for t in task_losses],
                "cost": costs,
                "auto": auto,
                "capped": capped,
                "b": (b_task, b_support),
                "ft": (ft_task, ft_support),
                "a": (a_task, a_support),
                "align_s": align_s,
            }
        )
        print(f"  {label}: align {align_s:.1f} s, α=1 gap {100 * rows[-1]['gap'][3]:.0f} %", flush=True)
    return rows


def calibrated_rows(seed_a: int, seed_b: int, tokens: int, kind: str = "bench-t5") -> list[str]:
    """Per global method: the fine-tune moved at α = 1 by `hf-rebasin transport` and calibrated on
    its training split's sources, scored on the held-out task and support text (gap as above)."""
    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run.pipeline import run_recipe

    ft_folder, b_folder = cached_model(f"{kind}-ft", seed_a), cached_model(kind, seed_b)  # type: ignore[arg-type]
    task = first_tokens(held_out_batches(ft_folder, 32), tokens)
    support = first_tokens(held_out_batches(b_folder, 32), tokens)

    def losses(folder: Any) -> tuple[float, float]:
        model = _model(folder)
        return evaluate_loss(model, task, task_of(model)).loss, evaluate_loss(model, support, task_of(model)).loss

    (b_task, b_support), (ft_task, _) = losses(b_folder), losses(ft_folder)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        section = calibrate_section(ft_folder, root, True)
        for label, strategy, maps in METHODS:
            if maps != "global":
                continue
            body = transport_body(kind, f"{kind}-ft", (seed_a, seed_b), strategy, root / strategy, section)
            if strategy != "vanilla":
                body["strategy"] = {"name": strategy, "residual_maps": maps}
            body["alpha"] = 1.0
            (root / f"{strategy}.yaml").write_text(yaml.safe_dump(body), encoding="utf-8")
            start = time.perf_counter()
            run_recipe(load_recipe(root / f"{strategy}.yaml"))
            t, s = losses(root / strategy)
            gap = 100 * (b_task - t) / (b_task - ft_task)
            out.append(
                f"| {seed_a} → {seed_b} | {label} | {t:.3f} ({gap:.0f} %) | {s - b_support:+.3f} "
                f"| {time.perf_counter() - start:.0f} |"
            )
            print(out[-1], flush=True)
    return out


def markdown(rows: list[dict[str, Any]], budget: float) -> str:
    head = "| A → B | method | " + " | ".join(f"α = {a:g}" for a in AUTO_ALPHAS) + " | `alpha: auto` | budget |"
    lines = [
        "Task loss (gap closed) / support cost over B, nats",
        "",
        head,
        "|---|---|" + "---:|" * (len(AUTO_ALPHAS) + 2),
    ]
    for r in rows:
        cells = [
            f"{t:.3f} ({100 * g:.0f} %) / {c:+.3f}" for t, g, c in zip(r["task"], r["gap"], r["cost"], strict=True)
        ]
        auto, capped = r["auto"], r["capped"]
        lines.append(
            f"| {r['pair']} | {r['method']} | "
            + " | ".join(cells)
            + f" | {auto.alpha:g} ({auto.rule}) | {capped.alpha:g} ({capped.rule}) |"
        )
    lines += ["", f"budget: {budget} nats of support loss over B"]
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| method | gap closed at α = 1, median (range) | support cost at α = 1 | gap closed at the auto α | its cost |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, _, _ in METHODS:
        mine = [r for r in rows if r["method"] == label]
        if not mine:
            continue
        at1 = sorted(100 * r["gap"][AUTO_ALPHAS.index(1.0)] for r in mine)
        cost1 = sorted(r["cost"][AUTO_ALPHAS.index(1.0)] for r in mine)
        auto = sorted(100 * r["gap"][r["auto"].index] for r in mine)
        cost_auto = sorted(r["cost"][r["auto"].index] for r in mine)
        lines.append(
            f"| {label} | {statistics.median(at1):.0f} % ({at1[0]:.0f} to {at1[-1]:.0f}) "
            f"| {statistics.median(cost1):+.3f} | {statistics.median(auto):.0f} % | {statistics.median(cost_auto):+.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kind", default="bench-gpt2", choices=["bench-gpt2", "bench-t5", "bench-t5-long"], help="the base pair's kind"
    )
    parser.add_argument("--pairs", nargs="+", default=["0:1", "0:2"], help="A:B seed pairs (A's fine-tune moves)")
    parser.add_argument("--tokens", type=int, default=32768, help="held-out tokens scored per data set")
    parser.add_argument("--budget", type=float, default=0.1, help="support budget (nats) of the capped choice")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="bench-t5: also the calibrated transport at α = 1 of each global method",
    )
    args = parser.parse_args()
    if args.calibrate and not args.kind.startswith("bench-t5"):
        parser.error(
            "--calibrate is for --kind bench-t5 / bench-t5-long (bench_calibration.py calibrates the causal zoo)"
        )
    torch.set_num_threads(args.threads)
    rows = []
    for pair in args.pairs:
        seed_a, seed_b = (int(s) for s in pair.split(":"))
        rows += pair_rows(seed_a, seed_b, args.tokens, args.budget, args.kind)
    print()
    print(markdown(rows, args.budget))
    print()
    print(summary(rows))
    if args.calibrate:
        lines = ["| A → B | method, calibrated, α = 1 | task loss (gap closed) | support cost | run s |"]
        lines.append("|---|---|---:|---:|---:|")
        for pair in args.pairs:
            seed_a, seed_b = (int(s) for s in pair.split(":"))
            lines += calibrated_rows(seed_a, seed_b, args.tokens, args.kind)
        print()
        print("\n".join(lines))


if __name__ == "__main__":
    main()
