"""Model card: golden cards for a merge and a barrier job, Hub metadata parsed back, edge cases.

The golden files are ``tests/golden/card_*.md``. After an intended change to the card, rewrite
them with ``UPDATE_GOLDEN=1 python -m pytest tests/run/test_card.py`` and review the diff.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import ModelCard

from hf_rebasin.run.card import render_card

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
LOCAL = "/data/runs/gpt2-seed1"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

MERGE_RECIPE = f"""\
job: merge
models:
  - {{model: org/gpt2-seed0, revision: v1.0}}
  - {LOCAL}
strategy: {{name: weight-matching, iterations: 5}}
data: {{dataset: org/wikitext-mini, split: train, column: text}}
merge: {{weight: 0.5}}
evaluate:
  task: causal-lm
  data: {{dataset: text, data_files: test.txt}}
  points: 5
  compare: [vanilla]
output: {{dir: out/gpt2-merge, push_to_hub: {{repo: user/gpt2-merge, private: true}}}}
"""

BARRIER_RECIPE = """\
job: barrier
models: [./bert-a, ./bert-b]
strategy: head-perm
evaluate: {task: masked-lm, data: {dataset: text, data_files: wiki.txt}, points: 3}
output: {dir: out/bert-barrier}
"""


def _curve(losses: list[float]) -> dict[str, Any]:
    lambdas = [i / (len(losses) - 1) for i in range(len(losses))]
    return {"lambdas": lambdas, "loss": losses, "metric": {"perplexity": [round(2.718281828**v, 6) for v in losses]}}


def merge_record() -> dict[str, Any]:
    """A merge of a Hub model (revision + commit) and a local folder, with a vanilla comparison."""
    return {
        "recipe": {
            "job": "merge",
            "models": [{"model": "org/gpt2-seed0", "revision": "v1.0"}, {"model": LOCAL, "revision": None}],
            "strategy": {"name": "weight-matching", "iterations": 5},
            "data": {"dataset": "org/wikitext-mini", "split": "train", "column": "text"},
            "merge": {"weight": 0.5},
            "evaluate": {"task": "causal-lm", "data": {"dataset": "text", "split": "train"}, "points": 5},
            "output": {"dir": "out/gpt2-merge", "push_to_hub": {"repo": "user/gpt2-merge", "private": True}},
        },
        "models": [
            {"model": "org/gpt2-seed0", "revision": "v1.0", "commit": COMMIT, "source": "hub"},
            {"model": LOCAL, "revision": None, "commit": None, "source": "local"},
        ],
        "strategy": "weight-matching",
        "strategy_options": {"iterations": 5, "seed": 0},
        "merge_weights": [0.5, 0.5],
        "task": "causal-lm",
        "canonical": False,
        "untied": [],
        "datasets": [
            {"role": "alignment", "dataset": "org/wikitext-mini", "split": "train", "source": "hub"},
            {"role": "evaluation", "dataset": "text", "split": "train", "source": "local"},
            {"role": "evaluation", "dataset": "org/wikitext-mini", "split": "test", "source": "hub"},
        ],
        "merged": {
            "weight-matching": {"loss": 1.25, "metric": {"perplexity": 3.49}, "count": 4096},
            "vanilla": {"loss": 2.5, "metric": {"perplexity": 12.18}, "count": 4096},
        },
        "barrier": {
            "vanilla": {"midpoint": 1.5, "linear": 1.5},
            "weight-matching": {"midpoint": 0.25, "linear": 0.25},
        },
        "curves": {
            "vanilla": _curve([2.0, 3.0, 3.5, 3.0, 2.0]),
            "weight-matching": _curve([2.0, 2.2, 2.25, 2.2, 2.0]),
        },
        "function_preserved": {"max_abs_diff": 2.9802322387695312e-05, "inputs": "evaluation data"},
        "notes": ["B's attention heads were matched by weight, not by activations"],
        "dtype": {
            "inputs": {"A": "bfloat16", "B": "bfloat16"},
            "output": "bfloat16",
            "from": "A",
            "compute": "float32",
        },
        "timings": {"load": 1.0, "align": 2.0, "evaluate": 3.0, "save": 0.5},
        "hf_rebasin_version": "0.1.0",
    }


def barrier_record() -> dict[str, Any]:
    """A barrier report between two local folders (no ``source``: older records mean local)."""
    return {
        "recipe": {"job": "barrier", "models": [{"model": "./bert-a"}, {"model": "./bert-b"}], "output": {}},
        "models": [
            {"model": "./bert-a", "revision": None, "commit": None},
            {"model": "./bert-b", "revision": None, "commit": None, "source": "local"},
        ],
        "strategy": "head-perm",
        "strategy_options": {"residual": "identity", "heads": "head-perm"},
        "merge_weights": None,
        "task": "masked-lm",
        "canonical": False,
        "untied": [],
        "datasets": [{"role": "evaluation", "dataset": "shakespeare", "split": "test", "source": "builtin"}],
        "barrier": {"head-perm": {"midpoint": 0.5, "linear": 0.5}},
        "curves": {"head-perm": _curve([1.0, 1.6, 1.2])},
        "function_preserved": {"max_abs_diff": 1.1920928955078125e-06, "inputs": "evaluation data"},
        "notes": [],
        "timings": {"load": 1.0, "align": 2.0, "evaluate": 3.0},
        "hf_rebasin_version": "0.1.0",
    }


def transport_record() -> dict[str, Any]:
    """A transport of a Hub fine-tune onto a new Hub release, with support data."""
    scores = {
        "loss": {"target": 3.1, "finetuned": 1.9, "naive": [2.8, 2.9], "transported": [2.0, 2.4]},
        "metric": {
            "target": {"perplexity": 22.2},
            "finetuned": {"perplexity": 6.7},
            "naive": [{"perplexity": 16.4}, {"perplexity": 18.2}],
            "transported": [{"perplexity": 7.4}, {"perplexity": 11.0}],
        },
    }
    return {
        "recipe": {"job": "transport", "calibrate": False, "output": {"dir": "out/moved"}},
        "models": [
            {"model": "org/base-v2", "revision": None, "commit": COMMIT, "source": "hub", "role": "target"},
            {"model": "org/base-v1", "revision": "v1", "commit": COMMIT, "source": "hub", "role": "base"},
            {"model": "org/base-v1-poetry", "revision": None, "commit": COMMIT, "source": "hub", "role": "finetuned"},
        ],
        "strategy": "transfusion",
        "strategy_options": {"max_iter": 100, "seed": 0},
        "task": "causal-lm",
        "canonical": False,
        "untied": [],
        "datasets": [
            {"role": "evaluation", "dataset": "shakespeare", "split": "test", "source": "builtin"},
        ],
        "transport": {"alphas": [1.0, 0.5], **scores, "support": scores},
        "barrier": {},
        "curves": {},
        "function_preserved": {"max_abs_diff": 2.5e-06, "inputs": "evaluation data"},
        "notes": [],
        "dtype": {
            "inputs": {"target": "float32", "base": "float32", "finetuned": "float32"},
            "output": "float32",
            "from": "target",
            "compute": "float32",
        },
        "timings": {"load": 1.0, "align": 2.0, "evaluate": 3.0, "save": 0.5},
        "hf_rebasin_version": "0.1.0",
    }


def test_transport_card_matches_golden() -> None:
    text = render_card(
        transport_record(), recipe_text="job: transport\ncalibrate: false\n", command="hf-rebasin moved.yaml"
    )
    _check_golden("card_transport.md", text)
    card = ModelCard(text)
    assert card.data.base_model == ["org/base-v2", "org/base-v1", "org/base-v1-poetry"]
    assert "| this model: B + 1·π(τ) | 2.0000 |" in text and "| naive B + 0.5·τ (no alignment) | 2.9000 |" in text
    assert "# Transported: org/base-v1-poetry moved onto org/base-v2" in text


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.is_file(), f"{path} is missing; create it with UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), (
        f"card differs from {path}; if intended, rerun with UPDATE_GOLDEN=1"
    )


def test_merge_card_matches_golden() -> None:
    text = render_card(merge_record(), recipe_text=MERGE_RECIPE, command="hf-rebasin gpt2-merge.yaml")
    _check_golden("card_merge.md", text)
    assert text == render_card(merge_record(), recipe_text=MERGE_RECIPE, command="hf-rebasin gpt2-merge.yaml")


def test_barrier_card_matches_golden() -> None:
    text = render_card(barrier_record(), recipe_text=BARRIER_RECIPE, command="hf-rebasin bert-barrier.yaml")
    _check_golden("card_barrier.md", text)


def test_merge_metadata_parses_back() -> None:
    text = render_card(merge_record(), recipe_text=MERGE_RECIPE, command="hf-rebasin gpt2-merge.yaml")
    card = ModelCard(text)
    assert card.data.base_model == ["org/gpt2-seed0"]
    assert card.data.base_model_relation == "merge"
    assert card.data.tags == ["merge", "hf-rebasin", "re-basin", "weight-matching"]
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.datasets == ["org/wikitext-mini"]  # deduplicated; the builtin `text` is no Hub id
    metadata = text.split("\n---\n", 1)[0]
    assert LOCAL not in metadata and "seed1" not in metadata
    assert LOCAL in card.text  # the body still names every input


def test_barrier_metadata_has_no_model_fields() -> None:
    card = ModelCard(render_card(barrier_record(), recipe_text=BARRIER_RECIPE, command="hf-rebasin b.yaml"))
    assert card.data.base_model is None and card.data.library_name is None and card.data.pipeline_tag is None
    assert card.data.datasets is None
    assert card.data.tags == ["merge", "hf-rebasin", "re-basin", "head-perm"]
    assert "from_pretrained" not in card.text and "./bert-a" in card.text


@pytest.mark.parametrize(
    ("task", "pipeline", "auto"),
    [
        ("masked-lm", "fill-mask", "AutoModelForMaskedLM"),
        ("sequence-classification", "text-classification", "AutoModelForSequenceClassification"),
        ("image-classification", "image-classification", "AutoModelForImageClassification"),
    ],
)
def test_task_sets_pipeline_tag_and_loader(task: str, pipeline: str, auto: str) -> None:
    record = merge_record()
    record["task"] = task
    card = ModelCard(render_card(record, recipe_text=MERGE_RECIPE, command="x"))
    assert card.data.pipeline_tag == pipeline
    assert f'{auto}.from_pretrained("user/gpt2-merge")' in card.text


def test_unmeasured_function_notes_and_escaping() -> None:
    record = merge_record()
    record["function_preserved"] = {"max_abs_diff": None, "reason": "the transfusion options change B's function"}
    record["models"][1]["model"] = "runs/a|b"
    record["strategy_options"] = {"mode": "x|y"}
    record["notes"] = ["first note", "second note"]
    record["canonical"] = True
    record["untied"] = ["lm_head.weight"]
    record["curves"] = {}
    record["barrier"] = {}
    text = render_card(record, recipe_text=MERGE_RECIPE, command="hf-rebasin m.yaml")
    assert "not measured: the transfusion options change B's function." in text
    assert "- first note\n- second note\n" in text
    assert "canonical form" in text and "`lm_head.weight`" in text
    assert "| B | `runs/a\\|b` |" in text and "`x\\|y`" in text
    assert "## Loss barrier" not in text and "barrier.png" not in text


def test_reading_without_vanilla_and_fences() -> None:
    record = merge_record()
    del record["curves"]["vanilla"]
    del record["barrier"]["vanilla"]
    recipe = "job: merge  # a ``` inside a comment\n"
    text = render_card(record, recipe_text=recipe, command="hf-rebasin m.yaml")
    assert "`weight-matching` leaves a linear barrier of 0.250 nats" in text
    assert "````yaml\n" + recipe + "````\n" in text


def test_reading_with_vanilla_and_no_secrets() -> None:
    record = copy.deepcopy(merge_record())
    token = "hf_" + "a" * 34
    text = render_card(record, recipe_text=MERGE_RECIPE + f"# token: {token}\n", command="hf-rebasin m.yaml")
    assert "`weight-matching` lowers the linear barrier from 1.500 to 0.250 nats (−83 %)." in text
    assert token not in text


def test_universe_merge_card_shows_the_merge_it_started_from() -> None:
    record = merge_record()
    record["strategy"] = "generalized-orthogonal"
    record["merged"] = {
        "generalized-orthogonal": {"loss": 2.3394, "metric": {"perplexity": 10.37}},
        "vanilla": {"loss": 4.3768, "metric": {"perplexity": 79.58}},
    }
    record["universe"] = {
        "rounds": 5,
        "converged": True,
        "reference": {"loss": 2.4522, "metric": {"perplexity": 11.61}},
    }
    text = render_card(record, recipe_text=MERGE_RECIPE, command="hf-rebasin universe.yaml")
    rows = [line for line in text.splitlines() if line.startswith("| this model") or line.startswith("| every model")]
    assert rows == [
        "| this model (`generalized-orthogonal`) | 2.3394 | perplexity 10.3700 |",
        "| every model aligned to A only (before the 5 universe rounds) | 2.4522 | perplexity 11.6100 |",
    ]
    assert text.index("| every model aligned") < text.index("| the same weights without alignment (`vanilla`)")
