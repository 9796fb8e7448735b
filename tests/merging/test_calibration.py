"""Calibration's parts, each against an independent computation: a folded correction gives the
logits of the hooked one (plain transformers forward), an adapter's factors hooked on give what PEFT
computes with the same factors, the chat opening and turn end are the template's own tokens,
written text is reproducible and never uses a row the model lacks, and distillation recovers a
known perturbation of the teacher."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

from hf_rebasin.evaluation.data import bpe_tokenizer
from hf_rebasin.merging.calibration.distill import Budget, Lesson, distill, kl
from hf_rebasin.merging.calibration.fit import adapter_fittable, fittable
from hf_rebasin.merging.calibration.text import continued, opening, self_written, turn_end
from hf_rebasin.merging.calibration.vocab import Rows
from vocab_models import CHATML, tiny_llama, vocab_tokenizer

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _gpt2(seed: int = 0, rows: int = 40, std: float = 0.02) -> T.GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = T.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=rows,
        n_positions=32,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=std,
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return T.GPT2LMHeadModel(config).eval()


def _ids(rows: int = 40) -> torch.Tensor:
    return torch.randint(0, rows, (3, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("make", [_gpt2, lambda: tiny_llama(40, 0)], ids=["gpt2-conv1d", "llama-linear"])
def test_a_folded_correction_gives_the_logits_of_the_hooked_one(make) -> None:
    model = make()
    fitted = fittable(model, "low-rank", rank=3, new_rows=torch.tensor([38, 39]), seed=0)
    with torch.no_grad():
        for c in fitted.corrections:  # B starts at zero: give it something to fold
            c.b.normal_(0, 0.3)
        for p in fitted.params:
            p.add_(0.01)
        hooked = model(input_ids=_ids()).logits
    fitted.fold()
    assert not fitted.hooks and not fitted.corrections
    plain = copy.deepcopy(model)  # a plain forward: nothing hooked any more
    assert torch.allclose(plain(input_ids=_ids()).logits, hooked, atol=1e-4)


def test_a_fresh_correction_leaves_the_model_as_it_was_and_rows_train_alone() -> None:
    model = _gpt2()
    before = model(input_ids=_ids()).logits.detach()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    fitted = fittable(model, "rows", rank=2, new_rows=torch.tensor([38, 39]), seed=0)
    assert torch.equal(model(input_ids=_ids()).logits.detach(), before)
    loss = model(input_ids=_ids()).logits.square().mean()
    loss.backward()
    torch.optim.SGD(fitted.params, lr=1.0).step()
    for name, p in model.named_parameters():
        changed = (p.detach() != original[name]).any(-1) if p.dim() == 2 else p.detach() != original[name]
        if name == "transformer.wte.weight":  # the tied head: the new rows only
            assert changed.nonzero().flatten().tolist() == [38, 39]
        else:
            assert not changed.any(), name


def test_an_adapters_factors_hooked_on_compute_what_peft_computes() -> None:
    peft = pytest.importorskip("peft")
    model = _gpt2()
    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, init_lora_weights=False
    )
    wrapped = peft.get_peft_model(copy.deepcopy(model), config).eval()
    factors = {}
    for name, module in wrapped.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            inner = name.removeprefix("base_model.model.")
            factors[inner] = (
                module.lora_A["default"].weight,
                module.lora_B["default"].weight,
                module.scaling["default"],
            )
    assert len(factors) == 4
    with torch.no_grad():
        expected = wrapped(input_ids=_ids()).logits
    fitted = adapter_fittable(model, factors, new_rows=torch.zeros(0, dtype=torch.long))
    assert torch.allclose(model(input_ids=_ids()).logits, expected, atol=1e-5)
    fitted.unhook()
    assert not torch.allclose(model(input_ids=_ids()).logits, expected, atol=1e-3)


def test_the_chat_opening_and_turn_end_are_the_templates_own_tokens() -> None:
    tok = bpe_tokenizer("the user asked and the assistant answered\n" * 20, 300)  # byte-level: any text encodes
    tok.add_special_tokens({"additional_special_tokens": CHATML})
    tok.chat_template = CHATML_TEMPLATE
    ids, about = opening(tok)
    assert tok.decode(ids) == "<|im_start|>user\n" and "chat template" in about
    assert turn_end(tok) == tok.convert_tokens_to_ids("<|im_end|>")
    plain = vocab_tokenizer(64)
    assert opening(plain) == ([plain.bos_token_id], "its BOS token") and turn_end(plain) is None


def test_written_text_is_reproducible_and_never_uses_a_row_the_model_lacks() -> None:
    model = _gpt2()
    rows = Rows(columns=torch.arange(0, 30))
    a = self_written(model, [1, 5], 5, 20, seed=3, rows=rows, batch_size=2)
    assert torch.equal(a, self_written(model, [1, 5], 5, 20, seed=3, rows=rows, batch_size=2))
    assert not torch.equal(a, self_written(model, [1, 5], 5, 20, seed=4, rows=rows))
    assert a.shape == (5, 20) and (a[:, :2] == torch.tensor([1, 5])).all() and int(a[:, 2:].max()) < 30
    # the cached sampling equals sampling with a full forward pass at every step
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([[1, 5]] * 2)
    with torch.no_grad():
        while ids.shape[1] < 20:
            probs = torch.softmax(rows.mask(model(input_ids=ids).logits[:, -1]), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], 1)
    assert torch.equal(ids, a[:2])
    greedy = continued(model, a[:2, :6], 20, rows)
    with torch.no_grad():
        step = a[:2, :6]
        while step.shape[1] < 20:
            step = torch.cat([step, rows.mask(model(input_ids=step).logits[:, -1]).argmax(-1, keepdim=True)], 1)
    assert torch.equal(greedy, step)


def test_distillation_recovers_a_known_perturbation_of_the_teacher() -> None:
    teacher = _gpt2(0, std=0.4)  # sharp distributions, as a trained model's
    student = copy.deepcopy(teacher)
    with torch.no_grad():  # a known change the `norms` fit can undo: every norm's scale and shift
        for name, p in student.named_parameters():
            if ".ln_" in name:
                p.mul_(1.6).add_(0.2)
    text = self_written(teacher, [1], 48, 24, seed=0)
    rows = Rows()
    before = kl(teacher, student, text, rows, 16)
    fitted = fittable(student, "norms", rank=1, new_rows=torch.zeros(0, dtype=torch.long), seed=0)
    lesson = Lesson(teacher, text, rows)
    history = distill(student, lesson, fitted, Budget(steps=300, batch_size=16, learning_rate=5e-2, guard=0, seed=0))
    after = kl(teacher, student, text, rows, 16)
    assert before > 0.05 and after < before / 20 and history[-1] < history[0]


def test_on_policy_replies_start_where_the_texts_replies_start() -> None:
    from hf_rebasin.merging.calibration.distill import _reply_prefixes

    tail = (7, 8, 9)  # a user turn's end and the opening of a reply
    text = torch.randint(10, 30, (6, 32), generator=torch.Generator().manual_seed(0))
    text[0, 6:9] = torch.tensor(tail)  # a reply starting at 9: inside [32 // 8, 32 // 2]
    text[1, 10:13] = torch.tensor(tail)  # at 13
    text[2, 25:28] = torch.tensor(tail)  # at 28: no room left for a reply, never a prefix
    lesson = Lesson(None, text, Rows(), reply_tail=tail)
    prefixes = _reply_prefixes(lesson, 12, torch.Generator().manual_seed(1))
    assert prefixes is not None and prefixes.shape == (12, 9)  # cut to the shortest, so they stack
    ends = {tuple(p.tolist()) for p in prefixes}
    assert ends <= {tuple(text[0, :9].tolist()), tuple(text[1, 4:13].tolist())} and len(ends) == 2
    assert all(p[-3:].tolist() == list(tail) for p in prefixes)
    assert _reply_prefixes(Lesson(None, text[3:], Rows(), reply_tail=tail), 4, torch.Generator()) is None


@pytest.mark.parametrize("make", [_gpt2, lambda: tiny_llama(40, 0)], ids=["gpt2-conv1d", "llama-linear"])
def test_checkpointed_layers_fit_the_same_correction(make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Activation checkpointing (on where a step's activations would pass 1 GiB) only trades memory
    for a recomputed forward pass: the fitted factors are the same as without it, and the student
    comes back without it (so it generates with its key/value cache)."""
    from hf_rebasin.merging.calibration import distill as module

    teacher, text = make(), _ids()
    fitted_b, used = [], []
    real = module._checkpointing
    monkeypatch.setattr(module, "_checkpointing", lambda s, on: used.append(real(s, on)) or used[-1])
    for limit in (module.CHECKPOINT_BYTES, 0):
        monkeypatch.setattr(module, "CHECKPOINT_BYTES", limit)
        student = copy.deepcopy(teacher)
        with torch.no_grad():
            for p in student.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        fitted = fittable(student, "low-rank", rank=2, new_rows=torch.zeros(0, dtype=torch.long), seed=0)
        distill(student, Lesson(teacher, text, Rows()), fitted, Budget(5, 3, 1e-2, 0.0, 0, on_policy=0.34))
        assert not student.is_activation_checkpointing and not student.training
        fitted_b.append(torch.cat([c.b.detach().flatten() for c in fitted.corrections]))
    assert used == [False, True] and fitted_b[0].abs().max() > 0
    torch.testing.assert_close(fitted_b[1], fitted_b[0], rtol=1e-5, atol=1e-7)


def _perturbed_fit(teacher: T.GPT2LMHeadModel) -> tuple[T.GPT2LMHeadModel, object]:
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    return student, fittable(student, "low-rank", rank=2, new_rows=torch.zeros(0, dtype=torch.long), seed=0)


def test_the_best_judged_point_of_a_fit_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Judged at every step of 8 (every eighth of the budget; scripted: 75 % of replies end at step 6,
    fewer elsewhere), the fit keeps step 6's numbers exactly; a tie goes to the later point."""
    from hf_rebasin.merging.calibration import select

    teacher, text = _gpt2(), _ids()
    for scripted, kept in (([0.5, 0.25, 0, 0.5, 0.5, 0.75, 0.25, 0.25], 6), ([0.5] * 8, 8)):
        student, fitted = _perturbed_fit(teacher)
        replies = iter(scripted)
        monkeypatch.setattr(select, "replies_ended", lambda *_, replies=replies: next(replies))
        point = select.BestPoint(student, fitted, [[1, 2, 3]], end=5, tokens=4, steps=8)
        seen: dict[int, list[torch.Tensor]] = {}

        def report(done: int, _total: int, _loss: float, point=point, seen=seen, fitted=fitted) -> None:
            seen[done] = [p.detach().clone() for p in fitted.params]
            point.progress(done)

        distill(student, Lesson(teacher, text, Rows()), fitted, Budget(8, 3, 1e-2, 0.0, 0), progress=report)
        assert point.finish() == kept and sorted(point.seen) == list(range(1, 9))
        assert all(torch.equal(p, s) for p, s in zip(fitted.params, seen[kept], strict=True))
        assert any(not torch.equal(a, b) for a, b in zip(seen[6], seen[8], strict=True))


def test_judging_a_fit_leaves_its_course_unchanged() -> None:
    """Greedy replies read no random numbers: the fit's end is the same, judged or not."""
    from hf_rebasin.merging.calibration.select import BestPoint

    teacher, text = _gpt2(), _ids()
    ends = []
    for judged in (False, True):
        student, fitted = _perturbed_fit(teacher)
        point = BestPoint(student, fitted, [[1, 2, 3], [4, 5]], end=7, tokens=6, steps=8)
        progress = (lambda d, _n, _l, point=point: point.progress(d)) if judged else None
        budget = Budget(8, 3, 1e-2, 0.0, 0, on_policy=0.34)
        distill(student, Lesson(teacher, text, Rows()), fitted, budget, progress=progress)
        ends.append([p.detach().clone() for p in fitted.params])
        assert student.training is False
    assert all(torch.equal(a, b) for a, b in zip(*ends, strict=True))
