"""Checks that need no weights: model folders, repository code, tokenizers, adapters, data files,
the task, the output folder and the push token, each written once. The plan runs them on what it
can see (`check_plan`); the fetch runs `check_models` again on what the plan could not (a Hub model
not downloaded, a zoo model not trained), skipping what was checked."""

from __future__ import annotations

import glob
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_rebasin.core.errors import DataError, IncompatibleModelsError, MissingDataError, UnsupportedArchitectureError
from hf_rebasin.core.roles import Roles, TransportRoles
from hf_rebasin.evaluation.evaldata import check_files
from hf_rebasin.evaluation.evaluate import task_of_class
from hf_rebasin.io.files import read_config
from hf_rebasin.io.gate import check_folder
from hf_rebasin.io.hub.client import HubError
from hf_rebasin.io.hub.push import has_token
from hf_rebasin.io.output import check_output
from hf_rebasin.io.remote_code import refuse_remote_code
from hf_rebasin.merging.lora import adapter_config, is_adapter
from hf_rebasin.merging.vocabulary import checks as vocabulary
from hf_rebasin.recipe import DataSpec, FineTuneRef, ModelRef, Recipe
from hf_rebasin.run.resolve import PlannedModel

__all__ = [
    "ModelChecks",
    "check_adapter",
    "check_data_files",
    "check_models",
    "check_plan",
    "check_push_token",
    "check_remote_code",
    "check_task_of_folder",
    "check_tokenizers",
    "gate",
    "read_paths",
    "task_folder",
    "task_mismatch",
]


def check_data_files(spec: DataSpec, where: str) -> None:
    """The files a data section names exist (globs match something), as `load_records` will check."""
    try:
        check_files(spec.data_files, spec.data_dir, Path.cwd())
    except DataError as e:
        raise DataError(f"`{where}`: {e}") from None


def read_paths(recipe: Recipe, models: Sequence[PlannedModel]) -> list[tuple[str, Path]]:
    """``(label, path)`` of everything a run reads: model folders, data files, the recipe file
    (an output that overlaps one of them is refused)."""
    out: list[tuple[str, Path]] = []
    if Path(recipe.source).is_file():
        out.append(("the recipe file", Path(recipe.source)))
    for m in models:
        label = f"`{m.where.removesuffix('.model')}`"
        if m.ref.source == "local":
            out.append((label, Path(m.ref.model)))
        if m.folder is not None:
            out.append((label, m.folder))
    ev = recipe.evaluate
    sections = (
        ("data", recipe.data),
        ("evaluate.data", ev.data if ev else None),
        ("evaluate.support", ev.support if ev else None),
    )
    for where, spec in sections:
        if spec is not None:
            out.extend(_data_paths(where, spec))
    return out


def _data_paths(where: str, spec: DataSpec) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    if Path(spec.dataset).is_absolute():  # a local dataset folder
        out.append((f"the `{where}.dataset` folder", Path(spec.dataset)))
    try:
        found = check_files(spec.data_files, spec.data_dir, Path.cwd())
    except DataError:  # reported where the files are checked
        return out
    files = found.get("data_files")
    entries = [files] if isinstance(files, str) else list(files.values()) if isinstance(files, dict) else files
    for entry in entries or []:
        for pattern in [entry] if isinstance(entry, str) else entry:
            matches = glob.glob(pattern, recursive=True) or [pattern]
            out.extend((f"the `{where}` data file", Path(m)) for m in matches)
    if "data_dir" in found:
        out.append((f"the `{where}.data_dir` folder", Path(found["data_dir"])))
    return out


def task_folder(models: Roles[PlannedModel]) -> Path | None:
    """The folder whose head sets the task: the reference, or for a transport the fine-tune (its
    head may be new), unless that is an adapter (then its base)."""
    if not isinstance(models, TransportRoles):
        return models.reference.folder
    ft = models.finetune.folder
    return ft if ft is not None and (ft / "config.json").is_file() else models.base.folder


def _same_base(named: str, ref: ModelRef, folder: Path | None) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names the recipe's ``base``."""
    candidates = {ref.model, str(ref)}
    if folder is not None:
        candidates.add(str(folder))
        candidates.add(str(folder.resolve()))
    if named in candidates:
        return True
    # a Hub id written with or without its owner (`gpt2` vs `openai-community/gpt2`)
    return ref.source == "hub" and named.rsplit("/", 1)[-1] == ref.model.rsplit("/", 1)[-1]


def check_adapter(recipe: Recipe, models: TransportRoles[PlannedModel]) -> list[str]:
    """A LoRA ``finetuned``: readable, plain LoRA, and trained on ``base`` (or ``check_base: false``).

    Returns notes for the run (a mismatch allowed by ``check_base: false``).
    """
    folder = models.finetune.folder
    ft = models.finetune.ref
    if (
        folder is None
        or not isinstance(ft, FineTuneRef)
        or not is_adapter(folder)
        or (folder / "config.json").is_file()
    ):
        return []
    config = adapter_config(folder, "finetuned.model", tokens=True)  # trainable tokens: merged at load
    named = config.get("base_model_name_or_path")
    base = models.base.ref
    if not named or _same_base(str(named), base, models.base.folder):
        return []
    if ft.check_base:
        raise IncompatibleModelsError(
            f"`finetuned.model`: the adapter {ft} was trained on {named!r} (base_model_name_or_path in "
            f"adapter_config.json), but `base` is {base}. Transporting it from the wrong base moves the wrong "
            f"task vector. If {named!r} is {base} under another name, set `finetuned.check_base: false`"
        )
    return [f"the adapter names {named!r} as its base; `base` is {base} (check_base: false)"]


def check_tokenizers(
    recipe: Recipe, models: Sequence[PlannedModel], skip: Collection[int] = ()
) -> dict[int, str | None]:
    """`vocabulary.checks.check_tokenizers` of the recipe's models (those not downloaded or trained
    yet left out), under its ``allow_different_tokenizers``: notes by model index."""
    checked = [
        vocabulary.CheckedModel(m.path if m.folder is not None and m.ready else None, m.where, str(m.ref))
        for m in models
    ]
    return vocabulary.check_tokenizers(checked, allow_different=recipe.allow_different_tokenizers, skip=skip)


def check_remote_code(recipe: Recipe, folder: Path, where: str) -> None:
    """A model whose loader files (config, tokenizer, processor, generation config) name their own
    code (``auto_map``) needs ``trust_remote_code``, and even then no repository code runs: the
    weights go into the stock class of their ``model_type`` (every tensor's shape is checked)."""
    refuse_remote_code(folder, where, trusted=recipe.trust_remote_code)


def _config_json(folder: Path) -> dict[str, Any]:
    """A folder's config.json as a dict; empty when missing (a zoo model not trained yet)."""
    if not os.path.lexists(folder / "config.json"):
        return {}
    return read_config(folder)  # through the gate: confined, regular, typed


def task_mismatch(task: str, class_name: str, implied: str) -> UnsupportedArchitectureError:
    """The error of an ``evaluate.task`` that does not fit the reference model's head."""
    return UnsupportedArchitectureError(
        f"`evaluate.task`: {task!r} does not fit the reference model, a {class_name} (its task is {implied!r}); "
        f"set `task: {implied}`"
    )


def check_task_of_folder(recipe: Recipe, folder: Path) -> None:
    """``evaluate.task`` against the head named in A's config.json (no weights needed)."""
    if recipe.evaluate is None:
        return
    # a zoo model not trained yet has no config.json: its task is checked after loading
    architectures = _config_json(folder).get("architectures") or []
    implied = task_of_class(str(architectures[0])) if architectures else None
    if implied is not None and implied != recipe.evaluate.task:
        raise task_mismatch(recipe.evaluate.task, str(architectures[0]), implied)


def cannot_calibrate(cls: str, task: str) -> IncompatibleModelsError:
    """The refusal of a calibration whose fine-tune writes no text (a classifier, a masked LM)."""
    return IncompatibleModelsError(
        f"`calibrate`: calibration fits next-token distributions, and the fine-tune is a {cls} ({task}), which "
        "writes no text to calibrate on: set `calibrate: false` for the data-free transport"
    )


def no_sources(cls: str) -> MissingDataError:
    """The refusal of an encoder-decoder's calibration without data to read its sources from."""
    return MissingDataError(
        f"`calibrate.data`: the fine-tune is a {cls}, an encoder-decoder, which writes from a source and cannot "
        "write its own: give `calibrate.data` (source → target pairs, or plain text, noised as the model was "
        "pretrained) or the recipe's `data` to calibrate on its sources, or set `calibrate: false` for the "
        "data-free transport"
    )


def check_calibration(recipe: Recipe, folder: Path) -> None:
    """A calibrating transport needs a fine-tune that writes text (its head, from config.json); an
    encoder-decoder's, data to read its sources from."""
    cal = getattr(recipe, "calibrate", None)
    if cal is None:
        return
    architectures = _config_json(folder).get("architectures") or []  # none yet: checked after loading
    implied = task_of_class(str(architectures[0])) if architectures else None
    if implied == "seq2seq" and cal.data is None and recipe.data is None:
        raise no_sources(str(architectures[0]))
    if implied is not None and implied not in ("causal-lm", "seq2seq"):
        raise cannot_calibrate(str(architectures[0]), implied)


def check_push_token(recipe: Recipe) -> None:
    """A push needs a token: refused before any work is done, not after an hour of it."""
    push = recipe.output.push_to_hub
    if push is not None and not has_token():
        raise HubError(
            f"`output.push_to_hub`: pushing to {push.repo!r} needs a token: set HF_TOKEN or run `hf auth login` "
            "(checked before any work is done)"
        )


@dataclass(frozen=True)
class ModelChecks:
    """What the checks of the models' files found, so that a later `check_models` (after the fetch)
    runs only what is left."""

    remote: frozenset[int] = frozenset()  # models (by recipe index) scanned for repository code
    tokenizers: tuple[tuple[int, str | None], ...] = ()  # (index, note or None) of each model checked
    adapter: tuple[str, ...] | None = None  # the adapter check's notes; None: it waits for the download

    def tokenizer_notes(self) -> list[str]:
        return [note for _, note in self.tokenizers if note]


def gate(recipe: Recipe, models: Sequence[PlannedModel]) -> None:
    """Every file a run reads of each model that is on disk, through the gate (`gate.check_folder`):
    the first thing done with a model folder, before the scan for repository code, the tokenizer
    comparison, the widths or the memory estimate read a byte of it."""
    for m in models:
        if m.ready:
            check_folder(m.path, allow_pickle=recipe.allow_pickle, where=f"`{m.where}`")


def check_models(recipe: Recipe, models: Roles[PlannedModel], done: ModelChecks | None = None) -> ModelChecks:
    """The models' files through the gate, then their repository code, a LoRA fine-tune's base and
    the tokenizers, skipping what ``done`` checked. Before the fetch (``done`` None) a folder without
    config.json (a zoo model not trained yet, an adapter) waits for the fetch's scan."""
    gate(recipe, models.all)  # before any byte of a model's files is read
    if done is None:
        remote = {i for i, m in enumerate(models.all) if m.folder is not None and (m.folder / "config.json").is_file()}
    else:
        remote = set(range(len(models.all))) - done.remote
    for i in sorted(remote):
        check_remote_code(recipe, models.all[i].path, models.all[i].where)
    before = done or ModelChecks()
    adapter = before.adapter
    if isinstance(models, TransportRoles) and adapter is None:
        notes = tuple(check_adapter(recipe, models))
        adapter = notes if models.base.ready and models.finetune.ready else None
    checked = dict(before.tokenizers)
    found = {**checked, **check_tokenizers(recipe, models.all, skip=checked.keys())}
    ready = models.reference.ready
    return ModelChecks(
        remote=frozenset(remote | before.remote),
        tokenizers=tuple((i, note) for i, note in sorted(found.items()) if ready and models.all[i].ready),
        adapter=adapter,
    )


def check_plan(recipe: Recipe, models: Roles[PlannedModel], output: Path, field: str) -> ModelChecks:
    """Every check that needs no weights, on what the plan can see: the models (`check_models`),
    the task against the head config.json names, the data files, the output folder (``field``
    names it in messages) and the push token."""
    checks = check_models(recipe, models)
    folder = task_folder(models)
    if folder is not None:
        check_task_of_folder(recipe, folder)
        check_calibration(recipe, folder)
    if recipe.data is not None:
        check_data_files(recipe.data, "data")
    if recipe.evaluate is not None:
        check_data_files(recipe.evaluate.data, "evaluate.data")
    check_output(output, recipe.output.overwrite, inputs=read_paths(recipe, models.all), where=field)
    check_push_token(recipe)
    return checks
