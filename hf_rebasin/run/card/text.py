"""How the card writes a value: Markdown-escaped text, table cells, inline code and fences, numbers
as the tables show them, and what published text must never show (tokens, the user's own folders).

Every section of the card formats through these, so a name from a folder or a recipe cannot break
the card's Markdown or publish the machine it was made on.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import PurePath, PureWindowsPath
from typing import Any, TypeVar

V = TypeVar("V")

# Hugging Face user access tokens; a recipe has no field for one, but a card must never carry one.
_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")


_MARKDOWN = re.compile(r"([\\`*_{}\[\]<>()#+!|~&])")


def _cell(text: str) -> str:
    """A Markdown table cell: ``|`` would end the cell and a line break the row."""
    return " ".join(text.split()).replace("|", "\\|")


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _text(text: str) -> str:
    """``text`` as Markdown shows it, letter for letter: a folder or repo name may hold ``<img …>``,
    ``*`` or ``[…](…)``, which a Hub page would otherwise render as HTML or a link."""
    return _MARKDOWN.sub(r"\\\1", " ".join(text.split()))


def _code(text: str) -> str:
    """``text`` as an inline code span inside a table cell: fenced past any backticks it holds."""
    text = _cell(text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _fence(text: str) -> str:
    """A code fence longer than any run of backticks inside ``text``, so the block cannot end early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def redact(text: str) -> str:
    """``text`` with anything shaped like a Hub token masked: a card is published."""
    return _TOKEN.sub("hf_***", text)


def _float(value: float | None) -> float:
    """A number as the tables show it; one written as null (not finite) is shown as nan."""
    return math.nan if value is None else float(value)


def _at(values: Sequence[V] | None, i: int) -> V | None:
    """``values[i]``, None past the end (a damaged record still renders a card)."""
    return values[i] if values is not None and 0 <= i < len(values) else None


def leaves_folder(path: str) -> bool:
    """Whether ``path`` as written points outside the folder it is relative to (absolute, ``~``, a
    drive, or through ``..``): published text shows such a path by its own name only, since the
    whole of it would publish the user's own folder layout."""
    posix, windows = PurePath(path), PureWindowsPath(path)
    absolute = posix.is_absolute() or windows.is_absolute() or bool(windows.drive) or path.startswith("~")
    return absolute or ".." in windows.parts


def shown_dir(value: Any) -> str:
    """The output folder as the card may show it: a relative path inside the recipe's folder as
    given; an absolute path or one reaching outside (``../``) only by its name."""
    if not value:
        return "path/to/this/folder"
    text = str(value)
    if leaves_folder(text):
        return PureWindowsPath(text).name or "path/to/this/folder"
    return text
