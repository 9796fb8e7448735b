"""Learned matching on models whose parameters are tied under two names (BERT's and XLM-R's MLM
head bias is also the decoder's bias): `functional_call` must get one value per tied tensor."""

from __future__ import annotations

import pytest
import torch

import tiny
from hf_rebasin.alignment.strategies import AlignmentData, Pair, align
from hf_rebasin.alignment.strategies.engines.learned import _loss
from hf_rebasin.symmetry.adapters import graph_for

MLM = {"bert": tiny.bert_mlm, "xlm-roberta": tiny.xlm_roberta_mlm}


def _batches(model: torch.nn.Module, n: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out = []
    for _ in range(n):
        ids = torch.randint(5, vocab, (4, 12), generator=g)
        labels = torch.full_like(ids, -100)
        picked = torch.rand(ids.shape, generator=g) < 0.3
        labels[picked] = ids[picked]
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


@pytest.mark.parametrize("family", MLM)
def test_the_loss_of_a_tied_state_dict_is_the_stock_models_loss(family: str) -> None:
    model = MLM[family](0).eval()
    sd = model.state_dict()
    alias = next(k for k in sd if k.endswith("decoder.bias"))
    source = alias.replace("decoder.bias", "bias")
    assert sd[source].data_ptr() == sd[alias].data_ptr()  # one tensor under two names
    batch = _batches(model, 1)[0]
    with torch.no_grad():
        stock = model(**batch).loss
        ours = _loss(model, {k: v.clone() for k, v in sd.items()}, batch)  # every name, each its own tensor
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", MLM)
def test_learned_matching_runs_on_a_masked_lm_with_a_tied_bias(family: str) -> None:
    a, b = MLM[family](0).eval(), MLM[family](1).eval()
    sd_a, sd_b = a.state_dict(), b.state_dict()
    graph = graph_for(a.config, sd_a.keys())
    data = AlignmentData(_batches(a, 4))
    alignment = align("generalized-orthogonal", Pair(graph, sd_a, sd_b, a, b, data), {"learned": True, "steps": 3})
    assert "learned" in alignment.diagnostics
