"""The limits on reading a recipe (hf_rebasin/recipe/limits.py): size, nesting, values, the kind of
file, and the model card's echo of a recipe's comments. The corpus rows are in bad_cases_recipes.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from hf_rebasin.core.errors import StrategyOptionError
from hf_rebasin.recipe import RecipeError, loads_recipe
from hf_rebasin.recipe.limits import (
    MAX_RECIPE_BYTES,
    MAX_YAML_DEPTH,
    YamlLimitError,
    echoed_recipe_text,
    load_limited,
    read_recipe_file,
)
from hf_rebasin.recipe.sections import MAX_YAML_VALUES

RECIPE = "job: merge\nmodels: [./a, ./b]\nstrategy: vanilla\noutput: {dir: out}\n"
PAD = ("# " + "a long comment " * 5 + "\n") * 120  # ~9.5 KB of comments


@pytest.fixture(params=["libyaml", "python"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each limit holds with libyaml's early check and without it (the composer's own check)."""
    if request.param == "python":
        monkeypatch.delattr(yaml, "CSafeLoader", raising=False)
    return str(request.param)


@pytest.mark.parametrize("flow", [True, False])
def test_nesting_up_to_the_limit_loads_and_past_it_is_refused(parser: str, flow: bool) -> None:
    def nested(depth: int) -> str:
        """``depth`` collections, the top-level mapping included, around one scalar."""
        if flow:
            return "a: " + "[" * (depth - 1) + "x" + "]" * (depth - 1)
        return "a:\n" + "".join(" " * (i + 1) + f"k{i}:\n" for i in range(depth - 1)) + " " * depth + "x\n"

    node, data = load_limited(nested(MAX_YAML_DEPTH))
    assert node is not None and data is not None
    with pytest.raises(YamlLimitError, match=f"more than {MAX_YAML_DEPTH} levels deep"):
        load_limited(nested(MAX_YAML_DEPTH + 1))


def test_deep_nesting_is_refused_fast(parser: str) -> None:
    for text in ("a: " + "[" * 100_000 + "]" * 100_000, "a:\n  " + "- " * 10_000 + "x", "{a: " * 50_000):
        with pytest.raises(YamlLimitError, match="levels deep") as e:
            load_limited(text)
        assert e.value.line is not None


def test_values_written_out_are_not_called_an_alias_bomb(parser: str) -> None:
    with pytest.raises(YamlLimitError) as e:
        load_limited("a: [" + ", ".join(["x"] * (MAX_YAML_VALUES - 2)) + "]")
    assert f"more than {MAX_YAML_VALUES} values" in e.value.message and "alias" not in e.value.message


def test_values_up_to_the_limit_load() -> None:
    _, data = load_limited("a: [" + ", ".join(["x"] * (MAX_YAML_VALUES - 3)) + "]")  # with the root, `a`, the list
    assert len(data["a"]) == MAX_YAML_VALUES - 3


def test_aliases_that_expand_past_the_limit_are_an_alias_bomb(parser: str) -> None:
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    with pytest.raises(YamlLimitError, match=r"aliases \(\*name\)"):
        load_limited("\n".join(lines))


def test_text_over_the_size_limit_is_refused() -> None:
    text = RECIPE + "#" * MAX_RECIPE_BYTES
    with pytest.raises(RecipeError, match="limited to 1 MiB") as e:
        loads_recipe(text)
    assert f"{len(text):,} bytes" in str(e.value)


def test_the_file_is_checked_before_it_is_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    (tmp_path / "folder.yaml").mkdir()
    (tmp_path / "loop.yaml").symlink_to("loop.yaml")
    (tmp_path / "null.yaml").symlink_to(os.devnull)
    expected = {
        "pipe.yaml": "FIFO",
        "folder.yaml": "is a folder",
        "loop.yaml": "symlink loop",
        "null.yaml": f"a link to {os.devnull}, which is a character device",
        "missing.yaml": "does not exist",
    }
    for name, words in expected.items():
        with pytest.raises(RecipeError, match=words):
            read_recipe_file(tmp_path / name)


def test_a_file_over_the_limit_is_refused_by_its_size_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(50 * 1024 * 1024)  # sparse: nothing to read if the check came after the read
    with pytest.raises(RecipeError, match=r"is 52,428,800 bytes; recipes are limited to 1 MiB \(1,048,576 bytes\)"):
        read_recipe_file(big)


def test_a_recipe_file_reads_as_before(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_bytes(RECIPE.replace("\n", "\r\n").encode())
    assert read_recipe_file(path) == RECIPE  # universal newlines, as Path.read_text
    path.write_bytes(b"job: \xff")
    with pytest.raises(RecipeError, match="cannot be read"):
        read_recipe_file(path)


def test_small_comments_are_echoed_as_written() -> None:
    text = "# why these two\n" + RECIPE + "# the end\n"
    assert echoed_recipe_text(text) == text
    assert echoed_recipe_text(text + PAD[: 8 * 1024 - len(text)]) == text + PAD[: 8 * 1024 - len(text)]


def test_bulky_comments_are_left_out_of_the_echo_and_the_data_is_the_same() -> None:
    text = (
        "job: merge   # the job\n"
        "models: ['./a#1', \"./b # not a comment\", c#d]  # a comment after a value\n"
        "note: |\n  # content of a block scalar, not a comment\n  two\n"
        "folded: >-\n  text # also content\n"
        "  # indented as the folded text: its content\n"
        "# a comment line between two keys\n"
        "strategy: {name: vanilla,  # inside a flow mapping\n  x: 1}\n" + PAD
    )
    echoed = echoed_recipe_text(text)
    assert yaml.safe_load(echoed) == yaml.safe_load(text)
    assert echoed.startswith("# 124 comment lines left out")
    for dropped in ("a long comment", "the job", "after a value", "between two keys", "inside a flow"):
        assert dropped not in echoed
    kept_all = (
        "./a#1",
        "./b # not a comment",
        "c#d",
        "# content of a block",
        "text # also",
        "# indented as the folded",
    )
    for kept in kept_all:
        assert kept in echoed
    assert len(echoed) < 600


def test_an_echo_that_would_change_the_data_falls_back_to_the_data() -> None:
    text = "a: |+\n  x\n\n# dropping this line would change the kept blank lines\n\nb: 1\n" + PAD
    echoed = echoed_recipe_text(text)
    assert yaml.safe_load(echoed) == yaml.safe_load(text)
    assert "left out" in echoed.splitlines()[0] and "a long comment" not in echoed


def test_set_values_have_the_same_limits() -> None:
    from hf_rebasin.cli import _parse_options

    assert _parse_options(["max_iter=[[1]]"]) == {"max_iter": [[1]]}
    with pytest.raises(StrategyOptionError, match=r"--set max_iter=\.\.\.`: the value nests .* more than 64 levels"):
        _parse_options(["max_iter=" + "[" * 100_000 + "]" * 100_000])
