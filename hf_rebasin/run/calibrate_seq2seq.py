"""A transport's calibration of an encoder-decoder (`merging.calibration.seq2seq`).

An encoder-decoder writes from a source and cannot write its own, so its calibration reads sources
from data: ``calibrate.data``, else the recipe's ``data`` (source → target pairs, or plain text
noised by the family's denoising objective, as the ``seq2seq`` evaluation reads it; only the
sources are used). From each source the fine-tune writes the continuation it is fitted on and the
target writes the guard's; held-out sources and the fine-tune's continuations of them measure the
KL before and after. Without data the run is refused, naming ``calibrate.data``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import DataError, IncompatibleModelsError
from hf_rebasin.core.roles import TransportRoles
from hf_rebasin.evaluation.scores import Calibration, Measured
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.merging.calibration.distill import Budget
from hf_rebasin.merging.calibration.fit import Fitted
from hf_rebasin.merging.calibration.seq2seq import Conversation, Seq2SeqLesson, Sources, distill_seq2seq, kl_seq2seq
from hf_rebasin.merging.calibration.seq2seq import written as written_from
from hf_rebasin.merging.calibration.vocab import Rows
from hf_rebasin.recipe.calibrate import Calibrate
from hf_rebasin.run.checks import no_sources
from hf_rebasin.run.data import BatchSpec, _block_size, batches
from hf_rebasin.run.load import Workspace

__all__ = ["Seq2SeqTexts", "fit_and_measure_seq2seq", "seq2seq_texts"]


@dataclass(frozen=True)
class Seq2SeqTexts:
    """The fine-tune's continuations of the calibration sources (fitted on, and held out), the
    target's of the fitted-on sources (the guard), and how they were made (the record's ``text``)."""

    train: Conversation
    held: Conversation
    guard: Conversation | None
    about: dict[str, Any]
    teacher_rows: Rows
    guard_rows: Rows
    start: int
    end: int | None
    pad: int


def _ids(config: Any) -> tuple[int, int | None, int]:
    """The decoder's start, end and padding ids (T5: start = padding = 0)."""
    start = getattr(config, "decoder_start_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    start = start if start is not None else pad
    if start is None:
        raise DataError("`calibrate`: the fine-tune's config names no decoder_start_token_id (nor pad_token_id)")
    end = getattr(config, "eos_token_id", None)
    end = end[0] if isinstance(end, list) and end else end
    return int(start), int(end) if isinstance(end, int) else None, int(pad if pad is not None else start)


def seq2seq_texts(
    ws: Workspace,
    models: TransportRoles[LoadedModel],
    cal: Calibrate,
    rows: tuple[Rows, Rows],
    reader: Callable[[Workspace], Any],
) -> Seq2SeqTexts:
    """Sources from ``calibrate.data`` (else ``data``) and what the fine-tune and the target write from
    them; ``rows``: the target's and the fine-tune's rows, ``reader``: the tokenizer of the data."""
    teacher, guard = models.finetune.model, models.target.model
    given = cal.data if cal.data is not None else ws.recipe.data
    if given is None:
        raise no_sources(type(teacher).__name__)
    where = "calibrate.data" if cal.data is not None else "data"
    if given.audio_column is not None:
        raise IncompatibleModelsError(
            f"`{where}`: calibrating a speech model on audio sources is not supported; set `calibrate: false`"
        )
    length = _block_size(teacher.config, cal.block_size, "calibrate")
    sources, made = _sources(ws, given, cal, length, teacher, reader(ws), where)
    start, end, pad = _ids(teacher.config)
    text = written_from(
        teacher, sources, length, start=start, end=end, pad=pad, seed=cal.seed, rows=rows[1], progress=_bar(ws)
    )
    held = min(cal.held, len(text) - 1)
    held_text, train = text.split(held)
    about: dict[str, Any] = {
        "source": f"the fine-tune's continuations of sources from `{where}` ({made})",
        "dataset": given.dataset,
        "sequences": len(text),
        "tokens": text.tokens(),
        "block_size": length,
    }
    guard_text = None
    if cal.guard > 0:
        guard_text = written_from(
            guard, train.sources, length, start=start, end=end, pad=pad, seed=cal.seed + 1, rows=rows[0]
        )
        about["guard"] = f"{len(guard_text)} continuations written by the target from the same sources"
    return Seq2SeqTexts(train, held_text, guard_text, about, rows[1], rows[0], start, end, pad)


def _sources(
    ws: Workspace, spec: Any, cal: Calibrate, length: int, teacher: Any, reader: Any, where: str
) -> tuple[Sources, str]:
    """``spec``'s sources (working rows), at most ``samples`` of them, and how they were made."""
    notes: list[str] = []
    batching = BatchSpec("seq2seq", cal.samples, None, None, cal.seed)
    sized = spec.model_copy(update={"block_size": length})
    made = batches(sized, batching, ws.base_dir, reader, teacher.config, where=where, notes=notes)
    width = max((int(b["input_ids"].shape[1]) for b in made), default=1)

    def padded(t: Tensor) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    ids = torch.cat([padded(b["input_ids"]) for b in made])[: cal.samples] if made else torch.zeros(0, 1)
    mask = torch.cat([padded(b["attention_mask"]) for b in made])[: cal.samples] if made else torch.zeros(0, 1)
    if len(ids) < 2:
        raise DataError(f"`{where}`: {len(ids)} source; calibration needs at least 2 (one held out): give more text")
    how = notes[0].split(": ", 1)[-1] if notes else "sources"
    return Sources(ids.long(), mask.long()), how


def _bar(ws: Workspace) -> Any:
    return lambda done, total: ws.progress("calibration continuations written by the fine-tune", done, total)


def fit_and_measure_seq2seq(
    ws: Workspace,
    models: TransportRoles[LoadedModel],
    student: Any,
    fitted: Fitted,
    t: Seq2SeqTexts,
    cal: Calibrate,
    start: float,
) -> Calibration:
    """``fitted`` of ``student`` fitted on ``t``, the KL on held-out sources measured before and after."""
    teacher = models.finetune.model
    before = kl_seq2seq(teacher, student, t.held, t.teacher_rows, 8)
    steps = cal.budget(fitted.fit == "adapter")
    budget = Budget(steps, cal.batch_size, cal.learning_rate, cal.guard, cal.seed, cal.on_policy, cal.divergence)
    guard = models.target.model if t.guard is not None else None
    lesson = Seq2SeqLesson(teacher, t.train, t.teacher_rows, t.start, t.end, t.pad, guard, t.guard, t.guard_rows)
    stage = f"calibrating ({fitted.fit})"
    distill_seq2seq(student, lesson, fitted, budget, progress=lambda done, total, _: ws.progress(stage, done, total))
    after = kl_seq2seq(teacher, student, t.held, t.teacher_rows, 8)
    kept = kept_or_noted(ws, before, after, "sources", "decoder token")
    text = t.about | {"held_out": len(t.held)}
    return outcome(cal, fitted, steps, start, kept, Measured(teacher=0.0, before=before, after=after), text)


def kept_or_noted(ws: Workspace, before: float, after: float, held: str, per: str) -> bool:
    """Whether the fit is kept (the KL to the fine-tune on held-out ``held`` did not rise); a note
    says why not where it did."""
    if after <= before:
        return True
    ws.notes.append(
        f"calibration raised the KL to the fine-tune on held-out {held} ({before:.4g} → {after:.4g} nats per "
        f"{per}): the transported weights are written as they were. More steps, a lower learning rate or a smaller "
        "`calibrate.guard` may help"
    )
    return False


def outcome(
    cal: Calibrate,
    fitted: Fitted,
    steps: int,
    start: float,
    kept: bool,
    kl: Measured,
    text: dict[str, Any],
    **more: Any,
) -> Calibration:
    """The calibration's record, as either path (decoder-only or encoder-decoder) reports it."""
    return Calibration(
        kept=kept,
        fit=fitted.fit,
        fitted=fitted.size,
        rank=cal.rank if fitted.fit == "low-rank" else None,
        steps=steps,
        guard=cal.guard,
        seconds=time.perf_counter() - start,
        text=text,
        kl=kl,
        adapter=True if fitted.fit == "adapter" else None,
        **more,
    )
