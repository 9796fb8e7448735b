"""Data, the tiny-model zoo, losses and barriers (hf_rebasin.evaluation.data / train / evaluate)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.core.errors import IncompatibleModelsError, RebasinUserError, UnsupportedArchitectureError
from hf_rebasin.evaluation import data, evaluate
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.evaluation.zoo.catalogue import config_hash

SHORT_PLAYS = ("macbeth",)


@pytest.fixture(scope="module")
def text() -> str:
    return data.shakespeare_text(SHORT_PLAYS)


@pytest.fixture(scope="module")
def tok(text: str) -> T.PreTrainedTokenizerFast:
    return data.char_tokenizer(text)


# ---------------------------------------------------------------------------------------------
# data


def test_shakespeare_text_is_plain_and_split(text: str) -> None:
    full = data.shakespeare_text()
    assert len(full) > 300_000  # enough text for the zoo
    assert "**" not in full and "_" not in full and "\\" not in full
    assert "MACBETH:\n" in text
    train_part = data.shakespeare_text(SHORT_PLAYS, split="train")
    test_part = data.shakespeare_text(SHORT_PLAYS, split="test")
    assert train_part + test_part == text
    assert 0.05 < len(test_part) / len(text) < 0.15
    assert data.shakespeare_text(SHORT_PLAYS) == text  # deterministic


def test_shakespeare_text_refuses_unknown_plays() -> None:
    with pytest.raises(RebasinUserError, match="unknown play 'hamlt'"):
        data.shakespeare_text(["hamlt"])
    with pytest.raises(RebasinUserError, match="split"):
        data.shakespeare_text(split="dev")  # type: ignore[arg-type]


def test_char_tokenizer_round_trip(tok: T.PreTrainedTokenizerFast, text: str, tmp_path: Path) -> None:
    assert len(tok) < 100
    assert (tok.pad_token_id, tok.unk_token_id, tok.eos_token_id) == (0, 1, 2)
    sample = text[1000:1400]
    ids = tok(sample, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(sample)  # one token per character
    assert tok.decode(ids) == sample
    tok.save_pretrained(str(tmp_path))
    again = T.AutoTokenizer.from_pretrained(str(tmp_path))
    assert again(sample, add_special_tokens=False)["input_ids"] == ids
    assert again.decode(ids) == sample
    assert again.pad_token_id == tok.pad_token_id
    assert data.char_tokenizer(text).get_vocab() == tok.get_vocab()  # deterministic ids


def test_text_blocks_pads_only_the_last_block(tok: T.PreTrainedTokenizerFast) -> None:
    blocks = data.text_blocks(tok, "abcdefghij", 4)
    assert blocks.shape == (3, 4) and blocks.dtype == torch.long
    assert tok.decode(blocks[:2].reshape(-1)) == "abcdefgh"
    assert blocks[2, 2:].tolist() == [tok.pad_token_id] * 2
    assert data.text_blocks(tok, "abcdefghi", 4).shape == (2, 4)  # a 1-token tail predicts nothing
    assert data.text_blocks(tok, "abcdefghij", 4, max_tokens=8).shape == (2, 4)


def test_batches_deterministic_with_labels_masked_at_pads(tok: T.PreTrainedTokenizerFast, text: str) -> None:
    blocks = data.text_blocks(tok, text[:2000], 32)
    assert (blocks[-1] == tok.pad_token_id).any()
    pad = tok.pad_token_id

    def run(seed: int | None) -> list[dict[str, torch.Tensor]]:
        return list(data.batches(blocks, 8, pad_token_id=pad, seed=seed))

    plain = run(None)
    assert torch.equal(torch.cat([b["input_ids"] for b in plain]), blocks)  # order kept without a seed
    assert [len(b["input_ids"]) for b in plain[:-1]] == [8] * (len(plain) - 1)
    for b in plain:
        pads = b["input_ids"] == pad
        assert torch.equal(b["attention_mask"], (~pads).long())
        assert (b["labels"][pads] == -100).all()
        assert torch.equal(b["labels"][~pads], b["input_ids"][~pads])
    one, two, other = run(1), run(1), run(2)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(one, two, strict=True))
    assert not torch.equal(one[0]["input_ids"], other[0]["input_ids"])
    dropped = list(data.batches(blocks, 8, pad_token_id=pad, seed=1, drop_last=True))
    assert {len(b["input_ids"]) for b in dropped} == {8}


def test_digits_dataset() -> None:
    x_train, _ = data.digits_dataset("train")
    x_test, y_test = data.digits_dataset("test")
    assert x_train.shape[1:] == (1, 8, 8) and x_train.dtype == torch.float32
    assert len(x_train) + len(x_test) == 1797 and len(x_test) == 359
    assert x_train.min() >= -1 and x_train.max() <= 1
    assert set(y_test.tolist()) == set(range(10))
    again, _ = data.digits_dataset("test")
    assert torch.equal(again, x_test)
    batch = next(data.image_batches(x_test, y_test, 32, seed=0))
    assert batch["pixel_values"].shape == (32, 1, 8, 8) and batch["labels"].shape == (32,)


# ---------------------------------------------------------------------------------------------
# evaluate


def test_task_of() -> None:
    assert evaluate.task_of(tiny.gpt2()) == "causal-lm"
    assert evaluate.task_of(tiny.llama()) == "causal-lm"
    assert evaluate.task_of(tiny.bert_mlm()) == "masked-lm"
    assert evaluate.task_of(tiny.roberta_cls()) == "sequence-classification"
    assert evaluate.task_of(tiny.vit()) == "image-classification"
    with pytest.raises(UnsupportedArchitectureError, match="BertModel"):
        evaluate.task_of(tiny.bert_base())


def _lm_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, tiny.V, (5, 12), generator=g)
    ids[1, 7:] = 0  # padding of unequal length
    ids[4, 3:] = 0
    blocks = ids
    return list(data.batches(blocks, 2, pad_token_id=0))


def test_evaluate_loss_causal_lm_matches_hand_computation() -> None:
    model = tiny.gpt2()
    batches = _lm_batches()
    result = evaluate.evaluate_loss(model, batches, "causal-lm")
    nll: list[float] = []
    with torch.no_grad():
        for b in batches:
            logp = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.log_softmax(-1)
            for row in range(len(b["input_ids"])):
                for t in range(b["input_ids"].shape[1] - 1):
                    target = int(b["labels"][row, t + 1])
                    if target != -100:
                        nll.append(-float(logp[row, t, target]))
    assert result.count == len(nll) == 5 * 11 - 5 - 9
    assert result.loss == pytest.approx(sum(nll) / len(nll), rel=1e-6)
    assert result.metric["perplexity"] == pytest.approx(math.exp(result.loss))
    # summed, not a mean of batch means: batching does not change the answer
    rebatched = list(data.batches(torch.cat([b["input_ids"] for b in batches]), 5, pad_token_id=0))
    assert evaluate.evaluate_loss(model, rebatched, "causal-lm").loss == pytest.approx(result.loss, rel=1e-6)


def test_evaluate_loss_masked_lm_counts_only_labelled_positions() -> None:
    model = tiny.bert_mlm()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, tiny.V, (3, 10), generator=g)
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 5], labels[2, 9] = ids[0, 2], ids[1, 5], ids[2, 9]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    result = evaluate.evaluate_loss(model, [batch], "masked-lm")
    with torch.no_grad():
        logp = model(input_ids=ids).logits.log_softmax(-1)
    hand = -(logp[0, 2, ids[0, 2]] + logp[1, 5, ids[1, 5]] + logp[2, 9, ids[2, 9]]) / 3
    assert result.count == 3
    assert result.loss == pytest.approx(float(hand), rel=1e-6)
    assert result.metric["pseudo_perplexity"] == pytest.approx(math.exp(result.loss))


def test_evaluate_loss_classification_with_accuracy() -> None:
    model = tiny.vit()
    g = torch.Generator().manual_seed(2)
    pixels = torch.randn(7, 1, 8, 8, generator=g)
    labels = torch.randint(0, 5, (7,), generator=g)
    result = evaluate.evaluate_loss(model, list(data.image_batches(pixels, labels, 3)), "image-classification")
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits
    assert result.count == 7
    assert result.loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)), rel=1e-6)
    assert result.metric["accuracy"] == pytest.approx(float((logits.argmax(-1) == labels).float().mean()))
    with pytest.raises(RebasinUserError, match="empty"):
        evaluate.evaluate_loss(model, [], "image-classification")
    with pytest.raises(RebasinUserError, match="labels"):
        evaluate.evaluate_loss(model, [{"pixel_values": pixels}], "image-classification")


def test_interpolate_endpoints_and_int_buffers() -> None:
    sd_a = {"w": torch.randn(3, 4), "n": torch.tensor([1, 2]), "h": torch.randn(2).half()}
    sd_b = {"w": torch.randn(3, 4), "n": torch.tensor([5, 6]), "h": torch.randn(2).half()}
    for name in sd_a:
        assert torch.equal(evaluate.interpolate(sd_a, sd_b, 1.0)[name], sd_a[name])
        assert torch.equal(evaluate.interpolate(sd_a, sd_b, 0.0)[name], sd_b[name] if name != "n" else sd_a["n"])
    mid = evaluate.interpolate(sd_a, sd_b, 0.25)
    assert torch.allclose(mid["w"], 0.25 * sd_a["w"] + 0.75 * sd_b["w"])
    assert mid["h"].dtype == torch.float16
    assert torch.equal(mid["n"], sd_a["n"])
    with pytest.raises(IncompatibleModelsError, match="'w'"):
        evaluate.interpolate(sd_a, {**sd_b, "w": torch.randn(4, 3)}, 0.5)
    with pytest.raises(IncompatibleModelsError, match="only in A"):
        evaluate.interpolate(sd_a, {"w": sd_b["w"]}, 0.5)


def test_interpolate_keeps_ties() -> None:
    sd_a, sd_b = tiny.gpt2(0).state_dict(), tiny.gpt2(1).state_dict()
    assert sd_a["lm_head.weight"].data_ptr() == sd_a["transformer.wte.weight"].data_ptr()
    mid = evaluate.interpolate(sd_a, sd_b, 0.3)
    assert mid["lm_head.weight"] is mid["transformer.wte.weight"]


def test_loss_curve_endpoints_equal_evaluate_loss() -> None:
    model_a, model_b = tiny.gpt2(0), tiny.gpt2(1)
    batches = iter(_lm_batches())  # a one-shot iterator: the curve must materialise it once
    data_list = _lm_batches()
    loss_a = evaluate.evaluate_loss(model_a, data_list, "causal-lm").loss
    loss_b = evaluate.evaluate_loss(model_b, data_list, "causal-lm").loss
    seen: list[float] = []
    # the model being reused *is* A, and sd_a holds views of its live parameters
    curve = evaluate.loss_curve(
        model_a,
        model_a.state_dict(),
        model_b.state_dict(),
        batches,
        "causal-lm",
        [0.0, 0.5, 1.0],
        progress=lambda i, lam, r: seen.append(lam),
    )
    assert seen == [0.0, 0.5, 1.0]
    assert curve.losses[2] == pytest.approx(loss_a, rel=1e-6)
    assert curve.losses[0] == pytest.approx(loss_b, rel=1e-6)
    assert curve.metrics["perplexity"][1] == pytest.approx(math.exp(curve.losses[1]))
    assert curve.as_dict()["loss"] == curve.losses
    b = evaluate.barrier(curve.lambdas, curve.losses)
    assert b["midpoint"] >= 0 and b["linear"] >= 0


def test_barrier_formulas() -> None:
    lams = evaluate.lambdas(5)
    assert lams == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert evaluate.barrier(lams, [2.0] * 5) == {"midpoint": 0.0, "linear": 0.0}
    # straight line from L_B = 1 (λ = 0) to L_A = 3 (λ = 1): no linear barrier, midpoint = 3 − 2
    line = [1.0, 1.5, 2.0, 2.5, 3.0]
    assert evaluate.barrier(lams, line) == pytest.approx({"midpoint": 1.0, "linear": 0.0})
    # a bump of height 1.5 above the line at λ = 0.25 (line value 1.5)
    bump = [1.0, 3.0, 2.0, 2.5, 3.0]
    assert evaluate.barrier(lams, bump) == pytest.approx({"midpoint": 1.0, "linear": 1.5})
    # unordered input gives the same answer
    assert evaluate.barrier(lams[::-1], bump[::-1]) == pytest.approx({"midpoint": 1.0, "linear": 1.5})
    with pytest.raises(ValueError, match="end points"):
        evaluate.barrier([0.0, 0.5], [1.0, 2.0])
    assert len(evaluate.lambdas()) == 21


# ---------------------------------------------------------------------------------------------
# train


TINY_GPT2 = train.GPT2TrainConfig(
    steps=3, batch_size=4, block_size=16, n_embd=16, n_layer=1, n_head=2, warmup=1, plays=SHORT_PLAYS, eval_tokens=512
)
TINY_VIT = train.ViTTrainConfig(steps=3, batch_size=8, hidden_size=16, num_hidden_layers=1, intermediate_size=16)


def test_cached_model_trains_once_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_REBASIN_CACHE", str(tmp_path / "cache"))
    steps: list[int] = []
    folder = train.cached_model("gpt2", 0, config=TINY_GPT2, progress=lambda s, loss: steps.append(s))
    assert folder.parent == tmp_path / "cache" / "zoo"
    assert folder.name == f"gpt2-seed0-{config_hash('gpt2', TINY_GPT2)}"
    assert steps == [0, 1, 2]
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder left
    again = train.cached_model("gpt2", 0, config=TINY_GPT2, progress=lambda s, loss: steps.append(s))
    assert again == folder and steps == [0, 1, 2]  # reused: no training
    record = train.training_record(folder)
    assert record["seed"] == 0 and record["held_out"]["tokens"] > 0

    model = T.GPT2LMHeadModel.from_pretrained(str(folder))
    held_out = train.held_out_batches(folder)
    result = evaluate.evaluate_loss(model, held_out, "causal-lm")
    assert result.loss == pytest.approx(record["held_out"]["loss"], rel=1e-5)
    assert result.count == record["held_out"]["tokens"]

    other = train.cached_model("gpt2", 1, config=TINY_GPT2)
    assert other != folder
    sd0, sd1 = model.state_dict(), T.GPT2LMHeadModel.from_pretrained(str(other)).state_dict()
    assert not torch.equal(sd0["transformer.h.0.mlp.c_fc.weight"], sd1["transformer.h.0.mlp.c_fc.weight"])


def test_training_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = train.train_tiny_vit(5, tmp_path / "a", TINY_VIT)
    b = train.train_tiny_vit(5, tmp_path / "b", TINY_VIT)
    sd_a = T.ViTForImageClassification.from_pretrained(str(a)).state_dict()
    sd_b = T.ViTForImageClassification.from_pretrained(str(b)).state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert train.training_record(a)["held_out"]["examples"] == 359
    assert "accuracy" in train.training_record(a)["held_out"]


def test_cached_model_refuses_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitectureError, match="available: gpt2, vit"):
        train.cached_model("roberta", 0, tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="ViTTrainConfig"):
        train.cached_model("vit", 0, tmp_path, config=TINY_GPT2)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# the full-budget zoo (slow)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "vit"])
def test_zoo_models_are_trained_and_have_a_barrier(kind: train.Kind, tmp_path: Path) -> None:
    folders = [train.cached_model(kind, seed, tmp_path) for seed in (0, 1)]
    records = [train.training_record(f) for f in folders]
    for r in records:
        if kind == "gpt2":
            assert r["held_out"]["loss"] < 2.0, r  # unigram entropy of the text is ≈ 3.3 nats
        else:
            assert r["held_out"]["accuracy"] > 0.85, r
    cls = T.GPT2LMHeadModel if kind == "gpt2" else T.ViTForImageClassification
    a, b = (cls.from_pretrained(str(f)) for f in folders)
    task = evaluate.task_of(a)
    curve = evaluate.loss_curve(
        a, a.state_dict(), b.state_dict(), train.held_out_batches(folders[0]), task, evaluate.lambdas()
    )
    assert curve.losses[-1] == pytest.approx(records[0]["held_out"]["loss"], rel=1e-4)
    assert curve.losses[0] == pytest.approx(records[1]["held_out"]["loss"], rel=1e-4)
    b_ = evaluate.barrier(curve.lambdas, curve.losses)
    times = [r["train_seconds"] for r in records]
    print(f"\n{kind}: train seconds {times}, held-out {[r['held_out'] for r in records]}, vanilla barrier {b_}")
    print(f"{kind} curve: {[round(x, 3) for x in curve.losses]}")
    assert b_["midpoint"] > 0.3  # separately trained models do not average (vanilla)
