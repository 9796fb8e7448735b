"""Classifiers of one family whose task heads are over other label sets (2 labels and 5, 3 and 9):
each loads with its stock class (the oracle), and lineage compares their bodies, the tensors under
``bert.``, saying it left the heads out. A merge or an alignment of the same folders is still
refused: heads over other label sets cannot be averaged nor moved onto each other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

from helpers import assert_user_error, flat, run_main
from hf_rebasin.core.lazy import dtype_of, is_lazy, shape_of
from hf_rebasin.io.bodies import bodies
from hf_rebasin.io.models import load_model
from hf_rebasin.lineage.record import LineageRecord
from lm_folders import write_recipe
from tiny import ENCODER_SIZES

NOISE = 0.05  # of each tensor's RMS: the fine-tune of the body under another head


def _classifier(cls: type[T.PreTrainedModel], labels: int, seed: int) -> T.PreTrainedModel:
    torch.manual_seed(seed)
    return cls(T.BertConfig(**ENCODER_SIZES, num_labels=labels)).eval()


def _tuned(body: T.PreTrainedModel, cls: type[T.PreTrainedModel], labels: int, seed: int) -> T.PreTrainedModel:
    """``body``'s ``bert.`` tensors, each noised, under a fresh head over ``labels`` labels."""
    out = _classifier(cls, labels, seed)
    g = torch.Generator().manual_seed(seed)
    own = out.state_dict()
    with torch.no_grad():
        for name, t in body.state_dict().items():
            if name.startswith("bert.") and t.is_floating_point():
                rms = t.pow(2).mean().sqrt()
                own[name].copy_(t + NOISE * rms * torch.randn(t.shape, generator=g))
    return out


def _saved(model: T.PreTrainedModel, folder: Path) -> Path:
    model.save_pretrained(str(folder))
    loaded = (
        T.AutoModelForTokenClassification if "Token" in type(model).__name__ else T.AutoModelForSequenceClassification
    )
    stock = loaded.from_pretrained(str(folder))  # the oracle: stock transformers loads each as it is
    assert type(stock) is type(model) and stock.config.num_labels == model.config.num_labels
    return folder


def _lineage(a: Path, b: Path) -> LineageRecord:
    proc = run_main("lineage", str(a), str(b), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return LineageRecord.model_validate_json(proc.stdout)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("labels")
    cls = T.BertForSequenceClassification
    two = _classifier(cls, 2, 0)
    return {
        "two": _saved(two, root / "two"),
        "five": _saved(_tuned(two, cls, 5, 1), root / "five"),
        "other": _saved(_classifier(cls, 5, 7), root / "other"),
    }


def test_one_body_under_other_heads_is_the_same_basis(folders: dict[str, Path]) -> None:
    record = _lineage(folders["two"], folders["five"])
    pair = record.pairs[0]
    assert pair.verdict == "same basis", pair
    note = str(record.settings["heads"])
    assert "model 1: 2" in note and "model 2: 5 labels" in note and "bodies" in note, note
    assert not any("classifier" in s.space for s in pair.spaces)


def test_bodies_of_other_seeds_under_other_heads_are_independent(folders: dict[str, Path]) -> None:
    record = _lineage(folders["two"], folders["other"])
    assert record.pairs[0].verdict == "independent", record.pairs[0]
    assert "heads" in record.settings


def test_token_classifiers_of_3_and_9_labels(tmp_path: Path) -> None:
    cls = T.BertForTokenClassification
    three = _classifier(cls, 3, 0)
    a, b = _saved(three, tmp_path / "a"), _saved(_tuned(three, cls, 9, 1), tmp_path / "b")
    proc = run_main("lineage", str(a), str(b))  # the table, and the note after it
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = flat(proc.stdout)
    assert "no alignment needed" in text and "label counts differ" in text and "model 2: 9" in text, text


def test_labels_alike_keep_the_heads(tmp_path: Path) -> None:
    """Heads of one shape are compared as they are: no body view, no note."""
    cls = T.BertForSequenceClassification
    two = _classifier(cls, 2, 0)
    record = _lineage(_saved(two, tmp_path / "a"), _saved(_tuned(two, cls, 2, 1), tmp_path / "b"))
    assert "heads" not in record.settings


@pytest.mark.slow  # the refusal and the job's notes: also checked in tests/io/test_initialised.py and the CLI
def test_a_merge_and_an_alignment_are_still_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    a, b = str(folders["two"]), str(folders["five"])
    assert_user_error(run_main("align", a, b, "--strategy", "weight-matching"), "task heads differ", "2 labels")
    body = {"job": "merge", "models": [a, b], "strategy": {"name": "weight-matching"}, "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = flat(proc.stderr)
    assert "task heads differ" in text and "has 5" in text and "architectures: [BertModel]" in text, text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stream", [True, False])
def test_the_body_view_reads_what_the_bare_model_holds(folders: dict[str, Path], stream: bool) -> None:
    """A streamed body stays a lazy view of the files (shapes and dtypes without a read), named as
    the bare model names its tensors, and reads the classifier's ``bert.`` tensors."""
    a, b = (load_model(folders[k], stream=stream) for k in ("two", "five"))
    assert (a.source is not None) == stream
    found = bodies(a, b)
    assert found is not None
    body, _ = found
    stock = T.BertForSequenceClassification.from_pretrained(str(folders["two"])).state_dict()
    weights = body.weights
    assert is_lazy(weights) == stream
    assert set(weights) == {n.removeprefix("bert.") for n in stock if n.startswith("bert.")}
    for name in weights:
        assert shape_of(weights, name) == stock[f"bert.{name}"].shape
        assert dtype_of(weights, name) == torch.float32
        assert torch.equal(weights[name].cpu(), stock[f"bert.{name}"])
    assert type(body.model) is T.BertModel
    assert not any("classifier" in s for s in body.graph.spaces), list(body.graph.spaces)
    same = load_model(folders["two"], stream=stream)
    assert bodies(a, same) is None  # one label count: compared as they are


@pytest.mark.slow  # the refusal and the job's notes: also checked in tests/io/test_initialised.py and the CLI
def test_job_lineage_notes_the_heads_left_out(folders: dict[str, Path], tmp_path: Path) -> None:
    body = {"job": "lineage", "models": [str(folders["two"]), str(folders["five"])], "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = LineageRecord.model_validate_json((tmp_path / "out" / "lineage.json").read_text())
    assert record.pairs[0].verdict == "same basis" and "heads" in record.settings
    assert "label counts differ" in flat((tmp_path / "out" / "README.md").read_text())
