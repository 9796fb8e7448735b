"""The gate at the seam: every function that reads a model folder's files passes them through
`hf_rebasin.io.files` first, so a FIFO, a device or a link out of the folder is refused before any
reader opens it.

The fixture `refuse_special_opens` stands in for the operating system: every ``open`` of a path
that is not a regular file or a folder fails the test (opening a FIFO would block it forever). Each
file-reading function is then called on a folder whose file is a FIFO, a link to ``/dev/zero`` or
a link out of the folder, and must answer with a typed user error naming that file.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tiny
from hf_rebasin.alignment import cache, widths
from hf_rebasin.core.errors import RebasinUserError
from hf_rebasin.evaluation.data import char_tokenizer
from hf_rebasin.io import datafiles, export, files, gate, layout, models, remote_code, tensors
from hf_rebasin.merging import lora
from hf_rebasin.merging.vocabulary import files as tokenizer_files
from hf_rebasin.run import checks, memory

OPENED: list[str] = []


def _special(path: Any) -> bool:
    """Whether ``path`` (a path or a descriptor) names something other than a regular file or folder."""
    if isinstance(path, int):
        return False
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@pytest.fixture
def refuse_special_opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every ``open`` (builtins, io, os) of a FIFO or a device raises instead, and is recorded."""
    OPENED.clear()

    def guard(real: Callable[..., Any]) -> Callable[..., Any]:
        def opener(path: Any, *args: Any, **kwargs: Any) -> Any:
            if _special(path):
                OPENED.append(str(path))
                raise AssertionError(f"opened {path!r}, which is not a regular file")
            return real(path, *args, **kwargs)

        return opener

    monkeypatch.setattr(builtins, "open", guard(builtins.open))
    monkeypatch.setattr(io, "open", guard(io.open))
    monkeypatch.setattr(os, "open", guard(os.open))
    yield OPENED


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    tiny.gpt2(0).save_pretrained(str(folder))
    char_tokenizer("to be or not to be").save_pretrained(str(folder))
    return folder


def _sharded(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    header = tensors.read_safetensors_header(folder / "model-00001-of-00001.safetensors")
    weight_map = dict.fromkeys(header, "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _templates(folder: Path) -> None:
    """A default chat template and a named one, as transformers 5 saves a dict of templates."""
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool.jinja").write_text("{{ tools }}")


def _copy_support(folder: Path) -> None:
    (folder.parent / "dest").mkdir(exist_ok=True)
    export.copy_support_files(folder, folder.parent / "dest")


def _adapter(folder: Path) -> None:
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["c_fc"], "fan_in_fan_out": True}
    (folder / "adapter_config.json").write_text(json.dumps(config))


TEMPLATE = "additional_chat_templates/tool.jinja"
# (what it reads, which file of the folder becomes special, how the folder is prepared, the call)
READERS: list[tuple[str, str, Callable[[Path], None] | None, Callable[[Path], Any]]] = [
    ("files.read_config", "config.json", None, files.read_config),
    ("files.read_json", "generation_config.json", None, lambda f: files.read_json(f / "generation_config.json")),
    ("files.read_header", "model.safetensors", None, lambda f: files.read_header(f / "model.safetensors")),
    ("gate.check_folder (config)", "config.json", None, gate.check_folder),
    ("gate.check_folder (tokenizer)", "tokenizer.json", None, gate.check_folder),
    ("gate.check_folder (weights)", "model.safetensors", None, gate.check_folder),
    (
        "layout.index_shards",
        "model.safetensors.index.json",
        _sharded,
        lambda f: layout.index_shards(f / "model.safetensors.index.json", "index"),
    ),
    ("gate.support_files", "tokenizer.json", None, gate.support_files),
    ("gate.support_files (named chat template)", TEMPLATE, _templates, gate.support_files),
    ("gate.check_folder (named chat template)", TEMPLATE, _templates, gate.check_folder),
    ("export.copy_support_files (named chat template)", TEMPLATE, _templates, _copy_support),
    ("vocabulary.files.load_tokenizer (named chat template)", TEMPLATE, _templates, tokenizer_files.load_tokenizer),
    ("run.memory.footprint (weights)", "model.safetensors", None, memory.footprint),
    ("run.memory.footprint (shard)", "model-00001-of-00001.safetensors", _sharded, memory.footprint),
    ("run.memory.footprint (config)", "config.json", None, memory.footprint),
    ("models.read_config", "config.json", None, models.read_config),
    ("models.load_model (weights)", "model.safetensors", None, models.load_model),
    ("models.load_model (tokenizer)", "tokenizer_config.json", None, models.load_model),
    (
        "tensors.read_safetensors_header",
        "model.safetensors",
        None,
        lambda f: tensors.read_safetensors_header(f / "model.safetensors"),
    ),
    (
        "tensors.checkpoint_entries",
        "model.safetensors",
        None,
        lambda f: tensors.checkpoint_entries([f / "model.safetensors"]),
    ),
    ("remote_code.code_references", "tokenizer_config.json", None, remote_code.code_references),
    ("lora.adapter_config", "adapter_config.json", _adapter, lora.adapter_config),
    ("run.widths.config_widths", "config.json", None, widths.config_widths),
    ("run.checks._config_json", "config.json", None, checks._config_json),
    ("vocabulary.files.load_tokenizer (tokenizer.json)", "tokenizer.json", None, tokenizer_files.load_tokenizer),
    (
        "vocabulary.files.load_tokenizer (tokenizer_config.json)",
        "tokenizer_config.json",
        None,
        tokenizer_files.load_tokenizer,
    ),
    (
        "vocabulary.files.load_tokenizer (special_tokens_map.json)",
        "special_tokens_map.json",
        lambda f: (f / "special_tokens_map.json").write_text("{}"),
        tokenizer_files.load_tokenizer,
    ),
    (
        "datafiles.check_files",
        "tokenizer.json",
        None,
        lambda f: datafiles.check_files(str(f / "tokenizer.json"), None, f),
    ),
    (
        "cache.model_identity",
        "model.safetensors",
        None,
        lambda f: cache.model_identity(type("M", (), {"commit": None, "folder": f})()),
    ),
]

SPECIALS = {
    "fifo": lambda path: os.mkfifo(path),
    "device": lambda path: path.symlink_to("/dev/zero"),
    "outside": lambda path: path.symlink_to(_outside(path)),
}


def _outside(path: Path) -> Path:
    """The test's file beside the model folder (a link from a sub-folder climbs further)."""
    return next(p / "elsewhere.json" for p in path.parents if (p / "elsewhere.json").exists())


@pytest.mark.parametrize("kind", sorted(SPECIALS))
@pytest.mark.parametrize(("name", "target", "prepare", "call"), READERS, ids=[r[0] for r in READERS])
def test_every_reader_refuses_a_special_file_before_opening_it(
    tmp_path: Path,
    refuse_special_opens: list[str],
    name: str,
    target: str,
    prepare: Callable[[Path], None] | None,
    call: Callable[[Path], Any],
    kind: str,
) -> None:
    folder = _folder(tmp_path)
    if prepare is not None:
        prepare(folder)
    (tmp_path / "elsewhere.json").write_text("{}")
    (folder / target).unlink()
    SPECIALS[kind](folder / target)
    if kind == "outside" and name.startswith("datafiles"):  # data files may live anywhere: only the kind counts
        call(folder)
        assert not refuse_special_opens
        return
    with pytest.raises(RebasinUserError) as caught:
        call(folder)
    assert target in str(caught.value), f"{name}: {caught.value}"
    assert not refuse_special_opens, f"{name} opened {refuse_special_opens}"


def test_the_fixture_catches_an_unguarded_open(tmp_path: Path, refuse_special_opens: list[str]) -> None:
    """The fixture itself: an open of a FIFO without the gate fails (and does not block)."""
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(AssertionError, match="not a regular file"):
        (tmp_path / "pipe").read_text()
    assert refuse_special_opens == [str(tmp_path / "pipe")]


def test_a_hub_snapshot_links_into_its_own_blobs(tmp_path: Path) -> None:
    """A Hub cache snapshot's files are links into the repository's blobs: inside, so read; a link
    out of the repository's cache folder is not."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    (snap / "config.json").symlink_to("../../blobs/f00d")
    assert files.model_root(snap) == repo
    assert files.read_config(snap)["n_embd"] == 64
    (tmp_path / "other.json").write_text("{}")
    (snap / "generation_config.json").symlink_to("../../../other.json")
    with pytest.raises(RebasinUserError, match="leads outside"):
        files.read_json(snap / "generation_config.json")


def test_typed_errors_name_the_file_and_the_key(tmp_path: Path) -> None:
    """The schema's message, checked against what the file holds (read back with plain json)."""
    folder = _folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_head": True}))
    with pytest.raises(RebasinUserError, match=r"config.json': `n_head`: .*given True"):
        files.read_config(folder)
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 10**9}))
    with pytest.raises(RebasinUserError, match=r"says `vocab_size` = 1000000000"):
        files.read_config(folder)


def test_a_header_is_checked_against_its_file(tmp_path: Path) -> None:
    """Spans are what dtype and shape make, inside the file, and never shared; the header the
    safetensors library reads (an independent reader) agrees with ours on a good file."""
    from safetensors import safe_open

    folder = _folder(tmp_path)
    path = folder / "model.safetensors"
    ours = files.read_header(path)
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            assert list(ours.tensors[key].shape) == list(f.get_slice(key).get_shape())
            assert ours.tensors[key].dtype == f.get_slice(key).get_dtype()
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]
    header[second]["shape"], header[second]["dtype"] = header[first]["shape"], header[first]["dtype"]
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + size :])
    with pytest.raises(RebasinUserError, match="share bytes"):
        files.read_header(path)


def test_json_that_no_loader_reads_is_checked_as_a_file_not_parsed(tmp_path: Path) -> None:
    """sentence-transformers' files as the Hub ships them (all-MiniLM-L6-v2's data_config.json is a
    list): the gate passes them; a link of one out of the folder is still refused."""
    folder = _folder(tmp_path)
    (folder / "data_config.json").write_text(json.dumps([{"name": "s2orc", "lines": 10}]))
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "type": "sentence_transformers.models.Transformer"}]))
    (folder / "config_sentence_transformers.json").write_text("not json, and no loader reads it")
    assert gate.check_folder(folder) == folder.resolve()
    remote_code.refuse_remote_code(folder)  # scanned for auto_map, the file that is not JSON passed over
    (tmp_path / "elsewhere.json").write_text("[]")
    (folder / "modules.json").unlink()
    (folder / "modules.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(RebasinUserError, match=r"modules\.json' leads outside"):
        gate.check_folder(folder)
