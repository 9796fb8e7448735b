"""Calibration of a moved LoRA adapter: its own factors fitted at their rank, so it stays an adapter.

The student is the target as PEFT would load the written adapter onto it: the tensors the adapter
stores whole (biases, ``modules_to_save``, the embedding and head with new tokens) in place, and
every factor pair hooked onto its layer with PEFT's scale times α. The factors (and the new tokens'
rows) are fitted to the fine-tune like a full model's correction (`run.calibrate`), then written
back in the adapter, where PEFT's ``scale · (α·B)·A`` is what the student computed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.roles import TransportRoles
from hf_rebasin.evaluation.scores import Calibration
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.io.rebuild import rebuilt
from hf_rebasin.merging.calibration.fit import adapter_fittable
from hf_rebasin.merging.lora import scaled_tensors, whole_tensor_names
from hf_rebasin.merging.vocabulary.adapter_tokens import added
from hf_rebasin.run.calibrate import fit_and_measure, new_rows, settings, texts
from hf_rebasin.run.load import Workspace
from hf_rebasin.run.lora_output import MovedAdapter

__all__ = ["calibrated_adapter"]


def _student_state(adapter: MovedAdapter, alpha: float) -> dict[str, Tensor]:
    """The target with what the adapter stores whole, for ``alpha``, and its embedding-layer
    factors merged (they are kept as moved, not fitted)."""
    written = adapter.written
    state = dict(adapter.target)
    names = whole_tensor_names(written, adapter.whole)
    scaled = scaled_tensors(written, adapter.factors, alpha, adapter.target, adapter.whole)
    for key, name in names.items():
        if key in scaled:
            state[name] = scaled[key].to(state[name].dtype)
    if adapter.vocab is not None:
        state.update(added(*adapter.vocab, alpha))
    for m in written.modules.values():
        if m.kind == "embedding":
            moved = dataclasses.replace(m, a=adapter.factors[m.key_a], b=adapter.factors[m.key_b])
            w = state[m.weight]
            state[m.weight] = (w.to(torch.float32) + alpha * moved.delta()).to(w.dtype)
    return state


def calibrated_adapter(
    ws: Workspace, models: TransportRoles[LoadedModel], adapter: MovedAdapter, alpha: float
) -> tuple[MovedAdapter, Calibration]:
    """``adapter`` (moved, for ``alpha``) with its factors and new rows fitted to the fine-tune."""
    cal = settings(ws)
    start = time.perf_counter()
    t = texts(ws, models, cal)
    state = _student_state(adapter, alpha)
    untie = adapter.vocab is not None and len(adapter.vocab[0]) > 1
    student = rebuilt(models.target.model, state, untie).float()
    trained = [m for m in adapter.written.modules.values() if m.kind != "embedding"]
    factors = {m.module: (adapter.factors[m.key_a], adapter.factors[m.key_b], m.scale * alpha) for m in trained}
    fitted = adapter_fittable(student, factors, new_rows=new_rows(ws) if adapter.vocab is not None else _none())
    record = fit_and_measure(ws, models, student, fitted, t, start)
    fitted.unhook()
    if not record.kept:
        return adapter, record
    out = dict(adapter.factors)
    for m, c in zip(trained, fitted.corrections, strict=True):
        out[m.key_a] = c.a.detach().to(adapter.factors[m.key_a].dtype)
        out[m.key_b] = c.b.detach().to(adapter.factors[m.key_b].dtype)
    vocab = adapter.vocab
    if vocab is not None and fitted.rows:
        learned = student.state_dict()
        rows = {n: learned[n].detach().to(given.dtype) for n, given in vocab[0].items()}
        vocab = (rows, {n: torch.zeros_like(t) for n, t in rows.items()})  # B + α·0: the rows as fitted
    return dataclasses.replace(adapter, factors=out, vocab=vocab), record


def _none() -> Any:
    return torch.zeros(0, dtype=torch.long)
