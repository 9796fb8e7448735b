"""Calibration of encoder-decoders (T5, BART) against independent computations: a student that is the
fine-tune perturbed gets closer to it on held-out sources (the KL read here with plain transformers,
on continuations the fine-tune writes with ``generate``), a folded correction gives the hooked logits,
continuations are reproducible, end where the end token is and never use a row the model lacks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tiny
from hf_rebasin.merging.calibration.distill import Budget
from hf_rebasin.merging.calibration.fit import fittable
from hf_rebasin.merging.calibration.seq2seq import Seq2SeqLesson, Sources, distill_seq2seq, kl_seq2seq, live, written
from hf_rebasin.merging.calibration.vocab import Rows

MODELS = {"t5": tiny.t5, "bart": tiny.bart}
NONE = torch.zeros(0, dtype=torch.long)


def _sources(n: int, seed: int, width: int = 10) -> Sources:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, tiny.V, (n, width), generator=g)
    mask = torch.ones_like(ids)
    for i in range(n):  # ragged: right padding on some rows
        cut = int(torch.randint(width // 2, width + 1, (1,), generator=g))
        ids[i, cut:], mask[i, cut:] = 1, 0
    return Sources(ids, mask)


def _perturbed(teacher: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """The teacher with a rank-2 change of every linear layer (what a rank-4 correction can undo)."""
    return tiny.drifted(copy.deepcopy(teacher), 3, scale)


def _ids(model: torch.nn.Module) -> tuple[int, int, int]:
    c = model.config
    return int(c.decoder_start_token_id), int(c.eos_token_id), int(c.pad_token_id)


def _stock_kl(teacher: torch.nn.Module, student: torch.nn.Module, sources: Sources, length: int) -> float:
    """KL(teacher ‖ student) per decoder token, on the teacher's greedy ``generate`` outputs."""
    with torch.no_grad():
        out = teacher.generate(
            input_ids=sources.ids,
            attention_mask=sources.mask,
            do_sample=False,
            max_length=length,
            min_length=0,
            num_beams=1,
            forced_bos_token_id=None,
            forced_eos_token_id=None,
            no_repeat_ngram_size=0,
            use_cache=False,  # transformers' cache for T5 sizes it by the encoder's depth
        )
        args = {"input_ids": sources.ids, "attention_mask": sources.mask, "decoder_input_ids": out}
        t = F.log_softmax(teacher(**args).logits.float(), -1)
        s = F.log_softmax(student(**args).logits.float(), -1)
    per = (t.exp() * (t - s)).sum(-1)
    eos = teacher.config.eos_token_id
    on = torch.ones_like(out, dtype=torch.bool)
    on[:, 1:] = (out[:, 1:] == eos).cumsum(1) == 0
    return float(per[on].mean())


@pytest.mark.parametrize("family", [pytest.param("t5", marks=pytest.mark.slow), "bart"])  # T5: ~50 s on 2 busy cores
def test_distillation_brings_a_perturbed_decoder_closer_to_the_fine_tune_on_held_out_sources(family: str) -> None:
    teacher = MODELS[family](0)
    target = MODELS[family](1)  # the guard: another model, whose own continuations hold the student
    student = _perturbed(teacher)
    start, end, pad = _ids(teacher)
    train, held = _sources(48, 0), _sources(8, 1)
    text = written(teacher, train, 12, start=start, end=end, pad=pad, seed=0)
    guard_text = written(target, train, 12, start=start, end=end, pad=pad, seed=1)
    lesson = Seq2SeqLesson(teacher, text, Rows(), start, end, pad, target, guard_text)
    before = _stock_kl(teacher, student, held, 12)
    fitted = fittable(student, "low-rank", rank=4, new_rows=NONE, seed=0)
    losses = distill_seq2seq(student, lesson, fitted, Budget(30, 8, 1e-2, 0.1, 0, on_policy=0.25))
    fitted.fold()
    after = _stock_kl(teacher, student, held, 12)
    assert len(losses) == 30 and not student.training
    assert after < 0.85 * before, (before, after)


@pytest.mark.parametrize("family", MODELS)
def test_a_folded_correction_of_an_encoder_decoder_gives_the_hooked_logits(family: str) -> None:
    model = MODELS[family](0)
    names = {n for n, _ in model.named_modules()}
    fitted = fittable(model, "low-rank", rank=3, new_rows=NONE, seed=0)
    hooked_names = {n for n, m in model.named_modules() if any(c.module is m for c in fitted.corrections)}
    wo = "decoder.block.0.layer.2.DenseReluDense.wo" if family == "t5" else "model.decoder.layers.0.fc2"
    assert wo in names and wo in hooked_names and "lm_head" not in hooked_names
    sources = _sources(3, 0)
    decoder = torch.randint(3, tiny.V, (3, 7), generator=torch.Generator().manual_seed(2))
    args = {"input_ids": sources.ids, "attention_mask": sources.mask, "decoder_input_ids": decoder}
    with torch.no_grad():
        for c in fitted.corrections:
            c.b.normal_(0, 0.3)
        hooked = model(**args).logits
    fitted.fold()
    with torch.no_grad():
        torch.testing.assert_close(model(**args).logits, hooked, rtol=1e-4, atol=1e-4)


def test_continuations_are_reproducible_end_at_the_end_token_and_keep_to_the_models_rows() -> None:
    model = tiny.bart(0)
    start, end, pad = _ids(model)
    sources = _sources(8, 0)
    rows = Rows(columns=torch.arange(0, 40))  # the model has tokens for the first 40 rows only
    a = written(model, sources, 16, start=start, end=end, pad=pad, seed=5, rows=rows, batch_size=3)
    b = written(model, sources, 16, start=start, end=end, pad=pad, seed=5, rows=rows, batch_size=3)
    assert torch.equal(a.decoder, b.decoder) and a.decoder.shape == (8, 16)
    assert (a.decoder[:, 0] == start).all() and int(a.decoder[:, 1:].max()) < 40
    greedy = written(model, sources, 16, start=start, end=end, pad=pad, seed=None)
    with torch.no_grad():
        stock = model.generate(
            input_ids=sources.ids,
            attention_mask=sources.mask,
            do_sample=False,
            max_length=16,
            min_length=0,
            num_beams=1,
            forced_bos_token_id=None,
            forced_eos_token_id=None,
            no_repeat_ngram_size=0,
        )
    for ours, theirs in zip(greedy.decoder.tolist(), stock.tolist(), strict=True):
        n = min(len(theirs), (ours.index(end) + 1) if end in ours[1:] else len(ours))
        assert ours[:n] == theirs[:n]


def test_live_positions_stop_after_the_end_token() -> None:
    decoder = torch.tensor([[0, 5, 2, 1, 1], [0, 5, 6, 7, 8]])
    assert live(decoder, 2).tolist() == [[True, True, False, False, False], [True] * 5]  # 5 predicts the end
    assert live(decoder, None).all()


def test_the_measured_kl_is_zero_for_the_teacher_and_matches_a_plain_computation() -> None:
    teacher = tiny.t5(0)
    student = _perturbed(teacher, 0.3)
    start, end, pad = _ids(teacher)
    c = written(teacher, _sources(5, 2), 10, start=start, end=end, pad=pad, seed=0)
    assert kl_seq2seq(teacher, teacher, c, Rows(), 2) == pytest.approx(0.0, abs=1e-6)
    args = {"input_ids": c.sources.ids, "attention_mask": c.sources.mask, "decoder_input_ids": c.decoder}
    with torch.no_grad():
        t = F.log_softmax(teacher(**args).logits, -1)
        s = F.log_softmax(student(**args).logits, -1)
    plain = float(((t.exp() * (t - s)).sum(-1))[c.live].mean())
    assert kl_seq2seq(teacher, student, c, Rows(), 2) == pytest.approx(plain, rel=1e-4)
