"""rebasin.json as a typed record (hf_rebasin.evaluation.record): the keys of the contract, per job, a round
trip through JSON, old and partial records read back, and the card the same from either form."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from hf_rebasin.evaluation.record import CacheStats, DatasetEntry, DtypeEntry, Findings, ModelEntry, RunRecord
from hf_rebasin.evaluation.scores import Universe
from hf_rebasin.run.card import render_card

CONTRACT = {"recipe", "models", "strategy", "barrier", "curves", "function_preserved", "timings"}


def _record(findings: Findings) -> RunRecord:
    return RunRecord(
        recipe={"job": "merge", "output": {"dir": "out"}},
        models=[
            ModelEntry("gpt2", "main", "0" * 40, "hub", None, license="mit"),
            ModelEntry("models/b", None, None, "local", "models/b"),
        ],
        datasets=[DatasetEntry("evaluation", "shakespeare", "hamlet", "test", "builtin")],
        findings=findings,
        notes=["a note"],
        timings={"load": 1.0, "align": 2.0, "evaluate": 3.0, "save": 0.5},
        cache=CacheStats(enabled=True, hits=1, misses=0),
        dtype=DtypeEntry({"A": "float32", "B": "bfloat16"}, "float32", "A"),
        hf_rebasin_version="0.0.0",
    )


def _merge_findings(**more: object) -> Findings:
    return Findings(
        strategy="weight-matching",
        strategy_options={"seed": 0},
        task="causal-lm",
        canonical=False,
        untied=[],
        function_preserved={"max_abs_diff": 1e-6, "tolerance": 1e-4, "inputs": "random example inputs"},
        barrier={"weight-matching": {"midpoint": 0.1, "linear": 0.2}},
        curves={"weight-matching": {"lambdas": [0.0, 1.0], "loss": [1.0, 1.0], "metric": {}}},
        merged={"weight-matching": {"loss": 1.5, "metric": {}, "count": 10}},
        merge_weights=[0.5, 0.5],
        **more,  # type: ignore[arg-type]
    )


def test_a_merge_record_round_trips_through_json() -> None:
    record = _record(_merge_findings(universe={"rounds": 2}))
    data = json.loads(json.dumps(record.to_json()))
    assert CONTRACT <= set(data)
    assert data["dtype"] == {
        "inputs": {"A": "float32", "B": "bfloat16"},
        "output": "float32",
        "from": "A",
        "compute": "float32",
        "kept": {},
    }
    assert data["models"][0]["license"] == "mit" and "license" not in data["models"][1]
    assert data["models"][0]["ignored_tensors"] == {}
    assert "role" not in data["models"][0] and "transport" not in data
    assert RunRecord.from_json(data) == record


def test_a_transport_record_has_no_merge_keys_and_a_barrier_has_null_weights() -> None:
    moved = Findings("vanilla", {}, "causal-lm", False, [], {"max_abs_diff": 0.0}, transport={"alphas": [1.0]})
    data = _record(moved).to_json()
    assert data["transport"] == {"alphas": [1.0]}
    assert not {"merged", "merge_weights", "universe"} & set(data)
    assert RunRecord.from_json(json.loads(json.dumps(data))).findings == moved

    barrier = _record(Findings("vanilla", {}, "causal-lm", False, [], {"max_abs_diff": 0.0})).to_json()
    assert barrier["merge_weights"] is None and barrier["merged"] == {}


def test_the_runner_exports_the_same_record() -> None:
    from hf_rebasin import run
    from hf_rebasin.run import record

    assert run.RunRecord is RunRecord and record.Findings is Findings


def test_an_old_partial_record_reads_back_with_defaults() -> None:
    old = RunRecord.from_json({"recipe": {"job": "barrier"}, "models": [{"model": "./a"}], "strategy": "vanilla"})
    assert old.job == "barrier" and old.models[0] == ModelEntry("./a", None, None, "local", None)
    assert old.findings == Findings("vanilla", {}, "", False, [], {})
    assert old.dtype == DtypeEntry({}) and old.cache == CacheStats(enabled=False)
    assert old.datasets == [] and old.notes == [] and old.hf_rebasin_version == "unknown"
    assert RunRecord.from_json({}).job == "merge"  # records from before jobs existed were merges
    newer = RunRecord.from_json({"models": [{"model": "m", "source": "hub", "added_later": 1}], "added": {}})
    assert newer.models == [ModelEntry("m", None, None, "hub", None)]  # unknown keys are ignored


def test_the_card_is_the_same_from_the_record_and_from_its_json() -> None:
    for findings in (
        _merge_findings(),
        Findings("vanilla", {}, "causal-lm", False, [], {"max_abs_diff": 0.0}, transport={"alphas": [1.0]}),
    ):
        record = _record(findings)
        data = json.loads(json.dumps(record.to_json()))
        card = render_card(record, recipe_text="job: merge", command="hf-rebasin r.yaml")
        assert card == render_card(data, recipe_text="job: merge", command="hf-rebasin r.yaml")


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"models": [{}]},
        {"recipe": {"job": "transport"}, "models": [{"model": 5, "source": None}], "transport": {"alphas": [1]}},
        {  # damaged: blocks of the wrong shape, a transport's scores without the transported ones
            "recipe": {"job": "transport"},
            "function_preserved": [1],
            "universe": "3 rounds",
            "merged": {"x": {"loss": "low"}},
            "transport": {"alphas": "1", "loss": {"target": 1.0}, "chosen": {"rule": "ratio"}, "adapter": 7},
            "dtype": {"from": 3, "kept": None},
        },
    ],
)
def test_old_partial_and_damaged_records_still_render_a_card(data: dict[str, Any]) -> None:
    record = RunRecord.from_json(data)
    card = render_card(data, recipe_text="job: merge", command="hf-rebasin r.yaml")
    assert card.startswith("---\n") and card == render_card(
        record, recipe_text="job: merge", command="hf-rebasin r.yaml"
    )
    assert "Function preservation was not recorded for this run." in card
    if data.get("models") == [{}]:
        assert record.models == [ModelEntry("?", None, None, "local", None)] and "`?`" in card
    transport = record.findings.transport
    if transport is not None:  # what could not be read is none: no chosen α, no adapter, no score rows
        assert transport.chosen is None and transport.adapter is None and transport.loss is None
        assert "chosen automatically" not in card and "LoRA" not in card


def test_a_damaged_model_entry_reads_as_model_question_mark() -> None:
    old = RunRecord.from_json({"models": [{"model": ["a", "b"], "revision": 3, "ignored_tensors": "x"}, "junk"]})
    assert old.models == [ModelEntry("?", "3", None, "local", None), ModelEntry()]  # "junk": an entry of defaults
    assert "| B | `?` |" in render_card(old, recipe_text="job: merge", command="hf-rebasin r.yaml")
    assert RunRecord.from_json({"models": "junk", "notes": None, "timings": {"load": "slow"}}).notes == []


def test_a_score_block_keeps_keys_this_version_does_not_know() -> None:
    moved = Findings("vanilla", {}, "causal-lm", False, [], {"max_abs_diff": 0.0}, transport={"alphas": [1.0]})
    data = json.loads(json.dumps(_record(moved).to_json()))
    data["transport"]["added_later"] = {"per_layer": [0.5]}
    data["transport"]["loss"] = {"target": 2.0, "finetuned": 1.0, "transported": [1.5], "forgotten": 0.1}
    data["function_preserved"]["per_model"] = {"B": 0.0}
    read = RunRecord.from_json(data)
    transport = read.findings.transport
    assert transport is not None and transport.model_extra == {"added_later": {"per_layer": [0.5]}}
    assert transport.loss is not None and transport.loss.model_extra == {"forgotten": 0.1}
    assert read.to_json() == data  # written again as read
    assert "added" not in RunRecord.from_json({**data, "added": 1}).to_json()  # top-level keys are the contract


def test_findings_are_complete_when_built() -> None:
    found = _merge_findings()
    with pytest.raises(ValidationError):
        found.universe = Universe(rounds=1)  # type: ignore[misc]
    assert found.function_preserved is not None
    with pytest.raises(ValidationError):
        found.function_preserved.max_abs_diff = 1.0  # type: ignore[misc]
