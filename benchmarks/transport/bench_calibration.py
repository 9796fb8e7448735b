"""Calibration after transport on the benchmark zoo: what each variant keeps of the fine-tune.

Each variant is a transport recipe run with the `hf-rebasin` command (the default recipe, the
data-free `calibrate: false`, and the ablations: which parameters are fitted, the on-policy share,
the guard, user data instead of self-written text). Every output folder is then scored by
`score_chat.py`, which loads it with stock transformers / PEFT and does not import hf-rebasin.
The fine-tune, the target and (for a LoRA adapter) PEFT's own merge of it are scored the same way.

    python benchmarks/transport/bench_calibration.py --case chat                  # bench-gpt2-chat 0 → bench-gpt2 1
    python benchmarks/transport/bench_calibration.py --case chat-lora --variants default data-free
    python benchmarks/transport/bench_calibration.py --case ft                    # bench-gpt2-ft (KJV) 0 → 1
    python benchmarks/transport/bench_calibration.py --case ft-lora               # bench-gpt2-ft as a LoRA adapter
    python benchmarks/transport/bench_calibration.py --case qwen3-chat            # bench-qwen3-chat 0 → bench-qwen3 1

Prints one row per model: task loss (chat tokens left out), the share of the target-to-fine-tune
gap closed, KL to the fine-tune, `<|im_end|>` top-1 at turn ends and greedy replies that end their
turn (chat cases), support loss (the target's own held-out text) and its cost per unit of task
gain against the fine-tune's own, and the run's seconds. The held-out texts are written once under
``--work`` by this script (the zoo's test splits: the benchmark zoo's data code is hf-rebasin's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CASES = {  # base, fine-tune, target (zoo names), whether it is a chat fine-tune
    "chat": ("bench-gpt2-seed0", "bench-gpt2-chat-seed0", "bench-gpt2-seed1", True),
    "chat-lora": ("bench-gpt2-seed0", "bench-gpt2-chat-lora-seed0", "bench-gpt2-seed1", True),
    "ft": ("bench-gpt2-seed0", "bench-gpt2-ft-seed0", "bench-gpt2-seed1", False),
    "ft-lora": ("bench-gpt2-seed0", "bench-gpt2-ft-lora-seed0", "bench-gpt2-seed1", False),
    "qwen3-chat": ("bench-qwen3-seed0", "bench-qwen3-chat-seed0", "bench-qwen3-seed1", True),
}
VARIANTS: dict[str, Any] = {
    "data-free": False,
    "default": True,
    "rows": {"fit": "rows"},
    "norms": {"fit": "norms"},
    "full": {"fit": "full", "learning_rate": 5e-4},
    "off-policy": {"on_policy": 0.0},
    "no-guard": {"guard": 0.0},
    "user-data": {"data": "USER"},  # the fine-tune's own training text, the run's `calibrate.data`
}


def held_out_texts(work: Path, chat: bool) -> dict[str, Path]:
    """The task's and the target's held-out text, the fine-tune's training text and 100 held-out
    user turns short enough for a 96-token reply in a 128-token context."""
    import random

    from transformers import AutoTokenizer

    from hf_rebasin.evaluation import data
    from hf_rebasin.evaluation.zoo.catalogue import ALL_PLAYS
    from hf_rebasin.evaluation.zoo.train import cached_model

    work.mkdir(parents=True, exist_ok=True)
    corpus = "kjv-chatml" if chat else "kjv"
    files = {
        "task": work / f"{corpus}-test.txt",
        "train": work / f"{corpus}-train.txt",
        "support": work / "shakespeare-test.txt",
        "prompts": work / "prompts.jsonl",
    }
    files["task"].write_text(data.corpus_text(corpus, split="test"), encoding="utf-8")
    files["train"].write_text(data.corpus_text(corpus, split="train")[:2_000_000], encoding="utf-8")
    files["support"].write_text(data.corpus_text("shakespeare", ALL_PLAYS, split="test"), encoding="utf-8")
    if chat:
        tok = AutoTokenizer.from_pretrained(str(cached_model("bench-gpt2-chat", 0)))
        lines = [line.strip() for line in data.kjv_text(split="test").splitlines() if line.strip()]
        random.Random(0).shuffle(lines)
        prompts = []
        for line in lines:
            messages = [{"role": "user", "content": line}]
            if len(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]) <= 32:
                prompts.append(json.dumps({"messages": messages}))
            if len(prompts) == 100:
                break
        files["prompts"].write_text("\n".join(prompts) + "\n", encoding="utf-8")
    return files


def run_variant(work: Path, case: str, name: str, files: dict[str, Path]) -> tuple[Path, float]:
    base, ft, target, _ = CASES[case]
    calibrate = VARIANTS[name]
    if isinstance(calibrate, dict) and calibrate.get("data") == "USER":
        calibrate = {**calibrate, "data": {"dataset": "text", "data_files": str(files["train"])}}
    body = {
        "job": "transport",
        "base": f"zoo:{base}",
        "finetuned": f"zoo:{ft}",
        "target": f"zoo:{target}",
        "calibrate": calibrate,
        "output": {"dir": str(work / case / name), "overwrite": True},
        "device": "cpu",
        "cache": False,
    }
    recipe = work / case / f"{name}.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    start = time.perf_counter()
    subprocess.run(["hf-rebasin", str(recipe)], check=True, capture_output=True, text=True)
    return work / case / name, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="chat")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["data-free", "default"])
    parser.add_argument("--work", type=Path, default=Path("bench-calibration"))
    args = parser.parse_args()
    from hf_rebasin.evaluation.zoo.train import cached_model

    base, ft, target, chat = CASES[args.case]
    folders = {
        k: cached_model(n.rsplit("-seed", 1)[0], int(n.rsplit("-seed", 1)[1]))
        for k, n in zip(("base", "ft", "target"), (base, ft, target), strict=True)
    }
    files = held_out_texts(args.work, chat)
    outputs, seconds = [], {}
    for name in args.variants:
        folder, secs = run_variant(args.work, args.case, name, files)
        outputs.append(folder)
        seconds[str(folder)] = secs
        print(f"{name}: {secs:.0f} s", flush=True)
    scores = args.work / args.case / "scores.json"
    own = f"{folders['ft']}::{folders['base']}" if args.case.endswith("lora") else str(folders["ft"])  # on its own base
    cmd = [sys.executable, str(HERE / "score_chat.py"), own, str(folders["target"]), str(folders["base"])]
    cmd += [str(o) for o in outputs]
    teacher = folders["ft"] if not args.case.endswith("lora") else own
    cmd += ["--teacher", str(teacher), "--target", str(folders["target"]), "--task", str(files["task"])]
    cmd += ["--support", str(files["support"]), "--json", str(scores), "--max-tokens", "32768"]
    if chat:
        cmd += ["--chat", "--prompts", str(files["prompts"])]
    subprocess.run(cmd, check=True)
    table(json.loads(scores.read_text()), seconds)


def table(rows: list[dict[str, Any]], seconds: dict[str, float]) -> None:
    """Gap closed and cost / gain against the target; the fine-tune's own cost / gain over its base A."""
    ft, target, base = rows[0], rows[1], rows[2]
    gap = target["task"]["loss"] - ft["task"]["loss"]
    own_gain = base["task"]["loss"] - ft["task"]["loss"]
    own_cost = ft["support"]["loss"] - base["support"]["loss"]
    print(
        f"the fine-tune over its base A: task gain {own_gain:.3f}, support cost {own_cost:.3f}, cost / gain {own_cost / own_gain:.2f}"
    )
    print("| model | task loss | gap closed | KL | `<|im_end|>` top-1 | replies ended | support | cost / gain | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows[:2] + rows[3:]:
        t, sup = r["task"], r.get("support", {}).get("loss", float("nan"))
        gain = target["task"]["loss"] - t["loss"]
        cost = sup - target["support"]["loss"]
        ends = r.get("generation", {}).get("ends")
        print(
            f"| {Path(r['folder'].split('::')[0]).name} | {t['loss']:.3f} | {gain / gap:.1%} | {t.get('kl', float('nan')):.3f} "
            f"| {t.get('im_end', float('nan')):.1%} | {'' if ends is None else f'{ends:.0%}'} | {sup:.3f} "
            f"| {cost / gain if gain else float('nan'):.2f} | {seconds.get(r['folder'], 0):.0f} |"
        )


if __name__ == "__main__":
    main()
