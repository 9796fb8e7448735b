"""Models whose vocabularies differ as Hub relatives' do, built as mergekit's own tokenizer tests
build them: a tiny Llama with a 64-token BPE vocabulary (``base``), the same with two ChatML tokens
added and two embedding rows more (``chatml``), and one whose tokenizer lists four placeholder tokens
past its 64 rows (``padded``). Each is a folder stock transformers loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers as T

CHATML = ["<|im_start|>", "<|im_end|>"]
UNUSED = [f"<UNUSED_{i}>" for i in range(4)]


def vocab_tokenizer(vocab_size: int, added: list[str] | None = None) -> T.PreTrainedTokenizerFast:
    """mergekit's test tokenizer: ``<unk> <s> </s> _tok_3 …`` as a BPE model, then ``added``."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"_tok_{i}" for i in range(3, vocab_size)]
    data = {
        "version": "1.0",
        "model": {"type": "BPE", "vocab": dict(zip(tokens, range(vocab_size), strict=True)), "merges": []},
        "added_tokens": [],
    }
    backend = tokenizers.Tokenizer.from_str(json.dumps(data))
    tok = T.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_tokens(list(added or []))
    return tok


def tiny_llama(rows: int, seed: int) -> T.LlamaForCausalLM:
    """mergekit's ``make_picollama`` in spirit, smaller (its merges are stored as test references):
    a 1-layer Llama of ``rows`` embedding rows, untied."""
    torch.manual_seed(seed)
    config = T.LlamaConfig(
        vocab_size=rows,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    return T.LlamaForCausalLM(config).eval()


def save_case(folder: Path, rows: int, added: list[str], seed: int) -> Path:
    """One case saved: the model (float32 safetensors) and its tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    tiny_llama(rows, seed).save_pretrained(str(folder))
    vocab_tokenizer(64, added).save_pretrained(str(folder))
    return folder


def mergekit_cases(root: Path) -> dict[str, Path]:
    """mergekit's three: ``base`` (64 tokens, 64 rows), ``chatml`` (66 tokens, 66 rows), ``padded``
    (68 tokens listed, 64 rows: the four placeholders have none)."""
    return {
        "base": save_case(root / "base", 64, [], 0),
        "chatml": save_case(root / "chatml", 66, CHATML, 1),
        "padded": save_case(root / "padded", 64, UNUSED, 2),
    }


def save_chat_transport(
    root: Path, base: torch.nn.Module, ft: Any, target: Any, target_added: list[str]
) -> dict[str, Path]:
    """A transport's three folders: ``base`` with a 64-token tokenizer; ``ft`` (the base resized for
    ChatML) with every weight moved a little, and the ChatML tokenizer; ``target`` filled with the
    base under a random permutation of its units, heads and residual features (its rows past the
    base's: tokens ``target_added`` of its own)."""
    from hf_rebasin.symmetry.adapters import graph_for

    base.save_pretrained(str(root / "base"))  # type: ignore[operator]
    vocab_tokenizer(64).save_pretrained(str(root / "base"))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in ft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    ft.save_pretrained(str(root / "ft"))
    vocab_tokenizer(64, CHATML).save_pretrained(str(root / "ft"))
    sd = base.state_dict()
    graph = graph_for(base.config, sd.keys())  # type: ignore[arg-type]
    moved = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(3)))
    with torch.no_grad():
        for name, t in moved.items():
            target.state_dict()[name][: t.shape[0]].copy_(t)
    target.save_pretrained(str(root / "target"))
    vocab_tokenizer(64, target_added).save_pretrained(str(root / "target"))
    return {"base": root / "base", "ft": root / "ft", "target": root / "target"}
