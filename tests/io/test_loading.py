"""Loading checks behind the bad-input rows (tests/bad_cases_loading.py): code never runs even when
a user would answer "y", NaN never passes a check, a preservation gap never ends in exit 0."""

from __future__ import annotations

import builtins
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from bad_cases_loading import EVIL, MARKER
from bad_input import Case, Workspace, run_case


def _vit_with_processor_auto_map(tmp_path: Path) -> Path:
    import transformers as T

    ws = Workspace(tmp_path)
    folder = ws.model("a", kind="vit")
    T.ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5], image_std=[0.5]).save_pretrained(str(folder))
    path = folder / "preprocessor_config.json"
    data = json.loads(path.read_text())
    data["auto_map"] = {"AutoImageProcessor": "evil.Evil"}
    path.write_text(json.dumps(data))
    (folder / "evil.py").write_text(EVIL)
    return folder


def test_processor_is_loaded_without_asking_even_when_trusted(tmp_path: Path, monkeypatch: Any) -> None:
    """trust_remote_code: true ignores a processor's auto_map: the stock class its file declares,
    no prompt (a terminal user answering "y" would have run evil.py), no import."""
    from hf_rebasin.io.remote_code import code_references
    from hf_rebasin.run.data import processor as _processor

    folder = _vit_with_processor_auto_map(tmp_path)
    assert code_references(folder) == [("preprocessor_config.json", "auto_map", "AutoImageProcessor")]

    def answer_yes(*args: Any) -> str:
        raise AssertionError("transformers asked whether to run repository code")

    monkeypatch.setattr(builtins, "input", answer_yes)
    processor = _processor(folder, "image-classification")
    assert type(processor).__name__.startswith("ViTImageProcessor")
    assert not (folder / MARKER).exists()


def test_load_model_refuses_code_references_unless_trusted(tmp_path: Path) -> None:
    from hf_rebasin.core.errors import UnsupportedArchitectureError
    from hf_rebasin.io.models import load_model

    folder = _vit_with_processor_auto_map(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match=r"preprocessor_config\.json"):
        load_model(folder)
    assert type(load_model(folder, trust_remote_code=True).model).__name__ == "ViTForImageClassification"
    assert not (folder / MARKER).exists()


def test_nan_is_never_within_tolerance() -> None:
    from hf_rebasin.alignment.verify import VerifyReport

    for value in (math.nan, math.inf):
        report = VerifyReport(max_abs_diff=value, compared=["logits"], transform_class="permutation", classes={})
        assert not report.ok
    assert VerifyReport(max_abs_diff=0.0, compared=[], transform_class="permutation", classes={}).ok


def test_compare_keeps_nan() -> None:
    from hf_rebasin.alignment.verify import compare
    from hf_rebasin.symmetry.adapters import get_adapter

    spec = get_adapter("gpt2")
    before = {"logits": torch.zeros(2, 3)}
    after = {"logits": torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]])}
    assert math.isnan(compare(spec, None, None, before, after))  # type: ignore[arg-type]  # no space is mapped


def test_a_preservation_gap_above_tolerance_is_exit_1_and_writes_nothing(tmp_path: Path, monkeypatch: Any) -> None:
    """Whatever let it through, a gap of 3.8e-2 (tied A, untied B before it was refused) or NaN is
    never reported as a result."""
    from hf_rebasin.run import stages

    for gap in (3.8e-2, math.nan):
        monkeypatch.setattr(stages, "function_gap", lambda *args, _gap=gap: (_gap, 1.0))
        ws = Workspace(tmp_path / str(gap))
        recipe = ws.merge_recipe(strategy="weight-matching")
        case = Case("gap", "weights", lambda ws: [], 1)
        result = run_case(case, ws, [str(recipe)])
        assert result.code == 1, result.stderr
        assert "function not preserved" in result.err
        assert not (ws.root / "out").exists()
