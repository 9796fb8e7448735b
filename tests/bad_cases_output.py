"""Bad-input corpus rows: output folders, the data-loss cases (see tests/bad_input.py)."""

from __future__ import annotations

from bad_input import Case, Outcome, Workspace


def _output_is_model_a(ws: Workspace) -> list[str]:
    recipe = ws.merge_recipe({"dir": "./a", "overwrite": True})
    ws.snapshot()
    return [str(recipe)]


def _inputs_untouched(ws: Workspace, result: Outcome) -> None:
    ws.unchanged()
    assert not ws.leftovers(), ws.leftovers()


CASES: list[Case] = [
    Case(
        "output-is-model-a-overwrite",
        "data loss",
        _output_is_model_a,
        2,
        needles=("output.dir", "models.0"),
        check=_inputs_untouched,
        before="exit 0, model A replaced by the merge",
    ),
]
