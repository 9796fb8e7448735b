"""Lineage across vocabularies: added tokens, an extended release or padding rows do not hide a
parent; the pair is judged on the rows both models have, matched by token."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_rebasin.io.models import load_model
from hf_rebasin.lineage.pairs import lineage_of
from vocab_models import CHATML, tiny_llama, vocab_tokenizer


def _save(model: torch.nn.Module, folder: Path, added: list[str]) -> str:
    model.save_pretrained(str(folder))
    vocab_tokenizer(64, added).save_pretrained(str(folder))
    return str(folder)


def _nudged(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def test_a_fine_tune_with_added_tokens_and_an_extended_release_are_same_basis_with_their_base(tmp_path: Path) -> None:
    base = _save(tiny_llama(64, 0), tmp_path / "base", [])
    chat = tiny_llama(64, 0)
    chat.resize_token_embeddings(66, mean_resizing=False)
    chat_folder = _save(_nudged(chat, 0.01, 1), tmp_path / "chat", CHATML)
    extended = tiny_llama(68, 0)  # the base's first 64 rows (same seed), 4 new rows of its own
    with torch.no_grad():
        for name, t in tiny_llama(64, 0).state_dict().items():
            extended.state_dict()[name][: t.shape[0]].copy_(t)
    ext_folder = _save(extended, tmp_path / "extended", [f"<ctl_{i}>" for i in range(4)])
    apart = _save(tiny_llama(66, 5), tmp_path / "apart", CHATML)
    folders = [base, chat_folder, ext_folder, apart]
    record = lineage_of([load_model(f) for f in folders], folders)
    verdicts = {(p.a, p.b): p.verdict for p in record.pairs}
    assert verdicts[(0, 1)] == "same basis"
    assert verdicts[(0, 2)] == "same basis"
    assert verdicts[(1, 2)] == "same basis"
    assert verdicts[(0, 3)] == "independent"
    assert "compared on the 64 tokens every model has" in str(record.settings["vocabulary"])
