"""A path the user gives that the file system refuses is a user error naming the field and the
reason in words (`io.files.probe`), and a field is named once (`core.errors.named`)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from bad_input import message_problems
from hf_rebasin.core.errors import ConfigError, UnreadableFileError, UserPathError, named, unprefixed
from hf_rebasin.io.files import probe, resolve_folder


def test_a_missing_path_is_none_and_an_existing_one_its_stat(tmp_path: Path) -> None:
    assert probe(tmp_path / "missing") is None
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    assert probe(tmp_path / "gone") is None  # a link to nothing: the caller says so
    info = probe(tmp_path)
    assert info is not None and info.st_ino == os.stat(tmp_path).st_ino


def test_a_name_too_long_is_named_in_words_with_the_path_shortened(tmp_path: Path) -> None:
    path = tmp_path / ("x" * 300)
    with pytest.raises(UserPathError) as e:
        probe(path, "`models.1.model`")
    message = str(e.value)
    assert message.startswith("`models.1.model`: ")
    assert "longer than the file system allows" in message and "300 bytes" in message
    assert "x" * 100 not in message and "…" in message  # shortened, not 300 characters of it


def test_a_path_through_a_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserPathError, match=r"MODEL: .*'.*config\.json' is a file, not a folder"):
        probe(tmp_path / "config.json" / "x", "MODEL")


def test_a_link_loop_is_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(UnreadableFileError, match=r"data_dir: .*symbolic link loop"):
        probe(tmp_path / "loop", "data_dir")
    with pytest.raises(UnreadableFileError, match="symbolic link loop"):
        resolve_folder(tmp_path / "loop")


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.EACCES, "permission denied"),  # the tests run as root, where a folder without permission reads anyway
        (errno.EPERM, "permission denied"),
        (errno.EIO, "the file system refused it"),
    ],
)
def test_every_other_refusal_is_a_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str
) -> None:
    def refuse(path: object, *args: object, **kwargs: object) -> os.stat_result:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(os, "stat", refuse)
    with pytest.raises(UserPathError, match=f"--output: .*cannot be used: {words}"):
        probe(tmp_path / "a", "--output")


def test_a_name_too_long_to_resolve_is_not_called_a_link_loop(tmp_path: Path) -> None:
    with pytest.raises(UserPathError, match="longer than the file system allows"):
        resolve_folder(tmp_path / ("x" * 300))


def test_a_nul_character_is_a_user_error() -> None:
    with pytest.raises(UserPathError, match="NUL character"):
        probe("a\x00b", "MODEL")


def test_a_field_is_named_once_however_the_regions_nest() -> None:
    with pytest.raises(ConfigError) as e, named("MODEL 2"), named("MODEL 2"):
        raise ConfigError("MODEL 2: bad")
    assert str(e.value) == "MODEL 2: bad"
    with pytest.raises(ConfigError) as e, named("MODEL 2"):
        raise ConfigError("bad")
    assert str(e.value) == "MODEL 2: bad"
    assert unprefixed("MODEL 2: bad", "MODEL 2") == "bad" and unprefixed("bad", "MODEL 2") == "bad"


@pytest.mark.parametrize(
    ("message", "flagged"),
    [
        ("`tokenizer.source`: must be a model's field, not {s!r}", True),
        ("{name} is not a model", True),
        ("token {0} is missing", True),
        ("has {n:,} rows", True),
        ("of {self.where}", True),
        ("MODEL 2: MODEL 2: 'lora' is a PEFT LoRA adapter", True),
        ("error: `models.0.model`: `models.0.model`: gone", True),
        ("write `tokenizer: {source: union}` to merge the vocabularies", False),
        ('the file holds {"a": 1}', False),
        ("`weight_map`: field required; given {'metadata': {}}", False),
        ("MODEL 2: 'lora' could not be read: MODEL 1: x", False),
        ("line 3, `models.0.model`: is required", False),
    ],
)
def test_the_message_check_flags_templates_and_doubled_prefixes(message: str, flagged: bool) -> None:
    assert bool(message_problems(message)) is flagged, message_problems(message)
