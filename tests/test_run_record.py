"""rebasin.json as a typed record (hf_rebasin.record): the keys of the contract, per job, a round
trip through JSON, old and partial records read back, and the card the same from either form."""

from __future__ import annotations

import json

from hf_rebasin.card import render_card
from hf_rebasin.record import CacheStats, DatasetEntry, DtypeEntry, Findings, ModelEntry, RunRecord

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
