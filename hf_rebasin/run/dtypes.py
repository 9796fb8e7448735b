"""The dtype a run writes its output in: ``output.dtype`` when set, else the reference model's
stored dtypes tensor by tensor (a bf16 model's float32 norms stay float32), with the notes that say
so and ``rebasin.json``'s ``dtype`` entry.

Decided once when the workspace loads, from the loaded models; the savers and the scorer read the
`OutputDtype` it gives (the work itself always runs in float32).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hf_rebasin.core.roles import Roles, TransportRoles
from hf_rebasin.evaluation.record import DtypeEntry
from hf_rebasin.io.checkpoint import dtype_name
from hf_rebasin.io.models import WRITABLE_DTYPES, LoadedModel
from hf_rebasin.io.rebuild import float32_tensors
from hf_rebasin.merging.lora import LoraAdapter
from hf_rebasin.recipe import Recipe
from hf_rebasin.recipe.jobs import get_job


@dataclass(frozen=True)
class OutputDtype:
    """The dtype the output is written in, and the tensors written in a dtype of their own (a bf16
    model's float32 norms, kept as stored). float32 and none kept for jobs that write no model."""

    dtype: torch.dtype = torch.float32
    kept: Mapping[str, torch.dtype] = dataclasses.field(default_factory=dict)


def output_dtype(
    recipe: Recipe, models: Roles[LoadedModel], adapter: LoraAdapter | None, notes: list[str]
) -> tuple[OutputDtype, DtypeEntry]:
    """The dtype the output is written in with the tensors written in a dtype of their own, and
    ``rebasin.json``'s ``dtype`` entry.

    ``output.dtype`` when set (every floating tensor); else the reference model's stored dtypes
    (merge: A; transport: the target B, or for an adapter the adapter's own), tensor by tensor, so a
    bf16 model stays bf16 and its float32 norms stay float32. Inputs stored in different dtypes
    follow the reference, with a note. The work itself always runs in float32.
    """
    names = models.names
    inputs = {role: dtype_name(lm.stored_dtype) for role, lm in zip(names, models.all, strict=True)}
    own: dict[str, torch.dtype] = {}
    if not get_job(recipe.job).writes_model:
        return OutputDtype(), DtypeEntry(inputs=inputs)
    if recipe.output.dtype is not None:
        chosen, source = getattr(torch, recipe.output.dtype), "output.dtype"
    elif adapter is not None:
        chosen, source = adapter.dtype, "finetuned"
    else:
        chosen, source = models.reference.stored_dtype, names[0]
        own = models.reference.own_dtypes(chosen)
        transport = isinstance(models, TransportRoles)
        written = (models.target, models.finetune) if isinstance(models, TransportRoles) else models.all
        if len({lm.stored_dtype for lm in written}) > 1:
            shown = ", ".join(f"{role} {name}" for role, name in inputs.items() if role != "base")
            who = "the target B's" if transport else "model A's (the reference)"
            notes.append(
                f"the inputs are stored in different dtypes ({shown}): the output is written in "
                f"{dtype_name(chosen)}, {who}; set `output.dtype` to choose another"
            )
    if chosen not in WRITABLE_DTYPES:
        notes.append(
            f"{names[0]} is stored in {dtype_name(chosen)}, which hf-rebasin does not write: written as float32"
        )
        chosen = torch.float32
    fp32 = _float32_modules(models.reference, chosen, own) if adapter is None else {}
    if fp32:
        notes.append(
            f"{len(fp32)} tensor{'s' * (len(fp32) > 1)} of modules {type(models.reference.model).__name__} keeps in "
            f"float32 (_keep_in_fp32_modules) written in float32, the rest in {dtype_name(chosen)}, as from_pretrained "
            "loads them (listed in rebasin.json's dtype.kept)"
        )
    own = {**own, **fp32}
    kept = {name: dtype_name(dtype) for name, dtype in sorted(own.items())}
    entry = DtypeEntry(inputs=inputs, output=dtype_name(chosen), source=source, kept=kept)
    if own and len(own) > len(fp32):
        counts = Counter(kept.values())
        shown = ", ".join(f"{n} tensor{'s' * (n > 1)} in {d}" for d, n in sorted(counts.items()))
        notes.append(
            f"{names[0]} stores its tensors in more than one dtype: written as stored ({shown}, the rest in "
            f"{dtype_name(chosen)}; listed in rebasin.json's dtype.kept); set `output.dtype` to write one dtype"
        )
    return OutputDtype(chosen, own), entry


def _float32_modules(
    reference: LoadedModel, chosen: torch.dtype, own: Mapping[str, torch.dtype]
) -> dict[str, torch.dtype]:
    """The tensors `from_pretrained` keeps in float32 when it loads the class in ``chosen`` (T5's ``wo``
    in float16, not in bfloat16), and which none of ``own`` already writes apart: written in float32."""
    return {name: torch.float32 for name in sorted(float32_tensors(reference.model, chosen)) if name not in own}
