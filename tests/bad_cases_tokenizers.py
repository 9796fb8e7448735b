"""Bad-input corpus rows: tokenizers (see tests/bad_input.py), checked like the weights (issue 43).

A tokenizer that does not load is never "no tokenizer" (the run would compare nothing and copy the
broken files into its output), a token id past the embedding matrix is refused before it crashes
the merged model (IndexError), and two tokenizers that differ are refused also when one of them
does not parse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from bad_input import Case, Outcome, Workspace, untouched

# a tokenizer_config.json that is valid JSON but names a class that cannot read this tokenizer:
# AutoTokenizer fails (TypeError), so the file-level JSON checks cannot be what refuses it
WRONG_CLASS = {"tokenizer_class": "T5Tokenizer"}
EXTRA = [f"<extra{i}>" for i in range(40)]  # ids 31..70 after the 31 of the character tokenizer


# -- helpers ------------------------------------------------------------------------------------


_untouched = untouched  # nothing written: inputs as they were, no output, no leftovers


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _models(ws: Workspace) -> tuple[Path, Path]:
    return ws.model("a", seed=0), ws.model("b", seed=1)


def _merge(ws: Workspace, **changes: Any) -> list[str]:
    """The vanilla merge of ./a and ./b (evaluate off) with top-level sections replaced."""
    body = yaml.safe_load(ws.merge_recipe().read_text(encoding="utf-8"))
    body.update(changes)
    recipe = ws.recipe(body)
    ws.snapshot()
    return [str(recipe)]


def _swap_ids(folder: Path, first: str = "a", second: str = "b") -> None:
    """Swap the ids of two characters in ``folder``'s tokenizer.json (the file stays valid)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _add_tokens(folder: Path) -> None:
    """``folder``'s tokenizer with `EXTRA` added (saved with ``save_pretrained``): ids up to 70."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_tokens(EXTRA)
    tokenizer.save_pretrained(str(folder))


# -- builds -------------------------------------------------------------------------------------


def _a_not_json(ws: Workspace) -> list[str]:
    a, _ = _models(ws)
    (a / "tokenizer.json").write_text("{not json", encoding="utf-8")
    return _merge(ws)


def _b_not_json(ws: Workspace) -> list[str]:
    _, b = _models(ws)
    (b / "tokenizer.json").write_text("{not json", encoding="utf-8")
    return _merge(ws)


def _ids_past_embedding(ws: Workspace) -> list[str]:
    for folder in _models(ws):
        _add_tokens(folder)
    return _merge(ws)


def _b_ids_past_embedding(ws: Workspace) -> list[str]:
    _, b = _models(ws)
    _add_tokens(b)
    return _merge(ws, allow_different_tokenizers=True)


def _ids_swapped(ws: Workspace) -> list[str]:
    _, b = _models(ws)
    _swap_ids(b)
    return _merge(ws)


def _swapped_a_broken(ws: Workspace) -> list[str]:
    a, b = _models(ws)
    _swap_ids(b)
    _edit_json(a / "tokenizer_config.json", **WRONG_CLASS)
    return _merge(ws)


def _a_broken_allowed(ws: Workspace) -> list[str]:
    a, _ = _models(ws)
    _edit_json(a / "tokenizer_config.json", **WRONG_CLASS)
    return _merge(ws, allow_different_tokenizers=True)


def _b_broken_allowed(ws: Workspace) -> list[str]:
    _, b = _models(ws)
    _edit_json(b / "tokenizer_config.json", **WRONG_CLASS)
    return _merge(ws, allow_different_tokenizers=True)


def _b_broken_noted(ws: Workspace, result: Outcome) -> None:
    """The run went ahead and says so; the output carries A's tokenizer, byte for byte."""
    ws.unchanged(allow_new=("out/",))
    assert not ws.leftovers(), ws.leftovers()
    out = ws.root / "out"
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert any("models.1.model" in n and "does not load" in n for n in record["notes"]), record["notes"]
    assert str(ws.root) not in json.dumps(record["notes"])  # published with the model: no local paths
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (ws.root / "a" / name).read_bytes(), name


# -- rows that differ (issue 64): the cause named, the dry run as the run, `align` as `job: align` -----


def _rows_apart(ws: Workspace, *, dry_run: bool) -> list[str]:
    """A merge of a model of 128 rows and one of 130, neither with a tokenizer."""
    import transformers as T

    for name, rows in (("a", 128), ("b", 130)):
        config = T.GPT2Config(vocab_size=rows, n_embd=32, n_layer=1, n_head=2, n_positions=64)
        T.GPT2LMHeadModel(config).save_pretrained(str(ws.root / name))
    return _merge(ws) + (["--dry-run"] if dry_run else [])


def _chatml_pair(ws: Workspace) -> list[str]:
    """`hf-rebasin align` of a base and its ChatML relative (two tokens and two rows more)."""
    from vocab_models import mergekit_cases

    cases = mergekit_cases(ws.root / "m")
    ws.snapshot()
    return ["align", str(cases["base"]), str(cases["chatml"]), "--output", "out", "--device", "cpu"]


def _recipe_in_message_runs(ws: Workspace, result: Outcome) -> None:
    """The recipe the refusal writes out is what `job: align` runs: it parses and aligns the pair."""
    from helpers import run_main

    untouched(ws, result)
    text = result.stderr[result.stderr.index("job: align") :]
    body = yaml.safe_load(text)
    assert body["job"] == "align" and body["output"] == {"dir": "out"}, body
    done = run_main(str(ws.recipe({**body, "device": "cpu"}, "align.yaml")), env={"HF_REBASIN_NO_CACHE": "1"})
    assert done.returncode == 0, done.stderr
    assert (ws.root / "out" / "a" / "model.safetensors").is_file() and (ws.root / "out" / "b").is_dir()


def _align_rows_apart(ws: Workspace) -> list[str]:
    _rows_apart(ws, dry_run=False)
    return ["align", str(ws.root / "a"), str(ws.root / "b"), "--device", "cpu"]


ROWS = "vocabularies differ: give each model its tokenizer"


CASES: list[Case] = [
    Case(
        "tokenizer-a-not-json",
        "tokenizers",
        _a_not_json,
        2,
        needles=("models.0.model", "tokenizer.json"),
        check=_untouched,
        before="exit 0; the output folder carried A's broken tokenizer.json",
    ),
    Case(
        "tokenizer-b-not-json",
        "tokenizers",
        _b_not_json,
        2,
        needles=("models.1.model", "tokenizer.json"),
        check=_untouched,
        before="exit 0; B's tokenizer skipped as if it had none",
    ),
    Case(
        "tokenizer-ids-past-embedding",
        "tokenizers",
        _ids_past_embedding,
        2,
        needles=("models.0.model", "'<extra39>' with id 70", "64 rows", "vocab_size", "IndexError"),
        check=_untouched,
        before="exit 0; the merged model raised IndexError on the first token past id 63",
    ),
    Case(
        "tokenizer-b-ids-past-embedding-allowed",
        "tokenizers",
        _b_ids_past_embedding,
        2,
        needles=("models.1.model", "with id 70", "vocab_size", "IndexError"),
        check=_untouched,
        before="exit 0 with a 'tokenizers differ' note",
    ),
    Case(
        "tokenizer-ids-swapped",
        "tokenizers",
        _ids_swapped,
        2,
        needles=("models.1.model", "differs", "token 'a' is id", "allow_different_tokenizers"),
        check=_untouched,
    ),
    Case(
        "tokenizer-ids-swapped-a-unparsable",
        "tokenizers",
        _swapped_a_broken,
        2,
        needles=("models.0.model", "tokenizer_config.json", "does not load"),
        check=_untouched,
        before="exit 0; A's tokenizer read as none, so B's swapped ids were never compared",
    ),
    Case(
        "tokenizer-a-unparsable-allowed",
        "tokenizers",
        _a_broken_allowed,
        2,
        needles=("models.0.model", "does not load", "must load"),
        check=_untouched,
        before="exit 0; the output folder carried A's broken tokenizer",
    ),
    Case(
        "tokenizer-b-unparsable-allowed",
        "tokenizers",
        _b_broken_allowed,
        0,
        check=_b_broken_noted,
        before="exit 0 without a note: B's tokenizer read as none",
    ),
    Case(
        "rows-apart-no-tokenizer",
        "tokenizers",
        lambda ws: _rows_apart(ws, dry_run=False),
        2,
        needles=(ROWS, "128 embedding rows", "130", "neither has a tokenizer"),
        check=_untouched,
        before="exit 2 blaming the architecture ('only models of one architecture and size can be aligned')",
    ),
    Case(
        "rows-apart-no-tokenizer-dry-run",
        "tokenizers",
        lambda ws: _rows_apart(ws, dry_run=True),
        2,
        needles=(ROWS, "128 embedding rows", "130", "neither has a tokenizer"),
        check=_untouched,
        before="exit 0: 'checks: ... in order'",
    ),
    Case(
        "align-cli-chatml-pair",
        "tokenizers",
        _chatml_pair,
        2,
        needles=("MODEL_B has 2 tokens that MODEL_A lacks", "job: align", "hf-rebasin align.yaml"),
        check=_recipe_in_message_runs,
        before="exit 2 blaming the architecture, while job: align with the same pair succeeds",
    ),
    Case(
        "align-cli-rows-apart-no-tokenizer",
        "tokenizers",
        _align_rows_apart,
        2,
        needles=(ROWS, "MODEL_A has 128 embedding rows"),
        check=_untouched,
        before="exit 2 blaming the architecture",
    ),
]
