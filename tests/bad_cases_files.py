"""Bad-input corpus rows: a model folder's files checked before anything reads them (see tests/bad_input.py).

Every path a recipe, a shard index or a config names is resolved and confined to its model's folder,
must be a regular file of a sane size, and every JSON file parses into its schema, before the dry
run's memory estimate, the repository-code scan or a loader reads a byte. Each row runs where the
hostile round found the failure: ``--dry-run`` (the estimate read first) and the run, or ``verify``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from bad_input import Case, Outcome, Workspace, untouched

# -- helpers ------------------------------------------------------------------------------------


_untouched = untouched  # nothing written: inputs as they were, no output, no leftovers


def _quick(limit: float) -> Any:
    """`_untouched`, and refused within ``limit`` seconds (a refusal is never slower than the work)."""

    def check(ws: Workspace, result: Outcome) -> None:
        _untouched(ws, result)
        assert result.seconds < limit, f"took {result.seconds:.1f} s"

    return check


def _merge(ws: Workspace, *extra: str, **changes: Any) -> list[str]:
    """The vanilla merge of ./a and ./b (built if missing), top-level sections replaced; ``extra``
    are more CLI arguments (``--dry-run``)."""
    body = yaml.safe_load(ws.merge_recipe().read_text(encoding="utf-8"))
    body.update(changes)
    recipe = ws.recipe(body)
    ws.snapshot()
    return [str(recipe), *extra]


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header (parsed) and its data bytes."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def _write_header(path: Path, header: Any, body: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)


def _edit_header(change: Any) -> Any:
    """B's model.safetensors with its header changed by ``change(header)`` (returns the new header)."""

    def build(ws: Workspace, *extra: str) -> list[str]:
        ws.model("a", seed=0)
        path = ws.model("b", seed=1) / "model.safetensors"
        header, body = _header(path)
        _write_header(path, change(header), body)
        return _merge(ws, *extra)

    return build


def _first(header: dict[str, Any]) -> str:
    return next(k for k in header if k != "__metadata__")


def _set_entry(key: str, value: Any) -> Any:
    def change(header: dict[str, Any]) -> dict[str, Any]:
        header[_first(header)][key] = value
        return header

    return change


def _huge_tensor(header: dict[str, Any]) -> dict[str, Any]:
    header[_first(header)]["shape"] = [1_000_000, 1_000_000]  # 10¹² values; the offsets still say 8 KB
    return header


def _edit_config(name: str, **changes: Any) -> None:
    path = Path(name) / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


def _b_file(name: str, content: str | bytes) -> Any:
    """B's file ``name`` replaced by ``content``."""

    def build(ws: Workspace, *extra: str) -> list[str]:
        ws.model("a", seed=0)
        ws.model("b", seed=1)
        ws.write(f"b/{name}", content)
        return _merge(ws, *extra)

    return build


def _dry(build: Any) -> Any:
    return lambda ws: build(ws, "--dry-run")


# -- the hostile round's cases ------------------------------------------------------------------


def _index_to_fifo(ws: Workspace, *extra: str) -> list[str]:
    """B sharded, its index naming ``../pipe.safetensors``: a FIFO beside the folder."""
    ws.model("a", seed=0)
    b = ws.model("b", seed=1)
    header, _ = _header(b / "model.safetensors")
    (b / "model.safetensors").rename(b / "model-00001-of-00001.safetensors")
    os.mkfifo(ws.root / "pipe.safetensors")
    weight_map = dict.fromkeys((k for k in header if k != "__metadata__"), "model-00001-of-00001.safetensors")
    weight_map[_first(header)] = "../pipe.safetensors"
    ws.write("b/model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}))
    return _merge(ws, *extra)


def _shard_link_to_fifo(ws: Workspace, *extra: str) -> list[str]:
    """B's model.safetensors a link to a FIFO outside its folder (the index check cannot see it)."""
    ws.model("a", seed=0)
    b = ws.model("b", seed=1)
    (b / "model.safetensors").unlink()
    os.mkfifo(ws.root / "pipe")
    (b / "model.safetensors").symlink_to("../pipe")
    return _merge(ws, *extra)


def _config_list(ws: Workspace, *extra: str) -> list[str]:
    ws.model("a", seed=0)
    ws.model("b", seed=1)
    ws.write("b/config.json", json.dumps([{"model_type": "gpt2"}]))
    return _merge(ws, *extra)


def _n_embd_huge(ws: Workspace, *extra: str) -> list[str]:
    ws.model("a", seed=0)
    ws.model("b", seed=1)
    _edit_config(str(ws.root / "b"), n_embd=1_000_000)
    return _merge(ws, *extra)


def _loop_folder(ws: Workspace) -> list[str]:
    ws.model("b", seed=1)
    (ws.root / "loop").symlink_to("loop")
    return _merge(ws, models=["./loop", "./b"])


# -- ten more of the same spirit ----------------------------------------------------------------


def _config_fifo(ws: Workspace, *extra: str) -> list[str]:
    ws.model("a", seed=0)
    b = ws.model("b", seed=1)
    (b / "config.json").unlink()
    os.mkfifo(b / "config.json")
    return _merge(ws, *extra)


def _config_device(ws: Workspace, *extra: str) -> list[str]:
    ws.model("a", seed=0)
    b = ws.model("b", seed=1)
    (b / "config.json").unlink()
    (b / "config.json").symlink_to("/dev/zero")
    return _merge(ws, *extra)


def _weights_from_elsewhere(ws: Workspace, *extra: str) -> list[str]:
    """B's model.safetensors a link to A's: a file outside B's folder."""
    ws.model("a", seed=0)
    b = ws.model("b", seed=1)
    (b / "model.safetensors").unlink()
    (b / "model.safetensors").symlink_to("../a/model.safetensors")
    return _merge(ws, *extra)


def _secret_licence(ws: Workspace) -> list[str]:
    """A's LICENSE a link to a private file outside its folder: the output (and a push) would carry it."""
    ws.model("a", seed=0)
    ws.model("b", seed=1)
    ws.write("secret.txt", "api-key: do-not-publish\n")
    (ws.root / "a" / "LICENSE").symlink_to("../secret.txt")
    return _merge(ws)


def _config_deep(ws: Workspace, *extra: str) -> list[str]:
    ws.model("a", seed=0)
    b = ws.model("b", seed=1)
    text = (b / "config.json").read_text(encoding="utf-8").rstrip().rstrip("}")
    ws.write("b/config.json", text + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return _merge(ws, *extra)


def _config_big(ws: Workspace, *extra: str) -> list[str]:
    ws.model("a", seed=0)
    b = ws.model("b", seed=1)
    text = (b / "config.json").read_text(encoding="utf-8").rstrip().rstrip("}")
    ws.write("b/config.json", text + ', "padding": "' + "x" * 20_000_000 + '"}')
    return _merge(ws, *extra)


def _index_number(ws: Workspace) -> list[str]:
    ws.model("a", seed=0)
    b = ws.model("b", seed=1)
    header, _ = _header(b / "model.safetensors")
    (b / "model.safetensors").rename(b / "model-00001-of-00001.safetensors")
    weight_map: dict[str, Any] = dict.fromkeys(
        (k for k in header if k != "__metadata__"), "model-00001-of-00001.safetensors"
    )
    weight_map[_first(header)] = 7
    ws.write("b/model.safetensors.index.json", json.dumps({"weight_map": weight_map}))
    return _merge(ws, "--dry-run")


def _adapter(config: Any) -> Any:
    """A transport whose ``finetuned`` is a LoRA adapter folder with this adapter_config.json."""

    def build(ws: Workspace) -> list[str]:
        ws.model("base", seed=0)
        ws.model("target", seed=1)
        ws.write("lora/adapter_config.json", config if isinstance(config, str) else json.dumps(config))
        ws.write("lora/adapter_model.safetensors", b"")
        body = {
            "job": "transport",
            "base": "./base",
            "finetuned": "./lora",
            "target": "./target",
            "strategy": "weight-matching",
            "calibrate": False,
            "output": {"dir": "out"},
            "device": "cpu",
        }
        recipe = ws.recipe(body)
        ws.snapshot()
        return [str(recipe), "--dry-run"]

    return build


LORA = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["c_fc"], "fan_in_fan_out": True}


def _data_fifo(ws: Workspace) -> list[str]:
    ws.model("a", seed=0)
    ws.model("b", seed=1)
    os.mkfifo(ws.root / "corpus.txt")
    evaluate = {"task": "causal-lm", "data": {"dataset": "text", "data_files": "corpus.txt"}, "points": 3}
    return _merge(ws, evaluate=evaluate)


def _verify_header(change: Any) -> Any:
    def build(ws: Workspace) -> list[str]:
        path = ws.model("a", seed=0) / "model.safetensors"
        header, body = _header(path)
        _write_header(path, change(header), body)
        ws.snapshot()
        return ["verify", "./a"]

    return build


_HANG = {"timeout": 90.0}  # a FIFO: a regression hangs; the run is interrupted (bad_input.Hung) and fails
NOT_JSON = "{this is not json"

CASES: list[Case] = [
    # the hostile round: files read before they were checked
    Case(
        "shard-index-fifo-outside-dry-run",
        "files",
        _dry(_index_to_fifo),
        2,
        needles=("models.1.model", "model.safetensors.index.json", "../pipe.safetensors"),
        check=_quick(20.0),
        before="hangs forever: the memory estimate opens the FIFO the index names before the traversal check",
        **_HANG,  # type: ignore[arg-type]
    ),
    Case(
        "shard-index-fifo-outside-run",
        "files",
        _index_to_fifo,
        2,
        needles=("models.1.model", "../pipe.safetensors"),
        check=_quick(20.0),
        before="hangs forever (the same FIFO, read by the run's memory estimate)",
        **_HANG,  # type: ignore[arg-type]
    ),
    Case(
        "shard-link-to-fifo-outside",
        "files",
        _dry(_shard_link_to_fifo),
        2,
        needles=("models.1.model", "model.safetensors", "leads outside"),
        check=_quick(20.0),
        before="hangs forever: the estimate opens the link's FIFO",
        **_HANG,  # type: ignore[arg-type]
    ),
    Case(
        "config-json-list-dry-run",
        "files",
        _dry(_config_list),
        2,
        needles=("models.1.model", "config.json", "JSON object", "list"),
        check=_quick(20.0),
        before="exit 1, internal error in the memory estimate",
    ),
    Case(
        "config-json-list-run",
        "files",
        _config_list,
        2,
        needles=("models.1.model", "config.json", "JSON object"),
        check=_quick(20.0),
        before="exit 1, internal error in the memory estimate",
    ),
    Case(
        "header-is-a-list",
        "files",
        _dry(_edit_header(lambda h: [h])),
        2,
        needles=("models.1.model", "model.safetensors", "header must be a JSON object"),
        check=_quick(20.0),
        before="exit 1, internal error in the memory estimate",
    ),
    Case(
        "header-shape-is-a-string",
        "files",
        _dry(_edit_header(_set_entry("shape", "64x64"))),
        2,
        needles=("models.1.model", "model.safetensors", "`shape`", "'64x64'"),
        check=_quick(20.0),
        before="exit 1, internal error in the memory estimate",
    ),
    Case(
        "header-dtype-is-a-list",
        "files",
        _dry(_edit_header(_set_entry("dtype", ["F32"]))),
        2,
        needles=("models.1.model", "model.safetensors", "`dtype`", "['F32']"),
        check=_quick(20.0),
        before="exit 1, internal error in the memory estimate",
    ),
    Case(
        "config-n-embd-1000000",
        "files",
        _dry(_n_embd_huge),
        2,
        needles=("models.1.model", "config.json' says `n_embd` = 1000000", "no machine could hold"),
        check=_quick(20.0),
        before="exit 2, blamed on memory: 'this run needs about 3.7 TiB of memory'",
    ),
    Case(
        "header-tensor-of-10-12-values",
        "files",
        _dry(_edit_header(_huge_tensor)),
        2,
        needles=("models.1.model", "model.safetensors", "[1000000, 1000000]", "does not describe this file"),
        check=_quick(20.0),
        before="exit 2, blamed on memory: 'this run needs about 22 TiB of memory'",
    ),
    Case(
        "model-folder-symlink-loop",
        "files",
        _loop_folder,
        2,
        needles=("models.0.model", "loop", "symbolic link loop"),
        check=_quick(20.0),
        before="exit 1, RuntimeError: Symlink loop",
    ),
    # ten more of the same spirit
    Case(
        "config-json-is-a-fifo",
        "files",
        _dry(_config_fifo),
        2,
        needles=("models.1.model", "config.json", "FIFO"),
        check=_quick(20.0),
        **_HANG,  # type: ignore[arg-type]
    ),
    Case(
        "config-json-links-to-dev-zero",
        "files",
        _dry(_config_device),
        2,
        needles=("models.1.model", "config.json", "leads outside"),
        check=_quick(20.0),
        **_HANG,  # type: ignore[arg-type]
    ),
    Case(
        "weights-link-outside-the-folder",
        "files",
        _dry(_weights_from_elsewhere),
        2,
        needles=("models.1.model", "model.safetensors", "leads outside", "copy the file"),
        check=_quick(20.0),
    ),
    Case(
        "licence-links-to-a-private-file",
        "files",
        _secret_licence,
        2,
        needles=("models.0.model", "LICENSE", "leads outside"),
        check=_quick(20.0),
        before="exit 0: the private file was copied into the output as LICENSE (and pushed with it)",
    ),
    Case(
        "generation-config-not-json",
        "files",
        _dry(_b_file("generation_config.json", NOT_JSON)),
        2,
        needles=("models.1.model", "generation_config.json", "not valid JSON"),
        check=_quick(20.0),
    ),
    Case(
        "generation-config-eos-is-text",
        "files",
        _dry(_b_file("generation_config.json", json.dumps({"eos_token_id": "two"}))),
        2,
        needles=("models.1.model", "generation_config.json", "`eos_token_id", "'two'"),
        check=_quick(20.0),
    ),
    Case(
        "tokenizer-config-added-token-id-not-a-number",
        "files",
        _dry(_b_file("tokenizer_config.json", json.dumps({"added_tokens_decoder": {"abc": {"content": "x"}}}))),
        2,
        needles=("models.1.model", "tokenizer_config.json", "added_tokens_decoder"),
        check=_quick(20.0),
    ),
    Case(
        "config-json-nested-100000-deep",
        "files",
        _dry(_config_deep),
        2,
        needles=("models.1.model", "config.json", "200 levels"),
        check=_quick(20.0),
        before="exit 1, RecursionError",
    ),
    Case(
        "config-json-20-mb",
        "files",
        _dry(_config_big),
        2,
        needles=("models.1.model", "config.json", "16,777,216 bytes"),
        check=_quick(20.0),
    ),
    Case(
        "shard-index-names-a-number",
        "files",
        _index_number,
        2,
        needles=("models.1.model", "model.safetensors.index.json", "weight_map"),
        check=_quick(20.0),
        before="exit 1, internal error (a number where a shard file name belongs)",
    ),
    Case(
        "adapter-config-is-a-list",
        "files",
        _adapter([LORA]),
        2,
        needles=("finetuned.model", "adapter_config.json", "JSON object"),
        check=_quick(20.0),
        before="exit 1, AttributeError: 'list' object has no attribute 'get'",
    ),
    Case(
        "adapter-rank-10-9",
        "files",
        _adapter({**LORA, "r": 10**9}),
        2,
        needles=("finetuned.model", "adapter_config.json", "`r`", "1000000000"),
        check=_quick(20.0),
    ),
    Case(
        "eval-data-file-is-a-fifo",
        "files",
        _data_fifo,
        2,
        needles=("evaluate.data", "corpus.txt", "FIFO"),
        check=_quick(20.0),
        **_HANG,  # type: ignore[arg-type]
    ),
    Case(
        "verify-header-offsets-negative",
        "files",
        _verify_header(_set_entry("data_offsets", [-8, 0])),
        2,
        needles=("model.safetensors", "`data_offsets", "-8"),
        check=_quick(20.0),
    ),
]
