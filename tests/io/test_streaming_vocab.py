"""Streamed runs of models whose vocabularies differ: each model's rows gathered into the working
layout, filled and written a block of rows at a time, never a whole model in memory.

Each streamed output is compared file by file with the in-memory path's (``safetensors``), and
its function with the fine-tune's as stock transformers computes it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import transformers as T

from hf_rebasin.core.lazy import LazyState, gather_rows
from streamed import both_ways, notes_of, safetensors_of
from vocab_models import CHATML, mergekit_cases, save_chat_transport


def test_gathered_rows_read_only_the_rows_they_need() -> None:
    full = torch.arange(4000 * 3, dtype=torch.float32).reshape(4000, 3)
    read: list[int] = []

    def rows(_name: str) -> Any:
        def block(start: int, stop: int) -> torch.Tensor:
            read.extend(range(start, stop))
            return full[start:stop]

        return block

    state = LazyState({"w": (4000, 3)}, {"w": torch.float32}, lambda _n: full, rows=rows)
    idx = torch.tensor([*range(10), 3990, 3991, -1, 5])
    got = gather_rows(state, {"w": idx}, fill=lambda _n: torch.full((3,), 7.0))["w"]
    assert got.shape == (14, 3)
    assert torch.equal(got[:10], full[:10]) and torch.equal(got[10:12], full[3990:3992])
    assert torch.equal(got[12], torch.full((3,), 7.0)) and torch.equal(got[13], full[5])
    assert sorted(set(read)) == [*range(10), 3990, 3991]  # two runs, nothing between them


def test_a_streamed_union_merge_writes_what_the_in_memory_merge_writes(
    tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    cases = mergekit_cases(tmp_path / "cases")
    body = {
        "job": "merge",
        "models": [str(cases[k]) for k in ("base", "padded", "chatml")],
        "strategy": "weight-matching",
        "merge": {"weight": [0.5, 0.25, 0.25]},
        "tokenizer": {"source": "union"},
    }
    memory, streamed = both_ways(body, tmp_path, capsys, monkeypatch)
    assert "weights streamed" in notes_of(streamed) and "weights streamed" not in notes_of(memory)
    tok = T.AutoTokenizer.from_pretrained(str(streamed))
    assert tok.convert_tokens_to_ids(CHATML) == [64, 65]
    assert safetensors_of(streamed)["model.embed_tokens.weight"].shape[0] == len(tok) == 66


def _tied_chat(root: Path) -> dict[str, Path]:
    """A GPT-2 base (tied head, 64 tokens), its ChatML fine-tune (66 rows) and a target that is the
    base with its units, heads and residual features permuted and 4 tokens of its own."""
    config = T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    base = T.GPT2LMHeadModel(config).eval()
    ft = copy.deepcopy(base)
    ft.resize_token_embeddings(66)
    target = T.GPT2LMHeadModel(T.GPT2Config(**{**config.to_dict(), "vocab_size": 68})).eval()
    return save_chat_transport(root, base, ft, target, [f"<ctl_{i}>" for i in range(4)])


def test_a_streamed_chat_transport_onto_an_extended_tied_target(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    folders = _tied_chat(tmp_path)
    body = {
        "job": "transport",
        "base": str(folders["base"]),
        "finetuned": str(folders["ft"]),
        "target": str(folders["target"]),
        "strategy": "weight-matching",
        "calibrate": False,
    }
    _, streamed = both_ways(body, tmp_path, capsys, monkeypatch)
    assert "weights streamed" in notes_of(streamed)
    tok = T.AutoTokenizer.from_pretrained(str(streamed))
    assert tok.convert_tokens_to_ids(CHATML) == [68, 69]  # after the target's own 4
    model = T.AutoModelForCausalLM.from_pretrained(str(streamed)).eval()
    ft = T.AutoModelForCausalLM.from_pretrained(str(folders["ft"])).eval()
    with torch.no_grad():  # the target is the base permuted: B + τ is the fine-tune, chat rows included
        a = model(torch.tensor([[1, 68, 5, 7, 69, 9]])).logits
        b = ft(torch.tensor([[1, 64, 5, 7, 65, 9]])).logits
    torch.testing.assert_close(a[..., :64], b[..., :64], rtol=0, atol=1e-4)
    torch.testing.assert_close(a[..., 68:], b[..., 64:], rtol=0, atol=1e-4)
