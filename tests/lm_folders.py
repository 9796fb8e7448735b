"""Causal LMs as folders, for tests that run jobs on them and check the result with stock
transformers: saved with a character tokenizer, loaded back with the Auto class, scored by
transformers' own loss, and the recipe that names them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers as T
import yaml

from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text


def save_lm(model: torch.nn.Module, folder: Path) -> Path:
    """``model`` saved with a character tokenizer of some of Hamlet (every id the tiny models have)."""
    tok = char_tokenizer(shakespeare_text(["hamlet"])[:3000].lower())
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def stock_lm(folder: Path) -> T.PreTrainedModel:
    """The folder as stock transformers loads it."""
    return T.AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def fixed_logits(model: T.PreTrainedModel) -> torch.Tensor:
    """Logits on two fixed rows of 20 token ids."""
    ids = torch.arange(40).reshape(2, 20) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


def transformers_loss(model: T.PreTrainedModel, batches: list[dict[str, torch.Tensor]]) -> float:
    """The token-weighted mean next-token loss, from transformers' own loss of each batch."""
    total = count = 0.0
    with torch.no_grad():
        for batch in batches:
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss) * n
            count += n
    return total / count


def write_recipe(root: Path, body: dict[str, Any]) -> Path:
    """``root/recipe.yaml`` holding ``body``, on the CPU and without the alignment cache."""
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({**body, "device": "cpu", "cache": False}, sort_keys=False), encoding="utf-8")
    return path
