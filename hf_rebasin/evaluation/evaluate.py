"""Losses along the line between two models, and the loss barrier.

All losses are in nats. A curve reuses one model object: each λ loads an interpolated state dict
into it in place, and the batches are materialised once, so a 21-point curve costs 21 forward
passes over the same tensors and nothing else. Loss and perplexity are computed in torch; metrics
a recipe names (``evaluate.metrics``, classification only) go through the `evaluate` library.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import DataError, IncompatibleModelsError, MetricError, UnsupportedArchitectureError
from hf_rebasin.core.names import CLASSIFICATION_TASKS, TASKS, Task
from hf_rebasin.merging.interpolate import StorageKey, storage_key

if TYPE_CHECKING:
    from torch import nn

# metrics every run computes in torch (the plot adds a panel only for metrics a recipe asks for)
BUILTIN_METRICS: tuple[str, ...] = ("perplexity", "pseudo_perplexity", "accuracy")
Batch = Mapping[str, Tensor]

# class-name suffix -> task; GPT-2's causal LM is the odd one out ("LMHeadModel")
_SUFFIXES: tuple[tuple[str, Task], ...] = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("ForSequenceClassification", "sequence-classification"),
    ("ForImageClassification", "image-classification"),
)


@dataclass(frozen=True)
class EvalResult:
    """Mean loss (nats) over ``count`` predictions: tokens for language models, examples otherwise."""

    loss: float
    metric: dict[str, float]
    count: int


@dataclass(frozen=True)
class Curve:
    """Loss (nats) and metrics at each λ, the weight on model A (λ = 1 is A, λ = 0 is B)."""

    lambdas: list[float]
    losses: list[float]
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The ``curves.<name>`` entry of ``rebasin.json`` (a documented contract: keys do not change)."""
        return {"lambdas": list(self.lambdas), "loss": list(self.losses), "metric": dict(self.metrics)}


@dataclass(frozen=True)
class Metric:
    """An `evaluate` metric loaded once, and the keyword arguments its ``compute`` takes
    (e.g. ``average: macro`` for F1 on more than two classes)."""

    name: str
    module: Any
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def compute(self, predictions: Tensor, references: Tensor) -> dict[str, float]:
        """The metric's numbers on class ids; a failure or a value that is not a number is the user's to fix."""
        try:
            out = self.module.compute(predictions=predictions.tolist(), references=references.tolist(), **self.kwargs)
        except Exception as e:  # a metric script may raise anything on arguments it does not take
            raise MetricError(
                f"`evaluate.metrics`: {self.name!r} failed on the predictions ({type(e).__name__}: {_line(e)}); "
                "fix its `kwargs` (e.g. `average: macro` for f1, precision or recall on more than two classes) "
                "or remove it"
            ) from None
        values: dict[str, float] = {}
        for key, value in (out or {}).items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                raise MetricError(
                    f"`evaluate.metrics`: {self.name!r} returned {key}={value!r}, not one number; pass `kwargs` "
                    "that make it one (e.g. `average: macro`) or remove it"
                ) from None
        return values


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def load_metric(entry: str, base_dir: Path, kwargs: Mapping[str, Any] | None = None) -> Metric:
    """``evaluate.load`` of a metric name on the Hub (``accuracy``, ``f1``) or of a local metric script
    (a ``.py`` file, or a folder holding ``<folder name>.py``; relative paths resolve against
    ``base_dir``, the recipe's folder). Anything that does not load is a `MetricError`."""
    import evaluate

    path = Path(entry).expanduser()
    local = entry.endswith(".py") or "/" in entry or "\\" in entry or (Path(base_dir) / path).exists()
    if local:
        path = path if path.is_absolute() else Path(base_dir).absolute() / path
        if not path.exists():
            raise MetricError(
                f"`evaluate.metrics`: the metric script {entry!r} is not there (looked for {path}); give the path "
                "of an `evaluate` metric script, relative to the recipe, or a metric name such as accuracy"
            )
    target = str(path) if local else entry
    try:
        module = evaluate.load(target)
    except Exception as e:  # evaluate.load raises FileNotFoundError, ConnectionError, ImportError, …
        where = (
            "a local metric script that does not load"
            if local
            else "not a metric `evaluate` could load (Hub names need the network or a copy in the evaluate cache)"
        )
        raise MetricError(
            f"`evaluate.metrics`: {entry!r} is {where}: {type(e).__name__}: {_line(e)}. Give the path of a local "
            "`evaluate` metric script (relative to the recipe), or run once with network access so the Hub "
            "metric is cached, or remove it"
        ) from None
    return Metric(name=entry, module=module, kwargs=dict(kwargs or {}))


def _seq2seq_classes() -> frozenset[str]:
    """Classes transformers itself maps to sequence-to-sequence generation (by name, so that
    ``Gemma3ForConditionalGeneration`` is not one and ``MarianMTModel`` is)."""
    from transformers.models.auto import modeling_auto as auto  # names only: no model code is imported

    names = {*auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values()}
    names |= {*auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES.values()}
    return frozenset(n for n in names if isinstance(n, str))


def task_of_class(name: str) -> Task | None:
    """The task implied by a model class name (``GPT2LMHeadModel`` → ``causal-lm``), else None.

    Works on ``config.json``'s ``architectures`` too, so a dry run can check a recipe's task
    without loading weights.
    """
    task = next((task for suffix, task in _SUFFIXES if name.endswith(suffix)), None)
    if task is None and (name.endswith("ForConditionalGeneration") or name.endswith("MTModel")):
        return "seq2seq" if name in _seq2seq_classes() else None
    return task


def task_of(model: nn.Module) -> Task:
    """The evaluation task implied by a model's class (``GPT2LMHeadModel`` → ``causal-lm``)."""
    name = type(model).__name__
    task = task_of_class(name)
    if task is not None:
        return task
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"cannot evaluate a {name}: it has no language-model head; load it with its sequence-to-sequence "
            "class (AutoModelForSeq2SeqLM) or a classification head"
        )
    raise UnsupportedArchitectureError(
        f"cannot tell which loss to evaluate for a {name}: supported heads are "
        f"{', '.join(s for s, _ in _SUFFIXES)} and sequence-to-sequence LMs (tasks {', '.join(TASKS)}); "
        "set `evaluate.task` and load the model with a matching head"
    )


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise UnsupportedArchitectureError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def evaluate_loss(model: nn.Module, batches: Iterable[Batch], task: Task, metrics: Sequence[Metric] = ()) -> EvalResult:
    """Cross-entropy of ``model`` over ``batches``: the sum of per-prediction losses / their count.

    Summing (instead of averaging batch means) makes the result independent of how the data were
    batched and of padding. Causal LM: every non-pad next token (labels -100 are skipped); masked
    LM: positions whose label is not -100; seq2seq: every target token (the batch carries the decoder's
    inputs, labels unshifted); classification: every example, plus accuracy and each
    of ``metrics`` on the argmax predictions. The model is put in eval mode; no gradients are kept.
    """
    _check_task(task)
    if metrics and task not in CLASSIFICATION_TASKS:
        raise MetricError(f"`evaluate.metrics` apply to {' and '.join(CLASSIFICATION_TASKS)}, not to {task}")
    predictions: list[Tensor] = []
    references: list[Tensor] = []
    device = _device(model)
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    correct = 0
    with torch.no_grad():
        for batch in batches:
            if "labels" not in batch:
                raise DataError(f"a {task} batch needs `labels` (-100 where nothing is predicted); got {sorted(batch)}")
            inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
            labels = batch["labels"].to(device)
            logits = model(**inputs).logits.float()
            if task == "causal-lm":
                logits, labels = logits[:, :-1], labels[:, 1:]
            elif task == "seq2seq" and "decoder_input_ids" not in inputs:
                raise DataError("a seq2seq batch needs `decoder_input_ids`: the model would shift the source instead")
            flat = logits.reshape(-1, logits.shape[-1])
            target = labels.reshape(-1)
            loss = torch.nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="sum")
            total += loss.double().cpu()
            keep = target != -100
            count += int(keep.sum())
            if task in CLASSIFICATION_TASKS:
                predicted = flat.argmax(-1)[keep]
                correct += int((predicted == target[keep]).sum())
                if metrics:
                    predictions.append(predicted.cpu())
                    references.append(target[keep].cpu())
    if count == 0:
        raise DataError("no predictions to evaluate: the data are empty or every label is -100")
    mean = float(total) / count
    metric: dict[str, float]
    if task in ("causal-lm", "seq2seq"):
        metric = {"perplexity": _exp(mean)}
    elif task == "masked-lm":
        metric = {"pseudo_perplexity": _exp(mean)}
    else:
        metric = {"accuracy": correct / count}
        for m in metrics:
            metric.update(m.compute(torch.cat(predictions), torch.cat(references)))
    return EvalResult(loss=mean, metric=metric, count=count)


def _exp(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).exp())


def interpolate(sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], lam: float) -> dict[str, Tensor]:
    """λ·A + (1−λ)·B for every floating tensor; other tensors (int buffers) are taken from A.

    Exact at the ends (`torch.lerp`): λ = 1 returns A's values, λ = 0 B's. Tied aliases (the same
    storage under two names in A and in B, e.g. ``lm_head.weight`` / ``wte.weight``) are computed
    once and stay one tensor in the result.
    """
    if sd_a.keys() != sd_b.keys():
        only_a = sorted(set(sd_a) - set(sd_b))
        only_b = sorted(set(sd_b) - set(sd_a))
        raise IncompatibleModelsError(
            f"the state dicts hold different tensors: only in A {only_a[:5]}, only in B {only_b[:5]}"
        )
    out: dict[str, Tensor] = {}
    done: dict[tuple[StorageKey, StorageKey], Tensor] = {}
    for name, a in sd_a.items():
        b = sd_b[name]
        if a.shape != b.shape:
            raise IncompatibleModelsError(f"tensor {name!r} has shape {tuple(a.shape)} in A and {tuple(b.shape)} in B")
        if not a.is_floating_point():
            out[name] = a
            continue
        key = (storage_key(a), storage_key(b))
        if key not in done:
            wide = a.dtype in (torch.float16, torch.bfloat16)
            start, end = (b.float(), a.float()) if wide else (b.to(a.dtype), a)
            done[key] = torch.lerp(start, end, float(lam)).to(a.dtype)
        out[name] = done[key]
    return out


def _own_copy(model: nn.Module, sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` with every tensor that shares storage with ``model`` cloned (aliases stay aliases).

    ``model.state_dict()`` returns views of the live parameters: loading an interpolated state
    into the model would silently rewrite them (and every later λ would be wrong).
    """
    live = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    clones: dict[StorageKey, Tensor] = {}
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        if t.untyped_storage().data_ptr() in live:
            key = storage_key(t)
            if key not in clones:
                clones[key] = t.detach().clone()
            out[name] = clones[key]
        else:
            out[name] = t
    return out


def _lerp_into(live: Mapping[str, Tensor], sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], lam: float) -> None:
    """Write λ·A + (1−λ)·B straight into the model's tensors (``live``: its ``state_dict()``, views of
    the parameters): one pass over memory per λ, where building a state dict and loading it were two."""
    done: set[StorageKey] = set()
    with torch.no_grad():
        for name, target in live.items():
            a, b = sd_a[name], sd_b[name]
            if a.shape != b.shape or a.shape != target.shape:
                raise IncompatibleModelsError(
                    f"tensor {name!r} has shape {tuple(a.shape)} in A, {tuple(b.shape)} in B and "
                    f"{tuple(target.shape)} in the model"
                )
            key = storage_key(target)
            if key in done:
                continue  # a tied alias: written once
            done.add(key)
            if not target.is_floating_point():
                target.copy_(a)
            elif target.dtype == a.dtype == b.dtype and target.dtype not in (torch.float16, torch.bfloat16):
                torch.lerp(b, a, lam, out=target)
            else:
                target.copy_(torch.lerp(b.float(), a.float(), lam))


def loss_curve(
    model: nn.Module,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    batches: Iterable[Batch],
    task: Task,
    lambdas: Sequence[float],
    *,
    progress: Callable[[int, float, EvalResult], None] | None = None,
    metrics: Sequence[Metric] = (),
) -> Curve:
    """Evaluate θ(λ) = λ·A + (1−λ)·B at every λ, reusing ``model`` (same architecture as A and B).

    Each λ writes the interpolated weights into ``model``'s own tensors (names and shapes must
    match A's state dict exactly); afterwards ``model`` holds θ(last λ). ``batches`` is consumed once into a list.
    ``progress(i, λ, result)`` is called after each point; ``metrics`` (classification) are
    computed at every λ beside the loss.
    """
    _check_task(task)
    data = list(batches)
    sd_a, sd_b = _own_copy(model, sd_a), _own_copy(model, sd_b)
    losses: list[float] = []
    values: dict[str, list[float]] = {}
    live = model.state_dict()
    if live.keys() != sd_a.keys():
        model.load_state_dict(interpolate(sd_a, sd_b, 1.0), strict=True)  # raises, naming the tensors
    for i, lam in enumerate(lambdas):
        _lerp_into(live, sd_a, sd_b, float(lam))
        result = evaluate_loss(model, data, task, metrics)
        losses.append(result.loss)
        for k, v in result.metric.items():
            values.setdefault(k, []).append(v)
        if progress is not None:
            progress(i, float(lam), result)
    return Curve(lambdas=[float(x) for x in lambdas], losses=losses, metrics=values)


def barrier(lambdas: Sequence[float], losses: Sequence[float]) -> dict[str, float]:
    """Both loss barriers (nats) of a curve whose λ include 0 (model B) and 1 (model A).

    ``midpoint`` = max_λ L(λ) − ½(L_A + L_B) (Frankle & Carbin; Verma & Elbayad);
    ``linear`` = max_λ [L(λ) − (λ·L_A + (1−λ)·L_B)] (Frankle et al. 2020; Theus et al.).
    """
    lam = [float(x) for x in lambdas]
    loss = [float(x) for x in losses]
    if len(lam) != len(loss):
        raise ValueError(f"{len(lam)} lambdas but {len(loss)} losses")
    if 0.0 not in lam or 1.0 not in lam:
        raise ValueError("a barrier needs the end points: lambdas must contain 0.0 (B) and 1.0 (A)")
    loss_a, loss_b = loss[lam.index(1.0)], loss[lam.index(0.0)]
    return {
        "midpoint": max(loss) - 0.5 * (loss_a + loss_b),
        "linear": max(v - (x * loss_a + (1 - x) * loss_b) for x, v in zip(lam, loss, strict=True)),
    }


def lambdas(points: int = 21) -> list[float]:
    """``points`` evenly spaced weights on model A, from 0 (B) to 1 (A) inclusive."""
    if points < 2:
        raise ValueError(f"a curve needs at least 2 points (its ends), not {points}")
    return [i / (points - 1) for i in range(points)]
