"""Calibration of an encoder-decoder (T5, BART, mBART, Marian): its decoder fitted given sources.

An encoder-decoder writes from a source, so it cannot write its own calibration text: the
sources come from data. From each source the fine-tune (the teacher) writes a continuation
itself, sampled at temperature 1 from its decoder's distribution over the rows it has tokens for
(as a decoder-only teacher writes its text, `text.self_written`), until its end-of-sequence token
or ``length`` decoder tokens. The student is then fitted, teacher-forced on those continuations,
to the teacher's next-token distribution at every decoder position up to the one that ends
(KL(teacher ‖ student), encoder input and decoder input both given). The guard does the same
with the target on the same sources, on continuations the target writes itself. The on-policy
share of a batch is continuations the student writes greedily from sources of the text, which
the teacher then corrects.

Pure torch on models a caller built; the fitted parameters are `fit`'s, as for a decoder-only model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.merging.calibration.distill import Budget, fit_steps, fitting, token_kl
from hf_rebasin.merging.calibration.fit import Fitted
from hf_rebasin.merging.calibration.text import _cache_argument
from hf_rebasin.merging.calibration.vocab import Rows

__all__ = ["Conversation", "Seq2SeqLesson", "Sources", "distill_seq2seq", "kl_seq2seq", "live", "written"]

REFRESH = 10  # steps the student's own continuations serve before it writes new ones


@dataclass(frozen=True)
class Sources:
    """Encoder inputs, right-padded: ``ids`` (n, S) and ``mask`` (n, S), 1 on a source token."""

    ids: Tensor
    mask: Tensor

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, index: Tensor | slice) -> Sources:
        """The rows ``index``, padding no row needs cut off."""
        ids, mask = self.ids[index], self.mask[index]
        keep = max(1, int(mask.sum(1).max())) if len(mask) else 1
        return Sources(ids[:, :keep], mask[:, :keep])


@dataclass(frozen=True)
class Conversation:
    """Sources and what a model wrote from each: ``decoder`` (n, L) starts with the decoder's start
    token; ``live`` (n, L) marks the positions whose next-token distribution counts (every one up
    to and including the one that predicts the end token)."""

    sources: Sources
    decoder: Tensor
    live: Tensor

    def __len__(self) -> int:
        return len(self.decoder)

    def take(self, index: Tensor | slice) -> Conversation:
        return Conversation(self.sources.take(index), self.decoder[index], self.live[index])

    def split(self, held: int) -> tuple[Conversation, Conversation]:
        """(the first ``held`` rows, the rest)."""
        return self.take(slice(0, held)), self.take(slice(held, None))

    def tokens(self) -> int:
        return int(self.live.sum())


def live(decoder: Tensor, end: int | None) -> Tensor:
    """Positions of ``decoder`` (each row starting with the start token) that come before the end
    token or are it: after the end, a decoder's text is padding."""
    out = torch.ones_like(decoder, dtype=torch.bool)
    if end is not None and decoder.shape[1] > 1:
        out[:, 1:] = (decoder[:, 1:] == end).cumsum(1) == 0
    return out


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def written(
    model: Any,
    sources: Sources,
    length: int,
    *,
    start: int,
    end: int | None,
    pad: int,
    seed: int | None,
    rows: Rows | None = None,
    batch_size: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> Conversation:
    """What ``model`` writes from each source: ``length`` decoder positions, the start token first,
    each next token sampled at temperature 1 (``seed`` None: greedy) from the rows it has tokens
    for; after the end token, ``pad``."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out = []
    for i in range(0, len(sources), batch_size):
        part = sources.take(slice(i, i + batch_size))
        out.append(_write(model, part, length, start, end, pad, gen, rows))
        if progress is not None:
            progress(min(i + batch_size, len(sources)), len(sources))
    decoder = torch.cat(out) if out else torch.zeros(0, length, dtype=torch.long)
    return Conversation(sources, decoder, live(decoder, end))


def _write(
    model: Any,
    sources: Sources,
    length: int,
    start: int,
    end: int | None,
    pad: int,
    gen: torch.Generator | None,
    rows: Rows | None,
) -> Tensor:
    """One batch's continuations: the encoder read once, the decoder's key/value cache kept."""
    device = _device(model)
    ids, mask = sources.ids.to(device), sources.mask.to(device)
    encoded = model.get_encoder()(input_ids=ids, attention_mask=mask)
    decoder = torch.full((len(ids), 1), start, dtype=torch.long, device=device)
    done = torch.zeros(len(ids), dtype=torch.bool, device=device)
    key, past = _cache_argument(model), None
    while decoder.shape[1] < length and not bool(done.all()):
        cached: dict[str, Any] = {key: past} if past is not None else {}
        step = model(
            encoder_outputs=encoded,
            attention_mask=mask,
            decoder_input_ids=decoder if past is None else decoder[:, -1:],
            use_cache=True,
            **cached,
        )
        past = getattr(step, "cache", None) or step.past_key_values
        logits = step.logits[:, -1].float()
        logits = rows.mask(logits) if rows is not None else logits
        if gen is None:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=gen).squeeze(-1).to(device)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        decoder = torch.cat([decoder, nxt[:, None]], 1)
        done |= nxt == end if end is not None else torch.zeros_like(done)
    if decoder.shape[1] < length:  # every row ended early: the rest is padding
        decoder = torch.cat([decoder, decoder.new_full((len(decoder), length - decoder.shape[1]), pad)], 1)
    return decoder.cpu()


def _logits(model: Any, c: Conversation) -> Tensor:
    device = _device(model)
    return model(
        input_ids=c.sources.ids.to(device),
        attention_mask=c.sources.mask.to(device),
        decoder_input_ids=c.decoder.to(device),
        use_cache=False,
    ).logits


def _term(
    teacher: Any, student: Any, c: Conversation, rows: Rows, divergence: str = "forward", *, whole: bool = False
) -> Tensor:
    """KL(teacher ‖ student) per live decoder position of ``c``, averaged over them."""
    with torch.no_grad():
        t = _logits(teacher, c)
    s = _logits(student, c)
    per = token_kl(t.to(s.device), s, rows, divergence, whole=whole)
    on = c.live.to(per.device)
    return (per * on).sum() / on.sum().clamp(min=1)


@torch.no_grad()
def kl_seq2seq(teacher: Any, student: Any, c: Conversation, rows: Rows, batch_size: int) -> float:
    """KL(teacher ‖ student) per live decoder token of ``c``, over the teacher's ``rows``."""
    total, n = 0.0, 0
    for i in range(0, len(c), batch_size):
        part = c.take(slice(i, i + batch_size))
        total += float(_term(teacher, student, part, rows)) * part.tokens()
        n += part.tokens()
    return total / max(n, 1)


@dataclass(frozen=True)
class Seq2SeqLesson:
    """The teacher and what it wrote from the calibration sources, the guard (the target) and what
    it wrote from the same sources; every model and id in the run's working rows."""

    teacher: Any
    text: Conversation
    teacher_rows: Rows
    start: int  # the decoder's start token, for the student's own continuations
    end: int | None
    pad: int
    guard: Any | None = None
    guard_text: Conversation | None = None
    guard_rows: Rows = field(default_factory=Rows)


def distill_seq2seq(
    student: Any,
    lesson: Seq2SeqLesson,
    fitted: Fitted,
    budget: Budget,
    *,
    progress: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Fit ``fitted``'s parameters of ``student``; returns the KL to the teacher at every step."""
    c = lesson.text
    positions = budget.batch_size * (c.sources.ids.shape[1] + c.decoder.shape[1])
    # no dropout (T5's and BART's 0.1: the held-out KL rose with it) unless checkpointing needs train mode
    with fitting(student, fitted, budget, positions, train=False) as (opt, sched, gen):
        own: list[Conversation | None] = [None]

        def step_loss(step: int) -> tuple[Tensor, Tensor]:
            if budget.on_policy > 0 and step % REFRESH == 0:
                own[0] = _own(student, lesson, round(budget.batch_size * budget.on_policy), gen)
            loss = _term(
                lesson.teacher, student, _batch(lesson, budget, gen, own[0]), lesson.teacher_rows, budget.divergence
            )
            if budget.guard > 0 and lesson.guard is not None and lesson.guard_text is not None:
                g = lesson.guard_text.take(_pick(len(lesson.guard_text), budget.batch_size, gen))
                return loss, loss + budget.guard * _term(lesson.guard, student, g, lesson.guard_rows, whole=True)
            return loss, loss

        return fit_steps(budget, opt, sched, step_loss, progress)


def _pick(n: int, k: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, n, (k,), generator=gen)


def _own(student: Any, lesson: Seq2SeqLesson, n: int, gen: torch.Generator) -> Conversation | None:
    """Greedy continuations the student writes from ``n`` sources of the text (GKD's on-policy
    share, as for a decoder-only model): the teacher then corrects it where its own text goes."""
    if n == 0:
        return None
    sources = lesson.text.sources.take(_pick(len(lesson.text), n, gen))
    was = student.training
    student.eval()
    own = written(
        student,
        sources,
        lesson.text.decoder.shape[1],
        start=lesson.start,
        end=lesson.end,
        pad=lesson.pad,
        seed=None,
        rows=lesson.teacher_rows,
    )
    student.train(was)
    return own


def _batch(lesson: Seq2SeqLesson, budget: Budget, gen: torch.Generator, own: Conversation | None) -> Conversation:
    """A batch of the teacher's continuations, its on-policy share replaced by the student's own."""
    ids = lesson.text.take(_pick(len(lesson.text), budget.batch_size, gen))
    if own is None:
        return ids
    return _joined(own, ids.take(slice(len(own), None)))


def _joined(a: Conversation, b: Conversation) -> Conversation:
    """Two conversations of the same decoder length as one batch (sources padded to the longer)."""
    width = max(a.sources.ids.shape[1], b.sources.ids.shape[1])

    def padded(t: Tensor) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    sources = Sources(
        torch.cat([padded(a.sources.ids), padded(b.sources.ids)]),
        torch.cat([padded(a.sources.mask), padded(b.sources.mask)]),
    )
    return Conversation(sources, torch.cat([a.decoder, b.decoder]), torch.cat([a.live, b.live]))
