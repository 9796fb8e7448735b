"""What every recipe section shares: strict models (unknown keys are errors), paths resolved against
the recipe's folder, numbers told from booleans, and values quoted in error messages.

Parsing is strict on purpose: unknown keys are errors and every enumerated choice is a ``Literal``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo


def quoted(value: Any) -> str:
    """A value as error messages quote it (cut at 80 characters)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def shown(value: Any) -> str:
    """A value as `quoted` shows it, but a boolean as the recipe wrote it (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else quoted(value)


class Section(BaseModel):
    """A recipe section: unknown keys are errors (a misspelt key never passes silently)."""

    model_config = ConfigDict(extra="forbid")


def recipe_dir(info: ValidationInfo) -> Path | None:
    """The recipe's folder, which relative paths in it are read against (None for a recipe from text)."""
    context = info.context
    base = context.get("base_dir") if isinstance(context, Mapping) else None
    return Path(base) if base is not None else None


def local_path(value: str, base: Path | None, *, force: bool = False) -> str:
    """``value`` resolved against the recipe's folder when it names a local path, else as given.

    Explicit paths (``./x``, ``../x``, ``/x``, ``~/x``) are always local; a bare ``org/name`` is a
    Hub id unless a folder of that name sits beside the recipe.
    """
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    if base is None or "://" in value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    explicit = value in (".", "..") or value.startswith(("./", "../", ".\\", "..\\"))
    candidate = base / path
    if force or explicit or os.path.exists(candidate):  # False, not OSError, for a name too long: checked later
        try:
            return str(candidate.resolve())
        except (RuntimeError, OSError):  # a symbolic link loop: the model's checks name it
            return os.path.abspath(candidate)
    return value


def is_number(value: Any) -> bool:
    """An int or a float, not a bool (YAML's ``true`` is no weight)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
