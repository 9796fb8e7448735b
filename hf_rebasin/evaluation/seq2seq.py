"""Sequence-to-sequence batches: sources, targets and the decoder's inputs, built once.

Two kinds of data give them. Records with a source and a target column (a translation or a
summary per row) are paired as they are. Plain text has no targets, so it is noised as the model
family was pretrained and the original is the target: T5's span corruption where the tokenizer has
``<extra_id_0>`` sentinels, BART's text infilling where it has a mask token, else a prefix split
(the first half of a block predicts the second). All draws come from one generator seeded by the
recipe's seed, so every λ of a curve reads the same noise, as masked-LM masks do.

``decoder_input_ids`` are always built here (labels shifted right after the decoder's start
token): BART called without them shifts the *source*, which would silently score another task.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from hf_rebasin.core.errors import DataError
from hf_rebasin.evaluation.evaldata import check_column

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "NOISE_DENSITY",
    "Objective",
    "Seq2SeqData",
    "block_room",
    "collate",
    "content_blocks",
    "noised_pairs",
    "objective_of",
    "seq2seq_batches",
]

Objective = Literal["pairs", "span-corruption", "text-infilling", "prefix-split"]
NOISE_DENSITY = 0.15  # T5: 15 % of tokens corrupted, in spans of mean length 3
MEAN_SPAN = 3.0
INFILL_RATIO = 0.3  # BART: 30 % of tokens masked, in Poisson(3) spans, each span one mask token
POISSON_MEAN = 3.0
_CHUNK = 1000  # records per tokenizer call

DESCRIPTIONS: dict[Objective, str] = {
    "pairs": "source → target pairs",
    "span-corruption": "T5 span corruption of plain text (15 % of tokens, mean span 3, one sentinel per span)",
    "text-infilling": "BART text infilling of plain text (30 % of tokens, Poisson(3) spans, one mask per span)",
    "prefix-split": "prefix split of plain text (each block's first half predicts its second)",
}


@dataclass(frozen=True)
class Seq2SeqData:
    """The batches and how they were made (the run's record says which objective scored the models)."""

    batches: list[dict[str, Tensor]]
    objective: Objective

    @property
    def description(self) -> str:
        return DESCRIPTIONS[self.objective]


def _sentinels(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """T5's sentinel ids ``<extra_id_0>``, ``<extra_id_1>``, … as long as the vocabulary has them."""
    vocab = tokenizer.get_vocab()
    out: list[int] = []
    while f"<extra_id_{len(out)}>" in vocab:
        out.append(int(vocab[f"<extra_id_{len(out)}>"]))
    return out


def objective_of(tokenizer: PreTrainedTokenizerBase, paired: bool) -> Objective:
    """What plain text is turned into for this tokenizer: the denoising its family was trained with."""
    if paired:
        return "pairs"
    if _sentinels(tokenizer):
        return "span-corruption"
    if tokenizer.mask_token_id is not None:
        return "text-infilling"
    return "prefix-split"


def _frame(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The special ids the tokenizer puts before and after a text (BART ``<s> … </s>``, T5 ``… </s>``),
    read off one encoding with and one without them (transformers 5 has no id-level framing call)."""
    probe = "a b"
    bare = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe)["input_ids"])
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return [], []


def _framed(frame: tuple[list[int], list[int]], ids: Sequence[int]) -> list[int]:
    return [*frame[0], *ids, *frame[1]]


def _partition(total: int, parts: int, g: torch.Generator) -> list[int]:
    """``total`` split into ``parts`` positive lengths at random cut points (T5's segmentation)."""
    if parts <= 1:
        return [total]
    cuts = sorted((torch.randperm(total - 1, generator=g)[: parts - 1] + 1).tolist())
    edges = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(edges)]


def span_corruption(ids: Sequence[int], sentinels: Sequence[int], g: torch.Generator) -> tuple[list[int], list[int]]:
    """T5's objective on content ids: (source with each noise span replaced by a sentinel,
    target of each sentinel followed by the span it replaced)."""
    n = len(ids)
    noise = min(max(1, round(n * NOISE_DENSITY)), n - 1)
    spans = max(1, min(round(noise / MEAN_SPAN), len(sentinels), noise, n - noise))
    noise_lengths, kept_lengths = _partition(noise, spans, g), _partition(n - noise, spans, g)
    source: list[int] = []
    target: list[int] = []
    at = 0
    for s, (kept, cut) in enumerate(zip(kept_lengths, noise_lengths, strict=True)):
        source.extend(ids[at : at + kept])
        source.append(sentinels[s])
        target.append(sentinels[s])
        target.extend(ids[at + kept : at + kept + cut])
        at += kept + cut
    return source, target


def text_infilling(ids: Sequence[int], mask_id: int, g: torch.Generator) -> list[int]:
    """BART's text infilling on content ids: spans of Poisson(3) lengths, 30 % of the tokens in all,
    each replaced by one mask token (the target is the original text)."""
    n = len(ids)
    budget = max(1, round(n * INFILL_RATIO))
    masked = torch.zeros(n, dtype=torch.bool)
    starts = torch.zeros(n, dtype=torch.bool)
    for _ in range(64 * n):  # bounded: spans that cannot fit any more end the draw
        if int(masked.sum()) >= budget:
            break
        length = max(1, int(torch.poisson(torch.tensor([POISSON_MEAN]), generator=g).item()))
        length = min(length, budget - int(masked.sum()))
        start = int(torch.randint(0, n - length + 1, (1,), generator=g))
        if masked[max(0, start - 1) : start + length + 1].any():
            continue  # spans neither overlap nor touch: each stays one mask
        masked[start : start + length] = True
        starts[start] = True
    return [mask_id if starts[i] else int(t) for i, t in enumerate(ids) if starts[i] or not masked[i]]


def content_blocks(
    tokenizer: PreTrainedTokenizerBase, records: datasets.Dataset, column: str, size: int, max_tokens: int | None
) -> Iterator[list[int]]:
    """Consecutive blocks of ``size`` content tokens (no special tokens) over all texts of ``column``;
    a last block of at least 4 tokens is kept."""
    check_column(records, column)
    buffer: list[int] = []
    read = 0
    for start in range(0, len(records), _CHUNK):
        texts = [t for t in records[start : start + _CHUNK][column] if t]
        if any(not isinstance(t, str) for t in texts):
            raise DataError(f"column {column!r} must hold text")
        for row in (
            tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"] if texts else []
        ):
            if max_tokens is not None:
                row = row[: max(0, max_tokens - read)]
            read += len(row)
            buffer.extend(row)
            while len(buffer) >= size:
                yield buffer[:size]
                buffer = buffer[size:]
        if max_tokens is not None and read >= max_tokens:
            break
    if len(buffer) >= 4:
        yield buffer


def _noised(
    tokenizer: PreTrainedTokenizerBase, objective: Objective, block: list[int], g: torch.Generator
) -> tuple[list[int], list[int]]:
    """(source, target) of one block of content ids, framed by the tokenizer's special tokens."""
    frame = _frame(tokenizer)
    if objective == "span-corruption":
        source, target = span_corruption(block, _sentinels(tokenizer), g)
        return _framed(frame, source), _framed(frame, target)
    if objective == "text-infilling":
        return _framed(frame, text_infilling(block, int(tokenizer.mask_token_id), g)), _framed(frame, block)
    half = len(block) // 2
    return _framed(frame, block[:half]), _framed(frame, block[half:])


def block_room(tokenizer: PreTrainedTokenizerBase, objective: Objective, block_size: int) -> int:
    """Content tokens per block of plain text, so that source and target fit ``block_size`` once framed
    (a span-corruption target starts with a sentinel)."""
    return max(4, block_size - len(_framed(_frame(tokenizer), [])) - (1 if objective == "span-corruption" else 0))


def noised_pairs(
    tokenizer: PreTrainedTokenizerBase, objective: Objective, blocks: Iterable[list[int]], seed: int
) -> Iterator[tuple[list[int], list[int]]]:
    """(source, target) of each block of content ids, all noise drawn from one generator seeded by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    for block in blocks:
        yield _noised(tokenizer, objective, block, g)


def _pairs(
    tokenizer: PreTrainedTokenizerBase,
    records: datasets.Dataset,
    columns: tuple[str, str],
    lengths: tuple[int, int],
    max_tokens: int | None,
) -> Iterator[tuple[list[int], list[int]]]:
    """(source, target) ids of each record, each truncated to its length (special tokens kept)."""
    for key, column in zip(("source_column", "target_column"), columns, strict=True):
        check_column(records, column, key)
    read = 0
    for start in range(0, len(records), _CHUNK):
        rows = records[start : start + _CHUNK]
        sources, targets = rows[columns[0]], rows[columns[1]]
        for i, (s, t) in enumerate(zip(sources, targets, strict=True)):
            if not isinstance(s, str) or not isinstance(t, str) or not s or not t:
                raise DataError(
                    f"record {start + i}: `{columns[0]}` and `{columns[1]}` must both hold non-empty text, "
                    f"got {type(s).__name__} and {type(t).__name__}"
                )
        src = tokenizer(sources, truncation=True, max_length=lengths[0], return_attention_mask=False)["input_ids"]
        tgt = tokenizer(targets, truncation=True, max_length=lengths[1], return_attention_mask=False)["input_ids"]
        for s_ids, t_ids in zip(src, tgt, strict=True):
            yield s_ids, t_ids
            read += len(s_ids) + len(t_ids)
            if max_tokens is not None and read >= max_tokens:
                return


def _pad(rows: Sequence[Sequence[int]], value: int) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return out, mask


def collate(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int, start_id: int) -> dict[str, Tensor]:
    """One batch: sources and targets right-padded; ``labels`` -100 on padding; ``decoder_input_ids`` the
    targets shifted right after ``start_id`` (the model's decoder start token)."""
    source, source_mask = _pad([s for s, _ in pairs], pad_id)
    target, target_mask = _pad([t for _, t in pairs], pad_id)
    decoder = torch.full_like(target, pad_id)
    decoder[:, 0] = start_id
    decoder[:, 1:] = target[:, :-1]
    return {
        "input_ids": source,
        "attention_mask": source_mask,
        "decoder_input_ids": decoder,
        "decoder_attention_mask": target_mask,
        "labels": target.masked_fill(target_mask == 0, -100),
    }


def seq2seq_batches(
    records: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    start_id: int,
    columns: tuple[str, str] | None,
    column: str = "text",
    block_size: int = 128,
    batch_size: int = 8,
    max_tokens: int | None = None,
    seed: int = 0,
) -> Seq2SeqData:
    """Seq2seq batches of ``records``: ``columns`` (source, target) paired, else ``column``'s text noised.

    ``block_size`` caps each source and each target in tokens; plain text is cut into blocks of
    content tokens that fit it once framed. ``start_id`` is the model's ``decoder_start_token_id``.
    """
    if block_size < 4:
        raise DataError(f"`block_size` must be at least 4 tokens for sequence-to-sequence data, not {block_size}")
    objective = objective_of(tokenizer, columns is not None)
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    pairs: Iterator[tuple[list[int], list[int]]]
    if columns is not None:
        pairs = _pairs(tokenizer, records, columns, (block_size, block_size), max_tokens)
    else:
        blocks = content_blocks(tokenizer, records, column, block_room(tokenizer, objective, block_size), max_tokens)
        pairs = noised_pairs(tokenizer, objective, blocks, seed)
    made: list[tuple[list[int], list[int]]] = list(pairs)
    if not made:
        where = f"columns {columns[0]!r} and {columns[1]!r}" if columns else f"column {column!r}"
        raise DataError(f"{where} gave no sequence-to-sequence example: add data or raise max_tokens")
    batches = [collate(made[i : i + batch_size], int(pad_id), start_id) for i in range(0, len(made), batch_size)]
    return Seq2SeqData(batches, objective)
