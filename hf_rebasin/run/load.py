"""The workspace of a run: its models loaded by role, the alignment and evaluation data
(`data.read_data`), the stage clock and the notes, built once from a `Plan`; every job reads it
and nothing reloads.

Jobs read a model's tensors through `weights`, not through the module, so that a tensor source
reading from disk can stand in for a loaded model where no forward pass is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.alignment.strategies import AlignmentData
from hf_rebasin.alignment.widths import to_widest, widths
from hf_rebasin.core.errors import IncompatibleModelsError, named
from hf_rebasin.core.roles import MergeRoles, Roles, TransportRoles
from hf_rebasin.evaluation.evaluate import Task
from hf_rebasin.evaluation.record import DtypeEntry
from hf_rebasin.io.checks import check_same_shapes
from hf_rebasin.io.models import LoadedModel, check_compatible, load_model, resolve_device, to_device
from hf_rebasin.io.ties import untied_note
from hf_rebasin.merging.initialised import initialised_note
from hf_rebasin.merging.lora import LoraAdapter, is_adapter
from hf_rebasin.merging.transport import check_shared
from hf_rebasin.merging.vocabulary.output import RunVocabulary, to_rows
from hf_rebasin.recipe import Recipe
from hf_rebasin.recipe.jobs import get_job
from hf_rebasin.run.adapter_models import is_bare_adapter, merged_into
from hf_rebasin.run.alignment_cache import RunCache
from hf_rebasin.run.clock import Progress, StageClock, noop
from hf_rebasin.run.data import AlignInput, metrics, read_data
from hf_rebasin.run.dtypes import OutputDtype, output_dtype
from hf_rebasin.run.fetch import fetch
from hf_rebasin.run.plan import Plan
from hf_rebasin.run.resolve import PlannedModel
from hf_rebasin.run.score import Scorer

__all__ = ["LOAD_STAGE", "Workspace", "load_workspace", "weights"]

LOAD_STAGE = "loading models"


def weights(lm: LoadedModel) -> Mapping[str, Tensor]:
    """A model's tensors by name: the one place jobs read weights (a streamed model's are read
    from disk one at a time, see `tensors.CheckpointSource`)."""
    return lm.weights


@dataclass
class Workspace:
    """What every job has once its models and data are loaded."""

    plan: Plan
    inputs: Roles[PlannedModel]  # as resolved after download: every folder known
    models: Roles[LoadedModel]
    task: Task  # the data's task (a transport: the fine-tune's)
    processor: Any  # A's tokenizer or image processor (None without data)
    align: AlignInput | None
    eval_batches: list[dict[str, Tensor]] | None
    clock: StageClock
    notes: list[str]
    cache: RunCache
    score: Scorer  # rounds to the output dtype before it scores
    output_dtype: OutputDtype  # what the savers write in
    dtype: DtypeEntry  # the record's entry
    device: torch.device
    base_dir: Path
    progress: Progress
    adapter: LoraAdapter | None = None  # transport: the fine-tune is this LoRA adapter (merged into A)
    rows: RunVocabulary | None = None  # the vocabularies, where they differ (`merging.vocabulary.output`)

    @property
    def recipe(self) -> Recipe:
        return self.plan.recipe

    @property
    def output(self) -> Path:
        return self.plan.output

    @property
    def data(self) -> AlignmentData | None:
        return self.align.data if self.align is not None else None

    @property
    def align_batches(self) -> list[dict[str, Tensor]] | None:
        return self.align.batches if self.align is not None else None

    @property
    def timings(self) -> dict[str, float]:
        return self.clock.seconds

    @property
    def speech(self) -> bool:
        """Whether the models read audio features (Whisper): their outputs load with the speech classes."""
        return getattr(self.models.reference.model, "main_input_name", "") == "input_features"


def load_workspace(plan: Plan, *, progress: Progress | None = None) -> Workspace:
    """Fetch what the plan resolved (`fetch.fetch`), load every model by role, read the data once.

    Zoo models trained on first use are timed apart (``train``); the rest is ``load``. A run whose
    estimated peak memory exceeds what is available stops before loading (`Plan.check_memory`)."""
    report = progress or noop
    dev = resolve_device(plan.device)
    clock, notes = StageClock(), list[str]()
    run_cache = RunCache(plan.recipe, plan.base_dir, notes, report)
    metric_list = metrics(plan.recipe, plan.base_dir)  # before any model loads: a metric that does not load fails fast
    with clock.stage("train" if plan.trains else "load"):
        plan = fetch(plan, report, notes)
    if plan.check_memory and plan.memory is not None:  # with every model downloaded: their sizes are known now
        plan.memory.check()
    recipe, inputs, base_dir = plan.recipe, plan.models, plan.base_dir
    with clock.stage("load"):
        notes.extend(plan.checks.adapter or ())
        models, adapter, rows = _load_models(plan, dev, report)
        notes.extend(_loading_notes(recipe, inputs, models, dev))
        notes.extend(rows.notes() if rows is not None else [])
        written, dtype_entry = output_dtype(recipe, models, adapter, notes)
        data = read_data(recipe, base_dir, inputs, models, rows)
        notes.extend(data.notes)
    return Workspace(
        plan=plan,
        inputs=inputs,
        models=models,
        task=data.task,
        processor=data.processor,
        align=data.align,
        eval_batches=data.eval_batches,
        clock=clock,
        notes=notes,
        cache=run_cache,
        score=Scorer(written.dtype, metric_list, written.kept),
        output_dtype=written,
        dtype=dtype_entry,
        device=dev,
        base_dir=base_dir,
        progress=report,
        adapter=adapter,
        rows=rows,
    )


def _loading_notes(
    recipe: Recipe, inputs: Roles[PlannedModel], models: Roles[LoadedModel], dev: torch.device
) -> list[str]:
    """What loading did that the record must say: tensors the files hold but loading dropped, ties
    the files contradict (read untied), models embedded into a wider shape, an adapter merged as a
    full fine-tune, weights streamed."""
    notes = [ignored_note(str(m.ref), lm.ignored) for m, lm in zip(inputs.all, models.all, strict=True) if lm.ignored]
    notes.extend(untied_note(str(m.ref), lm.untied) for m, lm in zip(inputs.all, models.all, strict=True) if lm.untied)
    notes.extend(
        initialised_note(str(m.ref), lm.initialised)
        for m, lm in zip(inputs.all, models.all, strict=True)
        if lm.initialised
    )
    notes.extend(lm.embedded for lm in models.all if lm.embedded)
    if isinstance(models, TransportRoles) and models.finetune.embedded and is_adapter(models.finetune.path):
        notes.append(
            "the LoRA adapter was merged into its narrower base and moved as a full fine-tune: the output is a "
            "full model of the target's shape, not an adapter (its factors have the narrow base's widths)"
        )
    sources = [lm.source for lm in models.all if lm.source is not None]
    if sources:
        on = sources[0].device
        where = f"; tensor math on {on}" + (
            " (MPS has no float64: forward passes only on mps)" if dev.type == "mps" else ""
        )
        why = f"a {recipe.job} without evaluation needs no model whole in memory"
        if getattr(recipe, "calibrate", None) is not None:
            why += "; calibration then holds the fine-tune and the target as stored, and the moved model it fits"
        notes.append(
            f"weights streamed: read from the safetensors files one tensor at a time and written the same way ({why}){where}"
        )
    return notes


def ignored_note(model: str, ignored: Mapping[str, str]) -> str:
    """The tensors of ``model``'s files that loading dropped, named once (``rebasin.json`` lists them all)."""
    names = sorted(ignored)
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"{model}: {len(names)} tensor{'s' * (len(names) > 1)} of its files ignored as stock transformers ignores "
        f"them when it loads the model (legacy buffers such as position_ids, rotary inv_freq, GPT-2 attn.bias): "
        f"{shown}; see rebasin.json models[].ignored_tensors"
    )


def _load(
    folder: Path, recipe: Recipe, where: str, *, stream: bool = False, device: torch.device | None = None
) -> LoadedModel:
    """`models.load_model` with the recipe's settings; a user error names the recipe field."""
    with named(f"`{where}`", unless_named=True):  # a message that names its field already stays as it is
        return load_model(
            folder,
            allow_pickle=recipe.allow_pickle,
            trust_remote_code=recipe.trust_remote_code,
            stream=stream,
            device=device,
        )


def _load_models(
    plan: Plan, dev: torch.device, report: Progress
) -> tuple[Roles[LoadedModel], LoraAdapter | None, RunVocabulary | None]:
    """Every model on ``dev`` in one vocabulary layout (rows matched by token where the vocabularies
    differ), each checked against the reference (a fine-tune: against its base)."""
    recipe, inputs, stream = plan.recipe, plan.models, plan.streamed
    total = len(inputs.all)
    done: list[LoadedModel] = []
    # streamed tensors are computed on the run's device; MPS has no float64 (the canonical form, the
    # weight views, the float64 sums need it), so there they stay on the CPU
    on = dev if dev.type != "mps" else torch.device("cpu")

    def placed(make: Callable[[], LoadedModel]) -> LoadedModel:
        lm = make()
        if lm.source is None:  # a streamed model's tensors go to the device when they are used
            to_device(lm.model, dev)
        done.append(lm)
        report(LOAD_STAGE, len(done), total)
        return lm

    def loaded(m: PlannedModel) -> LoadedModel:
        return _load(m.path, recipe, m.where, stream=stream, device=on)

    matched = partial(to_rows, plan.vocabulary, data=recipe.data is not None)  # rows matched by token
    report(LOAD_STAGE, 0, total)
    reference = placed(lambda: loaded(inputs.reference))
    if isinstance(inputs, MergeRoles):
        others = [placed(partial(loaded, m)) for m in inputs.others]
        names = [m.named for m in inputs.all]
        every, rows = matched(names, [reference, *others], [m.path for m in inputs.all])
        every, _ = to_widest(every, names)
        for lm in every[1:] if not get_job(plan.job).compares_depths else ():  # such a job maps them itself
            check_compatible(every[0], lm)
        return MergeRoles(every[0], tuple(every[1:])), None, rows
    base = placed(partial(loaded, inputs.base))
    finetune, adapter = _load_finetune(base, inputs.finetune.path, recipe, stream=stream, device=on)
    placed(lambda: finetune)
    folders = [inputs.reference.path, inputs.base.path, inputs.base.path if adapter else inputs.finetune.path]
    where = [m.named for m in (inputs.reference, inputs.base, inputs.finetune)]
    (reference, base, finetune), rows = matched(where, [reference, base, finetune], folders)
    if adapter is None:
        check_finetune(base, finetune)
    if transport_widths(reference, base, where):
        (reference, base, finetune), _ = to_widest([reference, base, finetune], where, into=0)
        adapter = None  # its factors are the narrow base's: moved as the full fine-tune it merges into
    check_compatible(reference, base)
    return TransportRoles(reference, base, finetune), adapter, rows


def transport_widths(target: LoadedModel, base: LoadedModel, where: list[str]) -> bool:
    """Whether the base (and its fine-tune) must be embedded into the target's shape; a target
    narrower than the base is refused: a wide task vector has no exact image in a narrower model."""
    found = widths(target.model.config.to_dict()), widths(base.model.config.to_dict())
    if found[0] == found[1]:
        return False
    narrower = {k: (found[1][k], v) for k, v in found[0].items() if isinstance(v, int) and v < found[1].get(k, v)}
    if narrower:
        what = ", ".join(f"{k} {a} → {b}" for k, (a, b) in narrower.items())
        raise IncompatibleModelsError(
            f"{where[0]} is narrower than the base {where[1]} ({what}): a task vector learned on a wider base has no "
            "exact image in a narrower model (it would need a projection that loses part of it). Transport onto a "
            "target at least as wide as the base in every width; a narrower base's fine-tune is embedded into a "
            "wider target exactly"
        )
    return True


def _load_finetune(
    base: LoadedModel, folder: Path, recipe: Recipe, *, stream: bool = False, device: torch.device | None = None
) -> tuple[LoadedModel, LoraAdapter | None]:
    """A transport's fine-tune, checked against its base: a full model of the same model type (its
    head may differ: a classifier trained on A's features), or a LoRA adapter merged into A."""
    if is_bare_adapter(folder):
        return merged_into(base, folder, allow_pickle=recipe.allow_pickle)
    ft = _load(folder, recipe, "finetuned.model", stream=stream, device=device)
    type_a, type_ft = base.model.config.model_type, ft.model.config.model_type
    if type_a != type_ft:
        raise IncompatibleModelsError(
            f"`finetuned.model`: {str(folder)!r} is a {type(ft.model).__name__} (model_type {type_ft!r}) but its "
            f"base {str(base.path)!r} is a {type(base.model).__name__} (model_type {type_a!r}): a fine-tune keeps "
            "the architecture of the base it was trained from"
        )
    return ft, None


def check_finetune(base: LoadedModel, ft: LoadedModel) -> None:
    """A full fine-tune's tensors against its base's, once both have one vocabulary layout."""
    sd_base, sd_ft = weights(base), weights(ft)
    check_shared(sd_base, sd_ft, "`finetuned.model`")
    if type(ft.model) is type(base.model) and sd_ft.keys() != sd_base.keys():
        check_same_shapes(sd_base, sd_ft, "the base", "the fine-tune")
