"""Side by side: the reference code of Theus et al.'s learned merge and hf-rebasin's, on one pair.

The reference (`github:antoniohonsell/Generalized-LMC-for-Transformers`: ``train_merger.py`` and
``merger.py``) runs unmodified, as its README runs it, in a virtual environment of its own
(transformers 4.50.1); nothing of it is imported here. Both tools get the same two GPT-2 of the zoo,
the same text (a training split they learn on, a validation split they stop on, a test split both
barriers are measured on, 11 λ as the reference's sweep) and the same tokens of training.

The reference's merged model is in *circuit form* (see ``circuit_form.py``): it interpolates each
head's QK and OV circuits, not the factors, so its merged model is not a GPT-2 of the parents'
shape. hf-rebasin's maps are therefore scored twice: as the GPT-2 a user pushes (factors
interpolated) and in circuit form, the reference's measure.

    python benchmarks/alignment/bench_reference.py --setup --reference PATH  # venv + check (minutes, once)
    python benchmarks/alignment/bench_reference.py --reference PATH --kind bench-gpt2 --pairs 0:1 0:2 1:2
    python benchmarks/alignment/bench_reference.py --reference PATH --kind gpt2 --epochs 2   # the tiny zoo: quick
    python benchmarks/alignment/bench_reference.py --reference PATH --paper   # the paper's own pair (GPU: trains 2 models)

PATH is a checkout of the reference (``git clone``), or a git directory whose HEAD is exported.
Prints one table per pair (barriers in nats and as % of vanilla's, tokens, steps, seconds) and
writes every curve to ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import circuit_form

from hf_rebasin.alignment.strategies import AlignmentData, Pair, align
from hf_rebasin.evaluation import data as hdata
from hf_rebasin.evaluation.evaluate import barrier, lambdas, loss_curve, task_of
from hf_rebasin.evaluation.zoo.train import cached_model, training_record
from hf_rebasin.io.models import load_model
from hf_rebasin.io.rebuild import rebuild

CACHE = Path.home() / ".cache" / "hf-rebasin"
VENV = CACHE / "reference-venv"
# the reference's requirements.txt, with transformers at the version its code runs on
REQUIREMENTS = ["transformers==4.50.1", "datasets", "einops", "POT", "accelerate>=0.26.0", "safetensors", "wandb"]
BATCH = 32  # the reference's training batch (blocks), used by both tools
POINTS = 11  # the reference's sweep: λ = 0, 0.1, …, 1
ENV = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}


def _slug(text: str) -> str:
    """``text`` with every character but letters and digits as ``_``: a file name."""
    return "".join(c if c.isalnum() else "_" for c in text)


def checkout(path: Path, work: Path) -> tuple[Path, str]:
    """A work tree of the reference and its commit: ``path`` itself, or HEAD exported from a git dir."""
    if (path / "train_merger.py").is_file():
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        return path, head.stdout.strip() or "unknown"
    commit = subprocess.run(
        ["git", f"--git-dir={path}", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    )
    tree = work / "reference"
    if not (tree / "train_merger.py").is_file():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", f"--git-dir={path}", "archive", "HEAD"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree, commit.stdout.strip()


def setup(venv: Path) -> None:
    """The reference's own environment (CPU torch first, as for hf-rebasin)."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, *REQUIREMENTS], check=True)
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import transformers, ot; print('transformers', transformers.__version__)",
        ],
        check=True,
    )


def texts(folder: Path, train_chars: int, val_chars: int, test_chars: int) -> dict[str, str]:
    """The zoo model's own training text (learned on and stopped on) and its held-out text (scored)."""
    cfg = training_record(folder)["config"]
    plays = tuple(cfg["plays"]) if "plays" in cfg else None
    train = hdata.corpus_text(cfg.get("corpus", "shakespeare"), plays, split="train")
    test = hdata.corpus_text(cfg.get("corpus", "shakespeare"), plays, split="test")
    return {
        "train": train[:train_chars],
        "validation": train[train_chars : train_chars + val_chars],
        "test": test[:test_chars],
    }


def reference_inputs(folder_a: Path, folder_b: Path, work: Path) -> None:
    """Model folders and a transformers-4 tokenizer folder in ``work``, as the reference loads them."""
    for name, folder in (("model_a", folder_a), ("model_b", folder_b)):
        (work / name).mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copyfile(folder / f, work / name / f)
    tok = work / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder_a / "tokenizer.json", tok / "tokenizer.json")
    ours = json.loads((folder_a / "tokenizer_config.json").read_text())
    config = {k: ours[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in ours}
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": ["input_ids", "attention_mask"]}
    config["model_max_length"] = 1 << 30
    (tok / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


SPLITS = """
import json, sys
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer
work, tok = sys.argv[1], sys.argv[2]
texts = json.load(open(work + "/texts.json"))
DatasetDict({k: Dataset.from_dict({"text": [v]}) for k, v in texts.items()}).save_to_disk(work + "/splits")
t = AutoTokenizer.from_pretrained(tok)
json.dump({k: t(v)["input_ids"] for k, v in texts.items()}, open(work + "/reference_ids.json", "w"))
"""


def prepare_reference(tree: Path, venv: Path, work: Path, split: dict[str, str]) -> None:
    """The reference's README steps 1 and 2 on our text: its splits and its token frequencies."""
    (work / "texts.json").write_text(json.dumps(split))
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-c", SPLITS, str(work), str(work / "tokenizer")], check=True, env=ENV, cwd=tree)
    freqs = [
        py,
        "compute_token_freqs.py",
        "--splits_dir",
        str(work / "splits"),
        "--tokenizer_dir",
        str(work / "tokenizer"),
    ]
    subprocess.run([*freqs, "--out_name", "token_freqs.pt"], check=True, env=ENV, cwd=tree, capture_output=True)


def run_reference(tree: Path, work: Path, args: argparse.Namespace, extra: str) -> dict[str, Any]:
    """The reference's learned merge (its README's step 4) on our pair, with ``extra`` arguments
    (``permutations_only,epochs=50`` for ``--permutations_only --epochs 50``); its sweep, steps,
    tokens and seconds."""
    splits = work / "splits"
    out = work / f"reference_merge{_slug(extra)}"
    shutil.rmtree(out, ignore_errors=True)
    command = [str(args.venv / "bin" / "python"), "train_merger.py", "--model_dir_0", str(work / "model_a")]
    command += ["--model_dir_1", str(work / "model_b"), "--tokenizer_dir", str(work / "tokenizer")]
    command += [
        "--splits_dir",
        str(splits),
        "--output_dir",
        str(out),
        "--token_freqs_path",
        str(splits / "token_freqs.pt"),
    ]
    command += ["--epochs", str(args.epochs), "--batch_size", str(BATCH), "--block_size", str(args.block)]
    command += ["--sampler", "narrow_uniform", "--seed", str(args.seed)]
    command += ["--early_stop"] if args.early_stop else []
    for item in filter(None, extra.split(",")):  # "epochs=50,permutations_only": later arguments win
        key, _, value = item.partition("=")
        command += [f"--{key}", *([value] if value else [])]
    start = time.perf_counter()
    done = subprocess.run(command, env=ENV, cwd=tree, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"the reference failed (exit {done.returncode}); its log: {out.parent / f'{out.name}.log'}")
    return read_reference(out, done.stdout + done.stderr, extra, seconds)


def read_reference(out: Path, log: str, extra: str, seconds: float | None) -> dict[str, Any]:
    """A reference run's results from what it wrote: its test sweep, its last trainer state, its log
    (the tokens it saw are counted once the splits' sizes are known: `seen_tokens`)."""
    sweep = json.loads((out / "merged_sampler_losses.json").read_text())
    states = sorted(out.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    state = json.loads(states[-1].read_text()) if states else {}
    runtime = re.search(r"'train_runtime': ([0-9.]+)", log)
    steps = int(state.get("global_step", 0))
    return {
        "variant": extra,
        "losses": [sweep["coeff_losses"][k] for k in sorted(sweep["coeff_losses"], key=float)],
        "linear": float(sweep["max_barrier"]),
        "steps": steps,
        "seconds": seconds,
        "train_seconds": float(runtime.group(1)) if runtime else None,
        "best_checkpoint": state.get("best_model_checkpoint"),
    }


def seen_tokens(steps: int, blocks: int, block: int) -> int:
    """Tokens a Trainer run of ``steps`` batches of ``BATCH`` saw: each epoch ends with a short batch."""
    per_epoch = -(-blocks // BATCH)
    epochs, rest = divmod(steps, per_epoch)
    return (epochs * blocks + min(rest * BATCH, blocks)) * block


def blocks_of(ids: list[int], block: int) -> torch.Tensor:
    """Consecutive blocks, the remainder dropped, as the reference's ``group_texts`` cuts them."""
    n = len(ids) // block
    return torch.tensor(ids[: n * block], dtype=torch.long).view(n, block)


def our_data(folder: Path, ids: dict[str, list[int]], block: int, seed: int) -> tuple[AlignmentData, float, list]:
    """Alignment data (training blocks, shuffled once, then the validation blocks held out for the
    stopping rule, as the reference stops on its validation split) and the test batches."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    pad = int(tokenizer.pad_token_id)
    train = list(hdata.batches(blocks_of(ids["train"], block), BATCH, pad_token_id=pad, seed=seed))
    held = list(hdata.batches(blocks_of(ids["validation"], block), BATCH, pad_token_id=pad))
    test = list(hdata.batches(blocks_of(ids["test"], block), 64, pad_token_id=pad))
    data = AlignmentData(train + held, frozenset(tokenizer.all_special_ids), "the reference's training split")
    return data, len(held) / (len(train) + len(held)), test


def check_tokens(folder: Path, texts_: dict[str, str], work: Path) -> dict[str, list[int]]:
    """Our tokenization of each split, refused unless it is the reference's, id for id."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    ours = {k: tokenizer(v, add_special_tokens=False)["input_ids"] for k, v in texts_.items()}
    theirs = json.loads((work / "reference_ids.json").read_text())
    for k in ours:
        if ours[k] != theirs[k]:
            raise SystemExit(f"the {k} split tokenizes differently in the two environments: no fair comparison")
    return ours


def score(name: str, a: Any, alignment: Any, test: list, shape: circuit_form.Shape) -> dict[str, Any]:
    """Both forms' curves of one aligned pair: as the GPT-2 a user pushes, and in circuit form."""
    sd_a, sd_b = dict(alignment.sd_a), alignment.aligned_b()
    model = rebuild(a.model, sd_a, untie=bool(alignment.untied))
    factors = loss_curve(model, sd_a, sd_b, test, task_of(a.model), lambdas(POINTS)).losses
    lams, circuits = circuit_form.curve(sd_a, sd_b, [b["input_ids"] for b in test], shape, POINTS)
    return {
        "strategy": name,
        "losses": list(factors),
        "linear": barrier(lams, factors)["linear"],
        "circuit_losses": circuits,
        "circuit_linear": barrier(lams, circuits)["linear"],
    }


def run_ours(folders: tuple[Path, Path], ids: dict[str, list[int]], args: argparse.Namespace, seed: int) -> list[dict]:
    """vanilla, generalized-orthogonal (data-free) and learned at the reference's planned tokens."""
    a, b = load_model(folders[0]), load_model(folders[1])
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    data, holdout, test = our_data(folders[0], ids, args.block, seed)

    def epochs(n: float) -> int:  # tokens of n epochs of the training split's whole blocks
        return int(n * (len(ids["train"]) // args.block) * args.block)

    shape = circuit_form.Shape.of(a.model.config)
    runs = [("vanilla", "vanilla", {}), ("generalized-orthogonal (data-free)", "generalized-orthogonal", {})]
    for variant in args.ours:
        options = {"learned": True, "budget": epochs(args.epochs), "holdout": holdout, **variant}
        if "epochs" in options:  # a budget in epochs over the training split
            options["budget"] = epochs(options.pop("epochs"))
        label = "learned" + (f" {json.dumps(variant)}" if variant else "")
        runs.append((label, "generalized-orthogonal", options))
    rows = []
    for label, name, options in runs:
        start = time.perf_counter()
        alignment = align(name, Pair(a.graph, sd_a, sd_b, a.model, b.model, data), options)
        seconds = time.perf_counter() - start
        row = score(label, a, alignment, test, shape)
        history = alignment.diagnostics.get("learned", {})
        row |= {"seconds": seconds, "steps": history.get("steps", [0])[-1], "tokens": history.get("tokens", [0])[-1]}
        row["notes"] = list(alignment.notes)
        rows.append(row)
        print(
            f"  ours, {label}: {row['linear']:.3f} (circuit form {row['circuit_linear']:.3f}), {seconds:.0f} s",
            flush=True,
        )
    return rows


def table(label: str, ours: list[dict[str, Any]], refs: list[dict[str, Any]], commit: str) -> str:
    """One pair: each run's linear barrier as a GPT-2 and in circuit form, % of vanilla's (as a GPT-2)."""
    vanilla = ours[0]["linear"]
    lines = [
        f"**{label}** (linear barrier, {POINTS} λ, test split; % of vanilla's {vanilla:.3f} as a GPT-2; "
        f"reference {commit[:7]})",
        "",
        "| run | barrier, as a GPT-2 | % | barrier, circuit form | % | steps | tokens | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ours:
        lines.append(
            f"| hf-rebasin {r['strategy']} | {r['linear']:.3f} | {100 * r['linear'] / vanilla:.1f} | "
            f"{r['circuit_linear']:.3f} | {100 * r['circuit_linear'] / vanilla:.1f} | {r['steps']} | "
            f"{r['tokens']:,} | {r['seconds']:.0f} |"
        )
    for r in refs:
        lines.append(
            f"| reference learned merge {r['variant']} | n/a (circuit form only) | | {r['linear']:.3f} | "
            f"{100 * r['linear'] / vanilla:.1f} | {r['steps']} | {r['tokens']:,} | {r['seconds'] or 0:.0f} "
            f"({r['train_seconds'] or 0:.0f} training) |"
        )
    return "\n".join(lines)


def compare(folders: tuple[Path, Path], split: dict[str, str], work: Path, tree: Path, commit: str, args: Any) -> dict:
    """Both tools on one pair whose inputs ``work`` holds (prepared for the reference); prints the
    table and writes results.json."""
    refs = []
    for extra in args.ref_variants:
        print(f"{work.name}: the reference, {args.epochs:g} epochs {extra}…", flush=True)
        refs.append(run_reference(tree, work, args, extra))
        print(f"  reference: {refs[-1]['linear']:.3f} (circuit form), {refs[-1]['steps']} steps", flush=True)
    ids = check_tokens(folders[0], split, work)
    for r in refs:
        r["tokens"] = seen_tokens(r["steps"], len(ids["train"]) // args.block, args.block)
    ours = run_ours(folders, ids, args, args.seed)
    ends = (ours[0]["losses"][0], ours[0]["losses"][-1])
    for r in refs:
        if max(abs(x - y) for x, y in zip(ends, (r["losses"][0], r["losses"][-1]), strict=True)) > 1e-3:
            raise SystemExit(
                f"the parents' test losses differ between the tools ({ends}, {r['losses']}): not comparable"
            )
    label = f"{work.name}, {len(ids['train']):,} training tokens × {args.epochs:g} epochs"
    print(table(label, ours, refs, commit), flush=True)
    result = {"pair": work.name, "reference": refs, "ours": ours, "commit": commit, "block": args.block}
    (work / f"results{_slug(args.tag)}.json").write_text(json.dumps(result, indent=1))
    return result


def zoo_pair(
    kind: str, seeds: tuple[int, int], tree: Path, args: argparse.Namespace
) -> tuple[tuple[Path, Path], dict, Path]:
    """A seed pair of the zoo, prepared for both tools: its folders, its own text cut into splits,
    the work folder."""
    folders = (cached_model(kind, seeds[0]), cached_model(kind, seeds[1]))
    work = args.out / f"{kind}-{seeds[0]}-{seeds[1]}"
    work.mkdir(parents=True, exist_ok=True)
    record = training_record(folders[0])["config"]
    args.block = int(record.get("block_size") or load_model(folders[0]).model.config.n_positions)
    reference_inputs(*folders, work)
    split = texts(folders[0], args.train_chars, args.val_chars, args.test_chars)
    prepare_reference(tree, args.venv, work, split)
    return folders, split, work


def paper_pair(tree: Path, args: argparse.Namespace) -> tuple[tuple[Path, Path], dict, Path]:
    """The paper's setting: two GPT-2 trained by the reference's ``train.py`` (its defaults: 6 layers,
    d = 256, 4 heads, blocks of 256, the GPT-2 tokenizer; up to 100 epochs, stopped on validation
    with patience 5) on its Tiny Shakespeare, split as its README splits it (5 % + 5 %, contiguous)."""
    work = args.out / "paper-tinyshakespeare"
    work.mkdir(parents=True, exist_ok=True)
    args.block = 256
    text = (tree / "tinyshakespeare.txt").read_text(encoding="utf-8")
    n = len(text)
    test_n, val_n = round(n * 0.05), round(n * 0.05)
    split = {
        "train": text[: n - val_n - test_n],
        "validation": text[n - val_n - test_n : n - test_n],
        "test": text[n - test_n :],
    }
    shutil.copytree(tree / "gpt2_tokenizer", work / "tokenizer", dirs_exist_ok=True)
    prepare_reference(tree, args.venv, work, split)
    py = str(args.venv / "bin" / "python")
    for seed, name in ((0, "model_a"), (1, "model_b")):
        if (work / name / "model.safetensors").is_file():
            continue
        command = [py, "train.py", "--splits_dir", str(work / "splits"), "--tokenizer_dir", str(work / "tokenizer")]
        command += ["--seed", str(seed), "--epochs", "100", "--early_stop", "--early_stop_patience", "5"]
        command += ["--output_dir", str(work / name), *(["--fp16"] if torch.cuda.is_available() else [])]
        print(f"training the paper's GPT-2, seed {seed} (the reference's train.py)…", flush=True)
        done = subprocess.run(command, env=ENV, cwd=tree, capture_output=True, text=True)
        (work / f"train_{name}.log").write_text(done.stdout + done.stderr)
        if done.returncode:
            raise SystemExit(f"the reference's train.py failed; its log: {work / f'train_{name}.log'}")
    return (work / "model_a", work / "model_b"), split, work


def summary(out: Path, kind: str) -> str:
    """The pairs of ``kind`` measured so far (their ``results.json``), side by side: each run's
    barrier as % of the pair's vanilla barrier (as a GPT-2), then the median."""
    found = sorted(out.glob(f"{kind}-*-*/results*.json"))
    if not found:
        return f"nothing measured yet for {kind} under {out}"
    runs: dict[str, dict[str, float]] = {}
    pairs = []
    for path in found:
        r = json.loads(path.read_text())
        pair, vanilla = path.parent.name.removeprefix(f"{kind}-").replace("-", ":"), r["ours"][0]["linear"]
        pairs += [pair] if pair not in pairs else []
        for o in r["ours"]:
            runs.setdefault(f"hf-rebasin {o['strategy']}, as a GPT-2", {})[pair] = 100 * o["linear"] / vanilla
            runs.setdefault(f"hf-rebasin {o['strategy']}, circuit form", {})[pair] = 100 * o["circuit_linear"] / vanilla
        for ref in r["reference"]:
            runs.setdefault(f"reference {ref['variant'] or 'learned merge'}, circuit form", {})[pair] = (
                100 * ref["linear"] / vanilla
            )
    lines = [
        "| run (% of vanilla's linear barrier) | " + " | ".join(pairs) + " | median |",
        "|---|" + "---:|" * (len(pairs) + 1),
    ]
    for name, got in runs.items():
        cells = [f"{got[p]:.1f}" if p in got else "—" for p in pairs]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {statistics.median(got.values()):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, required=True, help="a checkout of the reference, or its git dir")
    parser.add_argument("--venv", type=Path, default=VENV, help="the reference's own virtual environment")
    parser.add_argument("--setup", action="store_true", help="create the reference's environment, then stop")
    parser.add_argument("--summary", action="store_true", help="the pairs of --kind measured so far, side by side")
    parser.add_argument("--paper", action="store_true", help="the paper's setting (trains two GPT-2: a GPU's work)")
    parser.add_argument("--kind", default="bench-gpt2", help="a GPT-2 kind of the zoo (gpt2, bench-gpt2)")
    parser.add_argument("--pairs", nargs="+", default=["0:1"], help="seed pairs A:B")
    parser.add_argument("--epochs", type=float, default=10.0, help="the reference's epochs (its merge script's 10)")
    parser.add_argument(
        "--no-early-stop", dest="early_stop", action="store_false", help="the reference runs every step"
    )
    parser.add_argument("--train-chars", type=int, default=180_000, help="training text (both tools learn on it)")
    parser.add_argument("--val-chars", type=int, default=20_000, help="validation text (both tools stop on it)")
    parser.add_argument("--test-chars", type=int, default=100_000, help="test text (both barriers measured on it)")
    parser.add_argument(
        "--ours",
        nargs="*",
        type=json.loads,
        default=[{}],
        help='our learned runs, options as JSON (\'{"lr": 0.003}\'; {"epochs": 30}: 30 epochs of the training split)',
    )
    parser.add_argument(
        "--ref-variants",
        nargs="*",
        default=[""],
        help="the reference's runs: extra arguments, 'epochs=50,permutations_only' ('': as it is)",
    )
    parser.add_argument("--tag", default="", help="a name for this run's results file")
    parser.add_argument("--seed", type=int, default=42, help="the reference's seed (its default) and our λ seed")
    parser.add_argument("--out", type=Path, default=CACHE / "reference-bench")
    args = parser.parse_args(argv)
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    if args.setup:
        setup(args.venv)
        return
    if args.summary:
        print(summary(args.out, args.kind))
        return
    if not (args.venv / "bin" / "python").exists():
        raise SystemExit(f"no reference environment at {args.venv}: run with --setup first")
    tree, commit = checkout(args.reference, work)
    if args.paper:
        compare(*paper_pair(tree, args), tree, commit, args)
        return
    for pair in args.pairs:
        a, b = (int(x) for x in pair.split(":"))
        compare(*zoo_pair(args.kind, (a, b), tree, args), tree, commit, args)


if __name__ == "__main__":
    main()
