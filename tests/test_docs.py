"""The documentation checks itself: the recipe reference is what the schema gives, links and anchors
resolve, the README stays short, its recipes parse, and its test command is the one CI runs.

Fast and torch-free: only the recipe module (pydantic, yaml) is imported.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from hf_rebasin.recipe import loads_recipe, recipe_json_schema
from hf_rebasin.recipe.jobs import JOBS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "benchmarks").glob("*/README.md"))]
README_MAX_LINES = 260
NOT_A_RECIPE = "<!-- not-a-recipe -->"  # put on the line before a ```yaml block that shows part of a recipe

FENCE = re.compile(r"^(```+|~~~+)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


@functools.cache
def _generator() -> ModuleType:
    """docs/recipe_reference.py, imported from its file (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("recipe_reference", ROOT / "docs" / "recipe_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line.lstrip())
        if match:
            mark = match.group(1)[0] * 3
            if fence is None:
                fence = mark
                continue
            if mark == fence:
                fence = None
                continue
        if fence is None:
            yield number, line


def _blocks(text: str) -> Iterator[tuple[int, str, str, str]]:
    """(line of the opening fence, info string, body, the line before the fence) of every fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i].lstrip())
        if match is None:
            i += 1
            continue
        mark, info, start = match.group(1), lines[i].lstrip()[len(match.group(1)) :].strip(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith(mark):
            body.append(lines[i])
            i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        yield start + 1, info, "\n".join(body) + "\n", before.strip()
        i += 1


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markdown links and code marks read as their text, lowercase,
    punctuation dropped except `-` and `_`, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 … for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose(path.read_text(encoding="utf-8")):
        match = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        n = seen.get(slug, 0)
        found.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return found


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of every markdown link and image outside code blocks and code spans."""
    for number, line in _prose(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1)


# ---------------------------------------------------------------------------------------------
# (a) the recipe reference is generated from the schema


def test_recipe_reference_is_up_to_date() -> None:
    gen = _generator()
    expected = gen.render()
    page = ROOT / "docs" / "recipe-reference.md"
    current = page.read_text(encoding="utf-8") if page.exists() else ""
    assert current == expected, (
        f"docs/recipe-reference.md is stale: regenerate it with `{gen.COMMAND}`\n"
        + gen.stale_summary(current, expected)
    )


def test_recipe_reference_lists_every_key_and_every_strategy() -> None:
    gen = _generator()
    schema = recipe_json_schema()
    page = gen.render(schema)
    for name, definition in schema["$defs"].items():
        for key in definition.get("properties", {}):
            assert f"| `{key}` |" in page, f"{name}.{key} is missing"
    strategies = schema["$defs"]["MergeRecipe"]["properties"]["strategy"]["anyOf"][0]["enum"]
    for name in strategies:
        assert f"`name: {name}`" in page
    assert gen.render(copy.deepcopy(schema)) == page  # deterministic


def test_recipe_reference_has_one_section_per_job() -> None:
    gen = _generator()
    page = gen.render(recipe_json_schema())
    for job in JOBS:
        assert f"\n## job: {job}\n" in page
        assert f"(#job-{job})" in page
    transport = page.split("\n## job: transport\n")[1].split("\n## ")[0]
    assert "| `alpha` |" in transport and "| `models` |" not in transport and "| `merge` |" not in transport
    assert "| `job` | `transport` | required |" in transport  # the tag first
    align = page.split("\n## job: align\n")[1].split("\n## ")[0]
    assert "| `evaluate` |" not in align  # refused by job: align, so not offered
    assert page.count("\n### DataSpec\n") == 1  # shared sections once
    assert "`name: head-perm`" in page


def test_recipe_reference_check_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gen = _generator()
    page = tmp_path / "recipe-reference.md"
    assert gen.main(["--output", str(page)]) == 0
    assert gen.main(["--check", "--output", str(page)]) == 0
    page.write_text(page.read_text(encoding="utf-8").replace("| `job` |", "| `jobs` |", 1), encoding="utf-8")
    assert gen.main(["--check", "--output", str(page)]) == 1
    err = capsys.readouterr().err
    assert "python docs/recipe_reference.py" in err and "2 lines differ" in err


# ---------------------------------------------------------------------------------------------
# (b) links and anchors


def test_slugs_follow_github() -> None:
    assert github_slug("`hf-rebasin verify`") == "hf-rebasin-verify"
    assert github_slug("head-perm: the paper's variants") == "head-perm-the-papers-variants"
    assert github_slug("The trade-off, and `alpha: auto`") == "the-trade-off-and-alpha-auto"
    assert github_slug("Real-size models: streaming") == "real-size-models-streaming"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: Path) -> None:
    assert page.is_file(), f"{_rel(page)} is missing"
    broken = []
    for line, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{_rel(page)}:{line}: {target}: no such file")
            continue
        if anchor:
            if dest.suffix != ".md" or anchor not in anchors(dest):
                broken.append(f"{_rel(page)}:{line}: {target}: no heading #{anchor} in {dest.name}")
    assert not broken, "\n".join(broken)


# ---------------------------------------------------------------------------------------------
# (c) the README stays short


def test_readme_is_short() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


# ---------------------------------------------------------------------------------------------
# (d) the recipes shown parse


def _recipe_blocks() -> Iterator[tuple[str, str]]:
    for page in [README, *DOCS]:
        for line, info, body, before in _blocks(page.read_text(encoding="utf-8")):
            if info.split()[:1] != ["yaml"] or before == NOT_A_RECIPE:
                continue
            data = yaml.safe_load(body)
            if isinstance(data, dict) and "job" in data:
                yield f"{_rel(page)}:{line}", body


RECIPES = list(_recipe_blocks())


def test_there_are_recipes_to_check() -> None:
    assert len(RECIPES) >= 3


@pytest.mark.parametrize(("where", "body"), RECIPES, ids=[w for w, _ in RECIPES])
def test_recipe_blocks_parse(where: str, body: str, tmp_path: Path) -> None:
    recipe = loads_recipe(body, where, base_dir=tmp_path)  # offline: repo ids are checked by syntax
    assert recipe.job in JOBS


# ---------------------------------------------------------------------------------------------
# (e) the README's test command is CI's


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    commands = []
    for _, info, body, _ in _blocks(README.read_text(encoding="utf-8")):
        if info.split()[:1] not in (["bash"], ["sh"], ["console"], []):
            continue
        for line in body.splitlines():
            command = line.split(" #", 1)[0].strip()
            for part in command.split("&&"):
                part = part.strip()
                if part.startswith("python -m pytest") and '-m "not slow"' in part:
                    commands.append(part)
    assert commands, 'the README shows no `python -m pytest ... -m "not slow"` command'
    for command in commands:
        shlex.split(command)  # a command a shell can read
        assert command in ci, f"the README's test command `{command}` is not a line of .ci/run"
