"""Tokenizers checked like weights (issue 43): they load or are refused, their ids fit the
embedding matrix, and one that does not load is never read as "no tokenizer".

The largest id is computed independently of the check (plain ``json`` on tokenizer.json, and the
`tokenizers` library) and compared with what the check reports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import transformers as T
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bad_input import TEXT
from hf_rebasin.core.errors import IncompatibleModelsError, RebasinUserError, TokenizerError
from hf_rebasin.evaluation.data import char_tokenizer
from hf_rebasin.merging.vocabulary.checks import embedding_rows, largest_id
from hf_rebasin.merging.vocabulary.files import load_tokenizer
from hf_rebasin.recipe import Recipe, loads_recipe
from hf_rebasin.run.checks import check_tokenizers
from hf_rebasin.run.resolve import PlannedModel, ResolvedModel

LINES = [
    "the quick brown fox jumps over the lazy dog",
    "a merge of two models whose token ids mean different things is garbage",
    "tokenizers are checked like weights: they load, and their ids fit the embedding",
] * 4
EXTRA = [f"<extra{i}>" for i in range(12)]


# -- builders -----------------------------------------------------------------------------------


def _config(folder: Path, vocab_size: int, *, nested: bool = False) -> None:
    """A tiny GPT-2 config.json (or one whose vocab_size is nested in text_config), no weights."""
    config = T.GPT2Config(vocab_size=vocab_size, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    config.save_pretrained(str(folder))
    if nested:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        data["text_config"] = {"vocab_size": data.pop("vocab_size")}
        (folder / "config.json").write_text(json.dumps(data), encoding="utf-8")


def _char_folder(folder: Path, vocab_size: int = 64, extra: tuple[str, ...] = ()) -> Path:
    """The bad-input corpus's character tokenizer (31 ids) with ``extra`` tokens added."""
    tokenizer = char_tokenizer(TEXT)
    tokenizer.add_tokens(list(extra))
    tokenizer.save_pretrained(str(folder))
    _config(folder, vocab_size)
    return folder


def _bpe_folder(folder: Path, *, rows: int | None = None) -> Path:
    """A real-looking tokenizer: byte-level BPE trained on a few lines, saved as transformers does;
    config.json's vocab_size is its length unless ``rows``."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(LINES, trainer)
    fast = T.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(str(folder))
    _config(folder, len(fast) if rows is None else rows)
    return folder


def _planned(folders: list[Path]) -> tuple[list[PlannedModel], str]:
    models = [PlannedModel(f"models.{i}.model", _ref(f), ResolvedModel(f)) for i, f in enumerate(folders)]
    body = {"job": "merge", "models": [str(f) for f in folders], "strategy": "vanilla", "output": {"dir": "out"}}
    return models, yaml.safe_dump(body)


def _ref(folder: Path) -> Any:
    from hf_rebasin.recipe import ModelRef

    return ModelRef(model=str(folder))


def _recipe(text: str, **changes: Any) -> Recipe:
    body = yaml.safe_load(text)
    body.update(changes)
    return loads_recipe(yaml.safe_dump(body))


def _independent_largest(folder: Path) -> tuple[int, int, str]:
    """The largest id by plain JSON and by the `tokenizers` library, and the token JSON gives it."""
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {token: i for token, i in data["model"]["vocab"].items()}
    ids.update({t["content"]: t["id"] for t in data["added_tokens"]})
    by_json = max(ids.values())
    by_lib = max(Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True).values())
    token = max(ids, key=lambda t: (ids[t], t))
    return by_json, by_lib, token


# -- largest id and embedding rows --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "char+added", "bpe"])
def test_largest_id_agrees_with_json_and_the_tokenizers_library(kind: str, tmp_path: Path) -> None:
    folder = _bpe_folder(tmp_path) if kind == "bpe" else _char_folder(tmp_path, extra=tuple(EXTRA) * (kind != "char"))
    by_json, by_lib, token = _independent_largest(folder)
    assert by_json == by_lib
    assert largest_id(load_tokenizer(folder)) == (token, by_json)
    if kind == "char+added":
        assert (token, by_json) == (EXTRA[-1], 30 + len(EXTRA))


def test_a_real_bpe_tokenizer_that_fits_passes(tmp_path: Path) -> None:
    a, b = _bpe_folder(tmp_path / "a"), _bpe_folder(tmp_path / "b")
    planned, text = _planned([a, b])
    assert check_tokenizers(_recipe(text), planned) == {1: None}


def test_the_check_reports_the_independently_computed_largest_id(tmp_path: Path) -> None:
    a = _bpe_folder(tmp_path / "a")
    by_json, by_lib, token = _independent_largest(a)
    _config(a, by_json)  # one row short: the last id is past the embedding
    planned, text = _planned([a, _bpe_folder(tmp_path / "b")])
    with pytest.raises(TokenizerError) as err:
        check_tokenizers(_recipe(text), planned)
    message = str(err.value)
    assert message.startswith("`models.0.model`: ")
    assert f"has token {token!r} with id {by_lib}" in message
    assert f"the embedding matrix has {by_json} rows (config.json vocab_size)" in message
    assert "IndexError" in message


def test_ids_past_a_nested_vocab_size_are_refused(tmp_path: Path) -> None:
    a = _char_folder(tmp_path / "a", extra=tuple(EXTRA))
    _config(a, 40, nested=True)
    assert embedding_rows(a, "models.0.model") == (40, "text_config.vocab_size")
    planned, text = _planned([a])
    with pytest.raises(TokenizerError, match=r"id 42, but the embedding matrix has 40 rows \(config.json text_config"):
        check_tokenizers(_recipe(text, models=[str(a), str(a)]), planned)


def test_no_vocab_size_is_not_checked(tmp_path: Path) -> None:
    a = _char_folder(tmp_path / "a", extra=tuple(EXTRA))
    data = json.loads((a / "config.json").read_text(encoding="utf-8"))
    del data["vocab_size"]
    (a / "config.json").write_text(json.dumps(data), encoding="utf-8")
    assert embedding_rows(a, "models.0.model") is None
    assert embedding_rows(tmp_path, "models.0.model") is None  # no config.json (an adapter)


def test_a_special_token_id_counts(tmp_path: Path) -> None:
    """An added special token (a new pad token) is an id the model will see."""
    folder = tmp_path / "a"
    tokenizer = char_tokenizer(TEXT)
    tokenizer.add_special_tokens({"pad_token": "<newpad>"})
    tokenizer.save_pretrained(str(folder))
    _config(folder, 31)
    loaded = load_tokenizer(folder)
    assert loaded.pad_token_id == 31 and largest_id(loaded) == ("<newpad>", 31)
    planned, text = _planned([folder, folder])
    with pytest.raises(TokenizerError, match="'<newpad>' with id 31, but the embedding matrix has 31 rows"):
        check_tokenizers(_recipe(text), planned)


# -- tokenizers that do not load ----------------------------------------------------------------


def test_no_tokenizer_files_is_none(tmp_path: Path) -> None:
    _config(tmp_path, 64)
    assert load_tokenizer(tmp_path) is None


def test_files_that_do_not_parse_are_refused_before_the_loader_reads_them(tmp_path: Path) -> None:
    folder = _char_folder(tmp_path / "a")
    (folder / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(RebasinUserError) as err:
        load_tokenizer(folder)
    message = str(err.value)
    assert str(folder / "tokenizer.json") in message and "not valid JSON" in message and "\n" not in message


def test_files_that_do_not_load_are_an_error_naming_folder_files_and_reason(tmp_path: Path) -> None:
    folder = _broken(_char_folder(tmp_path / "a"))
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(folder)
    message = str(err.value)
    assert str(folder) in message and "(tokenizer.json, tokenizer_config.json)" in message
    assert "TypeError" in message and "save_pretrained" in message and "\n" not in message


def test_a_missing_package_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _char_folder(tmp_path / "a")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("LlamaTokenizer requires the SentencePiece library but it was not found\n" + "x" * 500)

    monkeypatch.setattr(T.AutoTokenizer, "from_pretrained", refuse)
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(folder)
    message = str(err.value)
    assert "ImportError: LlamaTokenizer requires the SentencePiece" in message
    assert "pip install sentencepiece" in message and "\n" not in message and len(message) < 700


def _broken(folder: Path) -> Path:
    """Valid JSON that AutoTokenizer cannot read (a class that does not fit the files)."""
    path = folder / "tokenizer_config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["tokenizer_class"] = "T5Tokenizer"
    path.write_text(json.dumps(data), encoding="utf-8")
    return folder


@pytest.mark.parametrize("allow", [False, True])
def test_a_reference_that_does_not_load_is_always_refused(allow: bool, tmp_path: Path) -> None:
    a, b = _broken(_char_folder(tmp_path / "a")), _char_folder(tmp_path / "b")
    planned, text = _planned([a, b])
    with pytest.raises(TokenizerError, match=r"^`models\.0\.model`: .*does not load.*must load"):
        check_tokenizers(_recipe(text, allow_different_tokenizers=allow), planned)


def test_another_model_that_does_not_load_differs_unless_allowed(tmp_path: Path) -> None:
    a, b = _char_folder(tmp_path / "a"), _broken(_char_folder(tmp_path / "b"))
    planned, text = _planned([a, b])
    with pytest.raises(TokenizerError, match=r"^`models\.1\.model`: .*does not load.*may differ"):
        check_tokenizers(_recipe(text), planned)
    notes = check_tokenizers(_recipe(text, allow_different_tokenizers=True), planned)
    note = notes[1] or ""
    assert list(notes) == [1] and re.search(r"`models\.1\.model` does not load \(TypeError: .*\); allowed by", note)
    assert str(tmp_path) not in note  # notes go into a published card: no path of this machine
    assert check_tokenizers(_recipe(text), planned, skip={1}) == {}  # checked already


def test_swapped_ids_are_still_refused_and_models_not_there_yet_are_left_out(tmp_path: Path) -> None:
    a, b = _char_folder(tmp_path / "a"), _char_folder(tmp_path / "b")
    data = json.loads((b / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (b / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    planned, text = _planned([a, b])
    with pytest.raises(IncompatibleModelsError, match="token 'a' is id"):
        check_tokenizers(_recipe(text), planned)
    later = [planned[0], PlannedModel("models.1.model", planned[1].ref, ResolvedModel(None))]
    assert check_tokenizers(_recipe(text), later) == {}  # a Hub model not downloaded: checked at load
