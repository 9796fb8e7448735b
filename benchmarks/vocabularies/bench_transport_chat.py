"""A chat fine-tune moved onto another seed: its ChatML tokens come along.

The fine-tune is ``bench-gpt2-chat`` seed A (``bench-gpt2`` seed A with ``<|im_start|>`` and
``<|im_end|>`` added, embeddings resized, fine-tuned on speeches of three comedies as ChatML
turns); the target is ``bench-gpt2`` seed B, whose vocabulary lacks both tokens. Each strategy's
transport is run as a recipe (``tokenizer.source: finetuned``, the default), the output folder
loaded back with stock ``AutoModelForCausalLM`` (an adapter output with PEFT, on the target resized
to its rows, as PEFT's guide loads an adapter with new tokens), and scored by this script alone:

- task: next-token loss on held-out dialogues (the fine-tune's tokenizer, which every output has),
  over the text tokens (the target cannot predict the chat tokens: they are left out of every
  model's loss, and the target reads them as its pad token), and the share of the gap between
  the target and the fine-tune that is closed;
- ``<|im_end|>``: at every position whose next token ends a turn, whether the model's most likely
  token is ``<|im_end|>`` (the fine-tune learned when a speech ends; the target never saw the token);
- support: loss on the target's own held-out text (what it forgets).

``vanilla`` is the naive transport: B + τ, the chat rows copied as they are. ``--lora`` moves
``bench-gpt2-chat-lora`` instead: the same fine-tune as a PEFT LoRA adapter whose new tokens are
trainable tokens (the fine-tune row is PEFT's own ``merge_and_unload`` of it on its resized base);
each output is an adapter for the target, its embedding and LM head in ``modules_to_save``.

    python benchmarks/vocabularies/bench_transport_chat.py                      # bench zoo, pairs 0:1 (trains it first)
    python benchmarks/vocabularies/bench_transport_chat.py --tiny --pairs 0:1   # the tiny zoo (gpt2, gpt2-chat): a minute
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

STRATEGIES = ("vanilla", "weight-matching", "generalized-orthogonal")


def _model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def _output(folder: Path, target: Path) -> Any:
    """A transport's output as a user loads it: a model, or an adapter for the target (the target
    resized to the rows the record gives, then ``PeftModel.from_pretrained``)."""
    if not (folder / "adapter_config.json").is_file():
        return _model(folder)
    from peft import PeftModel

    record = json.loads((folder / "rebasin.json").read_text(encoding="utf-8"))
    model = _model(target)
    model.resize_token_embeddings(record["transport"]["adapter"]["embedding_rows"])
    return PeftModel.from_pretrained(model, str(folder)).eval()


def score(
    model: Any, dialogues: list[dict[str, torch.Tensor]], support: list[dict[str, torch.Tensor]], end: int
) -> dict[str, float]:
    """Dialogue loss, ``<|im_end|>`` accuracy at turn ends, support loss: stock forward passes."""
    from hf_rebasin.evaluation.evaluate import evaluate_loss

    text = [{**b, "labels": b["labels"].masked_fill(b["labels"] >= end - 1, -100)} for b in dialogues]
    hits = total = 0
    with torch.no_grad():
        for batch in dialogues:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            nxt = batch["labels"][:, 1:]
            at = nxt == end
            hits += int((logits[:, :-1].argmax(-1)[at] == end).sum())
            total += int(at.sum())
    return {
        "task": evaluate_loss(model, text, "causal-lm").loss,
        "im_end": hits / max(total, 1),
        "turns": total,
        "support": evaluate_loss(model, support, "causal-lm").loss,
    }


def transported(root: Path, base: str, chat: str, target: str, strategy: str) -> tuple[Path, float]:
    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run.pipeline import run_recipe

    body = {
        "job": "transport",
        "base": base,
        "finetuned": chat,
        "target": target,
        "strategy": strategy,
        "output": {"dir": strategy},
        "device": "cpu",
        "cache": False,
    }
    path = root / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    start = time.perf_counter()
    run_recipe(load_recipe(path))
    return root / strategy, time.perf_counter() - start


def _peft_merged(adapter: Path, base: Path, rows: int) -> Any:
    """PEFT's own merge of a LoRA adapter with trainable tokens, on its base resized to ``rows``."""
    from peft import PeftModel

    model = _model(base)
    model.resize_token_embeddings(rows)
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


def pair(seed_a: int, seed_b: int, tiny: bool, lora: bool = False) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from hf_rebasin.evaluation.zoo.train import cached_model, held_out_batches

    base_kind, chat_kind = ("gpt2", "gpt2-chat") if tiny else ("bench-gpt2", "bench-gpt2-chat")
    chat_kind = "bench-gpt2-chat-lora" if lora else chat_kind
    chat, target = cached_model(chat_kind, seed_a), cached_model(base_kind, seed_b)
    dialogues, support = held_out_batches(chat, 32), held_out_batches(target, 32)
    tok = AutoTokenizer.from_pretrained(str(chat))
    end = int(tok.convert_tokens_to_ids("<|im_end|>"))
    ft = _peft_merged(chat, cached_model(base_kind, seed_a), len(tok)) if lora else _model(chat)
    rows = [{"model": "fine-tune A_ft" + (" (LoRA)" if lora else ""), **score(ft, dialogues, support, end)}]
    target_row = {"model": "target B", **score(_model(target), _own(dialogues, end), support, end)}
    rows.append(target_row)
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in STRATEGIES:
            folder, seconds = transported(
                Path(tmp),
                f"zoo:{base_kind}-seed{seed_a}",
                f"zoo:{chat_kind}-seed{seed_a}",
                f"zoo:{base_kind}-seed{seed_b}",
                strategy,
            )
            name = "naive B + τ" if strategy == "vanilla" else strategy
            moved = _output(folder, target)
            rows.append({"model": name, "seconds": seconds, **score(moved, dialogues, support, end)})
    gap = target_row["task"] - rows[0]["task"]
    for r in rows:
        r["pair"] = f"{seed_a}:{seed_b}"
        r["gap_closed"] = (target_row["task"] - r["task"]) / gap if gap else float("nan")
    return rows


def _own(batches: list[dict[str, torch.Tensor]], end: int) -> list[dict[str, torch.Tensor]]:
    """The dialogues as the target can read them: ChatML's ids (past its rows) as its pad id 0; its
    ``<|im_end|>`` accuracy is 0 by construction (it has no such row)."""
    return [{**b, "input_ids": b["input_ids"].masked_fill(b["input_ids"] >= end - 1, 0)} for b in batches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=["0:1"])
    parser.add_argument("--tiny", action="store_true", help="the tiny zoo (gpt2, gpt2-chat) instead of the bench zoo")
    parser.add_argument("--lora", action="store_true", help="the chat fine-tune as a LoRA adapter (bench zoo)")
    args = parser.parse_args()
    rows = []
    for p in args.pairs:
        a, b = (int(x) for x in p.split(":"))
        rows.extend(pair(a, b, args.tiny, args.lora))
    print("| pair | model | dialogue loss | gap closed | `<|im_end|>` at turn ends | support loss | s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        seconds = f"{r['seconds']:.0f}" if "seconds" in r else ""
        print(
            f"| {r['pair']} | {r['model']} | {r['task']:.4f} | {r['gap_closed']:.1%} | {r['im_end']:.1%} of {r['turns']} "
            f"| {r['support']:.4f} | {seconds} |"
        )


if __name__ == "__main__":
    main()
