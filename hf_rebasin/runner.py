"""Running a recipe end to end: load, align, merge, evaluate, write (DESIGN.md §2, §5, §9).

This module holds the order of the stages and nothing else: loading is `models`, alignment the
strategies, averaging `merge`, losses `evaluate`, files `export`. It never prints; the CLI passes a
``progress(stage, done, total)`` callback (``total`` 0 when unknown) and prints the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import __version__
from .errors import DataError, ModelNotFoundError, RebasinUserError, UnsupportedArchitectureError
from .recipe import DEVICE_PATTERN, DataSpec, ModelRef, Recipe, describe

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .evaluate import Curve, Task
    from .models import LoadedModel
    from .strategies import Alignment, AlignmentData

__all__ = ["Progress", "ResolvedModel", "RunResult", "plan", "resolve_model", "run_recipe"]

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: the CLI turns each stage into a progress bar (total 0: unknown)."""

LOAD_STAGE = "loading models"
SWEEP_STAGE = "λ sweep"
TEXT_TASKS = ("causal-lm", "masked-lm")
MAX_BLOCK = 128  # tokens per block of evaluation / alignment text (DESIGN.md §5: 128-token blocks)
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


def _noop(stage: str, done: int, total: int) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Resolving and planning


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model reference leads: its folder (None: a Hub model not downloaded yet) and commit."""

    folder: Path | None
    commit: str | None = None


def resolve_model(
    ref: ModelRef,
    where: str = "models.0.model",
    *,
    progress: Progress | None = None,
    fetch: bool = True,
    allow_pickle: bool = False,
) -> ResolvedModel:
    """The local folder of a model reference, trained (zoo) or downloaded (Hub) when ``fetch``.

    Without ``fetch`` (a dry run) nothing is trained or downloaded: a zoo model says where it will
    be, a Hub model is resolved to its commit from metadata alone.
    """
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

        if not fetch:
            commit, files = hub.resolve_revision(ref.model, ref.revision, where=where)
            hub.weight_patterns(ref.model, ref.revision, files, allow_pickle=allow_pickle, where=where)
            return ResolvedModel(None, commit)
        snap = hub.download_model(ref.model, ref.revision, allow_pickle=allow_pickle, where=where)
        return ResolvedModel(snap.folder, snap.commit)
    folder = Path(ref.model)
    if not folder.exists():
        raise ModelNotFoundError(f"{where}: the model folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ModelNotFoundError(f"{where}: {str(folder)!r} is a file; give the folder that holds config.json")
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"{where}: {str(folder)!r} has no config.json; a model folder is what `save_pretrained` writes"
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


def _check_recipe(recipe: Recipe, output: Path) -> list[ResolvedModel]:
    """Everything that can be checked without loading weights: models, files, output, push token."""
    from .export import check_output

    check_output(output, recipe.output.overwrite)
    resolved = [resolve_model(ref, where, fetch=False, allow_pickle=recipe.allow_pickle) for where, ref in recipe.refs]
    for (where, ref), res in zip(recipe.refs, resolved, strict=True):
        if res.folder is not None and (res.folder / "config.json").is_file():
            _check_remote_code(recipe, res.folder, where, ref)
    if resolved[0].folder is not None:
        _check_task_of_folder(recipe, resolved[0].folder)
    if recipe.data is not None:
        _check_data_files(recipe.data, "data")
    if recipe.evaluate is not None:
        _check_data_files(recipe.evaluate.data, "evaluate.data")
    push = recipe.output.push_to_hub
    if push is not None:
        from . import hub

        if not hub.has_token():
            raise hub.HubError(
                f"`output.push_to_hub`: pushing to {push.repo!r} needs a token: set HF_TOKEN or run `hf auth login` "
                "(checked before any work is done)"
            )
    return resolved


def _check_remote_code(recipe: Recipe, folder: Path, where: str, ref: ModelRef) -> None:
    """A model whose config.json names its own modeling code (``auto_map``) needs ``trust_remote_code``.

    hf-rebasin never downloads or runs repository code: with ``trust_remote_code: true`` the weights
    are loaded into the stock class of their ``model_type`` (every tensor's shape is checked).
    """
    config = _config_json(folder)
    if config.get("auto_map") and not recipe.trust_remote_code:
        raise UnsupportedArchitectureError(
            f"`{where}`: {ref} ships its own modeling code (auto_map in config.json: "
            f"{', '.join(sorted(config['auto_map']))}); hf-rebasin never runs repository code. Set "
            "`trust_remote_code: true` to load its weights into the stock class of its model_type instead"
        )


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


def plan(recipe: Recipe, *, output: Path | None = None) -> list[str]:
    """The plan of ``--dry-run``: `describe` plus the checks that need no weights (typed errors)."""
    target = _output_of(recipe, output)
    resolved = _check_recipe(recipe, target)
    lines = describe(recipe)
    for (_, ref), res in zip(recipe.refs, resolved, strict=True):
        if res.commit is not None:
            lines.append(f"resolved: {ref} -> commit {res.commit}")
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
            return transformers.AutoImageProcessor.from_pretrained(str(folder))
        return transformers.AutoTokenizer.from_pretrained(str(folder))
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
) -> float:
    """max |Δ logits| between B and B in A's basis (rebuilt from ``aligned``) on ``inputs``."""
    rebuilt = _rebuilt(model_b, aligned, bool(alignment.untied))
    model_b.eval()
    with torch.no_grad():
        before = model_b(**inputs).logits.float()
        after = rebuilt(**inputs).logits.float()
    return float((after - before).abs().max())


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


def _score(
    template: PreTrainedModel,
    sd: Mapping[str, Tensor],
    untie: bool,
    batches: Sequence[Mapping[str, Tensor]],
    task: Task,
) -> dict[str, Any]:
    """Loss and metric of a merged state dict on the evaluation batches (``rebasin.json``'s ``merged``)."""
    from .evaluate import evaluate_loss

    result = evaluate_loss(_rebuilt(template, sd, untie), batches, task)
    return {"loss": result.loss, "metric": dict(result.metric), "count": result.count}


def _sweep_progress(report: Progress, stage: str, total: int) -> Callable[[int, float, Any], None]:
    def step(i: int, _lam: float, _result: Any) -> None:
        report(stage, i + 1, total)

    return step


def _timed_align(name: str, options: Any, pair: Any, progress: Progress, timings: dict[str, float]) -> Alignment:
    from .strategies import align

    start = time.perf_counter()
    alignment = align(name, pair, options, progress)
    timings["align"] = timings.get("align", 0.0) + time.perf_counter() - start
    return alignment


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
    return {"max_abs_diff": max(gaps), "inputs": "evaluation or alignment data" if real else "random example inputs"}


def _curve(
    template: PreTrainedModel,
    alignment: Alignment,
    aligned_b: Mapping[str, Tensor],
    batches: Sequence[Mapping[str, Tensor]],
    task: Task,
    points: int,
    name: str,
    report: Progress,
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
    )


# ---------------------------------------------------------------------------------------------
# The run


def _model_entries(recipe: Recipe, resolved: Sequence[ResolvedModel]) -> list[dict[str, Any]]:
    return [
        {
            "model": ref.model,
            "revision": ref.revision,
            "commit": r.commit,
            "source": ref.source,
            "folder": str(r.folder),
            **({"role": where.split(".")[0]} if recipe.job == "transport" else {}),
        }
        for (where, ref), r in zip(recipe.refs, resolved, strict=True)
    ]


def _dataset_entries(recipe: Recipe) -> list[dict[str, Any]]:
    """Which data sets the run read, and whether each is a Hub id (the model card lists those)."""
    from .evaldata import BUILTIN_DATASETS, LOCAL_BUILDERS

    sections = [("alignment", recipe.data), ("evaluation", recipe.evaluate.data if recipe.evaluate else None)]
    out = []
    for role, spec in sections:
        if spec is None:
            continue
        local = spec.dataset in LOCAL_BUILDERS or Path(spec.dataset).is_absolute()
        source = "builtin" if spec.dataset in BUILTIN_DATASETS else "local" if local else "hub"
        out.append({"role": role, "dataset": spec.dataset, "name": spec.name, "split": spec.split, "source": source})
    return out


def _recipe_record(recipe: Recipe, output: Path) -> dict[str, Any]:
    dumped: dict[str, Any] = recipe.model_dump(mode="json")
    dumped["output"]["dir"] = str(output)
    return dumped


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
    and then into a temporary folder renamed into place (see `export.output_folder`).
    """
    from .evaluate import barrier, task_of
    from .export import copy_preprocessor_files, output_folder, save_merged_model, write_text
    from .merge import merge_state_dicts
    from .models import check_compatible, load_model
    from .report import markdown_table, plot_curves
    from .strategies import AlignmentData, Pair, get_strategy

    report = progress or _noop
    target = _output_of(recipe, output)
    _check_recipe(recipe, target)
    dev = _device(device or recipe.device)
    base_dir = Path(recipe.source).parent if Path(recipe.source).is_file() else Path.cwd()
    timings: dict[str, float] = {"load": 0.0, "align": 0.0, "evaluate": 0.0, "save": 0.0}
    notes: list[str] = []

    # load (zoo models are trained first when not cached: timed apart as "train")
    start = time.perf_counter()
    untrained = _untrained_zoo(recipe)
    resolved = [
        resolve_model(ref, where, progress=report, allow_pickle=recipe.allow_pickle) for where, ref in recipe.refs
    ]
    folders = [r.folder for r in resolved if r.folder is not None]
    for (where, ref), folder in zip(recipe.refs, folders, strict=True):
        _check_remote_code(recipe, folder, where, ref)
    if untrained:
        timings["train"] = time.perf_counter() - start
        start = time.perf_counter()
    loaded: list[LoadedModel] = []
    report(LOAD_STAGE, 0, len(folders))
    for i, folder in enumerate(folders):
        lm = load_model(folder, allow_pickle=recipe.allow_pickle)
        if loaded:
            check_compatible(loaded[0], lm)
        _move(lm.model, dev)
        loaded.append(lm)
        report(LOAD_STAGE, i + 1, len(folders))
    a = loaded[0]
    task = _task(recipe, a.model, task_of)
    ev = recipe.evaluate
    processor = _processor(folders[0], task) if (recipe.data is not None or ev is not None) else None
    align_batches: list[dict[str, Tensor]] | None = None
    data: AlignmentData | None = None
    if recipe.data is not None:
        align_batches = _batches(
            recipe.data,
            base_dir,
            task,
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
            a.model.config,
            batch_size=ev.batch_size,
            max_tokens=ev.max_tokens,
            max_examples=ev.max_examples,
            seed=ev.seed,
            where="evaluate.data",
        )
    timings["load"] = time.perf_counter() - start
    if recipe.job == "transport":
        ctx = _Context(
            recipe, target, resolved, folders, loaded, task, data, align_batches, eval_batches, timings, notes
        )
        return _transport(ctx, processor, base_dir, report, command, dev)

    # align every other model to A
    name = recipe.strategy.name
    options = recipe.strategy.options
    sd_a = a.model.state_dict()
    alignments: list[Alignment] = []
    for lm in loaded[1:]:
        pair = Pair(a.graph, sd_a, lm.model.state_dict(), a.model, lm.model, data)
        alignments.append(_timed_align(name, options, pair, report, timings))
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
                al = _timed_align(curve_name, get_strategy(curve_name).parse(None), pair, report, timings)
                aligned_b = al.aligned_b()
            start = time.perf_counter()
            curves[curve_name] = _curve(a.model, al, aligned_b, eval_batches, task, ev.points, curve_name, report)
            barriers[curve_name] = barrier(curves[curve_name].lambdas, curves[curve_name].losses)
            timings["evaluate"] += time.perf_counter() - start

    # merge, and score the merged model (and the unaligned average with the same weights)
    weights = recipe.merge.weights(len(loaded))
    scores: dict[str, dict[str, Any]] = {}
    merged: dict[str, Tensor] = {}
    if recipe.job == "merge":
        merged = merge_state_dicts([primary.sd_a, *aligned], weights)
        if ev is not None and eval_batches is not None:
            start = time.perf_counter()
            scores[name] = _score(a.model, merged, bool(primary.untied), eval_batches, task)
            if "vanilla" in ev.compare and name != "vanilla":
                plain = merge_state_dicts([sd_a, *(lm.model.state_dict() for lm in loaded[1:])], weights)
                scores["vanilla"] = _score(a.model, plain, False, eval_batches, task)
            timings["evaluate"] += time.perf_counter() - start

    # save
    start = time.perf_counter()
    files: list[str] = []
    with output_folder(target, overwrite=recipe.output.overwrite) as tmp:
        if recipe.job == "merge":
            save_merged_model(
                a.model, merged, tmp, untie=bool(primary.untied), max_shard_size=recipe.output.max_shard_size
            )
            copy_preprocessor_files(folders[0], tmp)
        if curves:
            plot_curves(curves, tmp / "barrier.png", title=_title(recipe, task))
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
            task=task,
            canonical=primary.canonical,
            untied=list(primary.untied),
            barrier=barriers,
            merged=scores,
            curves={k: c.as_dict() for k, c in curves.items()},
            function_preserved=preserved,
            notes=notes,
            timings=timings,
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
    )


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


Sweep = Callable[[], Iterator[dict[str, Tensor]]]  # the state dicts of one transport, α after α


def _transport_scores(
    ctx: _Context, batches: Sequence[Mapping[str, Tensor]], thetas: Sweep, untie: bool, naive: Sweep | None
) -> dict[str, Any]:
    """Loss and metric of target B, fine-tune A_ft, B + α·π(τ) per α and (``naive``) B + α·τ per α."""
    from .evaluate import evaluate_loss

    b, _a, a_ft = ctx.loaded
    out: dict[str, Any] = {"loss": {}, "metric": {}}

    def put(key: str, score: dict[str, Any], many: bool) -> None:
        if many:
            out["loss"].setdefault(key, []).append(score["loss"])
            out["metric"].setdefault(key, []).append(score["metric"])
        else:
            out["loss"][key], out["metric"][key] = score["loss"], score["metric"]

    for key, lm in (("target", b), ("finetuned", a_ft)):
        result = evaluate_loss(lm.model, batches, ctx.task)
        put(key, {"loss": result.loss, "metric": dict(result.metric)}, False)
    for theta in thetas():
        put("transported", _score(b.model, theta, untie, batches, ctx.task), True)
    for theta in naive() if naive is not None else ():
        put("naive", _score(b.model, theta, False, batches, ctx.task), True)
    return out


def _transport(
    ctx: _Context, processor: Any, base_dir: Path, report: Progress, command: str | None, dev: torch.device
) -> RunResult:
    """job: transport: align the old base A to the target B, move τ = A_ft − A, save B + α·π(τ)."""
    from .export import copy_preprocessor_files, output_folder, save_merged_model
    from .strategies import Pair, align
    from .transport import add_task_vector, task_vector

    recipe, timings, notes = ctx.recipe, ctx.timings, ctx.notes
    b, a, a_ft = ctx.loaded  # base and fine-tune were each checked against the target when loaded
    name, options = recipe.strategy.name, recipe.strategy.options
    pair = Pair(b.graph, b.model.state_dict(), a.model.state_dict(), b.model, a.model, ctx.data)
    alignment = _timed_align(name, options, pair, report, timings)
    notes.extend(alignment.notes)
    start = time.perf_counter()
    tau = task_vector(alignment, a.graph, a_ft.model.state_dict())
    timings["align"] += time.perf_counter() - start
    alphas = recipe.alphas
    untie = bool(alignment.untied)

    def sweep(target: Mapping[str, Tensor], moved: Mapping[str, Tensor]) -> Sweep:
        return lambda: (add_task_vector(target, moved, alpha) for alpha in alphas)  # one state dict at a time

    thetas = sweep(alignment.sd_a, tau)
    naive: Sweep | None = None
    ev = recipe.evaluate
    if ev is not None and "vanilla" in ev.compare:  # B + α·τ: the transport of an identity alignment
        plain = align("vanilla", Pair(b.graph, b.model.state_dict(), a.model.state_dict()))
        naive = sweep(plain.sd_a, task_vector(plain, a.graph, a_ft.model.state_dict()))

    inputs = _check_inputs(b, [ctx.eval_batches, ctx.align_batches], dev)
    preserved = _preservation(
        name, [a], [alignment], [alignment.aligned_b()], inputs, real=bool(ctx.eval_batches or ctx.align_batches)
    )
    moved: dict[str, Any] = {"alphas": alphas}
    if ev is not None and ctx.eval_batches is not None:
        start = time.perf_counter()
        moved.update(_transport_scores(ctx, ctx.eval_batches, thetas, untie, naive))
        if ev.support is not None:
            support = _batches(
                ev.support,
                base_dir,
                ctx.task,
                processor,
                b.model.config,
                batch_size=ev.batch_size,
                max_tokens=ev.support.max_tokens,
                max_examples=ev.support.max_examples,
                seed=ev.seed,
                where="evaluate.support",
            )
            moved["support"] = _transport_scores(ctx, support, thetas, untie, naive)
        timings["evaluate"] += time.perf_counter() - start

    start = time.perf_counter()
    with output_folder(ctx.output, overwrite=recipe.output.overwrite) as tmp:
        save_merged_model(b.model, next(iter(thetas())), tmp, untie=untie, max_shard_size=recipe.output.max_shard_size)
        copy_preprocessor_files(ctx.folders[0], tmp)
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
            canonical=alignment.canonical,
            untied=list(alignment.untied),
            transport=moved,
            barrier={},
            curves={},
            function_preserved=preserved,
            notes=notes,
            timings=timings,
        )
    pushed, push_error = _push(recipe, ctx.output, report)
    return RunResult(
        output=ctx.output,
        job=recipe.job,
        strategy=name,
        saved_model=True,
        function_preserved=preserved,
        timings=timings,
        notes=notes,
        files=files,
        canonical=alignment.canonical,
        untied=list(alignment.untied),
        pushed=pushed,
        push_error=push_error,
        transport=moved,
    )


def _write_record(
    folder: Path, recipe: Recipe, output: Path, resolved: Sequence[ResolvedModel], command: str | None, **fields: Any
) -> list[str]:
    """Write ``rebasin.json`` (DESIGN.md §9) and the card into ``folder``; return the folder's file names."""
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
