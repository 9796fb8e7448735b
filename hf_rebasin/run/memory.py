"""How a run holds its models, streamed or whole (`streamed`), and how much memory that needs,
estimated from the plan before a weight is loaded (`estimate`).

Each model's size comes from its safetensors headers (no weight is read): parameters, stored dtype,
bytes, and the largest tensor. A streamed run (`streamed`) holds a few copies of the largest
tensor and, for the matching strategies, the assignment problem of the widest space; a run that
loads its models holds each of them in float32 plus the copies its job makes (aligned, canonical,
merged, the model rebuilt for saving or scoring). The constants were measured on this package's
benchmarks (``benchmarks/scale/bench_scale.py``): an estimate, stated as one, that errs on the high side.

Torch-free: the dry run prints it without importing torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_rebasin.alignment.strategies import get_strategy
from hf_rebasin.core.memory import GIB, OVERHEAD, InsufficientMemoryError, available_memory, resident
from hf_rebasin.core.roles import Roles, TransportRoles
from hf_rebasin.io.files import read_config, read_header
from hf_rebasin.io.gate import safetensors_files
from hf_rebasin.io.schemas import SAFETENSORS_DTYPES
from hf_rebasin.merging.calibration.distill import CHECKPOINT_BYTES, activation_bytes
from hf_rebasin.recipe import Recipe
from hf_rebasin.recipe.jobs import get_job
from hf_rebasin.run.resolve import PlannedModel

__all__ = [
    "OVERHEAD",
    "InsufficientMemoryError",
    "MemoryEstimate",
    "ModelFootprint",
    "available_memory",
    "estimate",
    "footprint",
    "resident",
    "streamed",
    "streams",
]

STREAM_COPIES = 6  # float32 copies of the largest tensor a streamed step holds (inputs, maps, float64 sum)
# a tensor of vocabulary rows (an embedding, an LM head) is merged, saved and summed in blocks of
# rows; whole only in a forward pass, which holds it as stored and in float32
FORWARD_COPIES = 2
LAP_COPIES = 3  # float64 copies of the widest space's n×n cost (view, solver input, solver work)
ASSUMED_TOKENS = 100_000  # alignment data without `max_tokens`: the size of its hidden states is a guess
LEARNED_COPIES = 3  # learned matching: B under the dense maps and the interpolation (kept for backward), the model
_FLOATING = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_FLOATING |= {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_WIDTHS = ("intermediate_size", "n_inner", "hidden_size", "n_embd", "d_model")


@dataclass(frozen=True)
class ModelFootprint:
    """A model's size as its files state it."""

    params: int  # elements of its tensors
    nbytes: int  # bytes of its tensors on disk
    dtype: str  # the floating dtype holding most values
    largest: int  # elements of its largest tensor
    width: int  # its widest hidden space (MLP units, a MoE layer's expert units, or residual)
    hidden: int = 0  # the residual stream's width
    layers: int = 1  # its layer count
    largest_mixed: int = 0  # elements of its largest tensor other than vocabulary rows (streamed whole); 0: unknown
    experts: tuple[int, int] = (0, 0)  # a mixture of experts: (experts per layer, units per expert); (0, 0): dense


def _width(config: object) -> int:
    """The widest hidden space a config names (sub-configs included)."""
    if not isinstance(config, dict):
        return 0
    found = [v for k, v in config.items() if k in _WIDTHS and isinstance(v, int)]
    if config.get("n_inner") is None and isinstance(config.get("n_embd"), int):
        found.append(4 * config["n_embd"])  # GPT-2's MLP default
    found += [_width(v) for v in config.values() if isinstance(v, dict)]
    return max(found, default=0)


def _experts(config: object) -> tuple[int, int]:
    """(experts per layer, units per expert) of a mixture-of-experts config (Mixtral
    ``num_local_experts`` × ``intermediate_size``, Qwen ``num_experts`` × ``moe_intermediate_size``)."""
    if not isinstance(config, dict):
        return (0, 0)
    experts = config.get("num_local_experts") or config.get("num_experts")
    units = config.get("moe_intermediate_size") or config.get("intermediate_size")
    if isinstance(experts, int) and isinstance(units, int) and experts > 1:
        return (experts, units)
    return (0, 0)


def assignment_bytes(fp: ModelFootprint) -> int:
    """The assignment problem of a model's widest space: ``LAP_COPIES`` float64 copies of its n×n
    cost. A mixture of experts pairs one layer's expert units block by block from their factors
    (A's and B's stacked expert tensors, the copies a streamed step holds anyway): one f×f block at
    a time, or the residual stream's d×d where that is wider."""
    experts, units = fp.experts
    if not experts:
        return LAP_COPIES * 8 * fp.width**2
    return LAP_COPIES * 8 * max(units, fp.hidden) ** 2


def _assignment_words(known: list[ModelFootprint]) -> str:
    """What the assignment term of the estimate is, for the dry run's line."""
    fp = max(known, key=assignment_bytes)
    experts, units = fp.experts
    if experts:
        return f", the {experts}×{units} expert units of one layer paired one {units}×{units} block at a time"
    return ", the widest assignment problem"


def footprint(folder: Path) -> ModelFootprint | None:
    """The size of the model in ``folder`` from its safetensors headers; None when it has none
    (a pickle checkpoint, a LoRA adapter, a folder not downloaded yet)."""
    params = nbytes = largest = 0
    firsts: list[tuple[int, int]] = []  # (first dimension, elements) of every tensor
    by_dtype: dict[str, int] = {}
    folder = Path(folder)
    files = safetensors_files(folder)  # through the gate: confined, regular, headers checked
    for f in files:
        for t in read_header(f).tensors.values():
            n = t.numel
            firsts.append(((t.shape or (0,))[0], n))
            params += n
            nbytes += (n * SAFETENSORS_DTYPES[t.dtype] + 7) // 8
            largest = max(largest, n)
            if t.dtype in _FLOATING:
                by_dtype[_FLOATING[t.dtype]] = by_dtype.get(_FLOATING[t.dtype], 0) + n
    if not files or not params:
        return None
    config = read_config(folder) if (folder / "config.json").exists() else {}
    dtype = max(by_dtype, key=lambda d: by_dtype[d]) if by_dtype else "float32"
    hidden = next((config[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(config.get(k), int)), 0)
    layers = _layers(config)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    mixed = max((n for first, n in firsts if first != vocab), default=0)
    experts = _experts(config)
    if experts[0]:  # transformers stacks a layer's experts: [E, 2f, d] is read, mapped and written whole
        stacked = experts[0] * 2 * experts[1] * hidden
        largest, mixed = max(largest, stacked), max(mixed, stacked)
    width = max(_width(config), experts[0] * experts[1])  # a layer's expert units: one space
    return ModelFootprint(params, nbytes, dtype, largest, width, hidden, max(1, layers), mixed, experts)


def _layers(config: dict[str, Any]) -> int:
    """Layers of every stack: a decoder's, or an encoder-decoder's two (T5's ``num_layers`` +
    ``num_decoder_layers``, BART's ``encoder_layers`` + ``decoder_layers``)."""
    for keys in (
        ("num_hidden_layers",),
        ("n_layer",),
        ("num_layers", "num_decoder_layers"),
        ("encoder_layers", "decoder_layers"),
    ):
        found = [config[k] for k in keys if isinstance(config.get(k), int)]
        if found:
            return sum(found)
    return 1


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """The plan's memory: each model's footprint, how the run holds them, the estimated peak."""

    models: tuple[tuple[str, ModelFootprint | None], ...]  # (where in the recipe, footprint)
    streamed: bool
    peak: int | None  # bytes; None while a model's size is unknown (not downloaded yet)
    available: int | None  # what the machine has free now, besides what this process holds
    how: str  # what the estimate counts, for the dry run
    learned_limit: int | None = None  # learned matching: the most parameters per model that fit here

    held: int = 0  # this process's resident memory when estimated (counted in the peak, not available)

    @property
    def fits(self) -> bool:
        return self.peak is None or self.available is None or self.peak <= self.available + self.held

    def lines(self) -> list[str]:
        """The dry run's lines: per model its size, then the estimated peak against what is available."""
        out = []
        for where, fp in self.models:
            if fp is None:
                out.append(f"model {where}: size known once downloaded (or not a safetensors checkpoint)")
            else:
                out.append(f"model {where}: {fp.params / 1e6:,.1f}M parameters, {fp.dtype}, {_gib(fp.nbytes)} on disk")
        mode = "streamed tensor by tensor" if self.streamed else "models loaded whole, in float32"
        if self.peak is None:
            out.append(f"memory: {mode}; peak estimated once every model is downloaded")
        else:
            free = f" of {_gib(self.available + self.held)} available" if self.available is not None else ""
            out.append(f"memory: {mode}; estimated peak {_gib(self.peak)}{free} ({self.how})")
        if self.learned_limit is not None:
            out.append(f"learned matching: models of up to {self.learned_limit / 1e6:,.0f}M parameters fit here")
        return out

    def check(self) -> None:
        """Refuse a run that would not fit, before a weight is loaded (exit 2, with the numbers)."""
        if self.fits:
            return
        assert self.peak is not None and self.available is not None
        sizes = ", ".join(f"{where} {_gib(fp.nbytes)} ({fp.dtype})" for where, fp in self.models if fp is not None)
        if self.learned_limit is not None:
            hint = (
                f"Learned matching holds the models whole with their gradients: it supports models of up to "
                f"{self.learned_limit / 1e6:,.0f}M parameters here. Drop `learned` (the data-free alignment streams "
                "without `evaluate` and `data`), use a machine with more memory"
            )
        elif "calibration" in self.how:
            hint = (
                "Calibration holds the fine-tune and the target as stored and the student in float32: set "
                "`calibrate: false` (the data-free transport, which streams its models tensor by tensor), "
                + ("" if self.streamed else "remove `evaluate` (the transport then streams before it calibrates), ")
                + "use a machine with more memory"
            )
        elif not self.streamed:
            hint = (
                "Remove `evaluate` and `data` (a merge or transport by a data-free strategy then streams its models "
                "tensor by tensor), use a machine with more memory"
            )
        else:
            hint = "Use a machine with more memory"
        raise InsufficientMemoryError(
            f"this run needs about {_gib(self.peak)} of memory ({self.how}) but {_gib(self.available + self.held)} "
            "is available "
            f"(models: {sizes}); it was stopped before loading anything. {hint}, or pass --no-memory-check to run "
            "anyway if you know the estimate is too high"
        )


def estimate(
    recipe: Recipe, models: list[tuple[str, Path | None]], *, streamed: bool, available: int | None = None
) -> MemoryEstimate:
    """The memory a run of ``recipe`` will need, from its models' files (``None``: not local yet)."""
    found = tuple((where, footprint(folder) if folder is not None else None) for where, folder in models)
    avail = available if available is not None else available_memory()
    held = resident() if available is None else 0
    known = [fp for _, fp in found if fp is not None]
    if len(known) < len(found):
        return MemoryEstimate(found, streamed, None, avail, "", held=held)
    strategy, options = get_strategy(recipe.strategy.name), recipe.strategy.options
    profile = strategy.memory  # what the strategy holds besides the models
    lap = max(assignment_bytes(fp) for fp in known) if profile.assignment else 0
    if streamed:
        largest = max(fp.largest for fp in known)
        mixed = max(fp.largest_mixed or fp.largest for fp in known)
        peak = OVERHEAD + max(STREAM_COPIES * 4 * mixed, FORWARD_COPIES * 4 * largest) + lap
        if mixed < largest:
            how = f"{FORWARD_COPIES} float32 copies of the embedding, {STREAM_COPIES} of the largest other tensor"
        else:
            how = f"{STREAM_COPIES} float32 copies of the largest tensor"
        how += _assignment_words(known) if lap else ""
        if recipe.data is not None and profile.statistics is not None:  # activation statistics, layer by layer
            fp = known[0]
            tokens = recipe.data.max_tokens or ASSUMED_TOKENS
            hidden_states = 2 * 4 * tokens * fp.hidden  # A's and B's, kept between layers
            layer = 2 * 4 * fp.params // fp.layers  # one layer of each model, in float32
            moments = profile.statistics(options, fp)  # the statistics it holds at once
            peak += hidden_states + layer + moments
            assumed = "" if recipe.data.max_tokens else ", assumed: set data.max_tokens"
            how += f", one layer of each model and the hidden states of {tokens:,} tokens{assumed}"
        extra, words = _streamed_calibration(recipe, known)
        peak, how = peak + extra, how + words
        return MemoryEstimate(found, True, peak, avail, how, held=held)
    f32 = [4 * fp.params for fp in known]
    copies = sum(f32)  # every model in float32
    copies += 2 * f32[0] + f32[0] // 2  # the result, the model rebuilt to save or score it, and its bf16 cast
    if not strategy.identity:
        copies += sum(f32[1:])  # the other models in the reference's basis
    if strategy.canonical:
        copies += sum(f32)  # canonical forms
    if recipe.evaluate is not None:
        copies += 2 * f32[0]  # the model the λ sweep rebuilds, and its interpolated weights
    calibration = _calibration_bytes(recipe, known[0])
    copies += calibration
    learned = bool(profile.learned(options))
    if learned:
        copies += LEARNED_COPIES * f32[0]  # B mapped and the interpolation, kept for backward; the model run
    peak = OVERHEAD + copies + lap
    factor = copies / max(f32[0], 1)
    how = f"{factor:.1f}× the reference model in float32" + (_assignment_words(known) if lap else "")
    if calibration:
        how += ", calibration's student, optimizer state and activations included"
    limit = None
    if learned and avail is not None:  # the largest model (reference-sized) learned matching fits here
        limit = max(0, int((avail + held - OVERHEAD - lap) / (4 * factor)))
    return MemoryEstimate(found, False, peak, avail, how, learned_limit=limit, held=held)


def _streamed_calibration(recipe: Recipe, known: list[ModelFootprint]) -> tuple[int, str]:
    """What calibration holds after a streamed transport (`run.calibrate.whole`): the fine-tune
    (the last model) and, with a guard, the target (the first) as stored, and the student."""
    calibration = _calibration_bytes(recipe, known[0])
    if not calibration:
        return 0, ""
    cal = getattr(recipe, "calibrate", None)
    guard = known[0] if cal is not None and cal.guard > 0 else None
    building = 3 * 4 * max(fp.largest for fp in known)  # B, π(τ) and their sum, a tensor at a time
    held = calibration + building + _as_run(known[-1]) + (_as_run(guard) if guard is not None else 0)
    return held, (
        "; then calibration: the fine-tune"
        + (" and the target" if guard is not None else "")
        + " as stored, the student in float32 (built tensor by tensor) with its optimizer state and one step's "
        "activations"
    )


def _as_run(fp: ModelFootprint) -> int:
    """A model's bytes as calibration runs it: in its stored dtype where that is a float one."""
    return fp.nbytes if fp.dtype in ("float32", "bfloat16", "float16") else 4 * fp.params


def _calibration_bytes(recipe: Recipe, fp: ModelFootprint) -> int:
    """What a transport's calibration adds: the student in float32 (with AdamW's gradient and two
    moments where every parameter is fitted) and one step's activations (``batch_size × block``
    positions): ~16 hidden-wide values a layer of teacher and student, and three vocabulary-wide rows
    of logits (the vocabulary is taken as the embedding, the largest tensor, over the width). Where
    those activations would pass `CHECKPOINT_BYTES` the student's layers are checkpointed: each
    layer's input is kept and one layer's activations are live at a time."""
    cal = getattr(recipe, "calibrate", None)
    if cal is None:
        return 0
    student = 4 * fp.params * (4 if cal.fit == "full" else 1)
    positions = cal.batch_size * (cal.block_size or 128)
    vocab = fp.largest // max(fp.hidden, 1) if fp.hidden else 0
    layers = activation_bytes(fp.hidden, fp.layers, positions)
    if layers <= CHECKPOINT_BYTES:
        return student + 2 * (layers + 4 * positions * 3 * vocab)
    return student + 4 * positions * (fp.hidden * fp.layers + 2 * 16 * fp.hidden + 4 * vocab)


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

    if differ_in_width([m.folder for m in models.all]):  # the narrower ones are embedded in memory
        return False
    if not isinstance(models, TransportRoles):
        return True

    def architectures(m: PlannedModel) -> Any:
        folder = m.folder
        if folder is None or not os.path.lexists(folder / "config.json"):  # not downloaded yet, or an adapter
            return None
        return read_config(folder).get("architectures")  # through the gate

    found = architectures(models.finetune)
    return found is not None and found == architectures(models.base)
