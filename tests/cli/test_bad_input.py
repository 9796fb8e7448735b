"""The bad-input corpus (tests/bad_input.py), every row: exit code, message, and what is on disk after.

Rows are grouped by area in ``bad_cases_*``: output folders (data loss), loading (code from a
repository, non-finite or extra weights, bounded work), inputs (recipes, data, the Hub).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bad_cases_files import CASES as FILE_CASES
from bad_cases_inputs import CASES as INPUT_CASES
from bad_cases_loading import CASES as LOADING_CASES
from bad_cases_output import CASES as OUTPUT_CASES
from bad_cases_recipes import CASES as RECIPE_CASES
from bad_cases_tokenizers import CASES as TOKENIZER_CASES
from bad_input import Case, Hung, Workspace, assert_outcome, interrupted_after, run_case

CASES: list[Case] = [*OUTPUT_CASES, *LOADING_CASES, *INPUT_CASES, *FILE_CASES, *TOKENIZER_CASES, *RECIPE_CASES]


def _param(case: Case) -> object:
    marks = [pytest.mark.slow] if case.slow else []
    return pytest.param(case, id=case.id, marks=marks)


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_a_run_in_process_that_blocks_on_a_fifo_is_interrupted(tmp_path: Path) -> None:
    """The guard of the FIFO rows run in process: a regression that opens the FIFO fails, not hangs."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(Hung), interrupted_after(0.2):
        fifo.read_bytes()  # blocks: no writer


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case: Case, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    ws = Workspace(tmp_path)
    if case.hub:
        ws.hub = request.getfixturevalue("hub")
    argv = case.build(ws)
    result = run_case(case, ws, argv)
    assert_outcome(case, result)
    if case.check is not None:
        case.check(ws, result)
