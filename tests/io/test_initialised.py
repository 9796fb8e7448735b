"""Checkpoints whose files lack tensors that transformers initialises on load (a pooler, a task
head), with stock ``from_pretrained`` as the oracle: what it loads, we load; a missing tensor of the
body, which it would fill with random values, is refused with that reason. A merge takes such a
tensor from the model that has it and leaves out one that no model has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tiny
from helpers import flat, run_main
from hf_rebasin.core.errors import CheckpointError
from hf_rebasin.io.models import load_model
from hf_rebasin.symmetry.adapters import get_adapter
from lm_folders import write_recipe

POOLER = {"pooler.dense.weight", "pooler.dense.bias"}


def _drop(folder: Path, names: set[str]) -> None:
    """``folder``'s weights rewritten without ``names`` (as a tool that saved it without them would)."""
    path = folder / "model.safetensors"
    kept = {k: v for k, v in load_file(str(path)).items() if k not in names}
    save_file(kept, str(path), metadata={"format": "pt"})


def _stored(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _saved(model: torch.nn.Module, folder: Path, drop: set[str] = frozenset()) -> Path:
    model.save_pretrained(str(folder))
    if drop:
        _drop(folder, set(drop))
    return folder


def _stock_missing(cls: type, folder: Path) -> set[str]:
    _, info = cls.from_pretrained(str(folder), output_loading_info=True)
    return set(info["missing_keys"])


def test_a_bert_saved_without_its_pooler_loads_as_transformers_loads_it(tmp_path: Path) -> None:
    folder = _saved(tiny.bert_base(0), tmp_path / "m", POOLER)
    assert _stock_missing(T.BertModel, folder) == POOLER  # the oracle: transformers loads it
    loaded = load_model(folder)
    assert loaded.initialised == dict.fromkeys(sorted(POOLER), "a pooler")
    proc = run_main("verify", str(folder))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "a pooler: pooler.dense.bias, pooler.dense.weight" in flat(proc.stdout)


def test_a_classifier_over_a_bare_models_weights_loads_with_its_head_initialised(tmp_path: Path) -> None:
    folder = _saved(tiny.bert_base(0), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["BertForSequenceClassification"]
    (folder / "config.json").write_text(json.dumps(config))
    assert _stock_missing(T.BertForSequenceClassification, folder) == {"classifier.weight", "classifier.bias"}
    loaded = load_model(folder)
    assert set(loaded.initialised) == {"classifier.weight", "classifier.bias"}
    assert loaded.initialised["classifier.weight"] == "the BertForSequenceClassification task head"


def test_a_missing_body_tensor_is_refused_though_transformers_would_load_it(tmp_path: Path) -> None:
    name = "encoder.layer.0.attention.self.query.weight"
    folder = _saved(tiny.bert_base(0), tmp_path / "m", {name})
    assert name in _stock_missing(T.BertModel, folder)  # transformers loads it, random
    with pytest.raises(CheckpointError, match="initialise it at random") as e:
        load_model(folder)
    assert name in str(e.value)


def _permuted_twin(model: torch.nn.Module, folder: Path) -> Path:
    """``model`` under a random permutation of its heads, units and stream: the same function."""
    spec = get_adapter(model.config.model_type)
    sd = model.state_dict()
    graph = spec.graph(model.config, sd.keys())
    twin = type(model)(model.config)
    twin.load_state_dict(graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(3))))
    twin.save_pretrained(str(folder))
    return folder


def _merge(tmp_path: Path, a: Path, b: Path, job: str = "merge") -> Path:
    body = {"job": job, "models": [str(a), str(b)], "strategy": {"name": "weight-matching"}, "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp_path / "out"


def test_a_merge_takes_the_pooler_from_the_model_that_has_it(tmp_path: Path) -> None:
    """A lacks its pooler, B is A permuted with one: aligned B is A, so the merged body is A's, and
    its pooler is B's (its input carried into A's basis): the merged model computes A's hidden states
    and B's pooled output, run with the stock class. The record says what A's files lacked."""
    model = tiny.bert_base(0)
    b = _permuted_twin(model, tmp_path / "b")
    a = _saved(model, tmp_path / "a", POOLER)
    out = _merge(tmp_path, a, b)
    merged, twin = T.BertModel.from_pretrained(str(out)).eval(), T.BertModel.from_pretrained(str(b)).eval()
    ids = torch.randint(0, tiny.V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want_hidden, want_pooled = merged(ids), model.eval()(ids).last_hidden_state, twin(ids).pooler_output
    assert (got.last_hidden_state - want_hidden).abs().max() < 1e-4
    assert (got.pooler_output - want_pooled).abs().max() < 1e-4
    assert got.pooler_output.abs().max() > 1e-2  # a real pooler, not the zeros a lacking model holds
    record = json.loads((out / "rebasin.json").read_text())
    assert any("pooler.dense.weight" in n and "initialises at random" in n for n in record["notes"])
    assert record["models"][0]["initialised_tensors"] == dict.fromkeys(sorted(POOLER), "a pooler")
    assert "initialised_tensors" not in record["models"][1]


def test_a_tensor_no_model_has_is_left_out_of_the_output(tmp_path: Path) -> None:
    a = _saved(tiny.bert_base(0), tmp_path / "a", POOLER)
    b = _saved(tiny.bert_base(1), tmp_path / "b", POOLER)
    out = _merge(tmp_path, a, b)
    assert not POOLER & _stored(out)
    assert _stock_missing(T.BertModel, out) == POOLER  # loading initialises it again, as for the inputs


@pytest.mark.parametrize("how", ["recipe", "command"])
def test_an_aligned_model_is_written_without_what_its_files_lacked(tmp_path: Path, how: str) -> None:
    a = _saved(tiny.bert_base(0), tmp_path / "a")
    b = _saved(tiny.bert_base(1), tmp_path / "b", POOLER)
    if how == "recipe":
        out = _merge(tmp_path, a, b, job="align")
    else:
        out = tmp_path / "out"
        proc = run_main("align", str(a), str(b), "--output", str(out))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert POOLER <= _stored(folders[0]) and not POOLER & _stored(folders[1])
    assert _stock_missing(T.BertModel, folders[1]) == POOLER


def _transport(tmp_path: Path, base: Path, tuned: Path, target: Path) -> Path:
    body = {"job": "transport", "base": str(base), "finetuned": str(tuned), "target": str(target)}
    body |= {"strategy": "weight-matching", "calibrate": False, "alpha": 1.0, "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp_path / "out"


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return T.BertForSequenceClassification.from_pretrained(str(folder)).eval()(ids).logits


CLS_POOLER = {f"bert.{n}" for n in POOLER}


def test_a_target_without_its_pooler_takes_the_moved_bases(tmp_path: Path) -> None:
    """B is A permuted, saved without its pooler: B + π(fine-tune − A) is the fine-tune in B's basis
    only if B's missing pooler starts from A's, moved; then it computes the fine-tune's logits."""
    model = tiny.bert_cls(0)
    base = _saved(model, tmp_path / "base")
    tuned = _saved(tiny.drifted(tiny.bert_cls(0), 5, 0.3), tmp_path / "tuned")
    target = _permuted_twin(model, tmp_path / "target")
    _drop(target, CLS_POOLER)
    out = _transport(tmp_path, base, tuned, target)
    ids = torch.randint(0, tiny.V, (2, 9), generator=torch.Generator().manual_seed(0))
    assert (_logits(out, ids) - _logits(tuned, ids)).abs().max() < 1e-4
    assert (_logits(tuned, ids) - _logits(base, ids)).abs().max() > 1e-2  # the fine-tune moved something


def test_a_fine_tune_without_its_pooler_moves_nothing_there(tmp_path: Path) -> None:
    model = tiny.bert_cls(0)
    base = _saved(model, tmp_path / "base")
    tuned = _saved(tiny.drifted(tiny.bert_cls(0), 5, 0.3), tmp_path / "tuned", CLS_POOLER)
    target = _saved(tiny.bert_cls(1), tmp_path / "target")
    out = _transport(tmp_path, base, tuned, target)
    written, stored = load_file(str(out / "model.safetensors")), load_file(str(target / "model.safetensors"))
    for name in CLS_POOLER:
        assert torch.equal(written[name], stored[name])  # B's own: a random tensor moves no task vector


def test_lineage_compares_what_both_have(tmp_path: Path) -> None:
    """A model and its copy saved without the pooler are one model: no space in the evidence is the
    pooler (all zeros on one side: nothing to compare), and no alignment is needed."""
    model = tiny.bert_base(0)
    a, b = _saved(model, tmp_path / "a"), _saved(model, tmp_path / "b", POOLER)
    proc = run_main("lineage", str(a), str(b), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pair = json.loads(proc.stdout)["pairs"][0]
    assert "pooler" not in {s["space"] for s in pair["spaces"]}
    assert pair["next_step"].startswith("no alignment needed"), pair["next_step"]
    assert "pooler.dense.weight" in flat(proc.stderr)  # the note: what MODEL 2's files lack


def test_job_lineage_takes_such_a_model(tmp_path: Path) -> None:
    a = _saved(tiny.bert_base(0), tmp_path / "a")
    b = _saved(tiny.bert_base(1), tmp_path / "b", POOLER)
    proc = run_main(
        str(write_recipe(tmp_path, {"job": "lineage", "models": [str(a), str(b)], "output": {"dir": "out"}}))
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "out" / "lineage.json").read_text())
    assert "pooler" not in {s["space"] for s in record["pairs"][0]["spaces"]}


def test_classifiers_of_other_label_counts_are_refused_for_the_true_reason(tmp_path: Path) -> None:
    """Each loads with the stock class; what differs is the task, and the message says so and how to
    work on the bodies."""
    a = _saved(tiny.bert_cls(0), tmp_path / "a")
    config = tiny.bert_cls(0).config
    config.num_labels = 2
    b = _saved(T.BertForSequenceClassification(config), tmp_path / "b")
    assert not _stock_missing(T.BertForSequenceClassification, b)
    body = {
        "job": "merge",
        "models": [str(a), str(b)],
        "strategy": {"name": "weight-matching"},
        "output": {"dir": "out"},
    }
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = flat(proc.stderr)
    assert "task heads differ" in text and "3 labels" in text and "architectures: [BertModel]" in text
    assert not (tmp_path / "out").exists()


def test_a_language_models_missing_head_is_refused(tmp_path: Path) -> None:
    """An untied LM head is what a language model computes its logits with: transformers would load it
    random and warn; that is a broken checkpoint, not a fresh task head."""
    folder = _saved(tiny.gpt2_untied(0), tmp_path / "m", {"lm_head.weight"})
    assert "lm_head.weight" in _stock_missing(T.GPT2LMHeadModel, folder)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*initialise it at random"):
        load_model(folder)


@pytest.mark.parametrize("case", ["vit-base", "albert-base", "mpnet-base", "roberta-mc", "deberta-v2-cls"])
def test_every_family_saved_without_its_pooler_loads_as_transformers_loads_it(tmp_path: Path, case: str) -> None:
    model = tiny.FACTORIES[case](0)
    pooler = {n for n in model.state_dict() if "pooler" in n.split(".")}
    folder = _saved(model, tmp_path / "m", pooler)
    assert _stock_missing(type(model), folder) == pooler  # the oracle
    assert set(load_model(folder).initialised) == pooler
    proc = run_main("verify", str(folder))
    assert proc.returncode == 0, proc.stdout + proc.stderr
