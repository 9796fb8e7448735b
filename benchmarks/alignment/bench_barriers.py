"""Loss barriers of trained models: two tiny GPT-2 (character-level Shakespeare) and two tiny ViT
(digits) trained from different seeds by ``hf_rebasin.evaluation.zoo.train``, aligned by every strategy; or two
zoo models of any other kind trained from scratch: masked LMs on the same text (``--kind bert``,
``distilbert``, ``xlm-roberta``, ``modernbert``), causal LMs of another family trained like the
GPT-2 (``qwen3``, ``gemma``, ``gemma2``, ``gemma3``, ``olmo2``, ``phi3``, ``pythia``), image
classifiers trained like the ViT (``dinov2``, …).

    python benchmarks/alignment/bench_barriers.py            # both kinds (trains 4 models on first use, ~5 min)
    python benchmarks/alignment/bench_barriers.py --kind vit
    python benchmarks/alignment/bench_barriers.py --kind bert  # held-out masked-LM loss, fixed masks
    python benchmarks/alignment/bench_barriers.py --kind qwen3  # any zoo kind trained from scratch
    python benchmarks/alignment/bench_barriers.py --seeds 4   # spread of data-free results over visiting-order seeds

Prints one Markdown table per kind: both barrier definitions (nats, held-out data, 21 λ) and the
alignment time. ``tests/evaluation/test_trained.py`` runs the same code and checks the claims.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import torch

from hf_rebasin.alignment.strategies import Alignment, AlignmentData, Pair, align
from hf_rebasin.evaluation import data as hdata
from hf_rebasin.evaluation.evaluate import barrier, lambdas, loss_curve, task_of
from hf_rebasin.evaluation.zoo import catalogue as zoo
from hf_rebasin.evaluation.zoo.masked import masked_lm_batches
from hf_rebasin.evaluation.zoo.seq2seq import training_batches
from hf_rebasin.evaluation.zoo.train import cached_model, held_out_batches, training_record
from hf_rebasin.io.models import load_model
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import get_adapter
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import Space

# the zoo kinds trained from scratch, two seeds of which make a pair (not the fine-tunes of a gpt2)
KINDS = tuple(
    kind
    for kind, config in zoo.DEFAULT_CONFIGS.items()
    if not isinstance(
        config, zoo.GPT2FineTuneConfig | zoo.GPT2LoraConfig | zoo.GPT2NextConfig | zoo.DomainFineTuneConfig
    )
)

SEEDED = ("weight-matching", "transfusion", "generalized-orthogonal")

# (row label, strategy, options)
STRATEGIES: list[tuple[str, str, dict[str, Any]]] = [
    ("vanilla", "vanilla", {}),
    ("weight-matching", "weight-matching", {}),
    ("transfusion", "transfusion", {}),
    ("head-perm", "head-perm", {"residual": "all"}),
    ("generalized-orthogonal", "generalized-orthogonal", {}),
    ("generalized-orthogonal + learned", "generalized-orthogonal", {"learned": True, "steps": 150, "lr": 0.01}),
]
# --random N: B under N random permutations (seeds 0 … N−1), the barrier no matching should exceed
RANDOM = "random permutation"

# --learned: learned matching with its defaults, and with other rates and step counts
LEARNED: list[tuple[str, str, dict[str, Any]]] = [
    ("learned, defaults", "generalized-orthogonal", {"learned": True}),
    *(
        (f"learned, lr {lr:g}, {steps} steps", "generalized-orthogonal", {"learned": True, "lr": lr, "steps": steps})
        for lr, steps in ((0.01, 200), (0.03, 200), (0.1, 200), (0.03, 600))
    ),
]


def alignment_data(kind: str, folder: Any, batches: int = 8) -> AlignmentData:
    """Training-split data (never the held-out evaluation data); a BERT's masked once (seed 0), as a
    recipe's masked-LM data are, so that strategies learning on the loss have its labels."""
    config = zoo.DEFAULT_CONFIGS[kind]  # type: ignore[index]
    if isinstance(config, zoo.ViTTrainConfig | zoo.ImageTrainConfig):
        images, labels = hdata.digits_dataset("train")
        return AlignmentData(list(hdata.image_batches(images, labels, 64))[:batches], description="digits (train)")
    from transformers import PreTrainedTokenizerFast

    record = training_record(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    if isinstance(config, zoo.Seq2SeqTrainConfig):  # the training text noised once (seed 0), as in pretraining
        from transformers import AutoConfig

        start = int(AutoConfig.from_pretrained(str(folder)).decoder_start_token_id)
        made = training_batches(tokenizer, config, start, max_tokens=batches * 16 * 64)
        return AlignmentData(made, frozenset(tokenizer.all_special_ids), "Shakespeare (train), noised")
    text = hdata.shakespeare_text(tuple(record["config"]["plays"]), split="train")
    blocks = hdata.text_blocks(tokenizer, text, record["config"]["block_size"], max_tokens=batches * 16 * 64)
    pad = int(tokenizer.pad_token_id)
    made = (
        masked_lm_batches(blocks, tokenizer, 16, seed=0)
        if isinstance(config, zoo.BertTrainConfig | zoo.MaskedLMTrainConfig)
        else list(hdata.batches(blocks, 16, pad_token_id=pad))
    )
    return AlignmentData(made, frozenset(tokenizer.all_special_ids), "Shakespeare (train)")


def unsigned(graph: SymmetryGraph) -> SymmetryGraph:
    """``graph`` with every signed-permutation space lowered to plain permutations (the ablation)."""
    spaces = {
        n: dataclasses.replace(sp, max_class="permutation")
        if isinstance(sp, Space) and sp.max_class == "signed-permutation"
        else sp
        for n, sp in graph.spaces.items()
    }
    return dataclasses.replace(graph, spaces=spaces)


# --ablate: (row label, strategy, options, residual signs kept)
ABLATIONS: list[tuple[str, str, dict[str, Any], bool]] = [
    ("vanilla", "vanilla", {}, True),
    *(
        (
            f"{name}{', glu: keep' if glu == 'keep' else ''}{', no signs' if not signs else ''}",
            name,
            {"glu": glu},
            signs,
        )
        for name in SEEDED
        for glu in ("balance", "keep")
        for signs in (True, False)
    ),
]


def ablation(kind: str, seeds: int) -> str:
    """Linear barrier (11 λ) of each data-free strategy with and without the GLU balancing and the
    residual signs, mean and range over ``seeds`` visiting orders: whether the symmetries help."""
    config = zoo.DEFAULT_CONFIGS[kind]  # type: ignore[index]
    family = getattr(config, "family", kind)
    signed = any(getattr(sp, "max_class", "") == "signed-permutation" for sp in get_adapter(family).spaces)
    ablations = [a for a in ABLATIONS if signed or a[3]]  # without signed spaces "no signs" is the same run
    plain = frozenset(f"{label} seed={s}" for label, _, _, signs in ablations if not signs for s in range(seeds))
    runs = [
        (f"{label} seed={s}", name, {**options, "seed": s} if name != "vanilla" else options)
        for label, name, options, _ in ablations
        for s in (range(seeds) if name != "vanilla" else [0])
    ]
    rows = {r["strategy"]: r["linear"] for r in barrier_table(kind, points=11, strategies=runs, plain=plain)}
    lines = [f"**{kind}**, linear barrier over {seeds} visiting orders (mean, min–max)", ""]
    lines += ["| strategy | glu | residual signs | mean | min–max |", "|---|---|---|---|---|"]
    for label, name, options, signs in ablations:
        got = [v for k, v in rows.items() if k.startswith(f"{label} seed=")]
        glu = options.get("glu", "—")
        mean = sum(got) / len(got)
        lines.append(f"| {name} | {glu} | {'yes' if signs else 'no'} | {mean:.3f} | {min(got):.3f}–{max(got):.3f} |")
    return "\n".join(lines)


# --head-perm: head-perm with each way of choosing the residual permutation (its `residual` option)
HEAD_PERM_RESIDUALS: list[tuple[str, str, dict[str, Any]]] = [
    (f"head-perm, residual: {r}", "head-perm", {"residual": r})
    for r in ("identity", "first", "last", "all", "separate")
]


def first_tokens(batches: list[dict[str, Any]], tokens: int | None) -> list[dict[str, Any]]:
    """The first batches holding ``tokens`` scored positions (all of them when None, or for images)."""
    if tokens is None or "attention_mask" not in batches[0]:
        return batches
    out, seen = [], 0
    for b in batches:
        if seen >= tokens:
            break
        out.append(b)
        seen += int((b["labels"] != -100).sum()) if "labels" in b else int(b["attention_mask"].sum())
    return out


def barrier_table(
    kind: str,
    seeds: tuple[int, int] = (0, 1),
    points: int = 21,
    strategies: list[tuple[str, str, dict[str, Any]]] = STRATEGIES,
    batches: int = 8,
    plain: frozenset[str] = frozenset(),
    tokens: int | None = None,
) -> list[dict[str, Any]]:
    """One row per strategy: barriers of A = seeds[0] and B = seeds[1] aligned to A, and the curve
    (``lambdas``, ``losses``); ``batches`` of alignment data; the held-out text cut to ``tokens``
    scored tokens. Rows labelled in ``plain`` match signed-permutation spaces by plain permutations."""
    folder_a, folder_b = cached_model(kind, seeds[0]), cached_model(kind, seeds[1])  # type: ignore[arg-type]
    a, b = load_model(folder_a), load_model(folder_b)
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    evaluation = first_tokens(held_out_batches(folder_a), tokens)
    task = task_of(a.model)
    data = alignment_data(kind, folder_a, batches)
    rows = []
    for label, name, options in strategies:
        start = time.perf_counter()
        graph = unsigned(a.graph) if label in plain else a.graph
        if name == RANDOM:  # the baseline a matching should stay below: B under an arbitrary permutation
            t = graph.random_transform("permutation", torch.Generator().manual_seed(options["seed"]))
            alignment = Alignment(RANDOM, graph, sd_a, sd_b, t)
        else:
            alignment = align(name, Pair(graph, sd_a, sd_b, a.model, b.model, data), options)
        seconds = time.perf_counter() - start
        model = rebuild(a.model, dict(alignment.sd_a), untie=bool(alignment.untied))
        curve = loss_curve(model, alignment.sd_a, alignment.aligned_b(), evaluation, task, lambdas(points))
        rows.append(
            {
                "strategy": label,
                **barrier(curve.lambdas, curve.losses),
                "loss_a": curve.losses[-1],
                "loss_b": curve.losses[0],
                "loss_mid": curve.losses[len(curve.losses) // 2],
                "metric_mid": {k: v[len(v) // 2] for k, v in curve.metrics.items()},
                "lambdas": list(curve.lambdas),
                "losses": list(curve.losses),
                "seconds": seconds,
                "exact": alignment.exact,
            }
        )
    return rows


PARTS = (("weight-matching", {}), ("head-perm", {"residual": "all"}), ("generalized-orthogonal", {}))


def parts_table(kind: str, tokens: int = 16384, batches: int = 8) -> str:
    """Each of `PARTS`' transforms whole, its residual maps alone (heads and units as stored) and its
    heads and units alone (the streams as stored), seeds 0 → 1: each a transform of B that keeps its
    function, so the midpoint barriers (3 λ) say which part of a matching helps and which hurts."""
    folders = cached_model(kind, 0), cached_model(kind, 1)  # type: ignore[arg-type]
    a, b = load_model(folders[0]), load_model(folders[1])
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    evaluation, data = first_tokens(held_out_batches(folders[0]), tokens), alignment_data(kind, folders[0], batches)
    lines = [
        f"**{kind}**",
        "",
        "| strategy | whole | residual maps alone | heads and units alone |",
        "|---|---:|---:|---:|",
    ]
    for name, options in PARTS:
        alignment = align(name, Pair(a.graph, sd_a, sd_b, a.model, b.model, data), options)
        graph, ident = alignment.graph, alignment.graph.identity()
        streams = {n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual"}
        parts = (
            alignment.transform,
            {n: (m if n in streams else ident[n]) for n, m in alignment.transform.items()},
            {n: (ident[n] if n in streams else m) for n, m in alignment.transform.items()},
        )
        model = rebuild(a.model, dict(alignment.sd_a), untie=bool(alignment.untied))
        got = []
        for t in parts:
            curve = loss_curve(
                model, alignment.sd_a, graph.apply(alignment.sd_b, t), evaluation, task_of(model), lambdas(3)
            )
            got.append(barrier(curve.lambdas, curve.losses)["midpoint"])
        lines.append(f"| {name} | " + " | ".join(f"{g:.3f}" for g in got) + " |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def markdown(kind: str, rows: list[dict[str, Any]]) -> str:
    metric = next(iter(rows[0]["metric_mid"]), None)
    head = "| strategy | midpoint barrier | linear barrier | loss at λ=½ |" + (f" {metric} at λ=½ |" if metric else "")
    head += " align s |"
    lines = [f"**{kind}** (A: loss {rows[0]['loss_a']:.3f}, B: loss {rows[0]['loss_b']:.3f} nats)", "", head]
    lines.append("|---" * (head.count("|") - 1) + "|")
    for r in rows:
        line = f"| {r['strategy']} | {r['midpoint']:.3f} | {r['linear']:.3f} | {r['loss_mid']:.3f} |"
        if metric:
            line += f" {r['metric_mid'][metric]:.3f} |"
        lines.append(line + f" {r['seconds']:.1f} |")
    return "\n".join(lines)


def pair_table(
    kind: str,
    pairs: list[tuple[int, int]],
    strategies: list[tuple[str, str, dict[str, Any]]],
    tokens: int | None,
    batches: int = 8,
) -> str:
    """Each strategy's linear barrier over seed ``pairs``: per pair, then the median and range, in
    nats and as a share of vanilla's (the pair's own), with the median alignment seconds."""
    per_pair = {}
    for pair in pairs:
        rows = barrier_table(kind, pair, points=11, strategies=strategies, tokens=tokens, batches=batches)
        per_pair[pair] = {r["strategy"]: r for r in rows}
        print(
            f"{kind} {pair[0]}:{pair[1]}: " + ", ".join(f"{r['strategy']} {r['linear']:.3f}" for r in rows), flush=True
        )
    lines = [
        f"**{kind}**, linear barrier (11 λ) over seed pairs {', '.join(f'{a}:{b}' for a, b in pairs)}",
        "",
        "| strategy | "
        + " | ".join(f"{a}:{b}" for a, b in pairs)
        + " | median (range) | % of vanilla, median (range) | align s |",
        "|---|" + "---:|" * (len(pairs) + 3),
    ]
    for label, _, _ in strategies:
        got = [per_pair[p][label]["linear"] for p in pairs]
        shown = label
        if not all(per_pair[p][label]["exact"] for p in pairs):  # B changed: its end of the curve moved
            ends = ", ".join(f"{per_pair[p][label]['loss_b']:.2f}" for p in pairs)
            shown = f"{label} (changes B: its loss {ends})"
        share = sorted(100 * per_pair[p][label]["linear"] / per_pair[p]["vanilla"]["linear"] for p in pairs)
        secs = statistics.median(per_pair[p][label]["seconds"] for p in pairs)
        lines.append(
            f"| {shown} | "
            + " | ".join(f"{g:.3f}" for g in got)
            + f" | {statistics.median(got):.3f} ({min(got):.3f}–{max(got):.3f})"
            + f" | {statistics.median(share):.0f} % ({share[0]:.0f}–{share[-1]:.0f}) | {secs:.0f} |"
        )
    return "\n".join(lines)


def seed_spread(kind: str, seeds: int) -> str:
    """Linear barrier of each data-free strategy per ``seed`` option (the random visiting order of
    the coordinate descent): how much the result depends on it."""
    runs = [(f"{name} seed={s}", name, {"seed": s}) for name in SEEDED for s in range(seeds)]
    rows = {r["strategy"]: r for r in barrier_table(kind, points=11, strategies=[("vanilla", "vanilla", {}), *runs])}
    lines = [f"**{kind}**, linear barrier per seed (vanilla {rows['vanilla']['linear']:.3f})", ""]
    lines.append("| strategy | " + " | ".join(f"seed {s}" for s in range(seeds)) + " |")
    lines.append("|---" * (seeds + 1) + "|")
    for name in SEEDED:
        lines.append(
            f"| {name} | " + " | ".join(f"{rows[f'{name} seed={s}']['linear']:.3f}" for s in range(seeds)) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=(*KINDS, "both"), default="both", help="both: gpt2 and vit")
    parser.add_argument("--seeds", type=int, default=0, help="instead: data-free strategies over this many seeds")
    parser.add_argument(
        "--skip", action="append", default=[], metavar="ROW", help="leave out the row of this label (repeatable)"
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="instead: each data-free strategy with `glu: balance` / `keep`, and with / without residual signs",
    )
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=[],
        metavar="A:B",
        help="instead: the barriers over these seed pairs (median, range)",
    )
    parser.add_argument("--tokens", type=int, default=None, help="score this many held-out tokens (text kinds)")
    parser.add_argument("--points", type=int, default=21, help="λ values of each curve")
    parser.add_argument("--head-perm", action="store_true", help="add a head-perm row per `residual` option")
    parser.add_argument("--learned", action="store_true", help="add learned-matching rows (defaults, other lr/steps)")
    parser.add_argument(
        "--parts", action="store_true", help="instead: each matching's residual maps and its heads and units apart"
    )
    parser.add_argument(
        "--random", type=int, default=0, metavar="N", help="add N rows of B under a random permutation (a baseline)"
    )
    parser.add_argument(
        "--budget", type=int, nargs="+", default=[], help="add a learned row per budget (tokens or images to train on)"
    )
    parser.add_argument(
        "--variant",
        type=json.loads,
        nargs="+",
        default=[],
        metavar="JSON",
        help='add a learned row per set of options, e.g. \'{"rotations": "polar"}\'',
    )
    parser.add_argument(
        "--row",
        nargs=2,
        action="append",
        default=[],
        metavar=("STRATEGY", "JSON"),
        help='add a row of this strategy and options, e.g. generalized-orthogonal \'{"glu": "balance"}\' (repeatable)',
    )
    parser.add_argument(
        "--batches", type=int, default=8, help="alignment data: this many × 1,024 training tokens (or 64 images)"
    )
    args = parser.parse_args(argv)
    rows = STRATEGIES + (HEAD_PERM_RESIDUALS if args.head_perm else []) + (LEARNED if args.learned else [])
    rows += [(f"learned, budget {n:,}", "generalized-orthogonal", {"learned": True, "budget": n}) for n in args.budget]
    rows += [(f"{RANDOM}, seed {k}", RANDOM, {"seed": k}) for k in range(args.random)]
    rows += [(f"learned, {json.dumps(v)}", "generalized-orthogonal", {"learned": True, **v}) for v in args.variant]
    rows += [(f"{name}, {text}", name, json.loads(text)) for name, text in args.row]
    unknown = set(args.skip) - {label for label, _, _ in rows}
    if unknown:
        parser.error(f"--skip: no row {', '.join(sorted(unknown))}; rows: {', '.join(s[0] for s in rows)}")
    strategies = [s for s in rows if s[0] not in args.skip]
    torch.manual_seed(0)
    for kind in ("gpt2", "vit") if args.kind == "both" else (args.kind,):
        if args.parts:
            print(parts_table(kind, args.tokens or 16384, args.batches) + "\n")
            continue
        if args.pairs:
            pairs = [(int(a), int(b)) for a, b in (p.split(":") for p in args.pairs)]
            print(pair_table(kind, pairs, strategies, args.tokens, args.batches) + "\n")
            continue
        if args.ablate:
            print(ablation(kind, max(1, args.seeds)) + "\n")
            continue
        print(
            seed_spread(kind, args.seeds)
            if args.seeds
            else markdown(kind, barrier_table(kind, points=args.points, strategies=strategies, tokens=args.tokens))
        )
        print()


if __name__ == "__main__":
    main()
