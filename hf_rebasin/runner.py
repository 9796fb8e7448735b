"""Running a recipe end to end: load, align, merge, evaluate, write.

This module holds the order of the stages and nothing else: loading is `models`, alignment the
strategies, averaging `merge`, losses `evaluate`, files `export`. It never prints; the CLI passes a
``progress(stage, done, total)`` callback (``total`` 0 when unknown) and prints the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import __version__
from .errors import (
    DataError,
    IncompatibleModelsError,
    ModelNotFoundError,
    RebasinUserError,
    UnsupportedArchitectureError,
)
from .recipe import DEVICE_PATTERN, DataSpec, ModelRef, Recipe, describe

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .evaluate import Curve, Metric, Task
    from .lora import LoraAdapter
    from .models import LoadedModel
    from .strategies import Alignment, AlignmentData
    from .symmetry import SymmetryGraph

__all__ = ["Progress", "ResolvedModel", "RunResult", "plan", "resolve_model", "run_recipe"]

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: the CLI turns each stage into a progress bar (total 0: unknown)."""

LOAD_STAGE = "loading models"
SWEEP_STAGE = "λ sweep"
TEXT_TASKS = ("causal-lm", "masked-lm")
MAX_BLOCK = 128  # tokens per block of evaluation / alignment text
CHECK_ROWS = 4  # examples on which function preservation is measured


@dataclass
class RunResult:
    """What a run produced: where, the curves and barriers, the preservation check and timings."""

    output: Path
    job: str
    strategy: str
    saved_model: bool
    barriers: dict[str, dict[str, float]] = field(default_factory=dict)
    curves: dict[str, Curve] = field(default_factory=dict)
    merged: dict[str, dict[str, Any]] = field(default_factory=dict)  # loss / metric of the merged model(s)
    function_preserved: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    transport: dict[str, Any] = field(default_factory=dict)  # job transport: alphas and scores
    pushed: Any = None  # hub.PushResult when output.push_to_hub succeeded
    push_error: str | None = None  # why the push failed (the local folder is complete)
    canonical: bool = False  # the merged model was saved in canonical form (norm scales folded)
    untied: list[str] = field(default_factory=list)  # tied tensors stored separately in the merged model
    universe: dict[str, Any] = field(default_factory=dict)  # merge.universe: rounds, change per round, reference


def _noop(stage: str, done: int, total: int) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Resolving and planning


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model reference leads: its folder (None: a Hub model not downloaded yet) and commit."""

    folder: Path | None
    commit: str | None = None
    files: tuple[str, ...] | None = None  # a Hub model resolved without download: the files of its commit
    cached: bool = False  # a Hub model taken from the local Hugging Face cache (HF_HUB_OFFLINE=1)


def resolve_model(
    ref: ModelRef,
    where: str = "models.0.model",
    *,
    progress: Progress | None = None,
    fetch: bool = True,
    allow_pickle: bool = False,
    checked: ResolvedModel | None = None,
) -> ResolvedModel:
    """The local folder of a model reference, trained (zoo) or downloaded (Hub) when ``fetch``.

    Without ``fetch`` (a dry run) nothing is trained or downloaded: a zoo model says where it will
    be, a Hub model is resolved to its commit from metadata alone. ``checked`` is that earlier
    resolution: the download then takes its commit. A PEFT adapter is accepted only as a
    transport's ``finetuned``.
    """
    resolved = _resolve(ref, where, progress=progress, fetch=fetch, allow_pickle=allow_pickle, checked=checked)
    if resolved.folder is not None and not where.startswith("finetuned"):
        from .lora import is_adapter

        if is_adapter(resolved.folder) and not (resolved.folder / "config.json").is_file():
            raise ModelNotFoundError(
                f"`{where}`: {ref} is a PEFT adapter, not a model; an adapter can only be the `finetuned` of a "
                "job: transport (its base model goes in `base`)"
            )
    return resolved


def _resolve(
    ref: ModelRef,
    where: str,
    *,
    progress: Progress | None,
    fetch: bool,
    allow_pickle: bool,
    checked: ResolvedModel | None = None,
) -> ResolvedModel:
    adapter_ok = where.startswith("finetuned")
    where = f"`{where}`"
    if ref.zoo is not None:
        from . import train

        kind, seed = ref.zoo
        folder = train.zoo_folder(kind, seed)
        if fetch and not train.is_trained(folder):
            stage = f"training {ref.model} (first use; cached after)"
            report = progress or _noop
            steps = train.train_steps(kind)
            report(stage, 0, steps)
            folder = train.cached_model(kind, seed, progress=lambda step, _loss: report(stage, step + 1, steps))
        return ResolvedModel(folder)
    if ref.source == "hub":
        from . import hub

        if hub.offline():  # no network: the snapshot the cache holds, in a dry run too
            snap = hub.cached_model(ref.model, ref.revision, allow_pickle=allow_pickle, where=where)
            return ResolvedModel(snap.folder, snap.commit, cached=True)
        if not fetch:
            commit, files = hub.resolve_revision(ref.model, ref.revision, where=where)
            hub.weight_patterns(ref.model, ref.revision, files, allow_pickle=allow_pickle, where=where)
            return ResolvedModel(None, commit, tuple(files))
        pinned = (checked.commit, checked.files) if checked and checked.commit and checked.files is not None else None
        snap = hub.download_model(ref.model, ref.revision, allow_pickle=allow_pickle, where=where, resolved=pinned)
        return ResolvedModel(snap.folder, snap.commit)
    folder = Path(ref.model)
    if not folder.exists():
        raise ModelNotFoundError(f"{where}: the model folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ModelNotFoundError(f"{where}: {str(folder)!r} is a file; give the folder that holds config.json")
    if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        raise ModelNotFoundError(
            f"{where}: {str(folder)!r} has no config.json; a model folder is what `save_pretrained` writes"
            + (" (or, for `finetuned`, a PEFT adapter folder with adapter_config.json)" if adapter_ok else "")
        )
    return ResolvedModel(folder)


def _untrained_zoo(recipe: Recipe) -> bool:
    """Whether some zoo model of the recipe is not cached yet (the run will train it)."""
    from . import train

    return any(ref.zoo is not None and not train.is_trained(train.zoo_folder(*ref.zoo)) for _, ref in recipe.refs)


def _check_data_files(spec: DataSpec, where: str) -> None:
    """The files a data section names exist (globs match something), as `load_records` will check."""
    from .evaldata import check_files

    try:
        check_files(spec.data_files, spec.data_dir, Path.cwd())
    except DataError as e:
        raise DataError(f"`{where}`: {e}") from None


def _read_paths(recipe: Recipe, resolved: Sequence[ResolvedModel]) -> list[tuple[str, Path]]:
    """``(label, path)`` of everything a run reads: model folders, data files, the recipe file
    (an output that overlaps one of them is refused)."""
    import glob

    from .evaldata import check_files

    out: list[tuple[str, Path]] = []
    if Path(recipe.source).is_file():
        out.append(("the recipe file", Path(recipe.source)))
    for (where, ref), res in zip(recipe.refs, resolved, strict=True):
        label = f"`{where.removesuffix('.model')}`"
        if ref.source == "local":
            out.append((label, Path(ref.model)))
        if res.folder is not None:
            out.append((label, res.folder))
    ev = recipe.evaluate
    sections = (
        ("data", recipe.data),
        ("evaluate.data", ev.data if ev else None),
        ("evaluate.support", ev.support if ev else None),
    )
    for where, spec in sections:
        if spec is None:
            continue
        if Path(spec.dataset).is_absolute():  # a local dataset folder
            out.append((f"the `{where}.dataset` folder", Path(spec.dataset)))
        try:
            found = check_files(spec.data_files, spec.data_dir, Path.cwd())
        except DataError:  # reported where the files are checked
            continue
        files = found.get("data_files")
        entries = [files] if isinstance(files, str) else list(files.values()) if isinstance(files, dict) else files
        for entry in entries or []:
            for pattern in [entry] if isinstance(entry, str) else entry:
                matches = glob.glob(pattern, recursive=True) or [pattern]
                out.extend((f"the `{where}` data file", Path(m)) for m in matches)
        if "data_dir" in found:
            out.append((f"the `{where}.data_dir` folder", Path(found["data_dir"])))
    return out


def _check_recipe(recipe: Recipe, output: Path, output_field: str = "`output.dir`") -> list[ResolvedModel]:
    """Everything that can be checked without loading weights: models, files, output, push token."""
    from .export import check_output

    resolved = [resolve_model(ref, where, fetch=False, allow_pickle=recipe.allow_pickle) for where, ref in recipe.refs]
    for (where, _), res in zip(recipe.refs, resolved, strict=True):
        if res.folder is not None and (res.folder / "config.json").is_file():
            _check_remote_code(recipe, res.folder, where)
    if recipe.job == "transport":
        _check_adapter(recipe, resolved)
    _check_tokenizers(recipe, [r.folder for r in resolved])  # Hub models not downloaded yet: after download
    task_folder = _task_folder(recipe, resolved)
    if task_folder is not None:
        _check_task_of_folder(recipe, task_folder)
    if recipe.data is not None:
        _check_data_files(recipe.data, "data")
    if recipe.evaluate is not None:
        _check_data_files(recipe.evaluate.data, "evaluate.data")
    check_output(output, recipe.output.overwrite, inputs=_read_paths(recipe, resolved), where=output_field)
    push = recipe.output.push_to_hub
    if push is not None:
        from . import hub

        if not hub.has_token():
            raise hub.HubError(
                f"`output.push_to_hub`: pushing to {push.repo!r} needs a token: set HF_TOKEN or run `hf auth login` "
                "(checked before any work is done)"
            )
    return resolved


def _task_folder(recipe: Recipe, resolved: Sequence[ResolvedModel]) -> Path | None:
    """The folder whose head sets the task: the reference, or for a transport the fine-tune (its
    head may be new), unless that is an adapter (then its base)."""
    if recipe.job != "transport":
        return resolved[0].folder
    ft = resolved[2].folder
    return ft if ft is not None and (ft / "config.json").is_file() else resolved[1].folder


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


def _check_adapter(recipe: Recipe, resolved: Sequence[ResolvedModel]) -> list[str]:
    """A LoRA ``finetuned``: readable, plain LoRA, and trained on ``base`` (or ``check_base: false``).

    Returns notes for the run (a mismatch allowed by ``check_base: false``).
    """
    from .lora import adapter_config, is_adapter

    folder = resolved[2].folder
    ft = recipe.finetuned
    if folder is None or ft is None or not is_adapter(folder) or (folder / "config.json").is_file():
        return []
    config = adapter_config(folder, "finetuned.model")
    named = config.get("base_model_name_or_path")
    base = recipe.base
    assert base is not None  # a transport recipe has one
    if not named or _same_base(str(named), base, resolved[1].folder):
        return []
    if ft.check_base:
        raise IncompatibleModelsError(
            f"`finetuned.model`: the adapter {ft} was trained on {named!r} (base_model_name_or_path in "
            f"adapter_config.json), but `base` is {base}. Transporting it from the wrong base moves the wrong "
            f"task vector. If {named!r} is {base} under another name, set `finetuned.check_base: false`"
        )
    return [f"the adapter names {named!r} as its base; `base` is {base} (check_base: false)"]


_CACHED = " (resolved from the local Hugging Face cache, offline)"


def _check_tokenizers(recipe: Recipe, folders: Sequence[Path | None]) -> list[str]:
    """Every model's tokenizer against the reference's (vocabulary, special tokens, merges): token
    ids that mean different things make a merge or transport garbage with a normal-looking card.

    Refused unless ``allow_different_tokenizers``; then the difference is a note (rebasin.json and
    the card). Models without a tokenizer (image models, adapters) or not downloaded yet are skipped.
    """
    from .vocab import load_tokenizer, tokenizer_difference

    if not folders or folders[0] is None:
        return []
    reference = load_tokenizer(folders[0])
    if reference is None:
        return []
    first = recipe.refs[0][0]
    notes: list[str] = []
    for (where, ref), folder in zip(recipe.refs[1:], folders[1:], strict=True):
        other = load_tokenizer(folder) if folder is not None else None
        found = tokenizer_difference(reference, other, f"`{first}`", f"`{where}`") if other is not None else None
        if found is None:
            continue
        if not recipe.allow_different_tokenizers:
            raise IncompatibleModelsError(
                f"`{where}`: the tokenizer of {ref} differs from that of {recipe.refs[0][1]} (`{first}`): {found}. "
                "Token ids that mean different things make the result garbage. Use models that share a "
                "tokenizer, or set `allow_different_tokenizers: true` if you know better (the card will say so)"
            )
        notes.append(
            f"the tokenizers differ (allowed by `allow_different_tokenizers: true`): {found}; token ids may mean "
            "different things in the models combined"
        )
    return notes


def _load(folder: Path, recipe: Recipe, where: str) -> LoadedModel:
    """`models.load_model` with the recipe's settings; a user error names the recipe field."""
    from .models import load_model

    try:
        return load_model(folder, allow_pickle=recipe.allow_pickle, trust_remote_code=recipe.trust_remote_code)
    except RebasinUserError as e:
        if str(e).startswith("`"):
            raise
        raise type(e)(f"`{where}`: {e}") from None


def _load_finetune(base: LoadedModel, folder: Path, recipe: Recipe) -> tuple[LoadedModel, LoraAdapter | None]:
    """A transport's fine-tune, checked against its base: a full model of the same model type (its
    head may differ: a classifier trained on A's features), or a LoRA adapter merged into A."""
    from .lora import apply_adapter, is_adapter, read_adapter
    from .models import LoadedModel, check_same_shapes, rebuild
    from .transport import check_shared

    if is_adapter(folder) and not (folder / "config.json").is_file():
        adapter = read_adapter(folder, base.model, allow_pickle=recipe.allow_pickle, where="finetuned.model")
        merged = rebuild(base.model, apply_adapter(adapter, base.model.state_dict()))
        return LoadedModel(merged, base.graph, folder, adapter.dtype), adapter
    ft = _load(folder, recipe, "finetuned.model")
    type_a, type_ft = base.model.config.model_type, ft.model.config.model_type
    if type_a != type_ft:
        raise IncompatibleModelsError(
            f"`finetuned.model`: {str(folder)!r} is a {type(ft.model).__name__} (model_type {type_ft!r}) but its "
            f"base {str(base.path)!r} is a {type(base.model).__name__} (model_type {type_a!r}): a fine-tune keeps "
            "the architecture of the base it was trained from"
        )
    sd_base, sd_ft = base.model.state_dict(), ft.model.state_dict()
    check_shared(sd_base, sd_ft, "`finetuned.model`")
    if type(ft.model) is type(base.model) and sd_ft.keys() != sd_base.keys():
        check_same_shapes(sd_base, sd_ft, "the base", "the fine-tune")
    return ft, None


def _check_remote_code(recipe: Recipe, folder: Path, where: str) -> None:
    """A model whose loader files (config, tokenizer, processor, generation config) name their own
    code (``auto_map``) needs ``trust_remote_code``, and even then no repository code runs: the
    weights go into the stock class of their ``model_type`` (every tensor's shape is checked)."""
    from .remote_code import refuse_remote_code

    refuse_remote_code(folder, where, trusted=recipe.trust_remote_code)


def _config_json(folder: Path) -> dict[str, Any]:
    """A folder's config.json as a dict; empty when missing or broken (loading reports those itself)."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _task_mismatch(task: str, class_name: str, implied: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"`evaluate.task`: {task!r} does not fit the reference model, a {class_name} (its task is {implied!r}); "
        f"set `task: {implied}`"
    )


def _check_task_of_folder(recipe: Recipe, folder: Path) -> None:
    """``evaluate.task`` against the head named in A's config.json (no weights needed)."""
    from .evaluate import task_of_class

    if recipe.evaluate is None:
        return
    # a zoo model not trained yet has no config.json: its task is checked after loading
    architectures = _config_json(folder).get("architectures") or []
    implied = task_of_class(str(architectures[0])) if architectures else None
    if implied is not None and implied != recipe.evaluate.task:
        raise _task_mismatch(recipe.evaluate.task, str(architectures[0]), implied)


def _output_of(recipe: Recipe, output: Path | None) -> Path:
    return Path(output if output is not None else recipe.output.dir).expanduser().absolute()


def _output_field(output: Path | None) -> str:
    """How messages name the output: the recipe's field, or the command-line option overriding it."""
    return "--output" if output is not None else "`output.dir`"


def plan(recipe: Recipe, *, output: Path | None = None) -> list[str]:
    """The plan of ``--dry-run``: `describe` plus the checks that need no weights (typed errors)."""
    target = _output_of(recipe, output)
    resolved = _check_recipe(recipe, target, _output_field(output))
    lines = describe(recipe)
    for (_, ref), res in zip(recipe.refs, resolved, strict=True):
        if res.commit is not None:
            lines.append(f"resolved: {ref} -> commit {res.commit}{_CACHED if res.cached else ''}")
    if output is not None:
        lines = [f"output: {target} (from --output)" if line.startswith("output: ") else line for line in lines]
    lines.append("checks: models, data files and the output folder are in order; no weights were loaded")
    return lines


# ---------------------------------------------------------------------------------------------
# Data


def _device(name: str | None) -> torch.device:
    name = name or "auto"
    if not DEVICE_PATTERN.fullmatch(name):
        raise RebasinUserError(f"`device`: {name!r} is not a device; allowed: auto, cpu, cuda, cuda:N, mps")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RebasinUserError(f"`device`: {name!r} was asked for, but no CUDA device is available here")
    if name == "mps" and not torch.backends.mps.is_available():
        raise RebasinUserError("`device`: 'mps' was asked for, but MPS is not available here")
    return torch.device(name)


def _processor(folder: Path, task: Task) -> Any:
    """Model A's tokenizer (text tasks) or image processor, read from its folder."""
    import transformers

    image = task == "image-classification"
    kind = "image processor (preprocessor_config.json)" if image else "tokenizer (tokenizer.json or vocab files)"
    try:
        if image:
            # never interactive, never code: a file naming its own class gets the stock class it declares
            return transformers.AutoImageProcessor.from_pretrained(str(folder), trust_remote_code=False)
        return transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ModelNotFoundError(
            f"`models.0.model`: the reference folder {str(folder)!r} has no usable {kind}, which {task} data "
            f"need; save it beside the model with `save_pretrained` ({type(e).__name__}: {e})"
        ) from None


def _block_size(config: Any) -> int:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or MAX_BLOCK
    if getattr(config, "model_type", None) in ("roberta", "xlm-roberta", "camembert"):
        limit -= 2  # positions start after padding_idx
    return int(min(MAX_BLOCK, limit))


def _label2id(records: Any, column: str, config: Any) -> Mapping[str, int] | None:
    """The model's label2id when the data name their labels in its terms; None to use ids as they are."""
    label2id = dict(getattr(config, "label2id", None) or {})
    feature = records.features.get(column)
    names = getattr(feature, "names", None)
    if names is not None and not set(names) <= set(label2id):
        return None  # class folders such as 0..9: ids as they are
    return label2id or None


def _metrics(recipe: Recipe, base_dir: Path) -> list[Metric]:
    """The recipe's ``evaluate.metrics``, loaded once through `evaluate.load`."""
    from .evaluate import load_metric

    ev = recipe.evaluate
    return [load_metric(m.name, base_dir, m.kwargs) for m in ev.metric_specs()] if ev is not None else []


def _batches(
    spec: DataSpec,
    base_dir: Path,
    task: Task,
    processor: Any,
    config: Any,
    *,
    batch_size: int,
    max_tokens: int | None,
    max_examples: int | None,
    seed: int,
    where: str,
) -> list[dict[str, Tensor]]:
    """Batches of ``task`` from a recipe data section, built once."""
    from .evaldata import classification_batches, load_records, text_batches

    raw = spec.model_dump()
    raw.pop("max_tokens", None)
    if max_examples is not None:
        raw["max_examples"] = max_examples
    try:
        records = load_records(raw, base_dir)
        if task in TEXT_TASKS:
            return text_batches(
                records,
                processor,
                task=task,  # type: ignore[arg-type]
                column=spec.column or "text",
                block_size=_block_size(config),
                batch_size=batch_size,
                max_tokens=max_tokens,
                seed=seed,
            )
        label_column = spec.label_column or "label"
        image = task == "image-classification"
        batches = classification_batches(
            records,
            processor,
            task=task,  # type: ignore[arg-type]
            column=spec.column or "text",
            image_column=spec.image_column or "image",
            label_column=label_column,
            batch_size=batch_size,
            label2id=_label2id(records, label_column, config),
            max_length=None if image else _block_size(config),
            image_mode=("L" if getattr(config, "num_channels", 3) == 1 else "RGB") if image else None,
        )
    except DataError as e:
        raise DataError(f"`{where}`: {e}") from None
    n_labels = int(getattr(config, "num_labels", 0) or 0)
    top = max(int(b["labels"].max()) for b in batches)
    if n_labels and (top >= n_labels or min(int(b["labels"].min()) for b in batches) < 0):
        raise DataError(
            f"`{where}.label_column`: label id {top} is outside the model's {n_labels} classes (0..{n_labels - 1}); "
            "name the labels as in the model's config (label2id) or renumber them"
        )
    return batches


# ---------------------------------------------------------------------------------------------
# Alignment and checks


def _move(model: Any, device: torch.device) -> None:
    """``model.to(device)`` in place (transformers' typing of ``.to`` does not take a device)."""
    model.to(device)


def _inputs(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v[:CHECK_ROWS] for k, v in batch.items() if k != "labels"}


def _function_gap(
    model_b: PreTrainedModel, alignment: Alignment, aligned: Mapping[str, Tensor], inputs: Mapping[str, Tensor]
) -> tuple[float, float]:
    """max |Δ logits| between B and B in A's basis (rebuilt from ``aligned``) on ``inputs``, and
    max |logits| of B (the scale float32 rounding grows with)."""
    rebuilt = _rebuilt(model_b, aligned, bool(alignment.untied))
    model_b.eval()
    with torch.no_grad():
        before = model_b(**inputs).logits.float()
        after = rebuilt(**inputs).logits.float()
    return float((after - before).abs().max()), float(before.abs().max())


def _check_inputs(
    loaded: LoadedModel, batches: Sequence[Sequence[Mapping[str, Tensor]] | None], device: torch.device
) -> dict[str, Tensor]:
    """A few real inputs (evaluation or alignment data), else the fixed random ones of `verify`."""
    for group in batches:
        if group:
            return {k: v.to(device) for k, v in _inputs(group[0]).items()}
    from .adapters import get_adapter
    from .verify import example_inputs

    spec = get_adapter(loaded.model.config.model_type)
    inputs = example_inputs(spec, loaded.model.config, torch.Generator().manual_seed(0))
    return {k: v.to(device) for k, v in inputs.items()}


def _rebuilt(template: PreTrainedModel, sd: Mapping[str, Tensor], untie: bool) -> PreTrainedModel:
    """A model of ``template``'s class holding ``sd`` (a tied head stored apart when ``untie``), on its device."""
    from .models import rebuild

    model = rebuild(template, dict(sd), untie=untie)
    _move(model, next(template.parameters()).device)
    return model


class _Scorer:
    """Scores state dicts on one rebuilt model per (template, untie), loading each in place:
    rebuilding per α or per comparison would re-initialise every weight first (2.7 s for GPT-2
    small on 2 cores, against 0.04 s to load new weights).

    ``dtype`` is the dtype the output is written in: each state dict is rounded to it (and back to
    float32, where the scoring runs) first, so a score is that of the weights the user gets, not of
    the float32 weights before the cast. float32 changes nothing."""

    def __init__(self, dtype: torch.dtype = torch.float32, metrics: Sequence[Metric] = ()) -> None:
        self._models: dict[tuple[int, bool], PreTrainedModel] = {}
        self.dtype = dtype
        self.metrics = tuple(metrics)  # `evaluate.metrics`, scored beside the loss

    def __call__(
        self,
        template: PreTrainedModel,
        sd: Mapping[str, Tensor],
        untie: bool,
        batches: Sequence[Mapping[str, Tensor]],
        task: Task,
    ) -> dict[str, Any]:
        """Loss and metric of ``sd`` on the evaluation batches (``rebasin.json``'s ``merged``)."""
        from .evaluate import evaluate_loss

        if self.dtype != torch.float32:
            sd = {k: v.to(self.dtype).to(v.dtype) if v.is_floating_point() else v for k, v in sd.items()}
        key = (id(template), untie)
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = _rebuilt(template, sd, untie)
        else:
            model.load_state_dict(dict(sd), strict=True)
        result = evaluate_loss(model, batches, task, self.metrics)
        return {"loss": result.loss, "metric": dict(result.metric), "count": result.count}


def _sweep_progress(report: Progress, stage: str, total: int) -> Callable[[int, float, Any], None]:
    def step(i: int, _lam: float, _result: Any) -> None:
        report(stage, i + 1, total)

    return step


def _timed_align(
    name: str,
    options: Any,
    pair: Any,
    progress: Progress,
    timings: dict[str, float],
    *,
    cache: _CacheUse | None = None,
) -> Alignment:
    """Align B of ``pair`` to A, timed into ``timings["align"]``. With ``cache`` (see `_RunCache.use`)
    the alignment is read from the alignment cache when it is there (``align`` ≈ 0) and stored when not."""
    from .strategies import align

    start = time.perf_counter()
    alignment = cache.read(pair, name) if cache is not None else None
    if alignment is None:
        alignment = align(name, pair, options, progress)
    timings["align"] = timings.get("align", 0.0) + time.perf_counter() - start
    if cache is not None and not cache.hit:
        cache.write(alignment, pair)
    return alignment


@dataclass
class _RunCache:
    """The alignment cache as one run uses it: on or off, notes for the report, hits and misses."""

    recipe: Recipe
    base_dir: Path
    notes: list[str]
    progress: Progress = _noop
    hits: int = 0
    misses: int = 0

    @property
    def enabled(self) -> bool:
        from . import cache

        return cache.enabled(self.recipe.cache)

    def record(self) -> dict[str, Any]:
        """``rebasin.json``'s ``cache`` entry."""
        return {"enabled": self.enabled, "hits": self.hits, "misses": self.misses}

    def use(
        self,
        resolved: Sequence[ResolvedModel],
        reference: LoadedModel,
        other: LoadedModel,
        strategy: str,
        options: Any,
        label: str | None = None,
        graph: SymmetryGraph | None = None,
    ) -> _CacheUse | None:
        """The cache entry for aligning ``other`` to ``reference`` (None: caching is off or pointless).

        ``label`` names the pair in notes (default: the models' letters in the recipe, "B to A");
        ``graph`` is the graph of the `Pair` when it is not ``reference.graph``."""
        from . import cache
        from .export import support_files
        from .strategies import get_strategy

        if not self.enabled or strategy in cache.NOT_CACHED:
            return None
        by_folder = {r.folder: r for r in resolved if r.folder is not None}
        ref_res = by_folder.get(reference.path, ResolvedModel(reference.path))
        other_res = by_folder.get(other.path, ResolvedModel(other.path))
        parsed = get_strategy(strategy).parse(options)
        spec, ev = self.recipe.data, self.recipe.evaluate
        try:
            data = None
            if spec is not None and get_strategy(strategy).needs_data(parsed):
                data = cache.data_identity(
                    spec.model_dump(mode="json"),
                    self.base_dir,
                    # with A's config (in its identity) these say how `run_recipe` batches alignment data
                    evaluate_task=ev.task if ev is not None else None,
                    batch_size=ev.batch_size if ev is not None else 8,
                    seed=ev.seed if ev is not None else 0,
                    processor=cache.files_identity(support_files(reference.path), base=reference.path),
                )
            key = cache.alignment_key(
                ref_res,
                other_res,
                strategy,
                parsed,
                data=data,
                graph=graph if graph is not None else reference.graph,
                progress=self.progress,
            )
        except OSError as e:  # a file that cannot be hashed: align without the cache
            self.notes.append(f"alignment cache not used: cannot hash the input files ({e})")
            return None
        if label is None:
            folders = [r.folder for r in resolved]
            letter = {p: _letter(folders.index(p)) for p in (reference.path, other.path) if p in folders}
            label = f"{letter.get(other.path, 'B')} to {letter.get(reference.path, 'A')}"
        return _CacheUse(self, key, strategy, label)


@dataclass
class _CacheUse:
    """One alignment's entry in the cache: read it, or write it after computing."""

    run: _RunCache
    key: str
    strategy: str
    label: str
    hit: bool = False

    def read(self, pair: Any, name: str) -> Alignment | None:
        from . import cache

        try:
            alignment = cache.read_alignment(self.key, pair, name)
        except cache.CacheMiss as miss:
            self.run.misses += 1
            if miss.reason:
                self.run.notes.append(
                    f"cached alignment of {self.label} ({self.key[:12]}) not used: {miss.reason}; recomputed"
                )
            return None
        self.hit = True
        self.run.hits += 1
        self.run.notes.append(f"{self.strategy} alignment of {self.label} read from the cache ({self.key[:12]})")
        return alignment

    def write(self, alignment: Alignment, pair: Any) -> None:
        from . import cache

        try:
            cache.save_alignment(self.key, alignment, pair)
        except OSError as e:
            self.run.notes.append(f"alignment of {self.label} not cached: cannot write {cache.cache_dir()} ({e})")


def _tolerance(scale: float) -> float:
    """The preservation tolerance for logits of magnitude ``scale``: 1e-4 (`verify`'s) up to |logits|
    of 1, relative beyond, since float32 rounding of a transformed model grows with its outputs."""
    from .verify import TOLERANCE

    return TOLERANCE * max(1.0, scale)


def _check_preserved(gaps: Sequence[tuple[float, float]], others: Sequence[LoadedModel]) -> None:
    """A function-preserving alignment that changed a model's outputs (or made them NaN/Inf) is a
    bug: raised before anything is written, never reported as a result."""
    import math

    from .errors import FunctionNotPreservedError

    for (gap, scale), lm in zip(gaps, others, strict=True):
        tol = _tolerance(scale) if math.isfinite(scale) else 0.0
        if not (math.isfinite(gap) and gap <= tol):
            raise FunctionNotPreservedError(
                f"function not preserved: aligned, {str(lm.path)!r} gives outputs that differ from its own by "
                f"max |Δ logits| = {gap:.3g} (tolerance {tol:.3g}: 1e-4 × max(1, max |logits| = {scale:.3g})); "
                "nothing was written"
            )


def _preservation(
    strategy: str,
    others: Sequence[LoadedModel],
    alignments: Sequence[Alignment],
    aligned: Sequence[Mapping[str, Tensor]],
    inputs: Mapping[str, Tensor],
    *,
    real: bool,
) -> dict[str, Any]:
    """The ``function_preserved`` entry: worst max |Δ logits| over the aligned models, or why not measured."""
    if not all(al.exact for al in alignments):
        return {
            "max_abs_diff": None,
            "reason": f"strategy {strategy!r} with these options does not preserve B's function (experimental)",
        }
    gaps = [_function_gap(lm.model, al, sd, inputs) for lm, al, sd in zip(others, alignments, aligned, strict=True)]
    _check_preserved(gaps, others)
    return {
        "max_abs_diff": max(g for g, _ in gaps),
        "tolerance": max(_tolerance(scale) for _, scale in gaps),
        "inputs": "evaluation or alignment data" if real else "random example inputs",
    }


def _curve(
    template: PreTrainedModel,
    alignment: Alignment,
    aligned_b: Mapping[str, Tensor],
    batches: Sequence[Mapping[str, Tensor]],
    task: Task,
    points: int,
    name: str,
    report: Progress,
    metrics: Sequence[Metric] = (),
) -> Curve:
    """The loss along λ between A and aligned B, in the form (original or canonical) of the alignment."""
    from .evaluate import lambdas, loss_curve

    grid = lambdas(points)
    stage = f"{SWEEP_STAGE}: {name}"
    report(stage, 0, len(grid))
    return loss_curve(
        _rebuilt(template, alignment.sd_a, bool(alignment.untied)),  # holds both ends, untied when canonical
        alignment.sd_a,
        aligned_b,
        batches,
        task,
        grid,
        progress=_sweep_progress(report, stage, len(grid)),
        metrics=metrics,
    )


# ---------------------------------------------------------------------------------------------
# The run


def _recipe_dir(recipe: Recipe) -> Path:
    return Path(recipe.source).absolute().parent if Path(recipe.source).is_file() else Path.cwd()


def _relative(value: Any, base: Path) -> Any:
    """A local path as rebasin.json records it: relative to the recipe's folder (the record is
    published with the model; it must not show the user's own folder layout)."""
    import os

    if not isinstance(value, str) or not Path(value).is_absolute():
        return value
    try:
        return Path(os.path.relpath(value, base)).as_posix()
    except ValueError:  # another drive (Windows)
        return Path(value).name


_PATH_KEYS = frozenset({"model", "dir", "data_files", "data_dir", "dataset"})


def _relative_paths(data: Any, base: Path, key: str | None = None) -> Any:
    """``data`` (a recipe dump) with every local path under a path key made relative to ``base``."""
    if isinstance(data, dict):
        return {k: _relative_paths(v, base, k) for k, v in data.items()}
    if isinstance(data, list):
        return [_relative_paths(v, base, key) for v in data]
    return _relative(data, base) if key in _PATH_KEYS else data


def _model_entries(recipe: Recipe, resolved: Sequence[ResolvedModel]) -> list[dict[str, Any]]:
    from .card import read_license

    base = _recipe_dir(recipe)
    return [
        {
            "model": _relative(ref.model, base),
            "revision": ref.revision,
            "commit": r.commit,
            "source": ref.source,
            "folder": _relative(str(r.folder), base) if ref.source == "local" else None,  # caches: not recorded
            **({"role": where.split(".")[0]} if recipe.job == "transport" else {}),
            **({"license": lic} if r.folder is not None and (lic := read_license(r.folder)) else {}),
        }
        for (where, ref), r in zip(recipe.refs, resolved, strict=True)
    ]


def _dataset_entries(recipe: Recipe) -> list[dict[str, Any]]:
    """Which data sets the run read, and whether each is a Hub id (the model card lists those)."""
    from .evaldata import BUILTIN_DATASETS, LOCAL_BUILDERS

    ev = recipe.evaluate
    sections = [
        ("alignment", recipe.data),
        ("evaluation", ev.data if ev else None),
        ("support", ev.support if ev else None),
    ]
    out = []
    for role, spec in sections:
        if spec is None:
            continue
        local = spec.dataset in LOCAL_BUILDERS or Path(spec.dataset).is_absolute()
        source = "builtin" if spec.dataset in BUILTIN_DATASETS else "local" if local else "hub"
        dataset = _relative(spec.dataset, _recipe_dir(recipe))
        out.append({"role": role, "dataset": dataset, "name": spec.name, "split": spec.split, "source": source})
    return out


def _recipe_record(recipe: Recipe, output: Path) -> dict[str, Any]:
    """The recipe as run (``--output`` applied), local paths relative to the recipe's folder."""
    dumped: dict[str, Any] = recipe.model_dump(mode="json")
    dumped["output"]["dir"] = str(output)
    relative: dict[str, Any] = _relative_paths(dumped, _recipe_dir(recipe))
    return relative


def run_recipe(
    recipe: Recipe,
    *,
    output: Path | None = None,
    device: str | None = None,
    progress: Progress | None = None,
    command: str | None = None,
) -> RunResult:
    """Run ``recipe``: align every model to the first, merge (job merge), evaluate, write the folder.

    ``output`` and ``device`` override the recipe's; ``command`` is the line the model card gives
    to reproduce the run (default ``hf-rebasin <recipe file>``). Nothing is written until everything is computed,
    and then into a temporary folder renamed into place (see `export.output_folder`). The output is
    held for the whole run (`export.claim_output`): a second run on it is refused at once, and the
    leftovers of a killed run are cleaned up first (the result's notes say what was done).
    """
    from .export import claim_output

    target = _output_of(recipe, output)
    where = _output_field(output)
    checked = _check_recipe(recipe, target, where)
    with claim_output(target, overwrite=recipe.output.overwrite, where=where) as recovered:
        result = _run_recipe(recipe, target, checked, where, device=device, progress=progress, command=command)
    result.notes = [*recovered, *result.notes]
    return result


def _run_recipe(
    recipe: Recipe,
    target: Path,
    checked: list[ResolvedModel],
    where: str,
    *,
    device: str | None,
    progress: Progress | None,
    command: str | None,
) -> RunResult:
    """`run_recipe` once the recipe is checked and the output held."""
    from .evaluate import barrier, task_of
    from .export import check_inputs, copy_support_files, output_folder, save_merged_model, write_text
    from .merge import merge_state_dicts
    from .models import check_compatible
    from .report import markdown_table, metric_names, plot_curves
    from .strategies import AlignmentData, Pair, get_strategy

    report = progress or _noop
    dev = _device(device or recipe.device)
    base_dir = Path(recipe.source).parent if Path(recipe.source).is_file() else Path.cwd()
    timings: dict[str, float] = {"load": 0.0, "align": 0.0, "evaluate": 0.0, "save": 0.0}
    notes: list[str] = []
    run_cache = _RunCache(recipe, base_dir, notes, report)
    metrics = _metrics(recipe, base_dir)  # before any model loads: a metric that does not load fails fast

    # load (zoo models are trained first when not cached: timed apart as "train")
    start = time.perf_counter()
    untrained = _untrained_zoo(recipe)
    resolved = [
        resolve_model(ref, where, progress=report, allow_pickle=recipe.allow_pickle, checked=c)
        for (where, ref), c in zip(recipe.refs, checked, strict=True)
    ]
    folders = [r.folder for r in resolved if r.folder is not None]
    check_inputs(target, _read_paths(recipe, resolved), where)  # downloaded Hub folders are inputs too
    for (ref_where, _), folder in zip(recipe.refs, folders, strict=True):
        _check_remote_code(recipe, folder, ref_where)
    notes.extend(
        f"{ref} resolved from the local Hugging Face cache (offline): commit {res.commit}"
        for (_, ref), res in zip(recipe.refs, resolved, strict=True)
        if res.cached
    )
    notes.extend(_check_tokenizers(recipe, folders))
    if untrained:
        timings["train"] = time.perf_counter() - start
        start = time.perf_counter()
    adapter = None
    if recipe.job == "transport":
        notes.extend(_check_adapter(recipe, resolved))
    loaded: list[LoadedModel] = []
    report(LOAD_STAGE, 0, len(folders))
    for i, folder in enumerate(folders):
        if recipe.job == "transport" and i == 2:  # the fine-tune: a full model (any head) or an adapter
            lm, adapter = _load_finetune(loaded[1], folder, recipe)
        else:
            lm = _load(folder, recipe, recipe.refs[i][0])
            if loaded:
                check_compatible(loaded[0], lm)
        _move(lm.model, dev)
        loaded.append(lm)
        report(LOAD_STAGE, i + 1, len(folders))
    a = loaded[0]
    out_dtype, dtype_record = _output_dtype(recipe, loaded, adapter, notes)
    # a transport is scored on the fine-tune's task (its head may be new); alignment data go through the bases
    task = _task(recipe, loaded[2].model if recipe.job == "transport" else a.model, task_of)
    align_task = task_of(a.model) if recipe.job == "transport" else task
    ev = recipe.evaluate
    processor = _processor(folders[0], task) if (recipe.data is not None or ev is not None) else None
    align_batches: list[dict[str, Tensor]] | None = None
    data: AlignmentData | None = None
    if recipe.data is not None:
        align_batches = _batches(
            recipe.data,
            base_dir,
            align_task,
            processor,
            a.model.config,
            batch_size=ev.batch_size if ev is not None else 8,
            max_tokens=recipe.data.max_tokens,
            max_examples=recipe.data.max_examples,
            seed=ev.seed if ev is not None else 0,
            where="data",
        )
        special = frozenset(int(t) for t in getattr(processor, "all_special_ids", []) or [])
        data = AlignmentData(align_batches, special, description=f"{recipe.data.dataset} ({recipe.data.split})")
    eval_batches: list[dict[str, Tensor]] | None = None
    if ev is not None:
        eval_batches = _batches(
            ev.data,
            base_dir,
            task,
            processor,
            loaded[-1].model.config if recipe.job == "transport" else a.model.config,
            batch_size=ev.batch_size,
            max_tokens=ev.max_tokens,
            max_examples=ev.max_examples,
            seed=ev.seed,
            where="evaluate.data",
        )
    timings["load"] = time.perf_counter() - start
    if recipe.job == "transport":
        ctx = _Context(
            recipe,
            target,
            resolved,
            folders,
            loaded,
            task,
            data,
            align_batches,
            eval_batches,
            timings,
            notes,
            run_cache,
            adapter,
            score=_Scorer(out_dtype, metrics),
            dtype_record=dtype_record,
        )
        return _transport(ctx, processor, base_dir, report, command, dev)

    # align every other model to A
    name = recipe.strategy.name
    options = recipe.strategy.options
    sd_a = a.model.state_dict()
    alignments: list[Alignment] = []
    for lm in loaded[1:]:
        pair = Pair(a.graph, sd_a, lm.model.state_dict(), a.model, lm.model, data)
        alignments.append(
            _timed_align(name, options, pair, report, timings, cache=run_cache.use(resolved, a, lm, name, options))
        )
    primary = alignments[0]
    notes.extend(dict.fromkeys(n for al in alignments for n in al.notes))
    aligned = [al.aligned_b() for al in alignments]

    inputs = _check_inputs(a, [eval_batches, align_batches], dev)
    preserved = _preservation(name, loaded[1:], alignments, aligned, inputs, real=bool(eval_batches or align_batches))

    # evaluate: the strategy's curve and one per `compare` entry, on the same batches
    curves: dict[str, Curve] = {}
    barriers: dict[str, dict[str, float]] = {}
    if ev is not None and eval_batches is not None:
        if len(loaded) > 2:
            notes.append(f"curves are between A and B ({recipe.refs[1][1].model}); the other models are merged only")
        b = loaded[1]
        for curve_name in dict.fromkeys([name, *ev.compare]):
            if curve_name == name:
                al, aligned_b = primary, aligned[0]
            else:
                pair = Pair(a.graph, sd_a, b.model.state_dict(), a.model, b.model, data)
                compared = get_strategy(curve_name).parse(None)
                cached = run_cache.use(resolved, a, b, curve_name, compared)
                al = _timed_align(curve_name, compared, pair, report, timings, cache=cached)
                aligned_b = al.aligned_b()
            start = time.perf_counter()
            curves[curve_name] = _curve(
                a.model, al, aligned_b, eval_batches, task, ev.points, curve_name, report, metrics
            )
            barriers[curve_name] = barrier(curves[curve_name].lambdas, curves[curve_name].losses)
            timings["evaluate"] += time.perf_counter() - start

    # merge, and score the merged model (and the unaligned average with the same weights)
    weights = recipe.merge.weights(len(loaded))
    scores: dict[str, dict[str, Any]] = {}
    merged: dict[str, Tensor] = {}
    universe: dict[str, Any] | None = None
    score = _Scorer(out_dtype, metrics)  # the merged model is scored as written (rounded to out_dtype)
    if recipe.job == "merge" and recipe.merge.universe is not None:
        merged, reference, universe, preserved = _universe(
            recipe, loaded, alignments, weights, data, inputs, preserved, report, timings, notes
        )
        if ev is not None and eval_batches is not None:
            start = time.perf_counter()
            universe["reference"] = score(a.model, reference, bool(primary.untied), eval_batches, task)
            timings["evaluate"] += time.perf_counter() - start
    if recipe.job == "merge":
        if universe is None:
            merged = merge_state_dicts([primary.sd_a, *aligned], weights)
        if ev is not None and eval_batches is not None:
            start = time.perf_counter()
            scores[name] = score(a.model, merged, bool(primary.untied), eval_batches, task)
            if "vanilla" in ev.compare and name != "vanilla":
                plain = merge_state_dicts([sd_a, *(lm.model.state_dict() for lm in loaded[1:])], weights)
                scores["vanilla"] = score(a.model, plain, False, eval_batches, task)
            timings["evaluate"] += time.perf_counter() - start
            if universe is not None:
                notes.append(
                    f"universe: loss {scores[name]['loss']:.4f} nats; the reference merge (every model aligned "
                    f"to A only) {universe['reference']['loss']:.4f}"
                )

    # save
    start = time.perf_counter()
    files: list[str] = []
    with output_folder(target, overwrite=recipe.output.overwrite) as tmp:
        if recipe.job == "merge":
            save_merged_model(
                a.model,
                merged,
                tmp,
                untie=bool(primary.untied),
                max_shard_size=recipe.output.max_shard_size,
                dtype=out_dtype,
            )
            copy_support_files(folders[0], tmp)  # after save_pretrained: A's files as they were
        if curves:
            shown = metric_names(curves) if metrics else []  # a metric panel when the recipe asks for metrics
            plot_curves(curves, tmp / "barrier.png", title=_title(recipe, task), metrics=shown)
            write_text(tmp / "barrier.md", markdown_table(curves, barriers))
        timings["save"] = time.perf_counter() - start
        files = _write_record(
            tmp,
            recipe,
            target,
            resolved,
            command,
            strategy=name,
            strategy_options=options.model_dump(mode="json"),
            merge_weights=weights if recipe.job == "merge" else None,
            **({"universe": universe} if universe is not None else {}),
            task=task,
            canonical=primary.canonical,
            untied=list(primary.untied),
            barrier=barriers,
            merged=scores,
            curves={k: c.as_dict() for k, c in curves.items()},
            function_preserved=preserved,
            notes=notes,
            timings=timings,
            cache=run_cache.record(),
            dtype=dtype_record,
        )
    pushed, push_error = _push(recipe, target, report)
    return RunResult(
        output=target,
        job=recipe.job,
        strategy=name,
        saved_model=recipe.job == "merge",
        barriers=barriers,
        curves=curves,
        merged=scores,
        function_preserved=preserved,
        timings=timings,
        notes=notes,
        files=files,
        canonical=recipe.job == "merge" and primary.canonical,
        untied=list(primary.untied) if recipe.job == "merge" else [],
        pushed=pushed,
        push_error=push_error,
        universe=universe or {},
    )


def _universe(
    recipe: Recipe,
    loaded: Sequence[LoadedModel],
    alignments: Sequence[Alignment],
    weights: Sequence[float],
    data: AlignmentData | None,
    inputs: Mapping[str, Tensor],
    preserved: dict[str, Any],
    report: Progress,
    timings: dict[str, float],
    notes: list[str],
) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Any], dict[str, Any]]:
    """``merge.universe``: the universe merge, the reference merge it started from (every model
    aligned to A), its ``rebasin.json`` entry, and the preservation check widened to every model's
    map into the merge's basis (model A's included)."""
    from .universe import universe_merge

    settings = recipe.merge.universe
    assert settings is not None  # the caller checked
    start = time.perf_counter()
    result = universe_merge(
        recipe.strategy.name,
        recipe.strategy.options,
        loaded[0].graph,
        [lm.model.state_dict() for lm in loaded],
        weights,
        models=[lm.model for lm in loaded],
        data=data,
        iterations=settings.iterations,
        tol=settings.tol,
        leave_one_out=settings.leave_one_out,
        initial=alignments,
        progress=report,
    )
    timings["align"] += time.perf_counter() - start
    notes.extend(n for n in result.notes if n not in notes)
    if preserved.get("max_abs_diff") is not None:
        aligned = [al.aligned_b() for al in result.alignments]
        again = _preservation(recipe.strategy.name, loaded, result.alignments, aligned, inputs, real=True)
        worst = {k: max(preserved[k], again[k]) for k in ("max_abs_diff", "tolerance")}  # same inputs
        preserved = {**preserved, **worst}
    return result.merged, result.reference, result.record(), preserved


def _push(recipe: Recipe, folder: Path, report: Progress) -> tuple[Any, str | None]:
    """Push the finished folder when the recipe asks; a failure is returned, the folder is kept."""
    push = recipe.output.push_to_hub
    if push is None:
        return None, None
    from . import hub

    stage = f"pushing to {push.repo}"
    report(stage, 0, 1)
    message = push.commit_message or f"hf-rebasin {recipe.job} with {recipe.strategy.name} ({Path(recipe.source).name})"
    try:
        result = hub.push_folder(
            folder, push.repo, private=push.private, revision=push.revision, commit_message=message
        )
    except hub.PushError as e:
        return None, str(e)
    report(stage, 1, 1)
    return result, None


@dataclass
class _Context:
    """What every job has once its models and data are loaded."""

    recipe: Recipe
    output: Path
    resolved: list[ResolvedModel]
    folders: list[Path]
    loaded: list[LoadedModel]
    task: Task
    data: AlignmentData | None
    align_batches: list[dict[str, Tensor]] | None
    eval_batches: list[dict[str, Tensor]] | None
    timings: dict[str, float]
    notes: list[str]
    run_cache: _RunCache
    adapter: LoraAdapter | None = None  # transport: the fine-tune is this LoRA adapter (merged into A in loaded[2])
    score: _Scorer = field(default_factory=_Scorer)
    dtype_record: dict[str, Any] = field(default_factory=dict)  # rebasin.json's ``dtype`` (see `_output_dtype`)

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype the output is written in (the scorer rounds to it)."""
        return self.score.dtype


def _transport_scores(
    ctx: _Context,
    batches: Sequence[Mapping[str, Tensor]],
    moved: _Moved,
    naive: _Moved | None,
) -> dict[str, Any]:
    """Loss and metric of target B, fine-tune A_ft, B + α·π(τ) per α and (``naive``) B + α·τ per α.

    When the fine-tune has a head its base lacks, "target" is B carrying that head (moved, α = 0):
    B alone has no such head to score.
    """
    from .evaluate import evaluate_loss

    b, _a, a_ft = ctx.loaded
    out: dict[str, Any] = {"loss": {}, "metric": {}}

    def put(key: str, score: dict[str, Any], many: bool) -> None:
        if many:
            out["loss"].setdefault(key, []).append(score["loss"])
            out["metric"].setdefault(key, []).append(score["metric"])
        else:
            out["loss"][key], out["metric"][key] = score["loss"], score["metric"]

    ft = evaluate_loss(a_ft.model, batches, ctx.task, ctx.score.metrics)
    if moved.carried:
        put("target", ctx.score(moved.template, moved.theta(0.0), moved.untie, batches, ctx.task), False)
    else:
        target = evaluate_loss(b.model, batches, ctx.task, ctx.score.metrics)
        put("target", {"loss": target.loss, "metric": dict(target.metric)}, False)
    put("finetuned", {"loss": ft.loss, "metric": dict(ft.metric)}, False)
    for alpha in ctx.recipe.alphas:
        put("transported", ctx.score(moved.template, moved.theta(alpha), moved.untie, batches, ctx.task), True)
    for alpha in ctx.recipe.alphas if naive is not None else ():
        assert naive is not None
        put("naive", ctx.score(naive.template, naive.theta(alpha), naive.untie, batches, ctx.task), True)
    return out


@dataclass
class _Moved:
    """A task vector in the target's basis and what it takes to build ``B + α·τ`` as a model."""

    target: Mapping[str, Tensor]  # B's state dict, in the alignment's form
    tau: Mapping[str, Tensor]  # π(τ) on the tensors base and fine-tune share
    carried: Mapping[str, Tensor]  # tensors only the fine-tune has, moved whole
    names: Sequence[str]  # the output model's tensors, in order (the fine-tune's when its head is new)
    template: PreTrainedModel  # the class and config to build
    untie: bool

    def theta(self, alpha: float) -> dict[str, Tensor]:
        from .transport import add_task_vector

        body = add_task_vector(self.target, self.tau, alpha)
        if not self.carried:
            return body
        return {n: self.carried[n] if n in self.carried else body[n] for n in self.names}


def _move_task_vector(ctx: _Context, alignment: Alignment, graph: SymmetryGraph) -> _Moved:
    """π(τ) (and the fine-tune's own tensors) for ``alignment`` of A to B."""
    from .transport import move_finetune

    b, a, a_ft = ctx.loaded
    sd_ft = a_ft.model.state_dict()
    new_head = type(a_ft.model) is not type(a.model)
    ft_graph = a_ft.graph if new_head else None
    tau, carried = move_finetune(alignment, graph, sd_ft, ft_graph)  # carried: empty unless the head is new
    return _Moved(
        alignment.sd_a,
        tau,
        carried,
        list(sd_ft) if new_head else list(alignment.sd_a),
        a_ft.model if new_head else b.model,
        bool(alignment.untied) and not new_head,
    )


def _transport(
    ctx: _Context, processor: Any, base_dir: Path, report: Progress, command: str | None, dev: torch.device
) -> RunResult:
    """job: transport: align the old base A to the target B, move τ = A_ft − A, save B + α·π(τ)
    (a model folder), or for a LoRA adapter the adapter with its factors moved."""
    from .export import copy_support_files, output_folder, save_merged_model
    from .strategies import Pair, align

    recipe, timings, notes = ctx.recipe, ctx.timings, ctx.notes
    b, a, a_ft = ctx.loaded  # the fine-tune was checked against its base when loaded
    name, options = recipe.strategy.name, recipe.strategy.options
    graph = b.graph
    if ctx.adapter is not None:
        from .lora import canonical_blocker, lora_graph

        # generalized-orthogonal works in canonical form: an adapter follows it when its factors can
        # take the norm scales (see lora.transport_adapter); otherwise permutations only
        blocker = (
            canonical_blocker(ctx.adapter, b.graph, a.model.state_dict())
            if name == "generalized-orthogonal"
            else "permutation strategy"
        )
        if blocker is not None:
            graph, demoted = lora_graph(b.graph)  # graph.fallbacks names the spaces limited to permutations
            if demoted and name == "generalized-orthogonal":
                notes.append(f"the adapter cannot follow the canonical form: {blocker}")
    pair = Pair(graph, b.model.state_dict(), a.model.state_dict(), b.model, a.model, ctx.data)
    run_cache = ctx.run_cache
    cached = run_cache.use(ctx.resolved, b, a, name, options, label="A to B", graph=graph)
    alignment = _timed_align(name, options, pair, report, timings, cache=cached)
    notes.extend(alignment.notes)
    start = time.perf_counter()
    moved = _move_task_vector(ctx, alignment, graph)
    if moved.carried:
        notes.append(
            "only in the fine-tune, carried over in B's basis: "
            + ", ".join(sorted(moved.carried))
            + f"; the result is a {type(a_ft.model).__name__}"
        )
    timings["align"] += time.perf_counter() - start
    alphas = recipe.alphas
    naive: _Moved | None = None
    ev = recipe.evaluate
    if ev is not None and "vanilla" in ev.compare:  # B + α·τ: the transport of an identity alignment
        plain = align("vanilla", Pair(b.graph, b.model.state_dict(), a.model.state_dict()))
        naive = _move_task_vector(ctx, plain, b.graph)

    inputs = _check_inputs(b, [ctx.eval_batches if not moved.carried else None, ctx.align_batches], dev)
    preserved = _preservation(
        name, [a], [alignment], [alignment.aligned_b()], inputs, real=bool(ctx.eval_batches or ctx.align_batches)
    )
    record: dict[str, Any] = {"alphas": alphas}
    if ev is not None and ctx.eval_batches is not None:
        start = time.perf_counter()
        record.update(_transport_scores(ctx, ctx.eval_batches, moved, naive))
        if ev.support is not None:
            support = _batches(
                ev.support,
                base_dir,
                ctx.task,
                processor,
                a_ft.model.config,
                batch_size=ev.batch_size,
                max_tokens=ev.support.max_tokens,
                max_examples=ev.support.max_examples,
                seed=ev.seed,
                where="evaluate.support",
            )
            record["support"] = _transport_scores(ctx, support, moved, naive)
        timings["evaluate"] += time.perf_counter() - start
    if moved.carried:
        record["carried"] = sorted(moved.carried)

    start = time.perf_counter()
    with output_folder(ctx.output, overwrite=recipe.output.overwrite) as tmp:
        if ctx.adapter is not None:
            from .lora import save_adapter, transport_adapter

            sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
            canonical = alignment.graph if alignment.canonical and graph is b.graph else None
            factors, whole = transport_adapter(
                ctx.adapter, graph, alignment.transform, sd_a, sd_b, canonical_graph=canonical
            )
            save_adapter(
                ctx.adapter,
                factors,
                tmp,
                base_model=str(recipe.target),
                alpha=alphas[0],
                target=sd_b,
                whole=whole,
                dtype=ctx.out_dtype,
            )
            record["adapter"] = {
                **ctx.adapter.summary(),
                "canonical": canonical is not None,  # factors took the norm scales (generalized-orthogonal)
                "whole_biases": sorted(whole.values()),  # biases that carry a folded β's shift, stored whole
            }
        else:
            save_merged_model(
                moved.template,
                moved.theta(alphas[0]),
                tmp,
                untie=moved.untie,
                max_shard_size=recipe.output.max_shard_size,
                dtype=ctx.out_dtype,
            )
        copy_support_files(ctx.folders[0], tmp)  # after save_pretrained: B's files as they were
        timings["save"] = time.perf_counter() - start
        files = _write_record(
            tmp,
            recipe,
            ctx.output,
            ctx.resolved,
            command,
            strategy=name,
            strategy_options=options.model_dump(mode="json"),
            task=ctx.task,
            canonical=alignment.canonical and ctx.adapter is None,
            untied=list(alignment.untied) if ctx.adapter is None else [],  # an adapter stores no head
            transport=record,
            cache=run_cache.record(),
            barrier={},
            curves={},
            function_preserved=preserved,
            notes=notes,
            timings=timings,
            dtype=ctx.dtype_record,
        )
    pushed, push_error = _push(recipe, ctx.output, report)
    return RunResult(
        output=ctx.output,
        job=recipe.job,
        strategy=name,
        saved_model=ctx.adapter is None,
        function_preserved=preserved,
        timings=timings,
        notes=notes,
        files=files,
        canonical=alignment.canonical and ctx.adapter is None,
        untied=list(alignment.untied) if ctx.adapter is None else [],
        pushed=pushed,
        push_error=push_error,
        transport=record,
    )


def _output_dtype(
    recipe: Recipe, loaded: Sequence[LoadedModel], adapter: LoraAdapter | None, notes: list[str]
) -> tuple[torch.dtype, dict[str, Any]]:
    """The dtype the output is written in, and ``rebasin.json``'s ``dtype`` entry.

    ``output.dtype`` when set; else the reference model's stored dtype (merge: A; transport: the
    target B, or for an adapter the adapter's own), so a bf16 model stays bf16. Inputs stored in
    different dtypes follow the reference, with a note. The work itself always runs in float32.
    """
    from .models import WRITABLE_DTYPES, dtype_name

    roles = ["target", "base", "finetuned"] if recipe.job == "transport" else [_letter(i) for i in range(len(loaded))]
    inputs = {role: dtype_name(lm.stored_dtype) for role, lm in zip(roles, loaded, strict=False)}
    entry: dict[str, Any] = {"inputs": inputs, "output": None, "from": None, "compute": "float32"}
    if recipe.job == "barrier":  # no weights written
        return torch.float32, entry
    if recipe.output.dtype is not None:
        chosen, source = getattr(torch, recipe.output.dtype), "output.dtype"
    elif adapter is not None:
        chosen, source = adapter.dtype, "finetuned"
    else:
        chosen, source = loaded[0].stored_dtype, roles[0]
        written = list(loaded) if recipe.job == "merge" else [*loaded[:1], *loaded[2:]]  # transport: B, fine-tune
        if len({lm.stored_dtype for lm in written}) > 1:
            shown = ", ".join(f"{role} {name}" for role, name in inputs.items() if role != "base")
            who = "the target B's" if recipe.job == "transport" else "model A's (the reference)"
            notes.append(
                f"the inputs are stored in different dtypes ({shown}): the output is written in "
                f"{dtype_name(chosen)}, {who}; set `output.dtype` to choose another"
            )
    if chosen not in WRITABLE_DTYPES:
        notes.append(
            f"{roles[0]} is stored in {dtype_name(chosen)}, which hf-rebasin does not write: written as float32"
        )
        chosen = torch.float32
    entry["output"], entry["from"] = dtype_name(chosen), source
    return chosen, entry


def _letter(i: int) -> str:
    """A model's name in notes and records: A (the reference), B, C, …"""
    return chr(ord("A") + i) if i < 26 else f"#{i + 1}"


def _write_record(
    folder: Path, recipe: Recipe, output: Path, resolved: Sequence[ResolvedModel], command: str | None, **fields: Any
) -> list[str]:
    """Write ``rebasin.json`` and the card into ``folder``; return the folder's file names."""
    from .card import render_card
    from .export import write_json, write_text

    record = {
        "recipe": _recipe_record(recipe, output),
        "models": _model_entries(recipe, resolved),
        "datasets": _dataset_entries(recipe),
        **fields,
        "hf_rebasin_version": __version__,
    }
    write_json(folder / "rebasin.json", record)
    card = render_card(record, recipe_text=_recipe_text(recipe), command=_command(recipe, command))
    write_text(folder / "README.md", card)
    return sorted(p.name for p in folder.iterdir())


def _recipe_text(recipe: Recipe) -> str:
    """The recipe as written (comments and all), or as parsed when it was built in code."""
    if recipe.text is not None:
        return recipe.text.rstrip("\n")
    import yaml

    return yaml.safe_dump(recipe.model_dump(mode="json", exclude_defaults=True), sort_keys=False).rstrip("\n")


def _command(recipe: Recipe, command: str | None) -> str:
    if command is not None:
        return command
    return f"hf-rebasin {Path(recipe.source).name}" if Path(recipe.source).suffix else "hf-rebasin RECIPE.yaml"


def _task(recipe: Recipe, model: PreTrainedModel, task_of: Callable[[Any], Task]) -> Task:
    """The task of the data: ``evaluate.task`` (checked against A's head) or A's head."""
    ev = recipe.evaluate
    try:
        implied: Task | None = task_of(model)
    except UnsupportedArchitectureError:
        implied = None
    if ev is not None:
        if implied is not None and implied != ev.task:
            raise _task_mismatch(ev.task, type(model).__name__, implied)
        return ev.task
    if implied is None and recipe.data is not None:
        raise UnsupportedArchitectureError(
            f"`data`: cannot tell how to batch alignment data for a {type(model).__name__}; "
            "use a model with a task head (causal LM, masked LM, sequence or image classification)"
        )
    return implied or "causal-lm"


def _title(recipe: Recipe, task: str) -> str:
    names = [Path(ref.model).name or ref.model for _, ref in recipe.refs[:2]]
    return f"{task}: {names[0]} (λ=1) ↔ {names[1]} (λ=0), loss in nats"
