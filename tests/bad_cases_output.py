"""Bad-input corpus rows: output folders, the data-loss cases (see tests/bad_input.py).

An output folder that is, contains or lies inside an input (a model, the data, the recipe) is
refused before anything is loaded, overwrite or not; ``overwrite`` replaces only a previous
hf-rebasin output; a path that cannot be written is refused at plan time too (also ``--dry-run``).
"""

from __future__ import annotations

import json

from bad_input import Build, Case, Check, Outcome, Workspace, read_json, run_case

LONG_NAME = "x" * 300


def _merge(output: dict[str, object], *, dry_run: bool = False, evaluate: bool = False) -> Build:
    def build(ws: Workspace) -> list[str]:
        recipe = ws.merge_recipe(output, evaluate=evaluate)
        ws.snapshot()
        return [str(recipe), *(["--dry-run"] if dry_run else [])]

    return build


def _models_in_a_folder(ws: Workspace) -> list[str]:
    for name, seed in (("a", 0), ("b", 1)):
        ws.model(f"models/{name}", seed=seed)
    body = {
        "job": "merge",
        "models": ["./models/a", "./models/b"],
        "strategy": "vanilla",
        "output": {"dir": "./models", "overwrite": True},
        "device": "cpu",
    }
    recipe = ws.recipe(body)
    ws.snapshot()
    return [str(recipe)]


def _data_in_a_folder(ws: Workspace) -> list[str]:
    ws.text("data/corpus.txt")
    for name, seed in (("a", 0), ("b", 1)):
        ws.model(name, seed=seed)
    body = {
        "job": "merge",
        "models": ["./a", "./b"],
        "strategy": "vanilla",
        "evaluate": {"task": "causal-lm", "data": {"dataset": "text", "data_files": "data/*.txt"}, "points": 3},
        "output": {"dir": "./data", "overwrite": True},
        "device": "cpu",
    }
    recipe = ws.recipe(body)
    ws.snapshot()
    return [str(recipe)]


def _arbitrary_folder(ws: Workspace) -> list[str]:
    ws.write("stuff/notes.txt", "my notes, not an hf-rebasin output")
    return _merge({"dir": "./stuff", "overwrite": True})(ws)


def _empty_folder(ws: Workspace) -> list[str]:
    (ws.root / "empty").mkdir()
    return _merge({"dir": "./empty", "overwrite": True})(ws)


def _previous_output(ws: Workspace) -> list[str]:
    ws.write("out/rebasin.json", json.dumps({"hf_rebasin_version": "0.0", "old": True}))
    ws.write("out/model.safetensors", b"the previous merge")
    return _merge({"dir": "./out", "overwrite": True})(ws)


def _under_a_file(dry_run: bool) -> Build:
    def build(ws: Workspace) -> list[str]:
        ws.write("notes.txt", "a file, not a folder")
        return _merge({"dir": "./notes.txt/out"}, dry_run=dry_run)(ws)

    return build


def _align(output: str) -> Build:
    def build(ws: Workspace) -> list[str]:
        ws.write("notes.txt", "a file, not a folder")
        ws.model("a", seed=0, tokenizer=False)
        ws.model("b", seed=1, tokenizer=False)
        ws.snapshot()
        return ["align", "a", "b", "--strategy", "vanilla", "--output", output]

    return build


def _inputs_untouched(ws: Workspace, result: Outcome) -> None:
    ws.unchanged()
    assert not ws.leftovers(), ws.leftovers()


def _written_to(name: str) -> Check:
    def check(ws: Workspace, result: Outcome) -> None:
        ws.unchanged(allow_new=(f"{name}/",))
        folder = ws.root / name
        assert (folder / "rebasin.json").is_file() and (folder / "model.safetensors").stat().st_size > 1000
        assert not ws.leftovers(), ws.leftovers()

    return check


def _previous_replaced(ws: Workspace, result: Outcome) -> None:
    folder = ws.root / "out"
    record = read_json(folder / "rebasin.json")
    assert "old" not in record and (folder / "model.safetensors").stat().st_size > 1000
    assert not ws.leftovers(), ws.leftovers()
    assert not list(ws.root.glob(".out*")), list(ws.root.glob(".out*"))


def _disk_full(ws: Workspace) -> list[str]:
    recipe = ws.merge_recipe({"dir": "out"}, evaluate=True)
    ws.snapshot()
    return [str(recipe)]


def _damaged_cache_entry(ws: Workspace) -> list[str]:
    """A weight-matching merge run once with the alignment cache on, its cache entry then damaged."""
    ws.env.update(HF_REBASIN_NO_CACHE="0", HF_REBASIN_CACHE=str(ws.root / "rebasin-cache"))
    recipe = ws.merge_recipe({"dir": "first"}, strategy="weight-matching")
    first = run_case(Case("first", "cache", lambda ws: [], 0), ws, [str(recipe)])
    assert first.code == 0, first.stderr
    entries = list((ws.root / "rebasin-cache" / "alignments").glob("*.safetensors"))
    assert len(entries) == 1, entries
    entries[0].write_bytes(entries[0].read_bytes()[:100] + b"\x00garbage")
    return [str(ws.merge_recipe({"dir": "second"}, strategy="weight-matching"))]


def _recomputed(ws: Workspace, result: Outcome) -> None:
    assert "recomputed" in result.out, result.stdout
    assert read_json(ws.root / "second" / "rebasin.json")["cache"]["misses"] == 1


CASES: list[Case] = [
    Case(
        "output-is-model-a-overwrite",
        "data loss",
        _merge({"dir": "./a", "overwrite": True}),
        2,
        needles=("output.dir", "models.0"),
        check=_inputs_untouched,
        before="exit 0, model A replaced by the merge",
    ),
    Case(
        "output-is-model-a",
        "data loss",
        _merge({"dir": "./a"}),
        2,
        needles=("output.dir", "models.0"),
        check=_inputs_untouched,
        before="exit 2 'already exists ... set output.overwrite: true to replace it' (suggests replacing model A)",
    ),
    Case(
        "output-contains-the-models-overwrite",
        "data loss",
        _models_in_a_folder,
        2,
        needles=("output.dir", "models.0", "contains"),
        check=_inputs_untouched,
        before="exit 0, the folder holding both models (and their tokenizers) replaced by the merge",
    ),
    Case(
        "output-inside-model-a",
        "data loss",
        _merge({"dir": "./a/merged"}),
        2,
        needles=("output.dir", "models.0", "inside"),
        check=_inputs_untouched,
        before="exit 0, the merge written into model A's folder (a/merged)",
    ),
    Case(
        "output-is-the-recipe-folder",
        "data loss",
        _merge({"dir": ".", "overwrite": True}),
        2,
        needles=("output.dir", "recipe"),
        check=_inputs_untouched,
        before="exit 0, the recipe's folder (recipe, both models) replaced by the merge",
    ),
    Case(
        "output-is-the-data-file",
        "data loss",
        _merge({"dir": "./corpus.txt", "overwrite": True}, evaluate=True),
        2,
        needles=("output.dir", "evaluate.data", "corpus.txt"),
        check=_inputs_untouched,
        before="exit 2 after loading and evaluating: 'output ... is a file, not a folder' (does not name the data)",
    ),
    Case(
        "output-contains-the-data-file",
        "data loss",
        _data_in_a_folder,
        2,
        needles=("output.dir", "evaluate.data", "contains"),
        check=_inputs_untouched,
        before="exit 0, the data folder replaced by the merge",
    ),
    Case(
        "overwrite-arbitrary-folder",
        "data loss",
        _arbitrary_folder,
        2,
        needles=("output.dir", "rebasin.json", "stuff"),
        check=_inputs_untouched,
        before="exit 0, stuff/notes.txt deleted and the folder replaced by the merge",
    ),
    Case(
        "overwrite-empty-folder",
        "data loss",
        _empty_folder,
        0,
        check=_written_to("empty"),
        before="exit 0, written (kept: an empty folder holds nothing to lose)",
    ),
    Case(
        "overwrite-previous-output",
        "data loss",
        _previous_output,
        0,
        check=_previous_replaced,
        before="exit 0, replaced (kept)",
    ),
    Case(
        "output-is-root",
        "output path",
        _merge({"dir": "/", "overwrite": True}),
        2,
        needles=("output.dir", "'/'"),
        before="exit 1 after the whole run: internal error OSError (rename of '/')",
    ),
    Case(
        "output-under-a-file",
        "output path",
        _under_a_file(False),
        2,
        needles=("output.dir", "notes.txt", "is a file"),
        check=_inputs_untouched,
        before="exit 1 after the whole run: internal error (mkdir under a regular file)",
    ),
    Case(
        "output-in-proc",
        "output path",
        _merge({"dir": "/proc/hf-rebasin-out"}),
        2,
        needles=("output.dir", "/proc", "cannot be written"),
        check=_inputs_untouched,
        before="exit 1 after the whole run: internal error (mkdir in /proc)",
    ),
    Case(
        "output-name-too-long",
        "output path",
        _merge({"dir": f"./{LONG_NAME}"}),
        2,
        needles=("output.dir", "too long"),
        check=_inputs_untouched,
        before="exit 1 after the whole run: internal error OSError ENAMETOOLONG",
    ),
    Case(
        "dry-run-output-is-model-a",
        "data loss",
        _merge({"dir": "./a", "overwrite": True}, dry_run=True),
        2,
        needles=("output.dir", "models.0"),
        check=_inputs_untouched,
        before="exit 0, the plan printed as if all was in order",
    ),
    Case(
        "dry-run-output-under-a-file",
        "output path",
        _under_a_file(True),
        2,
        needles=("output.dir", "notes.txt", "is a file"),
        check=_inputs_untouched,
        before="exit 0, the plan printed as if all was in order",
    ),
    Case(
        "dry-run-output-in-proc",
        "output path",
        _merge({"dir": "/proc/hf-rebasin-out"}, dry_run=True),
        2,
        needles=("output.dir", "/proc"),
        check=_inputs_untouched,
        before="exit 0, the plan printed as if all was in order",
    ),
    Case(
        "align-output-is-model-a",
        "data loss",
        _align("a"),
        2,
        needles=("--output", "MODEL_A"),
        check=_inputs_untouched,
        before="exit 2 'already exists; choose another or remove it first' (does not say it is model A)",
    ),
    Case(
        "align-output-inside-model-b",
        "data loss",
        _align("b/aligned"),
        2,
        needles=("--output", "MODEL_B", "inside"),
        check=_inputs_untouched,
        before="exit 0, aligned B written into model B's folder",
    ),
    Case(
        "align-output-under-a-file",
        "output path",
        _align("notes.txt/aligned"),
        2,
        needles=("--output", "notes.txt", "is a file"),
        check=_inputs_untouched,
        before="exit 1: internal error (mkdir under a regular file)",
    ),
    Case(
        "disk-full-while-saving",
        "output path",
        _disk_full,
        2,
        needles=("`output.dir`", "File too large", "Nothing was replaced"),
        check=_inputs_untouched,
        max_file_bytes=60_000,  # the merged model is ~120 kB: its write fails as on a full disk
        before="exit 1: internal error SafetensorError 'I/O error: File too large' (a bug, it said)",
        slow=True,  # a whole merge to the failing write (7 s)
    ),
    Case(
        "damaged-cache-entry",
        "cache",
        _damaged_cache_entry,
        0,
        check=_recomputed,
        before="handled (the entry is recomputed and written again)",
    ),
]
