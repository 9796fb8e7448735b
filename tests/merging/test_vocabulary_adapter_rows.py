"""LoRA adapters trained with new tokens, read as PEFT saves them and merged as PEFT merges them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers as T

from hf_rebasin.merging.vocabulary.adapter_rows import adapter_rows, merged_with_tokens


def _gpt2_adapter(root: Path, lora: Any) -> T.GPT2LMHeadModel:
    """A tiny GPT-2 saved in ``root/base`` and a PEFT adapter of it resized to 66 rows (``lora``,
    its trainable weights moved off their start) in ``root/adapter``; the base is returned."""
    from peft import get_peft_model

    torch.manual_seed(0)
    config = T.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    base = T.GPT2LMHeadModel(config).eval()
    base.save_pretrained(str(root / "base"))
    resized = T.GPT2LMHeadModel.from_pretrained(str(root / "base"))
    resized.resize_token_embeddings(66)
    peft_model = get_peft_model(resized, lora)
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    peft_model.save_pretrained(str(root / "adapter"))
    return base


def test_trainable_tokens_on_a_tied_gpt2_head_merge_as_peft_merges_them(tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel

    base = _gpt2_adapter(
        tmp_path,
        LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, trainable_token_indices={"wte": [64, 65]}),
    )
    again = T.GPT2LMHeadModel.from_pretrained(str(tmp_path / "base"))
    again.resize_token_embeddings(66)
    theirs = PeftModel.from_pretrained(again, str(tmp_path / "adapter")).merge_and_unload().eval()
    assert adapter_rows(tmp_path / "adapter", base) == 66
    ours = merged_with_tokens(tmp_path / "adapter", base)
    ids = torch.tensor([[1, 64, 5, 65, 9]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=0, atol=1e-5)


def test_an_adapter_of_the_bases_own_rows_is_not_read_here(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)).eval()
    get_peft_model(base, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)).save_pretrained(
        str(tmp_path / "adapter")
    )
    fresh = T.GPT2LMHeadModel(base.config).eval()
    assert adapter_rows(tmp_path / "adapter", fresh) is None
    assert merged_with_tokens(tmp_path / "adapter", fresh) is None


def test_modules_to_save_on_a_tied_gpt2_head_part_as_peft_trains_them(tmp_path: Path) -> None:
    """PEFT trains a copy of each module of ``modules_to_save``: on GPT-2, whose LM head is its
    embedding, the two part. Saved from a base loaded from its folder, the adapter also holds the
    wrapped modules' own keys (``X.modules_to_save.weight``, ``X.original_module.weight``); it is read
    and merged untied, computing what PEFT's model computes."""
    from peft import LoraConfig, PeftModel

    base = _gpt2_adapter(
        tmp_path, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, modules_to_save=["wte", "lm_head"])
    )
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")).keys()
    assert "base_model.model.lm_head.original_module.weight" in keys  # PEFT's save_embedding_layers
    again = T.GPT2LMHeadModel.from_pretrained(str(tmp_path / "base"))
    again.resize_token_embeddings(66)
    theirs = PeftModel.from_pretrained(again, str(tmp_path / "adapter")).eval()
    ours = merged_with_tokens(tmp_path / "adapter", base)
    assert not ours.config.tie_word_embeddings
    assert ours.lm_head.weight.data_ptr() != ours.transformer.wte.weight.data_ptr()
    ids = torch.tensor([[1, 64, 5, 65, 9]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=0, atol=1e-5)
