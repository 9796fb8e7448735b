"""Fitting the moved model to the fine-tune, and the measures a card reports before and after.

The loss at each step is KL(teacher ‖ student) per token on a batch of calibration text, plus
``guard`` × KL(target ‖ student) on a batch of text the target wrote: the first pulls the student
toward what the fine-tune does, the second holds it where the target already was on its own text,
so what it gains on the task does not come from forgetting more than it must.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.merging.calibration.fit import Fitted
from hf_rebasin.merging.calibration.text import continued, forward
from hf_rebasin.merging.calibration.vocab import Rows

__all__ = [
    "CHECKPOINT_BYTES",
    "Budget",
    "Lesson",
    "activation_bytes",
    "checkpointing",
    "distill",
    "fit_steps",
    "fitting",
    "kl",
    "optimizer",
    "replies_ended",
    "token_kl",
    "turn_end_rate",
]


@dataclass(frozen=True)
class Budget:
    """How long and how hard to fit."""

    steps: int
    batch_size: int
    learning_rate: float
    guard: float
    seed: int
    on_policy: float = 0.0  # share of each batch the student writes itself (from a prefix of the text)
    divergence: str = "forward"  # of the teacher term: forward KL(teacher ‖ student), reverse, or symmetric


@dataclass(frozen=True)
class Lesson:
    """The teacher and its text, and the guard (the target) and its own; every model and text in
    the run's working rows, each distribution read over the rows its model has tokens for."""

    teacher: Any
    text: Tensor  # (n, L), working rows
    teacher_rows: Rows
    guard: Any | None = None
    guard_text: Tensor | None = None
    guard_rows: Rows = field(default_factory=Rows)
    reply_tail: tuple[int, ...] = ()  # the chat template's ids from a user turn's end to a reply's first word


def token_kl(
    teacher_logits: Tensor, student_logits: Tensor, rows: Rows, divergence: str = "forward", *, whole: bool = False
) -> Tensor:
    """KL(teacher ‖ student) per position, over the tokens the teacher has; ``reverse``:
    KL(student ‖ teacher), which seeks the teacher's modes; ``symmetric``: their mean. ``whole``:
    the student's distribution over all its rows (the guard: mass on a token the target lacks,
    where the target writes, counts against it), not renormalized over the teacher's."""
    t = torch.log_softmax(rows.read(teacher_logits).float(), -1)
    s = (
        rows.read(torch.log_softmax(student_logits.float(), -1))
        if whole
        else torch.log_softmax(rows.read(student_logits).float(), -1)
    )
    forward = (t.exp() * (t - s)).sum(-1)
    if divergence == "forward":
        return forward
    reverse = (s.exp() * (s - t)).sum(-1)
    return reverse if divergence == "reverse" else 0.5 * (forward + reverse)


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _term(
    teacher: Any, student: Any, ids: Tensor, rows: Rows, divergence: str = "forward", *, whole: bool = False
) -> Tensor:
    with torch.no_grad():
        t = teacher(input_ids=ids.to(_device(teacher)), use_cache=False).logits
    s = student(input_ids=ids.to(_device(student)), use_cache=False).logits  # no key/value cache to hold
    return token_kl(t.to(s.device), s, rows, divergence, whole=whole).mean()


def distill(
    student: Any,
    lesson: Lesson,
    fitted: Fitted,
    budget: Budget,
    *,
    progress: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Fit ``fitted``'s parameters of ``student``; returns the KL to the teacher at every step."""
    with fitting(student, fitted, budget, budget.batch_size * lesson.text.shape[1], train=True) as (opt, sched, gen):
        pool = _Pool()

        def step_loss(_step: int) -> tuple[Tensor, Tensor]:
            ids = _batch(student, lesson, budget, gen, pool)
            loss = _term(lesson.teacher, student, ids, lesson.teacher_rows, budget.divergence)
            if budget.guard > 0 and lesson.guard is not None and lesson.guard_text is not None:
                g = lesson.guard_text[torch.randint(0, len(lesson.guard_text), (budget.batch_size,), generator=gen)]
                return loss, loss + budget.guard * _term(lesson.guard, student, g, lesson.guard_rows, whole=True)
            return loss, loss

        return fit_steps(budget, opt, sched, step_loss, progress)


@contextlib.contextmanager
def fitting(
    student: Any, fitted: Fitted, budget: Budget, positions: int, *, train: bool
) -> Iterator[tuple[torch.optim.Optimizer, Any, torch.Generator]]:
    """What every fit needs around its steps: the optimizer and its schedule, the seeded generator,
    activation checkpointing where a step of ``positions`` tokens would hold too much, and the
    student back in eval mode, checkpointing off, after it, error or not. ``train``: dropout on
    while fitting (checkpointing puts the student in train mode whatever it says)."""
    gen = torch.Generator().manual_seed(budget.seed)
    opt, sched = optimizer(fitted, budget)
    checkpointed = checkpointing(student, positions)
    student.train(train or checkpointed)
    try:
        yield opt, sched, gen
    finally:
        if checkpointed:
            _unchecked(student)
        student.eval()


def fit_steps(
    budget: Budget,
    opt: torch.optim.Optimizer,
    sched: Any,
    step_loss: Callable[[int], tuple[Tensor, Tensor]],
    progress: Callable[[int, int, float], None] | None,
) -> list[float]:
    """``budget.steps`` optimizer steps on ``step_loss(step)``'s total; returns its first part (the
    teacher's term) at every step."""
    history: list[float] = []
    for step in range(budget.steps):
        loss, total = step_loss(step)
        total.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        history.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, budget.steps, history[-1])
    return history


def optimizer(fitted: Fitted, budget: Budget) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW on ``fitted``'s parameters, its rate warmed up over a tenth of the steps, then cosine."""
    opt = torch.optim.AdamW(fitted.params, lr=budget.learning_rate, weight_decay=0.0)
    warm = max(1, budget.steps // 10)

    def rate(step: int) -> float:
        return min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / budget.steps))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, rate)


CHECKPOINT_BYTES = 1 << 30  # a step's activations above this: the student's layers are checkpointed


def activation_bytes(hidden: int, layers: int, positions: int) -> int:
    """What a step keeps for the backward pass of ``positions`` tokens without checkpointing: about
    16 hidden-wide float32 values a layer (attention and MLP inputs and outputs). The run decides
    on it, and the plan's memory estimate counts with it."""
    return 4 * positions * 16 * hidden * layers


def _shape(config: Any) -> tuple[int, int]:
    """(width, layers) of a config (its text part, for a model with several)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None) or 0
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None) or 0
    return int(hidden), int(layers)


def checkpointing(student: Any, positions: int) -> bool:
    """`_checkpointing` where a step of ``positions`` tokens would keep more than `CHECKPOINT_BYTES`
    (an encoder-decoder's: its sources' and its decoder's positions). Whether it is on now."""
    return _checkpointing(student, activation_bytes(*_shape(student.config), positions) > CHECKPOINT_BYTES)


def _checkpointing(student: Any, on: bool) -> bool:
    """Activation checkpointing of ``student``'s layers where its class has it: a step then holds
    each layer's input, not its activations (a 7B model's step of 16 × 128 tokens: ~1 GiB, not
    ~34 GiB), for one more forward pass. Whether it is on now."""
    if not on or not getattr(student, "supports_gradient_checkpointing", False):
        return False
    if hasattr(student, "activation_checkpointing_enable"):  # transformers ≥ 5.x's name
        student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return True


def _unchecked(student: Any) -> None:
    """Activation checkpointing off (the student generates with its key/value cache again)."""
    if hasattr(student, "activation_checkpointing_disable"):
        student.activation_checkpointing_disable()
    else:
        student.gradient_checkpointing_disable()


REFRESH = 10  # steps an on-policy pool serves before the student writes a new one


class _Pool:
    """Text the student wrote itself, rewritten every ``REFRESH`` steps: writing token by token
    costs far more than a step, and a few steps' drift of the student changes little."""

    def __init__(self) -> None:
        self.text: Tensor | None = None
        self.age = REFRESH

    def take(self, student: Any, lesson: Lesson, n: int, gen: torch.Generator) -> Tensor:
        if self.text is None or self.age >= REFRESH:
            length = lesson.text.shape[1]
            prefixes = _reply_prefixes(lesson, n, gen) if lesson.reply_tail else None
            if prefixes is None:
                rows = lesson.text[torch.randint(0, len(lesson.text), (n,), generator=gen)]
                cut = int(torch.randint(max(1, length // 8), max(2, length // 2), (1,), generator=gen))
                prefixes = rows[:, :cut]
            student.eval()
            self.text = continued(student, prefixes, length, lesson.teacher_rows)
            student.train()
            self.age = 0
        self.age += 1
        return self.text


def _reply_prefixes(lesson: Lesson, n: int, gen: torch.Generator) -> Tensor | None:
    """``n`` prefixes that each end where an assistant's reply starts (a user turn, its end and the
    template's reply opening), cut to the shortest so they stack: the student then writes replies,
    where a loop or a turn never ended is what a user meets. None when the text has no reply that
    starts early enough to leave a reply's room."""
    text, tail = lesson.text, torch.tensor(lesson.reply_tail)
    length, k = text.shape[1], len(lesson.reply_tail)
    windows = text.unfold(1, k, 1)  # (rows, starts, k)
    row, at = torch.nonzero((windows == tail).all(-1), as_tuple=True)
    cut = at + k
    ok = (cut >= max(k + 1, length // 8)) & (cut <= length // 2)
    row, cut = row[ok], cut[ok]
    if len(row) == 0:
        return None
    pick = torch.randint(0, len(row), (n,), generator=gen)
    row, cut = row[pick], cut[pick]
    keep = int(cut.min())
    return torch.stack([text[r, c - keep : c] for r, c in zip(row.tolist(), cut.tolist(), strict=True)])


def _batch(student: Any, lesson: Lesson, budget: Budget, gen: torch.Generator, pool: _Pool) -> Tensor:
    """A batch of calibration text; its on-policy share is a prefix of the text that the student
    continues greedily (as in GKD, Agarwal et al. 2024: the teacher then corrects the student where
    the student's own text goes, e.g. a loop or a turn it does not end)."""
    ids = lesson.text[torch.randint(0, len(lesson.text), (budget.batch_size,), generator=gen)]
    own = round(budget.batch_size * budget.on_policy)
    if own == 0:
        return ids
    return torch.cat([pool.take(student, lesson, own, gen), ids[own:]])


@torch.no_grad()
def kl(teacher: Any, student: Any, text: Tensor, rows: Rows, batch_size: int) -> float:
    """KL(teacher ‖ student) per token on ``text``, over the teacher's ``rows``."""
    total, n = 0.0, 0
    for i in range(0, len(text), batch_size):
        ids = text[i : i + batch_size]
        total += float(_term(teacher, student, ids, rows)) * ids.numel()
        n += ids.numel()
    return total / max(n, 1)


@torch.no_grad()
def turn_end_rate(model: Any, text: Tensor, end: int, batch_size: int) -> float | None:
    """How often ``model``'s most likely token is ``end`` where ``text`` ends a turn; None when the
    text ends none."""
    hits = total = 0
    for i in range(0, len(text), batch_size):
        ids = text[i : i + batch_size]
        logits = model(input_ids=ids.to(_device(model))).logits[:, :-1]
        at = (ids[:, 1:] == end).to(logits.device)
        hits += int((logits.argmax(-1)[at] == end).sum())
        total += int(at.sum())
    return hits / total if total else None


@torch.no_grad()
def replies_ended(model: Any, prompts: list[list[int]], end: int, new_tokens: int) -> float | None:
    """The share of greedy replies to ``prompts`` (through the fine-tune's chat template) that emit
    ``end`` within ``new_tokens`` tokens; None without prompts."""
    if not prompts:
        return None
    device = _device(model)
    done = 0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        step = forward(model, ids)
        for _ in range(new_tokens):
            nxt = step.logits[:, -1].argmax(-1, keepdim=True)
            if int(nxt) == end:
                done += 1
                break
            step = forward(model, nxt, step)
    return done / len(prompts)
