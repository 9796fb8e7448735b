"""Data a run reads once its models are loaded (`read_data`): the task, model A's tokenizer or
image processor, and batches built once from a recipe data section with an explicit `BatchSpec`
(the alignment cache keys on it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from hf_rebasin.alignment.strategies import AlignmentData
from hf_rebasin.core.errors import DataError, ModelNotFoundError, UnsupportedArchitectureError
from hf_rebasin.core.roles import Roles, TransportRoles
from hf_rebasin.evaluation.evaldata import classification_batches, load_records, text_batches
from hf_rebasin.evaluation.evaluate import Metric, Task, load_metric, task_of
from hf_rebasin.evaluation.seq2seq import seq2seq_batches
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.merging.vocabulary.output import RunVocabulary
from hf_rebasin.recipe import DataSpec, Recipe
from hf_rebasin.run.checks import task_mismatch
from hf_rebasin.run.resolve import PlannedModel

__all__ = [
    "MAX_BLOCK",
    "TEXT_TASKS",
    "AlignInput",
    "BatchSpec",
    "RunData",
    "batches",
    "data_processor",
    "metrics",
    "processor",
    "read_data",
]

TEXT_TASKS = ("causal-lm", "masked-lm")
MAX_BLOCK = 128  # tokens per block of evaluation / alignment text
ALIGN_BATCH_SIZE = 8  # alignment data without an `evaluate` section: its defaults
ALIGN_SEED = 0


@dataclass(frozen=True)
class BatchSpec:
    """How a data section is cut into batches: the task, examples per batch, limits and the seed.

    Built once per data section; the batches are made from it and the alignment cache keys on
    the very same object, so a change in batching cannot reuse an alignment computed on other data.
    """

    task: Task
    batch_size: int
    max_tokens: int | None
    max_examples: int | None
    seed: int

    @classmethod
    def for_alignment(cls, recipe: Recipe, task: Task) -> BatchSpec | None:
        """``data``'s batching: the task of the models aligned, and ``evaluate``'s batch size and seed."""
        if recipe.data is None:
            return None
        ev = recipe.evaluate
        return cls(
            task,
            ev.batch_size if ev is not None else ALIGN_BATCH_SIZE,
            recipe.data.max_tokens,
            recipe.data.max_examples,
            ev.seed if ev is not None else ALIGN_SEED,
        )

    @classmethod
    def for_evaluation(cls, recipe: Recipe, task: Task) -> BatchSpec | None:
        """``evaluate.data``'s batching."""
        ev = recipe.evaluate
        if ev is None:
            return None
        return cls(task, ev.batch_size, ev.max_tokens, ev.max_examples, ev.seed)

    def identity(self) -> dict[str, Any]:
        """The spec as JSON values (the alignment cache's key)."""
        return dataclasses.asdict(self)


def processor(folder: Path, task: Task) -> Any:
    """Model A's tokenizer (text tasks) or image processor, read from its folder; a speech model's
    (a seq2seq folder with a feature extractor, ``preprocessor_config.json``) with its tokenizer."""
    import transformers  # heavy: only runs that read data need it

    if task == "seq2seq" and (Path(folder) / "preprocessor_config.json").is_file():
        from hf_rebasin.evaluation.speech import SpeechProcessor

        extractor = transformers.AutoFeatureExtractor.from_pretrained(str(folder), trust_remote_code=False)
        return SpeechProcessor(extractor, processor(folder, "causal-lm"))
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


def metrics(recipe: Recipe, base_dir: Path) -> list[Metric]:
    """The recipe's ``evaluate.metrics``, loaded once through `evaluate.load`."""
    ev = recipe.evaluate
    return [load_metric(m.name, base_dir, m.kwargs) for m in ev.metric_specs()] if ev is not None else []


# a model's context in tokens (Whisper's decoder: max_target_positions)
_CONTEXT = ("max_position_embeddings", "n_positions", "max_target_positions")


def _block_size(config: Any, requested: int | None = None, where: str = "data") -> int:
    """``requested`` (the data section's ``block_size``), or MAX_BLOCK; never past the model's context."""
    limit = next((getattr(config, k) for k in _CONTEXT if getattr(config, k, None)), None)
    if limit is not None and getattr(config, "model_type", None) in ("roberta", "xlm-roberta", "camembert"):
        limit -= 2  # positions start after padding_idx
    if requested is None:
        return int(min(MAX_BLOCK, limit or MAX_BLOCK))
    if limit is not None and requested > limit:
        raise DataError(
            f"`{where}.block_size` is {requested} tokens but the model reads at most {limit} positions: lower it"
        )
    return int(requested)


def _label2id(records: Any, column: str, config: Any) -> Mapping[str, int] | None:
    """The model's label2id when the data name their labels in its terms; None to use ids as they are."""
    label2id = dict(getattr(config, "label2id", None) or {})
    feature = records.features.get(column)
    names = getattr(feature, "names", None)
    if names is not None and not set(names) <= set(label2id):
        return None  # class folders such as 0..9: ids as they are
    return label2id or None


def batches(
    spec: DataSpec,
    batching: BatchSpec,
    base_dir: Path,
    proc: Any,
    config: Any,
    *,
    where: str,
    notes: list[str] | None = None,
) -> list[dict[str, Tensor]]:
    """Batches of ``batching.task`` from a recipe data section, built once (``notes`` get how
    sequence-to-sequence data were made)."""
    raw = spec.model_dump()
    raw.pop("max_tokens", None)
    image = batching.task == "image-classification"
    if image and spec.block_size is not None:
        raise DataError(f"`{where}.block_size` counts tokens: remove it for image classification")
    length = _block_size(config, raw.pop("block_size", None), where)
    if batching.max_examples is not None:
        raw["max_examples"] = batching.max_examples
    try:
        records = load_records(raw, base_dir)
        if batching.task in TEXT_TASKS:
            return text_batches(
                records,
                proc,
                task=batching.task,  # type: ignore[arg-type]
                column=spec.column or "text",
                block_size=length,
                batch_size=batching.batch_size,
                max_tokens=batching.max_tokens,
                seed=batching.seed,
            )
        if batching.task == "seq2seq" and spec.audio_column is not None:
            return _speech(spec, batching, records, proc, config, length, base_dir, notes, where)
        if batching.task == "seq2seq":
            return _seq2seq(spec, batching, records, proc, config, length, where, notes)
        out = _classification(spec, batching, records, proc, config, length)
    except DataError as e:
        raise DataError(f"`{where}`: {e}") from None
    _check_labels(out, config, where)
    return out


def _classification(
    spec: DataSpec, batching: BatchSpec, records: Any, proc: Any, config: Any, length: int
) -> list[dict[str, Tensor]]:
    label_column = spec.label_column or "label"
    image = batching.task == "image-classification"
    return classification_batches(
        records,
        proc,
        task=batching.task,  # type: ignore[arg-type]
        column=spec.column or "text",
        image_column=spec.image_column or "image",
        label_column=label_column,
        batch_size=batching.batch_size,
        label2id=_label2id(records, label_column, config),
        max_length=None if image else length,
        image_mode=("L" if _channels(config) == 1 else "RGB") if image else None,
    )


def _seq2seq(
    spec: DataSpec,
    batching: BatchSpec,
    records: Any,
    proc: Any,
    config: Any,
    length: int,
    where: str,
    notes: list[str] | None,
) -> list[dict[str, Tensor]]:
    """Source → target pairs (named columns, or ``source`` and ``target`` where the data have both),
    else ``column``'s plain text noised as the model's family was pretrained (said in a note)."""
    columns = (spec.source_column, spec.target_column)
    if columns[0] is None and {"source", "target"} <= set(records.column_names) and spec.column is None:
        columns = ("source", "target")
    start = getattr(config, "decoder_start_token_id", None)
    start = start if start is not None else getattr(config, "pad_token_id", None)
    if start is None:
        raise DataError(f"`{where}`: the model's config names no decoder_start_token_id (nor pad_token_id)")
    made = seq2seq_batches(
        records,
        proc,
        start_id=int(start),
        columns=None if columns[0] is None or columns[1] is None else (columns[0], columns[1]),
        column=spec.column or "text",
        block_size=length,
        batch_size=batching.batch_size,
        max_tokens=batching.max_tokens,
        seed=batching.seed,
    )
    if notes is not None:
        notes.append(f"`{where}`: {made.description}")
    return made.batches


def _speech(
    spec: DataSpec,
    batching: BatchSpec,
    records: Any,
    proc: Any,
    config: Any,
    length: int,
    base_dir: Path,
    notes: list[str] | None,
    where: str,
) -> list[dict[str, Tensor]]:
    """WAV clips → transcripts, for a speech encoder-decoder (its encoder takes exactly
    2·max_source_positions frames)."""
    from hf_rebasin.evaluation.speech import speech_batches

    if getattr(config, "max_source_positions", None) is None or getattr(config, "decoder_start_token_id", None) is None:
        raise DataError(f"`audio_column`: a {config.model_type} model reads no audio; remove it")
    made = speech_batches(
        records,
        proc,
        start_id=int(config.decoder_start_token_id),
        frames=2 * int(config.max_source_positions),
        audio_column=spec.audio_column or "audio",
        target_column=spec.target_column or "target",
        max_length=length,
        batch_size=batching.batch_size,
        base_dir=base_dir,
    )
    if notes is not None:
        notes.append(f"`{where}`: WAV clips → transcripts ({2 * int(config.max_source_positions)} feature frames)")
    return made


def _channels(config: Any) -> int:
    """The image channels a model reads: its vision tower's where the config has one (SigLIP)."""
    vision = getattr(config, "vision_config", None) or config
    return int(getattr(vision, "num_channels", 3))


def _check_labels(out: list[dict[str, Tensor]], config: Any, where: str) -> None:
    """Label ids inside the model's classes (a classifier would index out of range, or learn nothing)."""
    n_labels = int(getattr(config, "num_labels", 0) or 0)
    top = max(int(b["labels"].max()) for b in out)
    if n_labels and (top >= n_labels or min(int(b["labels"].min()) for b in out) < 0):
        raise DataError(
            f"`{where}.label_column`: label id {top} is outside the model's {n_labels} classes (0..{n_labels - 1}); "
            "name the labels as in the model's config (label2id) or renumber them"
        )


@dataclass
class AlignInput:
    """Alignment data as the strategies read them, with the batching that made them."""

    spec: BatchSpec  # the alignment cache keys on this very spec
    batches: list[dict[str, Tensor]]
    data: AlignmentData


@dataclass(frozen=True)
class RunData:
    """What a run reads besides its models, once: the data's task, the tokenizer or processor, the batches."""

    task: Task  # the data's task (a transport: the fine-tune's)
    processor: Any  # A's tokenizer or image processor (None without data)
    align: AlignInput | None
    eval_batches: list[dict[str, Tensor]] | None
    notes: tuple[str, ...] = ()  # how the data were made, where a choice was made for the user


def read_data(
    recipe: Recipe,
    base_dir: Path,
    inputs: Roles[PlannedModel],
    models: Roles[LoadedModel],
    rows: RunVocabulary | None,
) -> RunData:
    """The recipe's ``data`` and ``evaluate.data`` batched for the loaded ``models`` (``rows``: their
    vocabularies where they differ)."""
    task, align_task = _tasks(recipe, models)
    ev = recipe.evaluate
    proc = data_processor(inputs, task, rows) if (recipe.data is not None or ev is not None) else None
    notes: list[str] = []
    align = _alignment_data(recipe, base_dir, align_task, proc, models.reference, notes)
    return RunData(task, proc, align, _eval_batches(recipe, task, base_dir, proc, models, notes), tuple(notes))


def data_processor(inputs: Roles[PlannedModel], task: Task, rows: RunVocabulary | None) -> Any:
    """The reference's tokenizer or processor; where the vocabularies differ and the output's
    tokens are the first working rows, the output's tokenizer (a fine-tune's chat tokens encode)."""
    out = rows.output if rows is not None else None
    if rows is not None and out is not None and out.rows[: out.tokens] == tuple(range(out.tokens)):
        return rows.tokenizer()
    return processor(inputs.reference.path, task)


def _tasks(recipe: Recipe, models: Roles[LoadedModel]) -> tuple[Task, Task]:
    """The task of the evaluation data and that of the alignment data: a transport is scored on
    the fine-tune's task (its head may be new) while alignment data go through the bases."""
    if isinstance(models, TransportRoles):
        return _task(recipe, models.finetune.model), task_of(models.reference.model)
    task = _task(recipe, models.reference.model)
    return task, task


def _task(recipe: Recipe, model: Any) -> Task:
    """The task of the data: ``evaluate.task`` (checked against the model's head) or its head's."""
    ev = recipe.evaluate
    try:
        implied: Task | None = task_of(model)
    except UnsupportedArchitectureError:
        implied = None
    if ev is not None:
        if implied is not None and implied != ev.task:
            raise task_mismatch(ev.task, type(model).__name__, implied)
        return ev.task
    if implied is None and recipe.data is not None:
        raise UnsupportedArchitectureError(
            f"`data`: cannot tell how to batch alignment data for a {type(model).__name__}; "
            "use a model with a task head (causal LM, masked LM, sequence or image classification)"
        )
    return implied or "causal-lm"


def _alignment_data(
    recipe: Recipe, base_dir: Path, task: Task, proc: Any, reference: LoadedModel, notes: list[str]
) -> AlignInput | None:
    """``data`` batched once, with the spec that batched it (None without ``data``)."""
    spec = BatchSpec.for_alignment(recipe, task)
    if recipe.data is None or spec is None:
        return None
    made = batches(recipe.data, spec, base_dir, proc, reference.model.config, where="data", notes=notes)
    special = frozenset(int(t) for t in getattr(proc, "all_special_ids", []) or [])
    data = AlignmentData(made, special, description=f"{recipe.data.dataset} ({recipe.data.split})")
    return AlignInput(spec, made, data)


def _eval_batches(
    recipe: Recipe, task: Task, base_dir: Path, proc: Any, models: Roles[LoadedModel], notes: list[str]
) -> list[dict[str, Tensor]] | None:
    """``evaluate.data`` batched once (None without ``evaluate``); a transport's for the fine-tune,
    whose task and head it is scored on."""
    ev = recipe.evaluate
    eval_spec = BatchSpec.for_evaluation(recipe, task)
    if ev is None or eval_spec is None:
        return None
    config = (models.finetune if isinstance(models, TransportRoles) else models.reference).model.config
    return batches(ev.data, eval_spec, base_dir, proc, config, where="evaluate.data", notes=notes)
