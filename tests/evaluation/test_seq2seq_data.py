"""Sequence-to-sequence batches: pairs as they are, plain text noised as each family was pretrained,
and the decoder's inputs built here (never left to the model's own shift)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import datasets
import pytest
import torch

from hf_rebasin.core.errors import DataError
from hf_rebasin.evaluation.data import char_tokenizer
from hf_rebasin.evaluation.seq2seq import (
    INFILL_RATIO,
    collate,
    objective_of,
    seq2seq_batches,
    span_corruption,
    text_infilling,
)

TEXT = "to be, or not to be, that is the question:\nwhether 'tis nobler in the mind to suffer\n" * 6
SENTINELS = [f"<extra_id_{i}>" for i in range(8)]


def _t5_like():
    tok = char_tokenizer(TEXT)
    tok.add_special_tokens({"additional_special_tokens": SENTINELS})
    return tok


def _records(**columns: list[str]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(columns)


def test_span_corruption_splits_the_text_into_source_and_target_that_interleave_back_to_it() -> None:
    ids = list(range(100, 160))
    sentinels = list(range(10, 20))
    source, target = span_corruption(ids, sentinels, torch.Generator().manual_seed(3))
    used = [s for s in source if s in sentinels]
    assert used == sentinels[: len(used)] and [t for t in target if t in sentinels] == used
    # each sentinel in the source stands for the span that follows it in the target
    spans: dict[int, list[int]] = {}
    for t in target:
        if t in sentinels:
            key = t
            spans[key] = []
        else:
            spans[key].append(t)
    rebuilt = [x for s in source for x in (spans[s] if s in sentinels else [s])]
    assert rebuilt == ids
    assert sum(map(len, spans.values())) == round(0.15 * len(ids)) and all(spans.values())


def test_text_infilling_masks_about_thirty_percent_in_spans_each_one_mask() -> None:
    ids = list(range(100, 200))
    noised = text_infilling(ids, 7, torch.Generator().manual_seed(0))
    kept = [t for t in noised if t != 7]
    assert kept == [t for t in ids if t in set(kept)]  # the rest of the text, in order
    assert len(ids) - len(kept) == round(INFILL_RATIO * len(ids))
    assert 1 <= noised.count(7) < len(ids) - len(kept)  # spans, not single tokens
    assert all(not (a == b == 7) for a, b in itertools.pairwise(noised))  # no two masks touch


def test_the_decoder_reads_the_targets_shifted_right_after_its_start_token() -> None:
    batch = collate([([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])], pad_id=1, start_id=2)
    assert batch["decoder_input_ids"].tolist() == [[2, 8, 9, 1], [2, 8, 9, 10]]
    assert batch["labels"].tolist() == [[8, 9, -100, -100], [8, 9, 10, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["decoder_attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_plain_text_is_noised_as_the_tokenizer_says_the_family_was_trained() -> None:
    assert objective_of(_t5_like(), paired=False) == "span-corruption"
    assert objective_of(char_tokenizer(TEXT, mask=True), paired=False) == "text-infilling"
    assert objective_of(char_tokenizer(TEXT), paired=False) == "prefix-split"
    assert objective_of(_t5_like(), paired=True) == "pairs"


@pytest.mark.parametrize("kind", ["t5", "bart", "plain"])
def test_noise_is_fixed_by_the_seed_and_blocks_respect_the_block_size(kind: str) -> None:
    tok = {"t5": _t5_like(), "bart": char_tokenizer(TEXT, mask=True), "plain": char_tokenizer(TEXT)}[kind]
    records = _records(text=[TEXT])

    def made(seed: int) -> list[dict[str, torch.Tensor]]:
        kw = {"start_id": 0, "columns": None, "block_size": 32, "batch_size": 4, "seed": seed}
        return seq2seq_batches(records, tok, **kw).batches

    first, again, other = made(0), made(0), made(1)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(first, again, strict=True) for k in a)
    if kind != "plain":  # a prefix split draws nothing
        assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, other, strict=True))
    assert max(b["input_ids"].shape[1] for b in first) <= 32 and max(b["labels"].shape[1] for b in first) <= 32
    # no text is lost between blocks (but a last piece under 4 tokens): every content token is a target
    # token once (infilling), or a source or target token (prefix split; span corruption, whose
    # sentinels stand in both)
    n_text = len(tok(TEXT, add_special_tokens=False)["input_ids"])
    targets = sum(int((b["labels"] != -100).sum()) for b in first)
    sources = sum(int(b["attention_mask"].sum()) for b in first)
    if kind == "bart":
        read = targets
    elif kind == "plain":
        read = targets + sources
    else:
        read = targets + sources - 2 * sum(int((b["labels"] >= len(tok) - len(SENTINELS)).sum()) for b in first)
    assert 0 <= n_text - read < 4


def test_pairs_are_read_from_named_columns_and_truncated_to_the_block_size() -> None:
    tok = char_tokenizer(TEXT)
    records = _records(src=["to be", "or not to be, that is the question"], tgt=["that is", "whether"])
    made = seq2seq_batches(records, tok, start_id=0, columns=("src", "tgt"), block_size=8, batch_size=8)
    batch = made.batches[0]
    assert made.objective == "pairs"
    assert batch["input_ids"].shape == (2, 8)
    assert tok.decode(batch["input_ids"][0][:5]) == "to be" and tok.decode(batch["labels"][1][:7]) == "whether"


def test_a_pair_with_an_empty_target_is_refused_naming_the_record() -> None:
    records = _records(source=["to be", "or not"], target=["that is", ""])
    with pytest.raises(DataError, match="record 1: `source` and `target` must both hold non-empty text"):
        seq2seq_batches(records, char_tokenizer(TEXT), start_id=0, columns=("source", "target"))


def test_a_missing_pair_column_is_refused_naming_the_columns_there_are() -> None:
    records = _records(source=["to be"], text=["that is"])
    with pytest.raises(DataError, match=r"target_column 'target' is not a column .* source, text"):
        seq2seq_batches(records, char_tokenizer(TEXT), start_id=0, columns=("source", "target"))


def test_json_lines_pairs_load_through_the_json_builder(tmp_path: Path) -> None:
    from hf_rebasin.evaluation.evaldata import load_records

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"source": "to be", "target": "or not"}) + "\n" for _ in range(3)))
    records = load_records({"dataset": "json", "data_files": str(path), "source_column": "source"}, tmp_path)
    made = seq2seq_batches(records, char_tokenizer(TEXT), start_id=0, columns=("source", "target"))
    assert sum(b["labels"].shape[0] for b in made.batches) == 3
