"""Limits on what a recipe may cost to read: its size, its nesting and its number of values.

A recipe is a few dozen lines of YAML. A file from a stranger may be 50 MB of comments (minutes of
parsing, then a 50 MB model card), nested 100 000 levels deep (Python's recursion limit), a FIFO
(``open`` blocks forever) or a device (``/dev/zero`` never ends). Each is refused here, the file
before it is opened and the YAML as soon as it passes a limit, with a message that says which limit
and why; the model card's echo of a recipe drops comments past 8 KiB. The checks import no torch.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from hf_rebasin.io.files import file_kind
from hf_rebasin.recipe.problems import Problem, RecipeError
from hf_rebasin.recipe.sections import MAX_YAML_VALUES

__all__ = [
    "MAX_ECHOED_COMMENTS",
    "MAX_RECIPE_BYTES",
    "MAX_YAML_DEPTH",
    "YamlLimitError",
    "echoed_recipe_text",
    "expanded_size",
    "load_limited",
    "read_recipe_file",
]

MAX_RECIPE_BYTES = 1 << 20  # 1 MiB: the largest recipe in recipes/ is ~2 KB
MAX_YAML_DEPTH = 64  # no recipe nests more than ~8 levels; Python's recursion limit is ~1000 frames


class YamlLimitError(ValueError):
    """YAML text over one of the limits: ``message`` says which; ``line`` is where (1-based), if known."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line


def _too_big(size: int, what: str = "the recipe", more: str = "") -> str:
    """The size refusal: the size, the limit, and what to do."""
    return (
        f"{what} is {more}{size:,} bytes; recipes are limited to 1 MiB ({MAX_RECIPE_BYTES:,} bytes), and a recipe is a "
        "few dozen lines: remove the bulk (long comments, pasted data) or put data in a data file"
    )


def _too_many(what: str) -> str:
    """The refusal of values written out (not an alias bomb: there is no alias to remove)."""
    return f"{what} holds more than {MAX_YAML_VALUES} values; no recipe needs that many"


def _too_deep(what: str) -> str:
    """The refusal of deep nesting, with the limit: a recipe needs a few levels, the composer recurses."""
    return (
        f"{what} nests lists and mappings more than {MAX_YAML_DEPTH} levels deep, the limit (a recipe needs "
        "about 8): remove the extra brackets or indentation"
    )


def _precheck(text: str, what: str) -> None:
    """The nesting and value limits checked first with libyaml's event parser where PyYAML has it:
    it refuses 1 MB of values in 0.1 s, where the pure-Python composer takes 3 s. Its syntax errors
    are left to the composer (which checks the limits again), so messages stay PyYAML's."""
    c_loader = getattr(yaml, "CSafeLoader", None)
    if c_loader is None:
        return
    depth = values = 0
    try:
        for event in yaml.parse(text, Loader=c_loader):
            if isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
            elif isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
                values += 1
                depth += isinstance(event, yaml.CollectionStartEvent)
                line = event.start_mark.line + 1 if event.start_mark is not None else None
                if values > MAX_YAML_VALUES:
                    raise YamlLimitError(_too_many(what), line)
                if depth > MAX_YAML_DEPTH:
                    raise YamlLimitError(_too_deep(what), line)
    except yaml.YAMLError:
        return


class _LimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses, while composing, nesting past `MAX_YAML_DEPTH` and more than
    `MAX_YAML_VALUES` values as written (the composer recurses once per level: without the cap a deep
    recipe ends in RecursionError)."""

    def __init__(self, text: str, what: str) -> None:
        super().__init__(text)
        self._what = what
        self._depth = 0
        self._values = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):  # the anchor's node, already counted
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        line = self.peek_event().start_mark.line + 1
        self._values += 1
        if self._values > MAX_YAML_VALUES:
            raise YamlLimitError(_too_many(self._what), line)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH and self.check_event(yaml.CollectionStartEvent):
                raise YamlLimitError(_too_deep(self._what), line)
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1


# YAML 1.2's exponent floats (1e-3, 5E4): PyYAML reads YAML 1.1, where a float needs a dot and a
# signed exponent, so `tol: 1e-3` (as the docs write it) would be the string '1e-3', which a strict
# number refuses. Integers and 1.1's floats keep their own resolvers (earlier in each list).
_LimitedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def expanded_size(node: yaml.Node) -> int:
    """How many values ``node`` holds with every alias expanded, counted without expanding them.

    An alias is the same node object as its anchor, so sizes are memoised by identity: the count
    takes time linear in the YAML text however far the aliases would multiply it.
    """
    sizes: dict[int, int] = {}

    def size(n: yaml.Node, depth: int) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if depth > 200:  # a recursive alias (&a [*a]): no recipe has it; count it as too large
            return MAX_YAML_VALUES + 1
        sizes[id(n)] = MAX_YAML_VALUES + 1  # in progress: a cycle counts as too large
        total = 1
        if isinstance(n, yaml.MappingNode):
            total += sum(size(k, depth + 1) + size(v, depth + 1) for k, v in n.value)
        elif isinstance(n, yaml.SequenceNode):
            total += sum(size(item, depth + 1) for item in n.value)
        sizes[id(n)] = total = min(total, MAX_YAML_VALUES + 1)
        return total

    return size(node, 0)


def load_limited(text: str, what: str = "the recipe") -> tuple[yaml.Node | None, Any]:
    """The composed node and the data of YAML ``text``, parsed once, within the limits.

    Raises `YamlLimitError` for text over `MAX_RECIPE_BYTES`, nesting past `MAX_YAML_DEPTH`, more
    than `MAX_YAML_VALUES` values as written, or aliases that expand past that many (an alias bomb);
    ``yaml.YAMLError`` for bad syntax.
    """
    if len(text) > MAX_RECIPE_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_RECIPE_BYTES:
        raise YamlLimitError(_too_big(len(text.encode("utf-8", "surrogatepass")), what))
    _precheck(text, what)
    loader = _LimitedLoader(text, what)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        if expanded_size(node) > MAX_YAML_VALUES:
            raise YamlLimitError(
                f"YAML aliases (*name) expand {what} to more than {MAX_YAML_VALUES} values, which no recipe "
                "needs (an alias bomb?): write the repeated values out, or use fewer aliases"
            )
        return node, loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse(path: Path, kind: str) -> RecipeError:
    """A recipe path that is not a regular file, refused before it is opened; a link says where it points."""
    where = f"is a link to {os.path.realpath(path)}, which is" if path.is_symlink() else "is"
    why = "" if kind == "a folder" else ", not a regular file (reading it could block or never end)"
    return RecipeError(str(path), [Problem("", None, f"{where} {kind}{why}: give the recipe's YAML file")])


def read_recipe_file(path: Path) -> str:
    """The text of the recipe file at ``path``, checked with ``os.stat`` before it is opened: a
    regular file (a FIFO would block ``open``, a device never end) of at most `MAX_RECIPE_BYTES`; the
    read itself stops one byte past the limit, should the file grow or its size lie."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise RecipeError(str(path), [Problem("", None, "the recipe file does not exist")]) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            why = "is a symbolic link that leads back to itself (a symlink loop): point it at the recipe's YAML file"
            raise RecipeError(str(path), [Problem("", None, why)]) from None
        raise RecipeError(str(path), [Problem("", None, f"cannot be read: {e.strerror or e}")]) from None
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, f"a {file_kind(info.st_mode)}")
    if info.st_size > MAX_RECIPE_BYTES:
        raise RecipeError(str(path), [Problem("", None, _too_big(info.st_size))])
    try:  # O_NONBLOCK: should a FIFO replace the file after the stat, open returns instead of waiting
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise _refuse(path, f"a {file_kind(mode)}")
            data = f.read(MAX_RECIPE_BYTES + 1)
        if len(data) > MAX_RECIPE_BYTES:  # it grew after the stat, or its size lies (/proc)
            raise RecipeError(str(path), [Problem("", None, _too_big(MAX_RECIPE_BYTES, more="more than "))])
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(str(path), [Problem("", None, f"cannot be read: {e}")]) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as Path.read_text's universal newlines


MAX_ECHOED_COMMENTS = 8 << 10  # comment text the model card echoes with the recipe: 8 KiB


_Token = tuple[str, Any, Any]


def _token_key(token: yaml.Token) -> _Token:
    """A YAML token without its position: texts whose tokens are equal parse alike."""
    return type(token).__name__, getattr(token, "value", None), getattr(token, "style", None)


def _comment_spans(text: str) -> tuple[list[tuple[int, int]], list[_Token]]:
    """(start, end) of every comment in ``text`` (a ``#`` between YAML tokens, to the end of its
    line), and the tokens.

    Between two tokens there is only white space, line breaks and comments, so a ``#`` there starts
    a comment; one inside a token (a quoted or block scalar, ``a#b``) does not, whatever a regex
    would think.
    """
    spans: list[tuple[int, int]] = []
    keys: list[_Token] = []
    gap = 0
    for token in [*yaml.scan(text, Loader=yaml.SafeLoader), None]:
        stop = len(text) if token is None else token.start_mark.index
        at = text.find("#", gap, stop)
        while at != -1:
            end = text.find("\n", at, stop)
            end = stop if end == -1 else end
            spans.append((at, end))
            at = text.find("#", end, stop)
        if token is not None:
            keys.append(_token_key(token))
            gap = max(gap, token.end_mark.index)
    return spans, keys


def _without(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` without the comments at ``spans``: a comment alone on its line goes with its line,
    one after a value with the blanks before it."""
    parts, last = [], 0
    for start, end in spans:
        line_start = text.rfind("\n", 0, start) + 1
        if text[line_start:start].strip(" \t") == "":
            start, end = line_start, end + 1 if text.startswith("\n", end) else end
        else:
            while start > last and text[start - 1] in " \t":
                start -= 1
        parts.append(text[last:start])
        last = end
    return "".join([*parts, text[last:]]).lstrip("\ufeff")


def echoed_recipe_text(text: str) -> str:
    """The recipe text the model card echoes: as written while its comments are small (8 KiB), else
    without comments and with one comment saying how many were left out, so that a recipe of
    comments does not make a card of comments. Parses to the same data either way."""
    if len(text) <= MAX_ECHOED_COMMENTS:
        return text
    try:
        spans, keys = _comment_spans(text)
    except yaml.YAMLError:
        return text
    if sum(end - start for start, end in spans) <= MAX_ECHOED_COMMENTS:
        return text
    stripped = _without(text, spans)
    note = f"# {len(spans):,} comment lines left out (the recipe's comments came to more than 8 KiB)\n"
    try:
        same = [_token_key(t) for t in yaml.scan(stripped, Loader=yaml.SafeLoader)] == keys
    except yaml.YAMLError:
        same = False
    if not same:  # not expected; the data as YAML rather than an echo that means something else
        return note + yaml.safe_dump(load_limited(text)[1], sort_keys=False)
    return note + stripped
