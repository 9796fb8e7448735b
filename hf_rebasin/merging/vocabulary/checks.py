"""The models' tokenizers, checked like their weights: each must load, its token ids must fit the
model's embedding matrix, and every model's must mean what the reference's means by each id.

A tokenizer that does not load is never "no tokenizer": skipping it would compare nothing and copy
the broken files into the output. A token id at or past the embedding's rows crashes the model
(IndexError) on the first text that holds it, so it is refused before any work is done.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_rebasin.core.errors import IncompatibleModelsError, TokenizerError, named
from hf_rebasin.io.files import read_config
from hf_rebasin.merging.vocabulary.files import (
    has_tokenizer,
    load_tokenizer,
    merge_rule,
    model_json,
    tokenizer_difference,
)

__all__ = [
    "CheckedModel",
    "check_ids_fit",
    "check_rows_by_position",
    "check_tokenizers",
    "config_rows",
    "embedding_rows",
    "largest_id",
    "same_text",
]

_ALLOW = "`allow_different_tokenizers: true`"


@dataclass(frozen=True)
class CheckedModel:
    """A model as the tokenizer checks see it: its ``folder`` (None where its files are not there
    yet: a Hub model not downloaded, a zoo model not trained, checked when the run fetches them),
    the recipe field that names it (``where``) and how messages name the model (``ref``)."""

    folder: Path | None
    where: str
    ref: str

    @property
    def path(self) -> Path:
        assert self.folder is not None, "only models whose files are there are checked"
        return self.folder


def largest_id(tokenizer: Any) -> tuple[str, int] | None:
    """``(token, id)`` of the largest id the tokenizer can produce: its vocabulary with added tokens,
    and its special tokens; None for an empty tokenizer."""
    pairs = list(tokenizer.get_vocab().items())
    pairs.extend(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=False))
    found = [(str(token), int(i)) for token, i in pairs if isinstance(i, int) and not isinstance(i, bool)]
    return max(found, key=lambda p: (p[1], p[0]), default=None)


def placeholders(tokenizer: Any, rows: int) -> bool:
    """Whether the tokens past ``rows`` are placeholders a merge can leave out: added, not special,
    and every such added token past the rows (an embedding never resized for them, as mergekit's
    "padded" test model; one resized for some but not all is a mistake, refused)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    plain = [int(i) for i, t in decoder.items() if not getattr(t, "special", False)]
    past = [i for i, _ in ((i, t) for t, i in tokenizer.get_vocab().items()) if int(i) >= rows]
    return bool(plain) and all(i >= rows for i in plain) and set(past) <= set(plain)


def embedding_rows(folder: Path, where: str) -> tuple[int, str] | None:
    """``(rows, field)`` of the model's embedding matrix as its config.json declares them
    (``vocab_size``, or ``text_config.vocab_size`` for models that nest it); None when unknown."""
    if not (folder / "config.json").is_file():  # an adapter: no embedding of its own
        return None
    with named(f"`{where}`"):  # config.json's messages start with its path, never a field
        config = read_config(folder)
    text = config.get("text_config")
    for field, value in (
        ("vocab_size", config.get("vocab_size")),
        ("text_config.vocab_size", text.get("vocab_size") if isinstance(text, dict) else None),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, field
    return None


def config_rows(folders: Sequence[Path], wheres: Sequence[str]) -> list[int | None]:
    """Each model's embedding rows as its config.json declares them (`embedding_rows`; None: unknown)."""
    return [(embedding_rows(f, w) or (None, ""))[0] for f, w in zip(folders, wheres, strict=True)]


def check_ids_fit(m: CheckedModel, tokenizer: Any, *, reference: bool = True) -> None:
    """Every id of ``m``'s tokenizer is a row of its embedding matrix: a larger one is an IndexError
    inside the model on the first text that holds it. A model other than the reference may list
    `placeholders` past its rows: its tokens are matched by text, and those have none."""
    rows = embedding_rows(m.path, m.where)
    top = largest_id(tokenizer)
    if rows is None or top is None or top[1] < rows[0]:
        return
    if not reference and placeholders(tokenizer, rows[0]):
        return
    (token, i), (n, field) = top, rows
    raise TokenizerError(
        f"`{m.where}`: the tokenizer of {m.ref} has token {token!r} with id {i}, but the embedding matrix has {n} "
        f"rows (config.json {field}): that token would crash the model (IndexError). Use the tokenizer the model "
        "was trained with, or give the model rows for the new tokens (`model.resize_token_embeddings(len(tokenizer))`, "
        "then train them) and save it again"
    )


def _reference(m: CheckedModel) -> Any | None:
    """The reference's tokenizer, checked: one that does not load is always refused (the result is
    used with it, and carries its files)."""
    try:
        tokenizer = load_tokenizer(m.path)
    except TokenizerError as e:
        raise TokenizerError(
            f"`{m.where}`: {e}. The reference's tokenizer goes with the result, so it must load"
        ) from None
    if tokenizer is not None:
        check_ids_fit(m, tokenizer)
    return tokenizer


def _unloadable(allow_different: bool, first: CheckedModel, m: CheckedModel, error: TokenizerError) -> str:
    """A model whose tokenizer does not load: its ids cannot be compared with the reference's, so
    the tokenizers may differ; refused unless ``allow_different`` (``allow_different_tokenizers``;
    then the note)."""
    if not allow_different:
        raise TokenizerError(
            f"`{m.where}`: {error}. Its token ids cannot be compared with those of {first.ref} (`{first.where}`), "
            "so the tokenizers may differ, and token ids that mean different things make the result garbage. "
            f"Fix its tokenizer files, or set {_ALLOW} if you know the models share token ids (the card will say so)"
        )
    return (
        f"the tokenizer of `{m.where}` does not load ({error.reason}); allowed by {_ALLOW}: its token ids were "
        "not compared with the reference's and may mean different things"
    )


def _compare(allow_different: bool, first: CheckedModel, reference: Any | None, m: CheckedModel) -> str | None:
    """``m``'s tokenizer against the reference's: None when they agree (or either has none), the
    note of an allowed difference, else refused."""
    try:
        other = load_tokenizer(m.path)
    except TokenizerError as e:
        return _unloadable(allow_different, first, m, e)
    if other is None:
        return None
    check_ids_fit(m, other, reference=False)
    if reference is None:
        return None
    diff = tokenizer_difference(reference, other, f"`{first.where}`", f"`{m.where}`")
    if diff is not None and same_text(reference, other):
        return (
            f"the tokenizer of `{m.where}` reads text as `{first.where}`'s does but their vocabularies differ "
            f"({diff}): rows are matched by token"
        )
    if diff is not None and not allow_different:
        raise IncompatibleModelsError(
            f"`{m.where}`: the tokenizer of {m.ref} differs from that of {first.ref} (`{first.where}`): {diff}. "
            "Token ids that mean different things make the result garbage. Use models that share a "
            f"tokenizer, or set {_ALLOW} if you know better (the card will say so)"
        )
    return diff and (
        f"the tokenizers differ (allowed by {_ALLOW}): {diff}; token ids may mean different things in the models "
        "combined"
    )


def same_text(a: Any, b: Any) -> bool:
    """Whether two tokenizers cut text alike, whatever tokens either adds: the same model (BPE,
    Unigram, WordPiece) whose merges agree as far as the shorter list goes, and every regular token
    both have at the same id. A chat fine-tune's added tokens, a release that extends the
    vocabulary or special tokens given new roles pass; another tokenizer does not."""
    model_a, model_b = model_json(a), model_json(b)
    if model_a.get("type") != model_b.get("type"):
        return False
    merges_a, merges_b = list(model_a.get("merges") or []), list(model_b.get("merges") or [])
    n = min(len(merges_a), len(merges_b))
    if [merge_rule(x) for x in merges_a[:n]] != [merge_rule(x) for x in merges_b[:n]]:
        return False
    added_a = set(getattr(a, "added_tokens_encoder", {}) or {})
    added_b = set(getattr(b, "added_tokens_encoder", {}) or {})
    vocab_b = b.get_vocab()
    return all(
        vocab_b[t] == i for t, i in a.get_vocab().items() if t in vocab_b and t not in added_a and t not in added_b
    )


def check_tokenizers(
    models: Sequence[CheckedModel], *, allow_different: bool, skip: Collection[int] = ()
) -> dict[int, str | None]:
    """Every model's tokenizer: it loads, its ids fit its embedding, and it agrees with the
    reference's (vocabulary, special tokens, merges). Token ids that mean different things make a
    merge or transport garbage with a normal-looking card.

    A difference, or a tokenizer that does not load, is refused unless ``allow_different`` (the
    recipe's ``allow_different_tokenizers``); then it is a note (rebasin.json and the card), by the
    model's index. The reference's tokenizer must always load. Models without tokenizer files (image
    models, adapters) have nothing to check; models not downloaded or trained yet (no folder), and
    those in ``skip`` (checked already), are left out.
    """
    first = models[0]
    if first.folder is None:
        return {}
    reference = _reference(first)
    return {
        i: _compare(allow_different, first, reference, m)
        for i, m in enumerate(models[1:], start=1)
        if i not in skip and m.folder is not None
    }


def check_rows_by_position(names: Sequence[str], folders: Sequence[Path], rows: Sequence[int | None]) -> None:
    """Models whose rows cannot be matched by token pair them by position, which needs one row
    count: refuse other counts where a model has no tokenizer to match by, naming the cause (the
    plan and the run alike, so the dry run refuses what the run would)."""
    known = [(n, f, r) for n, f, r in zip(names, folders, rows, strict=True) if r is not None]
    if len({r for *_, r in known}) <= 1:
        return
    lacking = [n for n, f, _ in known if not has_tokenizer(f)]
    if not lacking:
        return  # matched by token (`run_vocabulary`), or a tokenizer that does not load, refused as such
    (first, _, r0), (other, _, r1) = known[0], next(k for k in known if k[2] != known[0][2])
    if len(lacking) == len(known):
        which = "neither has a tokenizer" if len(known) == 2 else "none has a tokenizer"
    else:
        which = f"{' and '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} no tokenizer"
    raise IncompatibleModelsError(
        f"vocabularies differ: give each model its tokenizer. {first} has {r0:,} embedding rows and {other} {r1:,}, "
        f"and {which}, so their rows cannot be matched by token (paired by position, each row would be "
        "averaged with another token's). Save the tokenizer each model was trained with beside its weights "
        "(`tokenizer.save_pretrained(folder)`)"
    )
