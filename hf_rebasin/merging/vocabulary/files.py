"""Do two models mean the same thing by the same token id? Their tokenizers, compared.

Independently trained models are the ones most likely to have different vocabularies, and a merge
of two models whose token ids mean different things produces garbage with a normal-looking card.
The tokenizers are compared as loaded (vocabulary, special tokens, BPE merges), not as file bytes:
the same tokenizer saved by two library versions gives different files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_rebasin.core.errors import TokenizerError

__all__ = [
    "LOADER_EXTRAS",
    "TOKENIZER_FILES",
    "differ_in_vocabulary",
    "has_tokenizer",
    "load_tokenizer",
    "loader_files",
    "merge_rule",
    "model_json",
    "template_files",
    "tokenizer_difference",
    "tokenizer_files",
]

# the files from which transformers builds a tokenizer; a folder with none of them has no tokenizer
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds tokenizer files (image models and adapters usually do not)."""
    return bool(tokenizer_files(folder))


def tokenizer_files(folder: Path) -> list[str]:
    """The tokenizer files ``folder`` holds, in `TOKENIZER_FILES` order (a FIFO or a link out of the
    folder too: `gate_tokenizer_files` refuses it)."""
    return [name for name in TOKENIZER_FILES if os.path.lexists(Path(folder) / name)]


# what a tokenizer loader may read besides `TOKENIZER_FILES` (and the named chat templates)
LOADER_EXTRAS = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")


# the chat template files besides the named ones (transformers 5 writes the .jinja; older processors the .json)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def template_files(folder: Path) -> list[str]:
    """The chat template files of ``folder``, relative to it: the default and the named ones."""
    from hf_rebasin.io.layout import chat_templates

    return [*(n for n in TEMPLATE_FILES if os.path.lexists(Path(folder) / n)), *chat_templates(folder)]


def loader_files(folder: Path) -> list[str]:
    """Every file of ``folder`` a tokenizer loader may read, relative to it: `TOKENIZER_FILES`,
    `LOADER_EXTRAS` and the named chat templates (``additional_chat_templates/*.jinja``)."""
    from hf_rebasin.io.layout import chat_templates

    present = [name for name in (*TOKENIZER_FILES, *LOADER_EXTRAS) if os.path.lexists(Path(folder) / name)]
    return [*present, *chat_templates(folder)]


def gate_tokenizer_files(folder: Path) -> dict[str, Path]:
    """Every file a tokenizer loader may read of ``folder`` through the gate (`files`): inside the
    model's folder, regular, of a sane size, JSON of its schema. Name -> the real path that passed."""
    from hf_rebasin.io.files import model_root, resolve_folder
    from hf_rebasin.io.gate import check_file

    root = model_root(resolve_folder(folder))
    return {name: check_file(Path(folder) / name, root) for name in loader_files(folder)}


def _reason(error: BaseException, folder: Path) -> str:
    """The loader's reason on one line, trimmed (some are paragraphs, some quote a whole file), the
    folder named by its name only (the reason may end up in a published card)."""
    text = " ".join(str(error).split()) or "no reason given"
    for path in sorted({str(folder), str(Path(folder).resolve())}, key=len, reverse=True):
        text = text.replace(path, Path(folder).name)
    return f"{type(error).__name__}: {text[:200]}{'…' * (len(text) > 200)}"


def _fix(error: BaseException) -> str:
    """How to fix a tokenizer that does not load: the package it asks for, or saving it again."""
    text = str(error).lower()
    if isinstance(error, ImportError) or "sentencepiece" in text or "tiktoken" in text:
        return (
            "install the package the loader asks for (such as `pip install sentencepiece`), or save the tokenizer "
            "again with `tokenizer.save_pretrained(folder)` so that it has a tokenizer.json"
        )
    return (
        "save the tokenizer again with `tokenizer.save_pretrained(folder)` (from the library that made it), or "
        "restore the folder's tokenizer files from where the model came from"
    )


def load_tokenizer(folder: Path) -> Any | None:
    """The tokenizer of ``folder`` (never repository code); None only when it has no tokenizer files.

    Files that are there but do not load are a `TokenizerError`, never "no tokenizer": a run that
    skipped them would compare nothing and copy the broken files into its output.
    """
    files = tokenizer_files(folder)
    if not files:
        return None
    gate_tokenizer_files(folder)  # confined, regular, typed: before the loader opens any of them
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # any loader failure (JSON, types, a missing package): the user's files
        reason = _reason(e, folder)
        error = TokenizerError(
            f"the tokenizer of {str(folder)!r} ({', '.join(files)}) does not load ({reason}); {_fix(e)}"
        )
        error.reason = reason
        raise error from None


def _specials(tokenizer: Any) -> dict[str, tuple[str, int | None]]:
    """Role (bos, eos, pad, ...) -> (token, id) of the named special tokens."""
    out: dict[str, tuple[str, int | None]] = {}
    for role, token in sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items()):
        if isinstance(token, str):
            ids = tokenizer.convert_tokens_to_ids([token])
            out[str(role).removesuffix("_token")] = (token, int(ids[0]) if ids and ids[0] is not None else None)
    return out


def model_json(tokenizer: Any) -> Mapping[str, Any]:
    """The ``model`` section of the fast tokenizer's tokenizer.json (type, merges), {} if none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {}
    try:
        model = json.loads(backend.to_str()).get("model")
    except (ValueError, AttributeError):
        return {}
    return model if isinstance(model, Mapping) else {}


def merge_rule(rule: Any) -> str:
    """A BPE merge rule as one string (tokenizer.json writes either "a b" or ["a", "b"])."""
    return " ".join(map(str, rule)) if isinstance(rule, Sequence) and not isinstance(rule, str) else str(rule)


def tokenizer_difference(a: Any, b: Any, name_a: str = "A", name_b: str = "B") -> str | None:
    """The first way tokenizer ``b`` differs from ``a`` in words ("token 'the' is id 12 in A but 40
    in B", the models named ``name_a`` and ``name_b``), None when they agree on vocabulary, special
    tokens and merges."""
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    for token, id_a in sorted(vocab_a.items(), key=lambda kv: (kv[1], kv[0])):
        id_b = vocab_b.get(token)
        if id_b is None:
            return f"token {token!r} (id {id_a} in {name_a}) is not in {name_b}'s vocabulary"
        if id_b != id_a:
            return f"token {token!r} is id {id_a} in {name_a} but {id_b} in {name_b}"
    for token, id_b in sorted(vocab_b.items(), key=lambda kv: (kv[1], kv[0])):
        if token not in vocab_a:
            return f"token {token!r} (id {id_b} in {name_b}) is not in {name_a}'s vocabulary"
    specials_a, specials_b = _specials(a), _specials(b)
    for role in sorted(set(specials_a) | set(specials_b)):
        sa, sb = specials_a.get(role), specials_b.get(role)
        if sa != sb:
            shown_a = f"{sa[0]!r} (id {sa[1]})" if sa else "not set"
            shown_b = f"{sb[0]!r} (id {sb[1]})" if sb else "not set"
            return f"the {role} token is {shown_a} in {name_a} but {shown_b} in {name_b}"
    model_a, model_b = model_json(a), model_json(b)
    if model_a.get("type") != model_b.get("type"):
        return f"the tokenizer model is {model_a.get('type')!r} in {name_a} but {model_b.get('type')!r} in {name_b}"
    merges_a, merges_b = list(model_a.get("merges") or []), list(model_b.get("merges") or [])
    for i, (ma, mb) in enumerate(zip(merges_a, merges_b, strict=False)):
        if merge_rule(ma) != merge_rule(mb):
            return f"BPE merge rule {i} is {merge_rule(ma)!r} in {name_a} but {merge_rule(mb)!r} in {name_b}"
    if len(merges_a) != len(merges_b):
        return f"{name_a} has {len(merges_a)} BPE merge rules and {name_b} {len(merges_b)}"
    return None


def differ_in_vocabulary(folders: Sequence[Path | None]) -> bool:
    """Whether the models in ``folders`` may have other tokens at their rows: other embedding sizes
    or other tokenizer files (read as bytes: cheap, and files that differ only in how they were
    written count as different, which only costs the in-memory path). Unknown folders: no."""
    from hf_rebasin.io.files import read_config

    seen: set[tuple[Any, ...]] = set()
    for folder in folders:
        if folder is None or not (Path(folder) / "config.json").is_file():
            continue
        config = read_config(Path(folder))
        nested = config.get("text_config")
        text = nested if isinstance(nested, dict) else {}
        files = tuple(
            (Path(folder) / name).read_bytes() if (Path(folder) / name).is_file() else None
            for name in ("tokenizer.json", "tokenizer_config.json", "added_tokens.json", "vocab.json", "vocab.txt")
        )
        seen.add((config.get("vocab_size"), text.get("vocab_size"), files))
    return len(seen) > 1
