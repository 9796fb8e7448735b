"""Score model folders as a user would use them, with stock transformers and PEFT only.

This script does not import hf-rebasin: what it reports about a transported model is measured the
way anyone who downloads the folder would measure it. Each folder is a model
(``AutoModelForCausalLM``) or a PEFT adapter (loaded on ``--target``, resized to the rows its
``rebasin.json`` names). For every folder it prints:

- ``task``: next-token loss on the held-out task text (``--task``, a text file), read with the
  folder's own tokenizer in blocks of ``--block`` tokens; with ``--chat``, the ChatML tokens are
  left out of the loss (a target without them cannot predict them);
- ``kl``: KL(teacher ‖ model) per token on the same text, where ``--teacher`` is given (the
  fine-tune; tokens the two vocabularies share, by string);
- ``im_end``: with ``--chat``, how often ``<|im_end|>`` is the most likely token where a turn ends;
- ``ends``: with ``--prompts`` (JSON lines of ``{"messages": [...]}``), the share of greedy replies
  through the folder's chat template that emit ``<|im_end|>`` within ``--new-tokens`` tokens;
- ``support``: loss on the target's own held-out text (``--support``): what the model forgot.

    python benchmarks/transport/score_chat.py out/chat out/chat-data-free --teacher ft/ --target new-base/ \
        --task dialogue_test.txt --support support_test.txt --prompts prompts.jsonl --chat --json scores.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

IM_END, IM_START = "<|im_end|>", "<|im_start|>"


def load(folder: Path, target: Path | None) -> tuple[Any, Any]:
    """A folder as a user loads it: a model, or an adapter on the target resized to its rows
    (``ADAPTER::BASE``: an adapter on another base, resized to the adapter's embedding rows)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if "::" in str(folder):
        adapter, base = (Path(p) for p in str(folder).split("::"))
        return _on_base(adapter, base)
    if not (folder / "adapter_config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(folder)).eval(), AutoTokenizer.from_pretrained(str(folder))
    from peft import PeftModel

    if target is None:
        raise SystemExit(f"{folder} is an adapter: give --target, the model it is for")
    tokenizer = AutoTokenizer.from_pretrained(str(folder if (folder / "tokenizer.json").is_file() else target))
    model = AutoModelForCausalLM.from_pretrained(str(target))
    record = folder / "rebasin.json"
    rows = None
    if record.is_file():
        rows = (
            json.loads(record.read_text(encoding="utf-8")).get("transport", {}).get("adapter", {}).get("embedding_rows")
        )
    if rows:
        model.resize_token_embeddings(int(rows))
    return PeftModel.from_pretrained(model, str(folder)).eval(), tokenizer


def _on_base(adapter: Path, base: Path) -> tuple[Any, Any]:
    """A PEFT adapter on its own base, resized to its tokenizer (PEFT's guide for new tokens)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    model = AutoModelForCausalLM.from_pretrained(str(base))
    model.resize_token_embeddings(len(tokenizer))
    return PeftModel.from_pretrained(model, str(adapter)).eval(), tokenizer


def blocks(tokenizer: Any, text: str, block: int, max_tokens: int) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    n = len(ids) // block
    return torch.tensor(ids[: n * block]).view(n, block)


def translate(ids: torch.Tensor, reader: Any, tokenizer: Any) -> torch.Tensor:
    """``reader``'s ids as ``tokenizer``'s, by token string; a token it lacks reads as its pad id."""
    if reader is tokenizer:
        return ids
    vocab = tokenizer.get_vocab()
    pad = tokenizer.pad_token_id or 0
    table = {i: vocab.get(w, pad) for w, i in reader.get_vocab().items()}
    return ids.clone().apply_(lambda v: table[v])


def chat_ids(tokenizer: Any) -> set[int]:
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in (IM_START, IM_END) if t in vocab}


@torch.no_grad()
def text_scores(
    model: Any, tokenizer: Any, text: str, args: argparse.Namespace, teacher: tuple[Any, Any] | None
) -> dict[str, float]:
    """Loss (chat tokens left out with --chat), ``<|im_end|>`` top-1 at turn ends, KL to the teacher."""
    reader = teacher[1] if teacher is not None else tokenizer  # every model scored on the same tokens
    raw = blocks(reader, text, args.block, args.max_tokens)
    data = translate(raw, reader, tokenizer)
    skip = chat_ids(reader) if args.chat else set()
    end, own_end = reader.get_vocab().get(IM_END), tokenizer.get_vocab().get(IM_END, -1)
    nll = count = hits = turns = 0.0
    kl = kl_count = 0.0
    if teacher is not None:
        t_vocab, s_vocab = reader.get_vocab(), tokenizer.get_vocab()
        common = sorted(set(t_vocab) & set(s_vocab))
        shared = (torch.tensor([t_vocab[w] for w in common]), torch.tensor([s_vocab[w] for w in common]))
    for i in range(0, len(data), args.batch):
        x, r = data[i : i + args.batch], raw[i : i + args.batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        y, ry = x[:, 1:], r[:, 1:]
        keep = torch.ones_like(y, dtype=torch.bool)
        for s in skip:
            keep &= ry != s
        logp = torch.log_softmax(logits, -1)
        nll -= float(logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)[keep].sum())
        count += int(keep.sum())
        if end is not None:
            at = ry == end
            hits += int((logits.argmax(-1)[at] == own_end).sum())
            turns += int(at.sum())
        if teacher is not None:
            t_logp = torch.log_softmax(teacher[0](input_ids=r).logits[:, :-1].float(), -1)
            p = t_logp[..., shared[0]].exp()
            kl += float((p * (t_logp[..., shared[0]] - logp[..., shared[1]])).sum())
            kl_count += y.numel()
    out = {"loss": nll / max(count, 1), "tokens": count}
    if end is not None and turns:
        out.update(im_end=hits / turns, turn_ends=turns)
    if teacher is not None:
        out["kl"] = kl / max(kl_count, 1)
    return out


@torch.no_grad()
def turn_ends(model: Any, tokenizer: Any, prompts: list[dict[str, Any]], new_tokens: int) -> dict[str, Any]:
    """Greedy replies through the chat template: the share that emit ``<|im_end|>`` in time."""
    end = tokenizer.get_vocab().get(IM_END)
    if end is None or not getattr(tokenizer, "chat_template", None):
        return {"ends": float("nan"), "prompts": len(prompts)}
    done = 0
    example = ""
    for k, p in enumerate(prompts):
        ids = tokenizer.apply_chat_template(
            p["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        prompt = ids["input_ids"]
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=end,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end,
        )
        reply = out[0, prompt.shape[1] :].tolist()
        done += int(end in reply)
        if k == 0:
            example = tokenizer.decode(reply)
    return {"ends": done / len(prompts), "prompts": len(prompts), "example": example}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="model or adapter folders (ADAPTER::BASE: on BASE)")
    parser.add_argument("--task", type=Path, required=True)
    parser.add_argument("--support", type=Path)
    parser.add_argument("--prompts", type=Path)
    parser.add_argument("--teacher", type=Path, help="the fine-tune (ADAPTER::BASE for an adapter)")
    parser.add_argument("--target", type=Path)
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=65536)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    task = args.task.read_text(encoding="utf-8")
    support = args.support.read_text(encoding="utf-8") if args.support else None
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines()] if args.prompts else []
    teacher = load(args.teacher, None) if args.teacher else None
    rows = []
    for folder in args.folders:
        model, tokenizer = load(folder, args.target)
        row: dict[str, Any] = {"folder": str(folder), "task": text_scores(model, tokenizer, task, args, teacher)}
        if support is not None:
            row["support"] = text_scores(
                model, tokenizer, support, argparse.Namespace(**{**vars(args), "chat": False}), None
            )
        if prompts:
            row["generation"] = turn_ends(model, tokenizer, prompts, args.new_tokens)
        rows.append(row)
        t = row["task"]
        print(
            f"{folder}: task {t['loss']:.4f}"
            + (f", kl {t['kl']:.4f}" if "kl" in t else "")
            + (f", <|im_end|> top-1 {t['im_end']:.1%} of {t['turn_ends']}" if "im_end" in t else "")
            + (f", support {row['support']['loss']:.4f}" if support is not None else "")
            + (
                f", replies ended {row['generation']['ends']:.1%}"
                if prompts and not math.isnan(row["generation"]["ends"])
                else ""
            ),
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
