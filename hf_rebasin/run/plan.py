"""The plan of a run: every check that needs no weights, done once, before anything is loaded.

`build_plan` resolves each model by role (Hub models to a commit, without downloading), checks
repository code, tokenizers, an adapter's base, the task, data files, the output folder and the
push token. ``--dry-run`` prints `Plan.lines`; a run loads from the plan and re-checks only what
the plan could not see (a Hub model not downloaded yet, a zoo model not trained yet).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from hf_rebasin.core.names import VocabularyChoice
from hf_rebasin.core.roles import Roles, TransportRoles
from hf_rebasin.io.files import read_config
from hf_rebasin.io.gate import check_folder
from hf_rebasin.io.output import check_output
from hf_rebasin.recipe import ModelRef, Recipe
from hf_rebasin.recipe.describe import describe
from hf_rebasin.recipe.jobs import get_job
from hf_rebasin.run.checks import (
    check_adapter,
    check_data_files,
    check_push_token,
    check_remote_code,
    check_task_of_folder,
    check_tokenizers,
    read_paths,
    task_folder,
)
from hf_rebasin.run.memory import MemoryEstimate, estimate
from hf_rebasin.run.resolve import PlannedModel, resolve_model

__all__ = [
    "Plan",
    "build_plan",
    "download_line",
    "gate",
    "memory_estimate",
    "plan",
    "streamed",
    "streams",
    "vocabulary_choice",
]

CACHED = " (resolved from the local Hugging Face cache, offline)"


@dataclass(frozen=True)
class Plan:
    """A recipe checked without weights: its models by role, the output, and what was checked."""

    recipe: Recipe
    output: Path  # absolute
    output_field: str  # how messages name the output: `output.dir` or --output
    models: Roles[PlannedModel]
    output_given: bool = False  # ``--output`` overrides the recipe's
    remote_checked: frozenset[int] = frozenset()  # models (by recipe index) checked for repository code
    tokenizer_notes: tuple[tuple[int, str | None], ...] = ()  # (index, note or None) of each model checked
    adapter_notes: tuple[str, ...] | None = None  # None: the adapter check waits for the download
    memory: MemoryEstimate | None = None  # the estimated peak (checked before loading, again after downloads)
    vocabulary_notes: tuple[str, ...] = ()  # what differs between the vocabularies (`vocabulary_notes`)

    @property
    def all(self) -> tuple[PlannedModel, ...]:
        """Every model in the recipe's order (the reference first)."""
        return self.models.all

    def lines(self) -> list[str]:
        """What ``--dry-run`` prints: the recipe described, resolved commits, and that the checks passed."""
        lines = describe(self.recipe, self.output if self.output_given else None)
        for m in self.all:
            if m.resolved.commit is not None:
                lines.append(f"resolved: {m.ref} -> commit {m.resolved.commit}{CACHED if m.resolved.cached else ''}")
        lines.append("downloads:")
        lines.extend(f"  {name}: {download_line(m)}" for name, m in zip(self.models.names, self.all, strict=True))
        lines.extend(self.width_lines())
        lines.extend(self.vocabulary_notes)
        if self.memory is not None:
            lines.extend(self.memory.lines())
        lines.append("checks: models, data files and the output folder are in order; no weights were loaded")
        return lines

    def width_lines(self) -> list[str]:
        """Models of different widths (read from config.json): what the run will embed."""
        from hf_rebasin.alignment.widths import config_widths

        found = [config_widths(_folder(m)) for m in self.all]
        known = [w for w in found if w is not None]
        if not known or all(w == known[0] for w in known[1:]):
            return []
        lines = ["widths differ: the narrower models are written into the widest shape when loaded (in memory):"]
        for name, w in zip(self.models.names, found, strict=True):
            shown = ", ".join(f"{k} {v}" for k, v in (w or {}).items() if v is not None) or "unknown until downloaded"
            lines.append(f"  {name}: {shown}")
        return lines


def download_line(m: PlannedModel) -> str:
    """What fetching ``m`` takes: ``org/name@main (abc1234): downloads 2 files, 12.3 MiB = … bytes
    (model.safetensors, config.json)``, or why nothing is downloaded (a local folder, the cache)."""
    ref, resolved = m.ref, m.resolved
    if ref.zoo is not None:
        return f"{ref.model}: zoo model, nothing downloaded"
    if ref.source != "hub":
        return f"{ref.model}: local folder, nothing downloaded"
    shown = f"{ref.model}@{ref.revision or 'main'}" + (f" ({resolved.commit[:7]})" if resolved.commit else "")
    if resolved.download is not None:
        return f"{shown}: {resolved.download.summary()}"
    if resolved.cached:
        return f"{shown}: already in the cache (offline), nothing downloaded"
    return f"{shown}: downloaded when the run loads it"


def streams(recipe: Recipe) -> bool:
    """Whether the run reads its models tensor by tensor from their files and writes the result
    the same way (memory: a few tensors or one layer, not the models), as the job's rule says
    (`jobs.Job.streams`: a merge or a transport with nothing that needs whole models in memory).
    head-perm's statistics then run layer by layer. A transport streams only a full fine-tune of
    its base's class (`streamed` checks the files)."""
    return get_job(recipe.job).streams(recipe)


def streamed(recipe: Recipe, models: Roles[PlannedModel]) -> bool:
    """`streams`, and for a transport, a fine-tune that is a full model of its base's class
    (config.json says so: an adapter, or a fine-tune with a head of its own, is loaded whole)."""
    if not streams(recipe):
        return False
    from hf_rebasin.alignment.widths import differ_in_width

    if differ_in_width([_folder(m) for m in models.all]):  # the narrower ones are embedded in memory
        return False
    if not isinstance(models, TransportRoles):
        return True

    def architectures(m: PlannedModel) -> Any:
        folder = _folder(m)
        if folder is None or not os.path.lexists(folder / "config.json"):  # not downloaded yet, or an adapter
            return None
        return read_config(folder).get("architectures")  # through the gate

    found = architectures(models.finetune)
    return found is not None and found == architectures(models.base)


def _folder(m: PlannedModel) -> Path | None:
    try:
        return m.path
    except RuntimeError:  # not downloaded yet
        return None


def vocabulary_choice(recipe: Recipe) -> VocabularyChoice | None:
    """The output's vocabulary where the models' differ, as the recipe's job decides it from its
    ``tokenizer`` section (if its job has one; `jobs.Job.vocabulary`); None for a job that decides
    none (lineage compares the rows of the tokens the models share)."""
    rule = get_job(recipe.job).vocabulary
    if rule is None:
        return None
    section = getattr(recipe, "tokenizer", None)
    if section is None:
        return rule(None, None)
    return rule(section.source, section.pad_to_multiple_of)


def vocabulary_notes(recipe: Recipe, models: Roles[PlannedModel]) -> tuple[str, ...]:
    """Vocabularies that differ, decided from the tokenizers and config.json (no weight): what each
    model adds or lacks against the reference and the output's vocabulary, or the error the run's
    load would raise (rows of other counts with no tokenizer to match them by)."""
    from hf_rebasin.merging.vocabulary.output import planned_vocabulary

    if not all(m.ready for m in models.all):
        return ()  # not downloaded or trained yet: the run decides when it loads them
    folders, names, wheres = [m.path for m in models.all], [m.named for m in models.all], [m.where for m in models.all]
    return tuple(planned_vocabulary(vocabulary_choice(recipe), folders, names, wheres))


def memory_estimate(recipe: Recipe, models: Roles[PlannedModel]) -> MemoryEstimate:
    """The run's peak memory, from the files of the models that are local (see `run.memory`)."""
    local = [(m.where, m.folder if m.ready else None) for m in models.all]
    return estimate(recipe, local, streamed=streamed(recipe, models))


def output_path(recipe: Recipe, output: Path | None) -> Path:
    """The output folder, absolute: ``output`` (``--output``) when given, else ``output.dir``."""
    return Path(output if output is not None else recipe.output.dir).expanduser().absolute()


def _planned(recipe: Recipe, entry: tuple[str, ModelRef]) -> PlannedModel:
    """A model resolved without downloading or training it."""
    where, ref = entry
    return PlannedModel(where, ref, resolve_model(ref, where, fetch=False, allow_pickle=recipe.allow_pickle))


def gate(recipe: Recipe, models: tuple[PlannedModel, ...]) -> None:
    """Every file a run reads of each model that is on disk, through the gate (`gate.check_folder`):
    the first thing done with a model folder, before the scan for repository code, the tokenizer
    comparison, the widths or the memory estimate read a byte of it."""
    for m in models:
        if m.ready:
            check_folder(m.path, allow_pickle=recipe.allow_pickle, where=f"`{m.where}`")


def build_plan(recipe: Recipe, *, output: Path | None = None) -> Plan:
    """Resolve and check ``recipe`` without loading a weight (typed errors name the recipe field)."""
    target = output_path(recipe, output)
    field = "--output" if output is not None else "`output.dir`"
    models = recipe.roles().map(partial(_planned, recipe))
    gate(recipe, models.all)  # before any byte of a model's files is read
    remote = frozenset(
        i for i, m in enumerate(models.all) if m.folder is not None and (m.folder / "config.json").is_file()
    )
    for i in sorted(remote):
        check_remote_code(recipe, models.all[i].path, models.all[i].where)
    adapter_notes: tuple[str, ...] | None = None
    if isinstance(models, TransportRoles):
        notes = tuple(check_adapter(recipe, models))
        adapter_notes = notes if models.base.ready and models.finetune.ready else None
    tokenizers = check_tokenizers(recipe, models.all)  # Hub models not downloaded yet: after download
    ready = models.reference.ready
    folder = task_folder(models)
    if folder is not None:
        check_task_of_folder(recipe, folder)
    if recipe.data is not None:
        check_data_files(recipe.data, "data")
    if recipe.evaluate is not None:
        check_data_files(recipe.evaluate.data, "evaluate.data")
    vocabularies = vocabulary_notes(recipe, models)  # the vocabularies decided once, before any weight
    check_output(target, recipe.output.overwrite, inputs=read_paths(recipe, models.all), where=field)
    check_push_token(recipe)
    return Plan(
        recipe,
        target,
        field,
        models,
        output_given=output is not None,
        remote_checked=remote,
        tokenizer_notes=tuple((i, note) for i, note in tokenizers.items() if ready and models.all[i].ready),
        adapter_notes=adapter_notes,
        memory=memory_estimate(recipe, models),
        vocabulary_notes=vocabularies,
    )


def plan(recipe: Recipe, *, output: Path | None = None) -> list[str]:
    """The plan of ``--dry-run`` as lines: `describe` plus the checks that need no weights."""
    return build_plan(recipe, output=output).lines()
