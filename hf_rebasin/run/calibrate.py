"""A transport's calibration step: the moved model fitted to the fine-tune (`merging.calibration`).

Reads the recipe's ``calibrate`` settings, decides the calibration text (``calibrate.data``, else
the recipe's ``data``, else text the fine-tune writes itself; an encoder-decoder's: continuations of
sources from data, `run.calibrate_seq2seq`), builds the student from the moved
weights, fits it with the target as guard, and measures it before and after on held-out text.
Every model and every text is in the run's working rows (where vocabularies differ, the layout
the models were loaded into), so the moved weights come back in the form the writer takes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import DataError, IncompatibleModelsError, ModelNotFoundError
from hf_rebasin.core.lazy import LazyState
from hf_rebasin.core.roles import TransportRoles
from hf_rebasin.evaluation.scores import Calibration, Measured
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.io.offload import materialized
from hf_rebasin.io.rebuild import output_config, rebuilt
from hf_rebasin.merging.calibration.distill import Budget, Lesson, distill, kl, replies_ended, turn_end_rate
from hf_rebasin.merging.calibration.fit import Fitted, fittable
from hf_rebasin.merging.calibration.select import BestPoint
from hf_rebasin.merging.calibration.text import opening, plain_start, reply_tail, self_written, turn_end
from hf_rebasin.merging.calibration.vocab import Rows
from hf_rebasin.recipe.calibrate import Calibrate
from hf_rebasin.run.calibrate_seq2seq import (
    Seq2SeqTexts,
    fit_and_measure_seq2seq,
    kept_or_noted,
    outcome,
    seq2seq_texts,
)
from hf_rebasin.run.checks import cannot_calibrate
from hf_rebasin.run.data import BatchSpec, _block_size, batches, data_processor, processor
from hf_rebasin.run.load import Workspace

__all__ = ["Texts", "calibrated", "fit_and_measure", "new_rows", "settings", "texts", "whole"]

REPLY_PROMPTS = 16  # held-out user turns the replies are measured on
REPLY_TOKENS = 96  # new tokens a reply may take to end its turn
SELECT_PROMPTS = 32  # further held-out user turns the fit's points are judged on (`BestPoint`)


@dataclass(frozen=True)
class Texts:
    """Calibration text split into what is fitted on and what is measured on, the guard's, and how
    it was made (the record's ``text``)."""

    train: Tensor
    held: Tensor
    guard: Tensor | None
    about: dict[str, Any]
    end: int | None  # the turn-end token (working row), where the fine-tune has a chat template
    reply_tail: list[int]  # the template's ids from a user turn's end to the assistant's first word


def settings(ws: Workspace) -> Calibrate:
    found = getattr(ws.recipe, "calibrate", None)
    assert isinstance(found, Calibrate)  # the transport job calls this only when calibrating
    return found


def _rows(ws: Workspace, i: int) -> Rows:
    """Model ``i``'s rows (0: target, 2: fine-tune) in the working layout."""
    return Rows.of(ws.rows.layout.sources[i]) if ws.rows is not None else Rows()


def _teacher_tokenizer(ws: Workspace) -> Any:
    """The fine-tune's own tokenizer (its chat template); an adapter without one: its base's."""
    if ws.rows is not None:
        return ws.rows.tokenizers[2]
    inputs = ws.inputs
    assert isinstance(inputs, TransportRoles)
    for planned in (inputs.finetune, inputs.base):
        try:
            return processor(planned.path, "causal-lm")
        except ModelNotFoundError:  # a folder without tokenizer files: the next one
            continue
    raise IncompatibleModelsError(
        "`calibrate`: neither the fine-tune nor its base has tokenizer files to write calibration text with; "
        "give `calibrate.data` or set `calibrate: false`"
    )


def _reader(ws: Workspace) -> Any:
    """A tokenizer whose ids are working rows (for calibration data read from files)."""
    if ws.processor is not None:
        return ws.processor
    if ws.rows is None:
        return _teacher_tokenizer(ws)
    return data_processor(ws.inputs, "causal-lm", ws.rows)  # the run's data reader: ids in working rows


def _check_generates(ws: Workspace, models: TransportRoles[LoadedModel]) -> None:
    if ws.task not in ("causal-lm", "seq2seq"):  # a model the plan could not see (not downloaded or trained then)
        raise cannot_calibrate(type(models.finetune.model).__name__, ws.task)


def texts(ws: Workspace, models: TransportRoles[LoadedModel], cal: Calibrate) -> Texts | Seq2SeqTexts:
    """The calibration text (given or written by the fine-tune), its held-out part and the target's own;
    an encoder-decoder's: continuations of sources from data (`run.calibrate_seq2seq`)."""
    _check_generates(ws, models)
    if ws.task == "seq2seq":
        return seq2seq_texts(ws, models, cal, (_rows(ws, 0), _rows(ws, 2)), _seq2seq_reader)
    teacher, guard = models.finetune.model, models.target.model
    length = _block_size(teacher.config, cal.block_size, "calibrate")
    tokenizer = _teacher_tokenizer(ws)
    ft_rows = _rows(ws, 2)
    start_own, start_about = opening(tokenizer)
    given = cal.data if cal.data is not None else ws.recipe.data
    about: dict[str, Any]
    if given is not None:
        text, about = _read(ws, given, cal, length, teacher), {"source": "data", "dataset": given.dataset}
    else:
        start = ft_rows.ids(start_own)
        if len(start) >= length:
            raise DataError(f"`calibrate.block_size` ({length}) leaves no room after the opening ({len(start)} tokens)")
        text = self_written(teacher, start, cal.samples, length, seed=cal.seed, rows=ft_rows, progress=_bar(ws))
        about = {"source": "written by the fine-tune", "opening": start_about}
    about |= {"sequences": len(text), "tokens": int(text.numel()), "block_size": length}
    guard_text = None
    if cal.guard > 0:
        g_tokenizer = ws.rows.tokenizers[0] if ws.rows is not None else tokenizer
        g_start = _rows(ws, 0).ids(plain_start(g_tokenizer)[0])  # plain text, never a chat turn
        guard_text = self_written(guard, g_start, len(text), length, seed=cal.seed + 1, rows=_rows(ws, 0))
        about["guard"] = f"{len(guard_text)} sequences written by the target"
    end_own = turn_end(tokenizer)
    end = ft_rows.ids([end_own])[0] if end_own is not None else None
    tail = ft_rows.ids(reply_tail(tokenizer)) if end is not None else []
    held = min(cal.held, len(text) - 1)
    return Texts(text[held:], text[:held], guard_text, about, end, tail)


def _seq2seq_reader(ws: Workspace) -> Any:
    """The tokenizer of an encoder-decoder's calibration data (ids in working rows)."""
    if ws.processor is not None:
        return ws.processor
    return _teacher_tokenizer(ws) if ws.rows is None else data_processor(ws.inputs, "seq2seq", ws.rows)


def _read(ws: Workspace, spec: Any, cal: Calibrate, length: int, teacher: Any) -> Tensor:
    """``spec``'s text in blocks of ``length`` tokens (working rows), at most ``samples`` of them."""
    batching = BatchSpec("causal-lm", cal.samples, None, None, cal.seed)
    where = "calibrate.data" if cal.data is not None else "data"
    sized = spec.model_copy(update={"block_size": length})
    made = batches(sized, batching, ws.base_dir, _reader(ws), teacher.config, where=where)
    ids = torch.cat([b["input_ids"] for b in made])[: cal.samples] if made else torch.zeros(0, length)
    if len(ids) < 2:
        raise DataError(
            f"`{where}`: {len(ids)} block of {length} tokens; calibration needs at least 2 (one held out): give more text"
        )
    return ids.long()


def _bar(ws: Workspace) -> Any:
    return lambda done, total: ws.progress("calibration text written by the fine-tune", done, total)


def lesson_of(models: TransportRoles[LoadedModel], t: Texts, ws: Workspace) -> Lesson:
    return Lesson(
        models.finetune.model, t.train, _rows(ws, 2), models.target.model, t.guard, _rows(ws, 0), tuple(t.reply_tail)
    )


def new_rows(ws: Workspace) -> Tensor:
    """Working rows of tokens the target lacks (the fine-tune's new tokens)."""
    if ws.rows is None:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(~ws.rows.layout.present(0)).squeeze(-1)


def _prompts(t: Texts, context: int, skip: int = 0, n: int = REPLY_PROMPTS) -> list[list[int]]:
    """Held-out user turns, each up to its turn end, then the template's opening of a reply: the
    shortest (after the ``skip`` shortest), so that most leave a whole reply's room in the context."""
    if t.end is None:
        return []
    out = []
    for row in t.held.tolist():
        if t.end in row[1:]:
            prompt = row[: row.index(t.end, 1)] + t.reply_tail
            if len(prompt) + 8 <= context:
                out.append(prompt)
    return sorted(out, key=len)[skip : skip + n]


def _measure(model: Any, teacher: Any, t: Texts, rows: Rows, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """KL to the teacher, turn-end top-1 and replies ended; the teacher itself is at KL 0 by definition."""
    out: dict[str, Any] = {"kl": 0.0 if model is teacher else kl(teacher, model, t.held, rows, 8)}
    if t.end is not None:
        out["turn_end"] = turn_end_rate(model, t.held, t.end, 8)
        out["replies"] = replies_ended(model, prompts, t.end, tokens)
    return out


def calibrated(
    ws: Workspace, models: TransportRoles[LoadedModel], template: Any, state: Mapping[str, Tensor], untie: bool
) -> tuple[Mapping[str, Tensor], Calibration]:
    """``state`` (the moved model's weights, working rows) fitted to the fine-tune, and the record."""
    cal = settings(ws)
    start = time.perf_counter()
    models = whole(ws, models)
    t = texts(ws, models, cal)
    student = _student(ws, template, state, untie)
    fitted = fittable(student, cal.fit, rank=cal.rank, new_rows=new_rows(ws), seed=cal.seed)
    record = fit_and_measure(ws, models, student, fitted, t, start)
    if not record.kept:
        return state, record
    fitted.fold()
    fitted_state = student.state_dict()
    dtype = state.dtype if isinstance(state, LazyState) else (lambda n: state[n].dtype)
    return {n: fitted_state[n].detach().to(dtype(n)) for n in state}, record


def whole(ws: Workspace, models: TransportRoles[LoadedModel]) -> TransportRoles[LoadedModel]:
    """``models`` with the fine-tune and (with a guard) the target in memory, where the transport
    streamed them: read once from their files into their class, in the dtype they are stored in
    (bfloat16 or float16; float32 otherwise). Only these run (teacher and guard); the base stays on
    disk."""

    def loaded(lm: LoadedModel) -> LoadedModel:
        if lm.source is None:
            return lm
        dtype = lm.stored_dtype if lm.stored_dtype in (torch.bfloat16, torch.float16) else torch.float32
        model = materialized(type(lm.model), lm.model.config, lm.source, ws.device, dtype)
        return dataclasses.replace(lm, model=model, source=None)

    target = loaded(models.target) if settings(ws).guard > 0 else models.target
    return dataclasses.replace(models, finetune=loaded(models.finetune), target=target)


def _student(ws: Workspace, template: Any, state: Mapping[str, Tensor], untie: bool) -> Any:
    """The moved model in float32, to fit: a streamed transport's weights are computed once, tensor
    by tensor, into a model built without a random initialisation."""
    if isinstance(state, LazyState):
        return materialized(type(template), output_config(template, untie), state, ws.device, torch.float32)
    return rebuilt(template, state, untie).float()


def fit_and_measure(
    ws: Workspace,
    models: TransportRoles[LoadedModel],
    student: Any,
    fitted: Fitted,
    t: Texts | Seq2SeqTexts,
    start: float,
) -> Calibration:
    """``fitted`` of ``student`` fitted on ``t``, measured before and after (the record); the
    corrections stay hooked on for the measure after, for the caller to fold or read."""
    cal = settings(ws)
    if isinstance(t, Seq2SeqTexts):
        return fit_and_measure_seq2seq(ws, models, student, fitted, t, cal, start)
    context = _context(models.finetune.model.config)
    prompts = _prompts(t, context)
    tokens = min(REPLY_TOKENS, context - max((len(p) for p in prompts), default=0))
    teacher, rows = models.finetune.model, _rows(ws, 2)
    own = _measure(teacher, teacher, t, rows, prompts, tokens)
    before = _measure(student, teacher, t, rows, prompts, tokens)
    steps = cal.budget(fitted.fit == "adapter")
    budget = Budget(steps, cal.batch_size, cal.learning_rate, cal.guard, cal.seed, cal.on_policy, cal.divergence)
    stage = f"calibrating ({fitted.fit})"
    select = _selector(student, fitted, t, context, steps)

    def report(done: int, total: int, _loss: float) -> None:
        ws.progress(stage, done, total)
        if select is not None:
            select.progress(done)

    distill(student, lesson_of(models, t, ws), fitted, budget, progress=report)
    kept_step = None
    if select is not None:
        kept_step = select.finish()
        _note_selected(ws, select, kept_step)
    after = _measure(student, teacher, t, rows, prompts, tokens)
    kept = kept_or_noted(ws, before["kl"], after["kl"], "text", "token")
    return outcome(
        cal,
        fitted,
        steps,
        start,
        kept,
        Measured(teacher=0.0, before=before["kl"], after=after["kl"]),
        t.about | ({"reply_prompts": len(prompts), "reply_tokens": tokens} if prompts else {}),
        turn_end=_measured("turn_end", own, before, after),
        replies=_measured("replies", own, before, after),
        judged=sorted(select.seen.items()) if select is not None else None,
        kept_step=kept_step,
    )


def _selector(student: Any, fitted: Fitted, t: Texts, context: int, steps: int) -> BestPoint | None:
    """For a chat model, the judge of the fit's points (`merging.calibration.select`), on held-out
    user turns other than the record's; None where there is no turn end, nothing to judge on, or
    every parameter is fitted (a copy of the point kept would be a second model)."""
    prompts = _prompts(t, context, skip=REPLY_PROMPTS, n=SELECT_PROMPTS)
    if t.end is None or not prompts or fitted.fit == "full":
        return None
    tokens = min(REPLY_TOKENS, context - max(len(p) for p in prompts))
    return BestPoint(student, fitted, prompts, t.end, tokens, steps)


def _note_selected(ws: Workspace, select: BestPoint, step: int) -> None:
    if step == select.steps:
        return
    seen = ", ".join(f"{s}: {100 * r:.0f} %" for s, r in sorted(select.seen.items()))
    ws.notes.append(
        f"calibration kept the fit at step {step} of {select.steps}: of {len(select.prompts)} held-out user turns "
        f"(not those the record reports), greedy replies ended at step {seen}"
    )


def _context(config: Any) -> int:
    """Positions the model reads (GPT-2's ``n_positions``, else ``max_position_embeddings``)."""
    for name in ("n_positions", "max_position_embeddings"):
        found = getattr(config, name, None)
        if isinstance(found, int) and found > 0:
            return found
    return 2048


def _measured(key: str, own: Mapping[str, Any], before: Mapping[str, Any], after: Mapping[str, Any]) -> Measured | None:
    if own.get(key) is None:
        return None
    return Measured(teacher=own[key], before=before[key], after=after[key])
