"""Evaluation data: local files load through `datasets`, batches are built once and masks are seeded."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.core.errors import DataError
from hf_rebasin.evaluation.data import char_tokenizer
from hf_rebasin.evaluation.evaldata import classification_batches, load_records, text_batches
from hf_rebasin.evaluation.evaluate import evaluate_loss

WORDS = "the king queen lord lady sword crown night day love death blood ghost castle sea wind".split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _lines(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (int(k),), generator=g))
        for k in torch.randint(3, 12, (n,), generator=g)
    ]


def _bert_tokenizer() -> T.PreTrainedTokenizerBase:
    """A word-level BERT tokenizer over WORDS (21 ids: fits tiny.V), built without the Hub."""
    return T.BertTokenizer(vocab={t: i for i, t in enumerate(SPECIALS + WORDS)})


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    lines = _lines(300)
    lines[5] = ""  # a blank line: a line break the model reads like any other text
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_text_json_csv_load(tmp_path: Path, text_file: Path) -> None:
    rows = [{"sentence": s, "label": ["neg", "pos"][i % 2]} for i, s in enumerate(_lines(20))]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    with (tmp_path / "d.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["sentence", "label"])
        w.writeheader()
        w.writerows(rows)

    text = load_records({"dataset": "text", "data_files": "corpus.txt", "column": "text"}, tmp_path)
    assert text.column_names == ["text"] and text["text"] == [text_file.read_text(encoding="utf-8")]
    js = load_records(
        {"dataset": "json", "data_files": ["d.jsonl"], "column": "sentence", "label_column": "label"}, tmp_path
    )
    assert js["sentence"] == [r["sentence"] for r in rows]
    cs = load_records(
        {
            "dataset": "csv",
            "data_files": str(tmp_path / "d.csv"),
            "split": "train",
            "max_examples": 7,
            "max_tokens": None,
        },
        Path("/nonexistent"),  # absolute data_files ignore base_dir
    )
    assert len(cs) == 7 and cs["label"] == [r["label"] for r in rows[:7]]
    by_split = {"dataset": "csv", "data_files": {"train": "d.csv", "test": ["d.csv"]}, "split": "test[:3]"}
    assert load_records(by_split, tmp_path)["sentence"] == [r["sentence"] for r in rows[:3]]


def test_causal_batches_shapes_and_tokens(text_file: Path) -> None:
    records = load_records({"dataset": "text", "data_files": str(text_file)}, text_file.parent)
    tok = char_tokenizer(text_file.read_text(encoding="utf-8"))
    out = text_batches(records, tok, task="causal-lm", block_size=32, batch_size=4)
    assert all(set(b) == {"input_ids", "attention_mask", "labels"} for b in out)
    assert all(b["input_ids"].shape == (4, 32) for b in out[:-1])
    assert out[-1]["input_ids"].shape[1] == 32 and 1 <= out[-1]["input_ids"].shape[0] <= 4
    ids = torch.cat([b["input_ids"] for b in out])
    attn = torch.cat([b["attention_mask"] for b in out])
    labels = torch.cat([b["labels"] for b in out])
    assert torch.equal(labels[attn == 1], ids[attn == 1]) and (labels[attn == 0] == -100).all()
    # nothing lost or reordered: the unpadded tokens are the file's, line breaks and blank line included
    expected = tok(text_file.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert ids[attn == 1].tolist() == expected

    capped = text_batches(records, tok, task="causal-lm", block_size=32, batch_size=4, max_tokens=100)
    capped_ids = torch.cat([b["input_ids"] for b in capped])
    assert capped_ids.shape == (4, 32) and int(torch.cat([b["attention_mask"] for b in capped]).sum()) == 100
    assert capped_ids.flatten()[:100].tolist() == expected[:100]

    model = tiny.gpt2()
    model.resize_token_embeddings(len(tok))
    assert evaluate_loss(model, out, "causal-lm").count == int(attn.sum()) - len(ids)  # one shift per block


def test_masked_lm_masks_are_seeded_and_skip_specials(text_file: Path) -> None:
    records = load_records({"dataset": "text", "data_files": str(text_file), "sample_by": "line"}, text_file.parent)
    tok = _bert_tokenizer()
    kw = {"task": "masked-lm", "block_size": 64, "batch_size": 8}
    first, again = text_batches(records, tok, seed=3, **kw), text_batches(records, tok, seed=3, **kw)
    other = text_batches(records, tok, seed=4, **kw)
    for a, b in zip(first, again, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    labels = torch.cat([b["labels"] for b in first])
    assert not torch.equal(labels, torch.cat([b["labels"] for b in other]))

    # the unmasked stream: causal batches label every real token with its original id
    plain = text_batches(records, tok, task="causal-lm", block_size=64, batch_size=8)
    orig = torch.cat([b["input_ids"] for b in plain])
    attn = torch.cat([b["attention_mask"] for b in first])
    masked = torch.cat([b["input_ids"] for b in first])
    special = torch.isin(orig, torch.tensor(tok.all_special_ids)) | (attn == 0)
    assert int(special[attn == 1].sum()) >= 2 * 299  # [CLS] … [SEP] around every line
    chosen = labels != -100
    assert not (chosen & special).any()  # never a special token or padding
    assert torch.equal(masked[special], orig[special])
    assert torch.equal(labels[chosen], orig[chosen])
    candidates = int((~special).sum())
    assert candidates > 2000
    assert abs(int(chosen.sum()) / candidates - 0.15) < 0.02
    as_mask = (masked == tok.mask_token_id) & chosen
    kept = (masked == orig) & chosen
    assert abs(int(as_mask.sum()) / int(chosen.sum()) - 0.8) < 0.06
    assert int(kept.sum()) > 0 and int((chosen & ~as_mask & ~kept).sum()) > 0  # some random replacements

    result = evaluate_loss(tiny.bert_mlm(), first, "masked-lm")
    assert result.count == int(chosen.sum()) and "pseudo_perplexity" in result.metric


@pytest.mark.parametrize("sample_by", ["line", "paragraph", "document", None])
def test_text_files_keep_their_line_breaks(tmp_path: Path, sample_by: str | None) -> None:
    """Every `sample_by` reads the file's characters: records joined as they are give the text back
    (the builder's own default, lines without their line breaks, scored a model on text it never saw)."""
    text = "HAMLET:\nTo be, or not to be.\n\n\nHORATIO:\nMy lord?\n  \nEnd\n"
    (tmp_path / "play.txt").write_text(text, encoding="utf-8")
    spec = {"dataset": "text", "data_files": "play.txt", "sample_by": sample_by}
    records = load_records(spec, tmp_path)
    joined = "".join(records["text"])
    want = {"line": text.count("\n"), "paragraph": 2, "document": 1, None: 1}[sample_by]
    assert len(records) == want
    # paragraphs get back the blank line the builder splits on (the last one too)
    assert joined == (text + "\n\n" if sample_by == "paragraph" else text)
    tok = char_tokenizer(text)
    batches = text_batches(records, tok, task="causal-lm", block_size=8, batch_size=2)
    ids = torch.cat([b["input_ids"] for b in batches])[torch.cat([b["attention_mask"] for b in batches]) == 1]
    assert tok.decode(ids.tolist()) == joined  # blank and whitespace-only lines are kept


def test_sample_by_is_for_the_text_builder(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"`sample_by` applies to the `text` builder only"):
        load_records({"dataset": "json", "data_files": "d.jsonl", "sample_by": "line"}, tmp_path)
    (tmp_path / "t.txt").write_text("a\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"`sample_by` must be one of line, paragraph, document"):
        load_records({"dataset": "text", "data_files": "t.txt", "sample_by": "page"}, tmp_path)


def test_imagefolder_loads_and_batches(tmp_path: Path) -> None:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i in range(15):
        label = int(digits.target[i]) % 5
        folder = tmp_path / "digits" / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((digits.images[i] * 15).astype("uint8"), mode="L").save(folder / f"{i}.png")
    records = load_records(
        {"dataset": "imagefolder", "data_files": "digits/**/*.png", "image_column": "image", "label_column": "label"},
        tmp_path,
    )
    assert len(records) == 15 and set(records.column_names) == {"image", "label"}
    from_dir = load_records({"dataset": "imagefolder", "data_dir": "digits", "data_files": None}, tmp_path)
    assert len(from_dir) == 15
    processor = T.ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5], image_std=[0.5])
    out = classification_batches(records, processor, task="image-classification", batch_size=4)
    assert [b["pixel_values"].shape for b in out] == [(4, 1, 8, 8)] * 3 + [(3, 1, 8, 8)]
    names = records.features["label"].names
    assert torch.cat([b["labels"] for b in out]).tolist() == [int(names[v]) for v in records["label"]]
    reverse = {str(k): 4 - k for k in range(5)}  # folder names mapped through a model's label2id
    mapped = classification_batches(records, processor, task="image-classification", label2id=reverse)
    assert mapped[0]["labels"].tolist() == [4 - int(names[v]) for v in records["label"]]
    result = evaluate_loss(tiny.vit(), out, "image-classification")
    assert result.count == 15 and 0.0 <= result.metric["accuracy"] <= 1.0


def test_sequence_classification_maps_string_labels(tmp_path: Path) -> None:
    rows = [{"sentence": s, "label": ["neg", "pos", "mid"][i % 3]} for i, s in enumerate(_lines(10))]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    records = load_records({"dataset": "json", "data_files": "d.jsonl"}, tmp_path)
    label2id = {"neg": 0, "pos": 1, "mid": 2}
    tok = _bert_tokenizer()
    out = classification_batches(
        records, tok, task="sequence-classification", column="sentence", batch_size=4, label2id=label2id
    )
    assert [b["input_ids"].shape[0] for b in out] == [4, 4, 2]
    assert torch.cat([b["labels"] for b in out]).tolist() == [label2id[r["label"]] for r in rows]
    assert (out[0]["input_ids"][:, 0] == tok.cls_token_id).all()
    assert evaluate_loss(tiny.bert_cls(), out, "sequence-classification").count == 10

    with pytest.raises(DataError, match=r"'mid'.*neg, pos"):
        classification_batches(
            records, tok, task="sequence-classification", column="sentence", label2id={"neg": 0, "pos": 1}
        )
    with pytest.raises(DataError, match="label2id"):
        classification_batches(records, tok, task="sequence-classification", column="sentence")


def test_user_errors_name_the_file_and_column(tmp_path: Path, text_file: Path) -> None:
    with pytest.raises(DataError, match=r"'missing\.txt' not found.*corpus\.txt"):
        load_records({"dataset": "text", "data_files": ["corpus.txt", "missing.txt"]}, tmp_path)
    with pytest.raises(DataError, match=r"'nope/\*\.png' matches no file"):
        load_records({"dataset": "imagefolder", "data_files": "nope/*.png"}, tmp_path)
    with pytest.raises(DataError, match=r"column 'sentence' is not a column.*columns are text"):
        load_records({"dataset": "text", "data_files": "corpus.txt", "column": "sentence"}, tmp_path)
    with pytest.raises(DataError, match=r"no split 'validation'.*train"):
        load_records({"dataset": "text", "data_files": "corpus.txt", "split": "validation"}, tmp_path)
    with pytest.raises(DataError, match=r"unknown data key.*colum"):
        load_records({"dataset": "text", "data_files": "corpus.txt", "colum": "text"}, tmp_path)
    with pytest.raises(DataError, match=r"data_dir 'images' not found.*corpus\.txt"):
        load_records({"dataset": "imagefolder", "data_dir": "images"}, tmp_path)
    with pytest.raises(DataError, match="set `data_files`"):
        load_records({"dataset": "csv"}, tmp_path)

    records = load_records({"dataset": "text", "data_files": "corpus.txt"}, tmp_path)
    tok = char_tokenizer(text_file.read_text(encoding="utf-8"))
    with pytest.raises(DataError, match=r"'body' is not a column.*columns are text"):
        text_batches(records, tok, task="causal-lm", column="body")
    with pytest.raises(DataError, match="mask token"):
        text_batches(records, tok, task="masked-lm")
    with pytest.raises(DataError, match="too few for one block"):
        text_batches(records, tok, task="causal-lm", max_tokens=1)
    assert issubclass(DataError, ValueError)


def test_builtin_shakespeare_is_the_zoo_text_one_record_per_play(tmp_path: Path) -> None:
    from hf_rebasin.evaluation import data

    test = load_records({"dataset": "shakespeare", "split": "test"}, tmp_path)
    assert test["play"] == list(data.DEFAULT_PLAYS)
    assert "\n".join(test["text"]) == data.shakespeare_text(split="test")  # newlines kept: the zoo reads them
    two = load_records(
        {"dataset": "shakespeare", "name": "hamlet, macbeth", "split": "train", "max_examples": 1}, tmp_path
    )
    assert two["play"] == ["hamlet"] and two["text"][0] == data.shakespeare_text(["hamlet"], split="train")
    with pytest.raises(DataError, match=r"unknown play\(s\) hamlett.*available:.*hamlet"):
        load_records({"dataset": "shakespeare", "name": "hamlett"}, tmp_path)
    with pytest.raises(DataError, match=r"splits train, test, all, not 'train\[:10\]'.*max_examples"):
        load_records({"dataset": "shakespeare", "split": "train[:10]"}, tmp_path)
    with pytest.raises(DataError, match="reads no files: remove `data_files`"):
        load_records({"dataset": "shakespeare", "data_files": "x.txt"}, tmp_path)


def test_builtin_digits_through_the_zoo_processor_give_the_training_pixels(tmp_path: Path) -> None:
    from hf_rebasin.evaluation import data
    from hf_rebasin.evaluation.zoo.images import digits_processor

    records = load_records({"dataset": "digits", "split": "test", "max_examples": 40}, tmp_path)
    assert records.features["label"].names == [str(i) for i in range(10)]
    batches = classification_batches(
        records,
        digits_processor(),
        task="image-classification",
        batch_size=16,
        image_mode="L",
        label2id={str(i): i for i in range(10)},
    )
    pixels = torch.cat([b["pixel_values"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    images, want = data.digits_dataset("test")
    assert torch.equal(labels, want[:40])
    assert pixels.shape == (40, 1, 8, 8)
    assert (pixels - images[:40]).abs().max() < 2 / 255  # 8-bit rounding only
    with pytest.raises(DataError, match="no configurations"):
        load_records({"dataset": "digits", "name": "x"}, tmp_path)
