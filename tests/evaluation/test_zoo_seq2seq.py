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

from hf_rebasin.evaluation.zoo import train
from hf_rebasin.evaluation.zoo.catalogue import DEFAULT_CONFIGS, Seq2SeqFineTuneConfig, Seq2SeqTrainConfig
from hf_rebasin.evaluation.zoo.train import finetune_seq2seq, held_out_batches, train_tiny_seq2seq


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


@pytest.mark.slow  # the whole Bible tokenized by characters: about 50 s each
@pytest.mark.parametrize("rank", [0, 4])
def test_a_zoo_fine_tune_of_a_bart_learns_the_bible_and_loads_as_users_load_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    base = train_tiny_seq2seq("bart", 0, tmp_path / "base", _short("bart", plays=("hamlet",), num_layers=1))
    monkeypatch.setattr(train, "cached_model", lambda kind, seed, *a, **k: base)
    modules = ("q_proj", "v_proj", "fc1")
    config = Seq2SeqFineTuneConfig(
        base="bart", steps=8, block_size=64, eval_tokens=1024, rank=rank, target_modules=modules
    )
    folder = finetune_seq2seq("bench-t5-ft-lora" if rank else "bench-t5-ft", 0, tmp_path / "ft", config)
    record = json.loads((folder / "training.json").read_text())
    if rank:
        import peft

        assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "zoo:bart-seed0"
        model = peft.PeftModel.from_pretrained(T.AutoModelForSeq2SeqLM.from_pretrained(str(base)), str(folder))
    else:
        model = T.AutoModelForSeq2SeqLM.from_pretrained(str(folder))
    assert _own_loss(model.eval(), held_out_batches(folder)) == pytest.approx(record["held_out"]["loss"], abs=1e-4)
