"""Bad-input corpus rows: loading (see tests/bad_input.py)."""

from __future__ import annotations

from bad_input import Case

CASES: list[Case] = []
