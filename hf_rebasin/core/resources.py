"""Where hf-rebasin's own files are: those it ships and the cache it writes.

Shipped: example recipes (``recipes/``) and model-card templates (``model_cards/``). They live at
the top of the repository, where users browse them, and the wheel installs them as
``hf_rebasin/recipes`` and ``hf_rebasin/model_cards`` (pyproject's package-dir). This module finds
them in either layout, so a checkout, an editable install and a wheel behave alike.

Written: one cache root (`cache_root`) holds the model zoo and the alignment cache, so one
variable (``HF_REBASIN_CACHE``) moves both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

Folder = Literal["recipes", "model_cards"]

_PACKAGE = Path(__file__).resolve().parents[1]  # hf_rebasin/, this file being hf_rebasin/core/resources.py
CACHE_ENV = "HF_REBASIN_CACHE"


def cache_root() -> Path:
    """``$HF_REBASIN_CACHE`` if set, else ``~/.cache/hf-rebasin``: the zoo lives in ``<root>/zoo``,
    the alignment cache in ``<root>/alignments``; read on every call, so tests can point it elsewhere."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf-rebasin"


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
