"""What a published output folder says about the machine it was made on: nothing.

A card and ``rebasin.json`` are pushed to the Hub with the model. Local folders outside the
recipe's folder appear by their own name (or the recipe's ``label``), never as a path of the
user's machine; names from folders are shown as text, so a folder named like an HTML tag stays
text on the page. The card is rendered with a Markdown renderer (markdown-it, CommonMark) to
check what a reader would see, not only the Markdown we wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from markdown_it import MarkdownIt

import tiny
from hf_rebasin.recipe import load_recipe
from hf_rebasin.run import run_recipe

EVIL = "<img src=x onerror=alert(1)>"


def _save(folder: Path, seed: int) -> Path:
    tiny.FACTORIES["gpt2"](seed).save_pretrained(str(folder))
    return folder


def _run(tmp_path: Path, body: dict[str, Any], text: str | None = None) -> tuple[str, dict[str, Any], Path]:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    recipe = project / "recipe.yaml"
    recipe.write_text(text if text is not None else yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    result = run_recipe(load_recipe(recipe), check_memory=False)
    card = (result.output / "README.md").read_text(encoding="utf-8")
    record = json.loads((result.output / "rebasin.json").read_text(encoding="utf-8"))
    return card, record, result.output


def test_folders_outside_the_recipe_are_shown_by_name_and_as_text(tmp_path: Path) -> None:
    elsewhere = tmp_path / "home" / "alice" / "secret-project"
    a = _save(elsewhere / EVIL, 0)
    _save(elsewhere / "model-b", 1)
    out = tmp_path / "somewhere" / "else" / "out"
    text = (
        "# a recipe with paths of this machine\n"
        "job: merge\n"
        f"models:\n  - {json.dumps(str(a))}   # absolute\n  - ../home/alice/secret-project/model-b\n"
        "strategy: weight-matching\n"
        f"output:\n  dir: {json.dumps(str(out))}\n"
    )
    card, record, folder = _run(tmp_path, {}, text)
    assert folder == out
    private = str(elsewhere)
    for where, body in (("card", card), ("rebasin.json", json.dumps(record))):
        assert private not in body and "secret-project" not in body, where
        assert "/home/alice" not in body and "../" not in body and str(tmp_path) not in body, where
    assert [m["model"] for m in record["models"]] == [EVIL, "model-b"]
    assert [m["folder"] for m in record["models"]] == [EVIL, "model-b"]
    assert record["recipe"]["output"]["dir"] == "out"
    # the recipe echo keeps its comments, with the paths cut to their names
    assert "# a recipe with paths of this machine" in card and "# absolute" in card
    # a reader sees the folder's name as text: no HTML element comes out of the renderer
    html = MarkdownIt("commonmark").enable("table").render(card)
    assert "<img src=x" not in html and 'src="x"' not in html  # the card's own plot is the only image
    assert "&lt;img src=x onerror=alert(1)&gt;" in html  # the title, as text
    title = next(line for line in card.splitlines() if line.startswith("# Re-basin merge"))
    assert MarkdownIt("commonmark").renderInline(title[2:]) == (
        "Re-basin merge: &lt;img src=x onerror=alert(1)&gt; + model-b"
    )


def test_a_label_names_the_model_and_a_folder_inside_the_recipe_stays_relative(tmp_path: Path) -> None:
    project = tmp_path / "project"
    a = _save(project / "models" / "a", 0)
    b = _save(tmp_path / "private" / "b", 1)
    body = {
        "job": "merge",
        "models": [{"model": "models/a"}, {"model": str(b), "label": "B *from* [a colleague](x)"}],
        "strategy": "weight-matching",
        "output": {"dir": "out"},
    }
    card, record, _ = _run(tmp_path, body)
    assert a.is_dir()
    assert [m["model"] for m in record["models"]] == ["models/a", "b"]
    assert [m.get("label") for m in record["models"]] == [None, "B *from* [a colleague](x)"]
    assert str(tmp_path) not in card and str(tmp_path) not in json.dumps(record)
    html = MarkdownIt("commonmark").enable("table").render(card)
    assert "<em>" not in html and "<a href" not in html.split("huggingface")[0]  # shown as written
    assert "Re-basin merge: a + B *from* [a colleague](x)" in html
