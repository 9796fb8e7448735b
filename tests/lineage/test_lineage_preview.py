"""The lineage verdict a merge's or a transport's dry run prints (`lineage.preview`), and when it
prints the command instead."""

from __future__ import annotations

from pathlib import Path

import yaml
from test_lineage import _fine_tuned, _transformed

import tiny
from helpers import flat, run_main
from hf_rebasin.recipe import load_recipe
from hf_rebasin.run import build_plan
from hf_rebasin.run import lineage_preview as preview


def _folders(saved_model) -> dict[str, Path]:
    """A, its fine-tune (same basis), a moved copy of that fine-tune (kin in another basis), a model
    trained apart, and that model's fine-tune."""
    a = tiny.FACTORIES["gpt2"](0).eval()
    ft, moved, other_ft = (tiny.FACTORIES["gpt2"](s) for s in (0, 0, 1))
    ft.load_state_dict(_fine_tuned(a.state_dict()))
    moved.load_state_dict(_transformed(a, _fine_tuned(a.state_dict(), seed=2), "orthogonal"))
    other_ft.load_state_dict(_fine_tuned(other_ft.state_dict()))
    return {
        "a": saved_model(a, name="a"),
        "ft": saved_model(ft, name="ft"),
        "moved": saved_model(moved, name="moved"),
        "apart": saved_model("gpt2", seed=1, name="apart"),
        "apart-ft": saved_model(other_ft, name="apart-ft"),
    }


def _dry_run(tmp_path: Path, body: dict) -> str:
    recipe = tmp_path / "recipe.yaml"
    out = tmp_path / "out"
    recipe.write_text(yaml.safe_dump({**body, "output": {"dir": str(out)}}))
    proc = run_main(str(recipe), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert not out.exists()  # a dry run writes nothing
    return flat(proc.stdout)


def test_a_merge_dry_run_says_what_each_model_is_to_the_reference_and_warns_a_plain_average(saved_model, tmp_path):
    m = _folders(saved_model)
    models = [str(m[k]) for k in ("a", "ft", "moved", "apart")]
    printed = _dry_run(tmp_path, {"job": "merge", "models": models, "strategy": "vanilla"})
    assert "A (reference) vs B: same basis" in printed and "a plain average is right" in printed
    assert "A (reference) vs C: related up to symmetry" in printed
    assert "kin in another basis, and vanilla aligns nothing" in printed
    assert "A (reference) vs D: independent" in printed and "trained apart, and vanilla aligns nothing" in printed
    aligned = _dry_run(tmp_path, {"job": "merge", "models": models[:3], "strategy": "generalized-orthogonal"})
    assert "the recipe's generalized-orthogonal aligns them first, as it should" in aligned
    assert "warning" not in aligned


def test_a_transport_dry_run_checks_the_fine_tune_descends_from_its_base(saved_model, tmp_path):
    m = _folders(saved_model)
    body = {"job": "transport", "base": str(m["a"]), "target": str(m["moved"]), "strategy": "generalized-orthogonal"}
    body |= {"calibrate": False}
    good = _dry_run(tmp_path, {**body, "finetuned": str(m["ft"])})
    assert "base A vs fine-tune A + τ: same basis" in good and "task vector τ = fine-tune − base is sound" in good
    assert "target B (reference) vs base A: related up to symmetry" in good and "warning" not in good
    wrong = _dry_run(tmp_path, {**body, "finetuned": str(m["apart-ft"])})
    assert "base A vs fine-tune A + τ: independent" in wrong
    assert "warning: the fine-tune does not descend from `base`" in wrong


def test_models_not_on_disk_or_too_large_are_not_compared(saved_model, tmp_path, monkeypatch):
    m = _folders(saved_model)
    recipe = tmp_path / "recipe.yaml"
    merge = {"job": "merge", "strategy": "vanilla", "output": {"dir": "o"}}
    recipe.write_text(yaml.safe_dump({**merge, "models": [str(m["a"]), str(m["ft"])]}))
    monkeypatch.setattr(preview, "PREVIEW_PARAMS", 1_000)
    (line,) = preview.preview_lines(build_plan(load_recipe(recipe)))
    assert "not compared in a dry run" in line and "more than the dry run compares" in line
    assert f"`hf-rebasin lineage {m['a']} {m['ft']}`" in line
    monkeypatch.setenv("HF_REBASIN_CACHE", str(tmp_path / "empty-cache"))
    recipe.write_text(yaml.safe_dump({**merge, "models": ["zoo:gpt2-seed0", str(m["ft"])]}))
    (line,) = preview.preview_lines(build_plan(load_recipe(recipe)))
    assert "zoo:gpt2-seed0) is not on disk yet (trained on first use)" in line
    lineage = tmp_path / "lineage.yaml"
    lineage.write_text(
        yaml.safe_dump({"job": "lineage", "models": [str(m["a"]), str(m["ft"])], "output": {"dir": "o"}})
    )
    assert preview.preview_lines(build_plan(load_recipe(lineage))) == []
