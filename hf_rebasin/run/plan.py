"""The plan of a run: the recipe read and checked once, and every decision that needs no weights.

`build_plan` resolves each model by role (Hub models to a commit, without downloading), runs the
checks (`checks.check_plan`), and decides the output, the vocabulary, streaming and memory and the
steps of the run; `pipeline.execute` runs those steps and never reads the recipe again.
``--dry-run`` prints `Plan.lines`. What the plan could not see (a Hub model not downloaded yet, a
zoo model not trained yet) is checked and decided when it is fetched (`fetched`), by the same
functions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from hf_rebasin.core.names import VocabularyChoice
from hf_rebasin.core.roles import Roles
from hf_rebasin.merging.vocabulary.output import planned_vocabulary
from hf_rebasin.recipe import ModelRef, Recipe
from hf_rebasin.recipe.describe import describe
from hf_rebasin.recipe.jobs import get_job
from hf_rebasin.run.checks import ModelChecks, check_plan
from hf_rebasin.run.memory import MemoryEstimate, estimate, streamed
from hf_rebasin.run.resolve import PlannedModel, resolve_model

__all__ = ["Plan", "PushPlan", "build_plan", "download_line", "fetched", "memory_estimate", "plan", "vocabulary_choice"]

CACHED = " (resolved from the local Hugging Face cache, offline)"


@dataclass(frozen=True)
class PushPlan:
    """Where the finished folder goes (`output.push_to_hub`), with its commit message decided."""

    repo: str
    private: bool | None  # None: the account's default
    revision: str | None
    message: str


@dataclass(frozen=True)
class Plan:
    """A recipe checked without weights, and what the run will do: its models by role, the output,
    the vocabulary, streaming and memory, and its steps (`pipeline.STEPS`)."""

    recipe: Recipe  # the job's options, and the copy of the recipe the record keeps
    output: Path  # absolute
    output_field: str  # how messages name the output: `output.dir` or --output
    models: Roles[PlannedModel]
    checks: ModelChecks  # what was checked (the fetch checks the rest)
    streamed: bool  # models read tensor by tensor from their files (`memory.streamed`)
    memory: MemoryEstimate | None  # the estimated peak (checked before loading, again after downloads)
    vocabulary: VocabularyChoice | None  # the output's vocabulary where the models' differ
    steps: tuple[str, ...]  # what `pipeline.execute` runs, in order
    device: str  # ``--device`` or the recipe's
    base_dir: Path  # where the recipe's relative data paths start
    output_given: bool = False  # ``--output`` overrides the recipe's
    overwrite: bool = False  # `output.overwrite`
    push: PushPlan | None = None  # `output.push_to_hub`
    check_memory: bool = True  # refuse a run whose estimated peak exceeds what is available
    trains: bool = False  # some zoo model is trained on first use (timed apart: ``train``)
    vocabulary_notes: tuple[str, ...] = ()  # what differs between the vocabularies (`vocabulary_notes`)

    @property
    def job(self) -> str:
        return self.recipe.job

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
        lines.extend(self.compute_lines())
        lines.append("steps: " + " → ".join(self.step_words()))
        lines.append("checks: models, data files and the output folder are in order; no weights were loaded")
        return lines

    def compute_lines(self) -> list[str]:
        """A calibrating transport's arithmetic and its time here, once the target's size is known."""
        cal = getattr(self.recipe, "calibrate", None)
        known = self.memory.models[0][1] if self.memory is not None and self.memory.models else None
        if cal is None or known is None:
            return []
        from hf_rebasin.run.compute import compute_line

        return [compute_line(cal, known.params, self.device)]

    def step_words(self) -> list[str]:
        """The steps the run takes, in words: ``load (streamed) → merge → write → push to org/name``."""
        words = {
            "load": "load" + (" (streamed: tensor by tensor from the files)" if self.streamed else ""),
            "job": self.job,
            "write": "write",
            "push": f"push to {self.push.repo}" if self.push is not None else "push",
        }
        return [words[step] for step in self.steps]

    def width_lines(self) -> list[str]:
        """Models of different widths (read from config.json): what the run will embed."""
        from hf_rebasin.alignment.widths import config_widths

        found = [config_widths(m.folder) for m in self.all]
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


def vocabulary_notes(choice: VocabularyChoice | None, models: Roles[PlannedModel]) -> tuple[str, ...]:
    """Vocabularies that differ, decided from the tokenizers and config.json (no weight): what each
    model adds or lacks against the reference and the output's vocabulary, or the error the run's
    load would raise (rows of other counts with no tokenizer to match them by)."""
    if not all(m.ready for m in models.all):
        return ()  # not downloaded or trained yet: the run decides when it loads them
    folders, names, wheres = [m.path for m in models.all], [m.named for m in models.all], [m.where for m in models.all]
    return tuple(planned_vocabulary(choice, folders, names, wheres))


def memory_estimate(recipe: Recipe, models: Roles[PlannedModel], stream: bool) -> MemoryEstimate:
    """The run's peak memory, from the files of the models that are local (see `run.memory`)."""
    local = [(m.where, m.folder if m.ready else None) for m in models.all]
    return estimate(recipe, local, streamed=stream)


def _planned(recipe: Recipe, entry: tuple[str, ModelRef]) -> PlannedModel:
    """A model resolved without downloading or training it."""
    where, ref = entry
    return PlannedModel(where, ref, resolve_model(ref, where, fetch=False, allow_pickle=recipe.allow_pickle))


def _push(recipe: Recipe) -> PushPlan | None:
    push = recipe.output.push_to_hub
    if push is None:
        return None
    message = push.commit_message or f"hf-rebasin {recipe.job} with {recipe.strategy.name} ({Path(recipe.source).name})"
    return PushPlan(push.repo, push.private, push.revision, message)


def build_plan(
    recipe: Recipe, *, output: Path | None = None, device: str | None = None, check_memory: bool = True
) -> Plan:
    """Resolve and check ``recipe`` without loading a weight (typed errors name the recipe field),
    and decide what the run does. ``output`` and ``device`` override the recipe's."""
    target = Path(output if output is not None else recipe.output.dir).expanduser().absolute()
    field = "--output" if output is not None else "`output.dir`"
    source = Path(recipe.source)
    push, choice = _push(recipe), vocabulary_choice(recipe)
    models = recipe.roles().map(partial(_planned, recipe))
    checks = check_plan(recipe, models, target, field)
    stream = streamed(recipe, models)
    return Plan(
        recipe,
        target,
        field,
        models,
        checks,
        stream,
        memory_estimate(recipe, models, stream),
        choice,
        steps=("load", "job", "write", "push") if push is not None else ("load", "job", "write"),
        device=device or recipe.device,
        base_dir=source.parent if source.is_file() else Path.cwd(),
        output_given=output is not None,
        overwrite=recipe.output.overwrite,
        push=push,
        check_memory=check_memory,
        trains=any(m.ref.zoo is not None and not m.ready for m in models.all),
        vocabulary_notes=vocabulary_notes(choice, models),  # the vocabularies decided once, before any weight
    )


def fetched(plan: Plan, models: Roles[PlannedModel], checks: ModelChecks) -> Plan:
    """``plan`` once its models are on disk (`fetch.fetch`): streaming and memory decided again, by
    the same rules, on what the plan could not see."""
    stream = streamed(plan.recipe, models)
    return dataclasses.replace(
        plan, models=models, checks=checks, streamed=stream, memory=memory_estimate(plan.recipe, models, stream)
    )


def plan(recipe: Recipe, *, output: Path | None = None) -> list[str]:
    """The plan of ``--dry-run`` as lines: `describe` plus the checks that need no weights."""
    return build_plan(recipe, output=output).lines()
