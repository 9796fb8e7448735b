"""The zoo's BERT: a character-level masked LM on Shakespeare (hf_rebasin.evaluation.zoo.train / zoo, kind "bert").

A tiny config trains in well under a second; every claim is checked against what stock
transformers and plain torch compute from the saved folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as T

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.evaluation import data, evaldata
from hf_rebasin.evaluation.zoo import catalogue as zoo
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.evaluation.zoo.masked import _masked_epoch, bert_data
from hf_rebasin.recipe import ZOO_PATTERN, load_recipe

PLAYS = ("macbeth",)
TINY = zoo.BertTrainConfig(
    steps=3,
    batch_size=4,
    block_size=16,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    warmup=1,
    plays=PLAYS,
    eval_tokens=512,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train.cached_model("bert", 0, tmp_path_factory.mktemp("zoo"), config=TINY)


def _held_out_ids() -> torch.Tensor:
    """The held-out text as the tokenizer's ids, cut into blocks: computed here, not by the zoo."""
    text = data.shakespeare_text(PLAYS, split="test")
    tokenizer = data.char_tokenizer(data.shakespeare_text(PLAYS), mask=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: TINY.eval_tokens]
    assert len(ids) == TINY.eval_tokens and TINY.eval_tokens % TINY.block_size == 0
    return torch.tensor(ids).view(-1, TINY.block_size)


def test_the_folder_loads_with_stock_classes_and_has_a_mask_token(folder: Path) -> None:
    assert folder.name == f"bert-seed0-{zoo.config_hash('bert', TINY)}"
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder left
    model = T.AutoModelForMaskedLM.from_pretrained(str(folder))
    assert type(model) is T.BertForMaskedLM
    tokenizer = T.PreTrainedTokenizerFast.from_pretrained(str(folder))
    assert tokenizer.mask_token == "<mask>" and tokenizer.mask_token_id == len(tokenizer) - 1
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.max_position_embeddings == TINY.block_size
    assert model.config.hidden_dropout_prob == model.config.attention_probs_dropout_prob == 0.0
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (16, 1)
    record = train.training_record(folder)
    assert record["kind"] == "bert" and record["config"] == {**dataclasses.asdict(TINY), "plays": list(PLAYS)}
    assert set(record["held_out"]) == {"loss", "tokens", "pseudo_perplexity"}


def test_the_recorded_held_out_loss_is_the_masked_lm_cross_entropy(folder: Path) -> None:
    model = T.AutoModelForMaskedLM.from_pretrained(str(folder)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in train.held_out_batches(folder):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            keep = batch["labels"] != -100
            total += float(F.cross_entropy(logits[keep].double(), batch["labels"][keep], reduction="sum"))
            count += int(keep.sum())
    held_out = train.training_record(folder)["held_out"]
    assert count == held_out["tokens"]
    assert total / count == pytest.approx(held_out["loss"], rel=1e-5)
    assert held_out["pseudo_perplexity"] == pytest.approx(torch.tensor(total / count).exp().item(), rel=1e-5)


def test_held_out_batches_are_fixed_bert_masks_of_the_held_out_text(folder: Path) -> None:
    first, again, other_size = (train.held_out_batches(folder, n) for n in (64, 64, 7))
    assert [b.keys() for b in first] == [{"input_ids", "attention_mask", "labels"}] * len(first)
    for key in ("input_ids", "attention_mask", "labels"):
        whole = torch.cat([b[key] for b in first])
        assert all(torch.equal(a[key], b[key]) for a, b in zip(first, again, strict=True))  # deterministic
        assert torch.equal(whole, torch.cat([b[key] for b in other_size]))  # masks do not depend on batching
    inputs, labels = torch.cat([b["input_ids"] for b in first]), torch.cat([b["labels"] for b in first])
    original = _held_out_ids()
    assert torch.equal(torch.cat([b["attention_mask"] for b in first]), torch.ones_like(original))  # no padding
    chosen = labels != -100
    assert torch.equal(labels[chosen], original[chosen])  # predicted: the original characters
    assert torch.equal(inputs[~chosen], original[~chosen])  # not chosen: unchanged, label -100
    assert 0.10 < chosen.float().mean() < 0.20  # 15 %
    mask_id = len(data.char_tokenizer(data.shakespeare_text(PLAYS), mask=True)) - 1
    assert 0.65 < (inputs[chosen] == mask_id).float().mean() < 0.95  # 80 % <mask>
    assert not (inputs[~chosen] == mask_id).any()
    # the same draw as a recipe's masked-LM data with seed 0: one generator over all the blocks
    expected = evaldata.mask_tokens(
        original, torch.ones_like(original, dtype=torch.bool), mask_token_id=mask_id, vocab_size=mask_id + 1, seed=0
    )
    assert torch.equal(inputs, expected[0]) and torch.equal(labels, expected[1])


def test_training_is_deterministic_per_seed_and_seeds_differ(folder: Path, tmp_path: Path) -> None:
    a = train.train_tiny_bert(0, tmp_path / "a", TINY)
    b = train.train_tiny_bert(1, tmp_path / "b", TINY)
    sd = T.BertForMaskedLM.from_pretrained(str(folder)).state_dict()
    sd_a = T.BertForMaskedLM.from_pretrained(str(a)).state_dict()
    sd_b = T.BertForMaskedLM.from_pretrained(str(b)).state_dict()
    assert sd.keys() == sd_a.keys() and all(torch.equal(sd[k], sd_a[k]) for k in sd)
    assert train.training_record(a)["held_out"] == train.training_record(folder)["held_out"]
    key = "bert.encoder.layer.0.intermediate.dense.weight"
    assert not torch.equal(sd[key], sd_b[key])


def test_training_batches_draw_fresh_masks_every_step() -> None:
    tokenizer, blocks, _ = bert_data(TINY)
    epoch = list(_masked_epoch(blocks[:64], tokenizer, 8, seed=3))
    again = list(_masked_epoch(blocks[:64], tokenizer, 8, seed=3))
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(epoch, again, strict=True))
    other = list(_masked_epoch(blocks[:64], tokenizer, 8, seed=4))
    chosen = [b["labels"] != -100 for b in (*epoch, *other)]
    assert len({tuple(c.flatten().tolist()) for c in chosen}) == len(chosen)  # no two batches share masks
    for b in epoch:
        assert set(b) == {"input_ids", "attention_mask", "labels"}
        keep = b["labels"] != -100
        assert 0 < keep.sum() < keep.numel()


def test_char_tokenizer_default_vocabulary_is_unchanged() -> None:
    text = data.shakespeare_text(PLAYS)
    expected = {tok: i for i, tok in enumerate(["<pad>", "<unk>", "<eos>", *sorted(set(text))])}
    plain = data.char_tokenizer(text)
    assert plain.get_vocab() == expected and data.char_tokenizer(text, mask=False).get_vocab() == expected
    assert plain.mask_token is None
    masked = data.char_tokenizer(text, mask=True)
    assert masked.get_vocab() == {**expected, "<mask>": len(expected)}
    sample = text[500:800]
    assert masked(sample)["input_ids"] == plain(sample)["input_ids"]


def test_char_tokenizer_mask_round_trips(tmp_path: Path) -> None:
    tokenizer = data.char_tokenizer("abc", mask=True)
    tokenizer.save_pretrained(str(tmp_path))
    again = T.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert again.mask_token_id == tokenizer.mask_token_id == 6
    assert again("a<mask>c", add_special_tokens=False)["input_ids"] == [3, 6, 5]


def test_the_bert_kind_is_a_zoo_kind_with_its_own_cache_key(tmp_path: Path) -> None:
    assert "bert" in train.KINDS and isinstance(zoo.DEFAULT_CONFIGS["bert"], zoo.BertTrainConfig)
    default = zoo.DEFAULT_CONFIGS["bert"]
    assert zoo.config_hash("bert", default) != zoo.config_hash("gpt2", zoo.DEFAULT_CONFIGS["gpt2"])
    assert zoo.zoo_folder("bert", 2, tmp_path).name == f"bert-seed2-{zoo.config_hash('bert', default)}"
    with pytest.raises(UnsupportedArchitectureError, match="BertTrainConfig"):
        zoo.zoo_folder("bert", 0, tmp_path, config=zoo.DEFAULT_CONFIGS["gpt2"])
    assert zoo.train_steps("bert") == default.steps
    match = ZOO_PATTERN.fullmatch("zoo:bert-seed3")
    assert match is not None and match.groups() == ("bert", "3")


def test_a_recipe_names_zoo_berts(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "job: barrier\nmodels: [zoo:bert-seed0, zoo:bert-seed1]\nstrategy: vanilla\n"
        "evaluate:\n  task: masked-lm\n  data: {dataset: shakespeare, split: test}\noutput: {dir: out}\n"
    )
    recipe = load_recipe(path)
    assert [m.zoo for m in recipe.models] == [("bert", 0), ("bert", 1)]
