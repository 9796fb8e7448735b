"""The circuit-form merge of ``benchmarks/alignment/circuit_form.py`` (the form the reference code of Theus et
al. interpolates), checked against the stock GPT-2: one model in circuit form computes what
``GPT2LMHeadModel`` computes, and a head whose Q/K and V/O are turned by inner maps has the same
circuits, so its circuit-form merge with the original is the original at every λ."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "alignment"))

import circuit_form

_model = tiny.gpt2  # norms away from (1, 0), so that folding them is tested


def _ids() -> torch.Tensor:
    return torch.randint(0, tiny.V, (3, 12), generator=torch.Generator().manual_seed(0))


def test_one_model_in_circuit_form_is_the_stock_gpt2():
    for tied in (True, False):
        model = _model(0, tied)
        shape = circuit_form.Shape.of(model.config)
        with torch.no_grad():
            stock = model(_ids()).logits
        ours = circuit_form.logits([(1.0, model.state_dict())], _ids(), shape)
        assert (ours - stock).abs().max() < 1e-4


def test_inner_maps_leave_the_circuits_and_so_the_merge_unchanged():
    model = _model(1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    d, nh = model.config.n_embd, model.config.n_head
    hd = d // nh
    turned = {k: v.clone() for k, v in sd.items()}
    for i in range(2):
        w, b = turned[f"transformer.h.{i}.attn.c_attn.weight"], turned[f"transformer.h.{i}.attn.c_attn.bias"]
        o = turned[f"transformer.h.{i}.attn.c_proj.weight"]
        for h in range(nh):
            r = torch.linalg.qr(torch.randn(hd, hd))[0]  # Q and K by one rotation: scores unchanged
            s = torch.linalg.qr(torch.randn(hd, hd))[0] * 1.7  # V by any invertible map, O by its inverse
            for part, m in ((0, r), (1, r), (2, s)):
                cols = slice(part * d + h * hd, part * d + (h + 1) * hd)
                w[:, cols], b[cols] = w[:, cols] @ m, b[cols] @ m
            rows = slice(h * hd, (h + 1) * hd)
            o[rows] = torch.linalg.inv(s) @ o[rows]
    shape = circuit_form.Shape.of(model.config)
    base = circuit_form.logits([(1.0, sd)], _ids(), shape)
    assert (circuit_form.logits([(1.0, turned)], _ids(), shape) - base).abs().max() < 1e-4  # same function
    mixed = (circuit_form.logits([(0.5, sd), (0.5, turned)], _ids(), shape) - base).abs().max()
    assert mixed < 1e-4
    # the factors' average is another function: the circuit form is what makes the difference
    factor = GPT2LMHeadModel(model.config).eval()
    factor.load_state_dict({k: 0.5 * sd[k] + 0.5 * turned[k] for k in sd})
    with torch.no_grad():
        assert (factor(_ids()).logits - base).abs().max() > max(1e-3, 100 * mixed)


def test_the_curve_ends_at_the_parents_losses():
    a, b = _model(2), _model(3)
    shape = circuit_form.Shape.of(a.config)
    blocks = [_ids()]
    lams, losses = circuit_form.curve(a.state_dict(), b.state_dict(), blocks, shape, points=3)
    with torch.no_grad():
        stock = [float(m(blocks[0], labels=blocks[0]).loss) for m in (b, a)]
    assert lams == [0.0, 0.5, 1.0]
    assert abs(losses[0] - stock[0]) < 1e-4 and abs(losses[-1] - stock[1]) < 1e-4
