"""A tiny chat fine-tune moved by the default recipe ends its turns when it generates.

Three models are trained here, each a few seconds: a character-level GPT-2 base A and a target B
from another seed on plain text, and a chat fine-tune of A (ChatML's two tokens added) on short
user / assistant exchanges, so that it ends its turns. Each is saved as stock transformers saves it.
The fine-tune is moved onto B by the recipe a new user writes (base, fine-tune, target, output), and
the output folder is loaded with stock ``AutoModelForCausalLM`` and asked held-out questions through
its chat template, greedily: the share of replies that emit ``<|im_end|>`` is compared with the
fine-tune's own, and with the data-free transport's (``calibrate: false``), which does not end them.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import transformers as T

from helpers import run_main
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from lm_folders import write_recipe

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTEXT = 96


def _lines() -> list[str]:
    text = shakespeare_text(["hamlet", "macbeth", "othello"]).lower()
    lines = [" ".join(line.split()) for line in text.splitlines()]
    return [line for line in lines if 8 <= len(line) <= 24 and ":" not in line]


def _train(model: T.PreTrainedModel, blocks: torch.Tensor, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / steps))
        batch = blocks[torch.randint(0, len(blocks), (32,), generator=gen)]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def _blocks(tok: T.PreTrainedTokenizerFast, text: str) -> torch.Tensor:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // CONTEXT
    return torch.tensor(ids[: n * CONTEXT]).view(n, CONTEXT)


def _exchange(lines: list[str]) -> str:
    roles = ("user", "assistant")
    return "".join(f"<|im_start|>{roles[i % 2]}\n{line}<|im_end|>\n" for i, line in enumerate(lines))


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    lines = _lines()
    train, held = lines[: int(0.9 * len(lines))], lines[int(0.9 * len(lines)) :]
    tok = char_tokenizer("\n".join(lines) + "\n")
    folders = {}
    for name, seed in (("base", 0), ("target", 1)):
        torch.manual_seed(seed)
        config = T.GPT2Config(vocab_size=len(tok), n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4)
        config.bos_token_id = config.eos_token_id = tok.eos_token_id
        model = T.GPT2LMHeadModel(config)
        _train(model, _blocks(tok, "\n".join(random.Random(seed).sample(train, len(train)))), 300, seed)
        model.save_pretrained(str(root / name))
        tok.save_pretrained(str(root / name))
        folders[name] = root / name
    chat_tok = char_tokenizer("\n".join(lines) + "\n")
    chat_tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat_tok.chat_template = TEMPLATE
    ft = T.GPT2LMHeadModel.from_pretrained(str(folders["base"]))
    ft.resize_token_embeddings(len(chat_tok))
    _train(ft, _blocks(chat_tok, _exchange(random.Random(2).sample(train, len(train)))), 300, 2)
    ft.save_pretrained(str(root / "ft"))
    chat_tok.save_pretrained(str(root / "ft"))
    folders["ft"] = root / "ft"
    (root / "held.txt").write_text("\n".join(held[:40]), encoding="utf-8")
    return folders


def _replies_ended(folder: Path, questions: list[str]) -> float:
    """Greedy replies through the folder's own chat template that emit <|im_end|>: stock transformers only."""
    model = T.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tok = T.AutoTokenizer.from_pretrained(str(folder))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ended = 0
    for question in questions:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=CONTEXT - ids.shape[1],
            do_sample=False,
            eos_token_id=end,
            pad_token_id=tok.pad_token_id,
        )
        ended += end in out[0, ids.shape[1] :].tolist()
    return ended / len(questions)


def test_the_default_recipe_moves_a_chat_fine_tune_that_ends_its_turns(trio: dict[str, Path], tmp_path: Path) -> None:
    questions = (trio["ft"].parent / "held.txt").read_text(encoding="utf-8").splitlines()
    roles = {"base": str(trio["base"]), "finetuned": str(trio["ft"]), "target": str(trio["target"])}
    runs = {}
    for name, extra in (("calibrated", {}), ("data-free", {"calibrate": False})):
        folder = tmp_path / name
        folder.mkdir()
        done = run_main(str(write_recipe(folder, {"job": "transport", **roles, **extra, "output": {"dir": "out"}})))
        assert done.returncode == 0, done.stderr
        runs[name] = _replies_ended(folder / "out", questions)
    own = _replies_ended(trio["ft"], questions)
    assert own >= 0.8, own  # the fine-tune ends its turns
    assert runs["calibrated"] >= 0.8 * own, runs
    assert runs["data-free"] < 0.5 * own, runs
