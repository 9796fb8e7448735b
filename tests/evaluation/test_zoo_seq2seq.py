"""The zoo's encoder-decoders: pretrained by denoising, saved as stock folders, and scored on held-out
batches that reproduce their recorded loss through the model's own loss (labels shifted by the model)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from hf_rebasin.evaluation.zoo.catalogue import DEFAULT_CONFIGS, Seq2SeqTrainConfig
from hf_rebasin.evaluation.zoo.train import held_out_batches, train_tiny_seq2seq


def _short(kind: str, **changes: object) -> Seq2SeqTrainConfig:
    default = DEFAULT_CONFIGS[kind]  # type: ignore[index]
    assert isinstance(default, Seq2SeqTrainConfig)
    return dataclasses.replace(default, steps=30, warmup=5, eval_tokens=2048, **changes)  # type: ignore[arg-type]


def _own_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean loss per target token from the model's own loss: it builds its decoder inputs from the labels."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"] != -100).sum())
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
            total, count = total + float(out.loss) * n, count + n
    return total / count


def test_a_zoo_bart_reloads_with_the_stock_class_and_its_held_out_loss_is_its_own(tmp_path: Path) -> None:
    folder = train_tiny_seq2seq("bart", 0, tmp_path / "bart", _short("bart", plays=("hamlet",), num_layers=1))
    record = json.loads((folder / "training.json").read_text())
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(folder)).eval()
    tokenizer = T.AutoTokenizer.from_pretrained(str(folder))
    assert type(model).__name__ == "BartForConditionalGeneration" and tokenizer.mask_token is not None
    assert tokenizer("to be")["input_ids"][-1] == tokenizer.eos_token_id  # every text ends in <eos>
    batches = held_out_batches(folder)
    assert record["held_out"]["tokens"] == sum(int((b["labels"] != -100).sum()) for b in batches)
    assert _own_loss(model, batches) == pytest.approx(record["held_out"]["loss"], abs=1e-4)
    assert record["train_curve"][-1] < record["train_curve"][0]


def test_a_zoo_t5_stores_its_head_apart_as_t5_v1_1_does(tmp_path: Path) -> None:
    config = _short("bench-t5", vocab_size=300, hidden_size=32, num_layers=1, head_dim=8, intermediate_size=48)
    folder = train_tiny_seq2seq("bench-t5", 0, tmp_path / "t5", dataclasses.replace(config, plays=("hamlet",)))
    stored = load_file(str(folder / "model.safetensors"))
    assert {"shared.weight", "lm_head.weight"} <= set(stored) and "encoder.embed_tokens.weight" not in stored
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(folder)).eval()
    assert model.lm_head.weight is not model.shared.weight and not model.config.scale_decoder_outputs
    assert model.config.feed_forward_proj == "gated-gelu"
    tokenizer = T.AutoTokenizer.from_pretrained(str(folder))
    assert "<extra_id_0>" in tokenizer.get_vocab()
    record = json.loads((folder / "training.json").read_text())
    assert _own_loss(model, held_out_batches(folder)) == pytest.approx(record["held_out"]["loss"], abs=1e-4)
