"""Which embedding row is which token: a model's vocabulary read from its tokenizer and its
embedding size, and the rows of several models matched by token, not by id.

Hub relatives rarely have the same number of rows: a chat fine-tune adds ``<|im_start|>`` and
``<|im_end|>``, a new base release extends the vocabulary (Mistral v0.3: 32,000 → 32,768 ids, the
first 32,000 kept), a checkpoint pads its embedding past its tokens (Qwen2: 151,936 rows for
151,646 tokens), a tokenizer lists placeholder tokens the embedding never got. Each row is told
apart here as a token, an added token, or a padding row (no token), and tokens are compared by the
text they stand for: byte-level ``Ġ`` and SentencePiece ``▁`` spellings are read back to bytes,
added and special tokens by their content. Pure Python: the tokenizers are read by the caller.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = ["Vocabulary", "VocabularyDifference", "compare_vocabularies", "read_vocabulary", "token_key"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted (``Ġ`` → 0x20)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _convention(tokenizer: Any) -> str:
    """How the tokenizer spells a token's text: ``byte-level`` (GPT-2), ``metaspace``
    (SentencePiece ``▁``) or ``plain`` (WordPiece, word-level: the spelling is the text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        found = json.loads(backend.to_str()) if backend is not None else {}
    except (ValueError, AttributeError):
        found = {}
    text = json.dumps([found.get("decoder"), found.get("pre_tokenizer")])
    if '"ByteLevel"' in text:
        return "byte-level"
    if '"Metaspace"' in text or "\u2581" in text or '"ByteFallback"' in text:
        return "metaspace"
    return "plain"


def token_key(token: str, convention: str) -> str:
    """The text a vocabulary token stands for, as one byte per character (latin-1), so that two
    conventions compare: ``Ġthe`` (byte-level) and ``▁the`` (SentencePiece) both read `` the``."""
    if convention == "byte-level":
        table = _byte_decoder()
        if all(c in table for c in token):
            return bytes(table[c] for c in token).decode("latin-1")
        return token
    if convention == "metaspace":
        m = _BYTE_TOKEN.fullmatch(token)
        if m:
            return chr(int(m.group(1), 16))
        return token.replace("\u2581", " ").encode("utf-8").decode("latin-1")
    return token


@dataclass(frozen=True)
class Vocabulary:
    """One model's embedding rows as tokens.

    ``keys[r]``: the text of row ``r``'s token (`token_key`; an added token: its content), None for
    a row no token uses (padding past the tokenizer, or a hole in its ids). ``spelled[r]``: the
    token as the tokenizer writes it. ``added``: the rows of added tokens (special ones included).
    ``rowless``: ``(token, id)`` of tokens whose id has no row (placeholders past the embedding).
    """

    keys: tuple[str | None, ...]
    spelled: tuple[str | None, ...]
    added: frozenset[int]
    rowless: tuple[tuple[str, int], ...] = ()

    @property
    def rows(self) -> int:
        return len(self.keys)

    @property
    def tokens(self) -> int:
        """Rows below the last token's: what the tokenizer can produce (padding rows come after)."""
        return max((r + 1 for r, k in enumerate(self.keys) if k is not None), default=0)

    @property
    def padding(self) -> int:
        return self.rows - self.tokens

    def row_of(self) -> dict[str, int]:
        """Token text → row (the first, if a text has two spellings)."""
        out: dict[str, int] = {}
        for r, k in enumerate(self.keys):
            if k is not None:
                out.setdefault(k, r)
        return out


def read_vocabulary(tokenizer: Any, rows: int) -> Vocabulary:
    """The vocabulary of a model whose embedding has ``rows`` rows and whose tokenizer is ``tokenizer``."""
    convention = _convention(tokenizer)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    added_ids = {int(i): str(getattr(t, "content", t)) for i, t in decoder.items()}
    keys: list[str | None] = [None] * rows
    spelled: list[str | None] = [None] * rows
    rowless: list[tuple[str, int]] = []
    for token, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0])):
        i = int(i)
        if i >= rows:
            rowless.append((token, i))
            continue
        if spelled[i] is not None:
            continue  # two spellings of one id: the first (by text) names the row
        spelled[i] = token
        keys[i] = token if i in added_ids else token_key(token, convention)
    added = frozenset(i for i in added_ids if i < rows and keys[i] is not None)
    return Vocabulary(tuple(keys), tuple(spelled), added, tuple(rowless))


@dataclass(frozen=True)
class VocabularyDifference:
    """How model B's rows relate to the reference A's, token by token."""

    shared: int  # tokens both have
    only_a: tuple[str, ...]  # spelled as A writes them, in A's row order
    only_b: tuple[str, ...]
    moved: int  # shared tokens at another row in B
    prefix: int  # rows from 0 where both have the same token (or both none)
    tokens: tuple[int, int]  # each one's tokens (rows below its last token)
    padding: tuple[int, int]  # each one's padding rows
    rowless: tuple[int, int]  # each one's tokens without a row

    @property
    def same(self) -> bool:
        return not (self.only_a or self.only_b or self.moved) and self.padding[0] == self.padding[1]

    def coverage(self) -> tuple[float, float]:
        """Shared tokens over each one's vocabulary."""
        return tuple(self.shared / n if n else 1.0 for n in self.tokens)  # type: ignore[return-value]

    def describe(self, name_a: str = "A", name_b: str = "B") -> str:
        """One line: what B adds, lacks or moves against A, and where the ids agree."""
        parts: list[str] = []
        if self.only_b:
            parts.append(f"{name_b} has {_count(self.only_b)} that {name_a} lacks ({_shown(self.only_b)})")
        if self.only_a:
            parts.append(f"{name_a} has {_count(self.only_a)} that {name_b} lacks ({_shown(self.only_a)})")
        if self.moved:
            parts.append(f"{self.moved:,} shared tokens have other ids")
        for name, n in ((name_a, self.padding[0]), (name_b, self.padding[1])):
            if n:
                parts.append(f"{name} has {n:,} padding row{'s' * (n > 1)} past its tokens")
        for name, n in ((name_a, self.rowless[0]), (name_b, self.rowless[1])):
            if n:
                parts.append(f"{name}'s tokenizer has {n:,} token{'s' * (n > 1)} without an embedding row (left out)")
        if not parts:
            return f"{name_a} and {name_b} have the same {self.shared:,} tokens at the same rows"
        cov_a, cov_b = self.coverage()
        parts.append(
            f"{self.shared:,} tokens shared ({cov_a:.1%} of {name_a}'s, {cov_b:.1%} of {name_b}'s); "
            f"ids agree for the first {self.prefix:,} rows"
        )
        return "; ".join(parts)


def _count(tokens: Sequence[str]) -> str:
    return f"{len(tokens):,} token{'s' * (len(tokens) > 1)}"


def _shown(tokens: Sequence[str], n: int = 4) -> str:
    head = ", ".join(repr(t) for t in tokens[:n])
    return head + (f" and {len(tokens) - n:,} more" if len(tokens) > n else "")


def compare_vocabularies(a: Vocabulary, b: Vocabulary) -> VocabularyDifference:
    """B's rows against A's, matched by token text."""
    rows_a, rows_b = a.row_of(), b.row_of()
    shared = rows_a.keys() & rows_b.keys()
    only_a = tuple(a.spelled[r] or k for k, r in sorted(rows_a.items(), key=lambda kv: kv[1]) if k not in rows_b)
    only_b = tuple(b.spelled[r] or k for k, r in sorted(rows_b.items(), key=lambda kv: kv[1]) if k not in rows_a)
    moved = sum(rows_a[k] != rows_b[k] for k in shared)
    prefix = 0
    for ka, kb in zip(a.keys, b.keys, strict=False):
        if ka != kb:
            break
        prefix += 1
    return VocabularyDifference(
        shared=len(shared),
        only_a=only_a,
        only_b=only_b,
        moved=moved,
        prefix=prefix,
        tokens=(a.tokens, b.tokens),
        padding=(a.padding, b.padding),
        rowless=(len(a.rowless), len(b.rowless)),
    )


def spelled_by_key(vocabularies: Sequence[Vocabulary]) -> Mapping[str, str]:
    """Token text → its spelling in the first vocabulary that has it (for messages)."""
    out: dict[str, str] = {}
    for v in vocabularies:
        for k, s in zip(v.keys, v.spelled, strict=True):
            if k is not None and s is not None:
                out.setdefault(k, s)
    return out
