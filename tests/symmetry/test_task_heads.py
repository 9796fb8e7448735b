"""The encoders' task heads beyond classification, in the nine families transformers gives a
multiple-choice head: multiple choice, extractive question answering (``start_logits`` /
``end_logits``) and pre-training (BERT's two heads). A random allowed transform keeps every logit of
the stock model, checked on the written folder loaded with the stock Auto class on inputs built
here; `verify` compares every ``*logits`` output (it once compared none of these and passed), and
activation matching runs a multiple-choice model (a batch's rows read as one question's choices)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers as T

import tiny
from helpers import run_main
from hf_rebasin.alignment.verify import TOLERANCE, verify_model
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import graph_for
from symmetry_checks import planted_by_activations

FAMILIES = {
    "bert": "bert-cls",
    "roberta": "roberta-cls",
    "xlm-roberta": "xlm-roberta-cls",
    "distilbert": "distilbert-cls",
    "electra": "electra-cls",
    "albert": "albert-cls",
    "mpnet": "mpnet-cls",
    "deberta-v2": "deberta-v2-cls",
    "modernbert": "modernbert-cls",
}
HEADS = {
    "multiple-choice": T.AutoModelForMultipleChoice,
    "question-answering": T.AutoModelForQuestionAnswering,
    "pretraining": T.AutoModelForPreTraining,
}


def _model(family: str, head: str = "multiple-choice", seed: int = 0) -> torch.nn.Module:
    config = copy.deepcopy(tiny.FACTORIES[FAMILIES[family]](0).config)
    config.num_labels = 2  # question answering's start and end
    torch.manual_seed(seed)
    return tiny._randomize_norms(HEADS[head].from_config(config), seed)


def _inputs(config: T.PretrainedConfig, head: str) -> dict[str, torch.Tensor]:
    """Two questions of three choices each (``[2, 3, 10]``), else six rows of 10; one row padded."""
    g = torch.Generator().manual_seed(5)
    shape = (2, 3, 10) if head == "multiple-choice" else (6, 10)
    ids = torch.randint(3, config.vocab_size, shape, generator=g)  # past the special ids at the bottom
    mask = torch.ones_like(ids)
    mask.view(-1, 10)[-1, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(**inputs)
    return {k: v for k, v in out.items() if k.endswith("logits")}


def test_the_families_are_the_ones_transformers_gives_a_multiple_choice_head():
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES as MC

    from hf_rebasin.symmetry.adapters import REGISTRY

    assert sorted(FAMILIES) == sorted(t for t in REGISTRY.model_types if t in MC)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("head", sorted(HEADS))
def test_a_random_transform_keeps_every_logit_of_the_stock_class(tmp_path: Path, family, head):
    if (family, head) == ("modernbert", "pretraining"):
        pytest.skip("transformers gives ModernBERT no pre-training class")
    model = _model(family, head).eval()
    names = sorted(_logits(model, _inputs(model.config, head)))
    report = verify_model(model, "orthogonal", seed=3)  # permutations where a LayerNorm stream allows no more
    assert report.compared == names and report.max_abs_diff <= TOLERANCE
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    moved = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(4)))
    assert max((moved[k] - sd[k]).abs().max().item() for k in sd) > 1e-2  # the weights really moved
    rebuild(model, moved).save_pretrained(str(tmp_path / "moved"))
    stock = HEADS[head].from_pretrained(str(tmp_path / "moved")).eval()
    inputs = _inputs(model.config, head)
    before, after = _logits(model, inputs), _logits(stock, inputs)
    if head == "multiple-choice":
        assert before["logits"].shape == (2, 3)
    assert max((before[k] - after[k]).abs().max().item() for k in names) <= 1e-4
    # the negative control: every weight moved but one matrix of the first layer
    kept = next(k for k in sd if ".0." in k and sd[k].dim() == 2 and not torch.equal(sd[k], moved[k]))
    control = _logits(rebuild(model, {**moved, kept: sd[kept]}), inputs)
    assert max((control[k] - before[k]).abs().max().item() for k in names) > 1e-3


@pytest.mark.parametrize("family", ["bert", "deberta-v2", "albert"])
def test_activation_matching_recovers_a_planted_permutation(family):
    alignment, gap = planted_by_activations(_model(family), "last", seed=9)
    assert alignment.exact and gap < 1e-6


def test_verify_runs_on_a_saved_multiple_choice_folder(tmp_path: Path):
    _model("bert").save_pretrained(str(tmp_path / "mc"))
    result = run_main("verify", str(tmp_path / "mc"), "--class", "permutation")
    assert result.returncode == 0, result.stderr
    assert "outputs unchanged" in result.stdout and "logits" in result.stdout
