"""Files shipped with hf-rebasin: example recipes (``recipes/``) and model-card templates (``model_cards/``).

They live at the top of the repository, where users browse them, and the wheel installs them as
``hf_rebasin/recipes`` and ``hf_rebasin/model_cards`` (pyproject's package-dir). This module finds
them in either layout, so a checkout, an editable install and a wheel behave alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Folder = Literal["recipes", "model_cards"]

_PACKAGE = Path(__file__).resolve().parent


def resource(folder: Folder, name: str) -> Path:
    """The path of shipped file ``folder/name``; FileNotFoundError names both places looked in."""
    places = (_PACKAGE / folder / name, _PACKAGE.parent / folder / name)
    for path in places:
        if path.is_file():
            return path
    raise FileNotFoundError(f"{folder}/{name} is not installed (looked in {places[0]} and {places[1]})")


def listing(folder: Folder, pattern: str = "*") -> list[Path]:
    """Shipped files of ``folder`` matching ``pattern``, sorted by name (the installed copy wins)."""
    for root in (_PACKAGE / folder, _PACKAGE.parent / folder):
        if root.is_dir():
            return sorted(p for p in root.glob(pattern) if p.is_file())
    return []
