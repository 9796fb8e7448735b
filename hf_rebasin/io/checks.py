"""A checkpoint's tensors checked against its config by transformers' own rules, before loading.

Each check names the file or the tensor at fault, so that a user mistake (a config and weights
from different models, a quantized or broken checkpoint, two models that cannot be aligned)
becomes a typed error instead of a load report and a RuntimeError.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import CheckpointError, ConfigError, IncompatibleModelsError
from hf_rebasin.core.lazy import shape_of
from hf_rebasin.io.checkpoint import Checkpoint, dtype_name
from hf_rebasin.io.renames import Piece, Renamer, dropped_on_load, initialised_on_load, made_on_load
from hf_rebasin.io.tensors import CheckpointSource, StackedKeys

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _skeleton(cls: type[PreTrainedModel], config: Any) -> PreTrainedModel:
    """``cls(config)`` on the meta device (no memory); a config it cannot be built from is a user error."""
    try:
        with torch.device("meta"):
            return cls(config)
    except (ValueError, TypeError, RuntimeError, IndexError, ZeroDivisionError) as e:
        raise ConfigError(f"config.json does not describe a buildable {cls.__name__}: {e}") from None


def _layer_fields(config: Any) -> list[tuple[str, Any]]:
    """(field as written in config.json, config object) for the config and each sub-config with a layer count."""
    out = []
    subs = [(f"{k}.", getattr(config, k, None)) for k in getattr(config, "sub_configs", {})]
    for label, cfg in [("", config), *subs]:
        if cfg is None or getattr(cfg, "num_hidden_layers", None) is None:
            continue
        field = dict(getattr(cfg, "attribute_map", {}) or {}).get("num_hidden_layers", "num_hidden_layers")
        out.append((f"{label}{field}", cfg))
    return out


def _check_layer_counts(
    folder: Path, cls: type[PreTrainedModel], config: Any, checkpoint: Checkpoint
) -> Renamer | None:
    """The layer counts of config.json against the layers in the checkpoint, from probes of 1 and 2
    layers: building the model's skeleton costs time per layer even on the meta device (90 s for
    20000 GPT-2 blocks), so a config that claims more layers than the weights hold is refused first."""
    import re

    fields = _layer_fields(config)
    counts = {name: int(cfg.num_hidden_layers) for name, cfg in fields}
    if not fields or max(counts.values()) <= 2:
        return None

    def probe(grown: str | None) -> PreTrainedModel:
        small = copy.deepcopy(config)
        for name, cfg in _layer_fields(small):
            cfg.num_hidden_layers = min(counts[name], 2 if name == grown else 1)
        return _skeleton(cls, small)

    base = probe(None)
    base_keys = set(base.state_dict())
    renamer = Renamer(base)
    prefix = f"{renamer.prefix}." if renamer.prefix else ""
    renamed = [renamer(k) for k in checkpoint.shapes]
    for name, want in counts.items():
        if want < 2:
            continue
        containers = set()
        for key in set(probe(name).state_dict()) - base_keys:
            m = re.match(r"(.*?)\.1\.", key)
            if m:
                containers.add(m.group(1))
        for container in sorted(containers):
            pattern = re.compile(rf"(?:^|\.){re.escape(container.removeprefix(prefix))}\.(\d+)\.")
            found = {int(m.group(1)) for k in renamed if (m := pattern.search(k))}
            if len(found) < want:
                raise CheckpointError(
                    f"{str(folder / 'config.json')!r}: `{name}` is {want}, but the checkpoint holds "
                    f"{len(found)} layers of {container}; the config and the weights come from different models"
                )
    return renamer


def check_checkpoint(
    folder: Path, cls: type[PreTrainedModel], config: Any, checkpoint: Checkpoint
) -> tuple[dict[str, str], dict[str, str]]:
    """Every tensor the config implies is in the checkpoint with its shape and a floating dtype
    where the model computes with it, and no other tensor is (after transformers' renames) but those
    stock loading drops; returns (model name -> checkpoint name, dropped checkpoint name -> why)."""
    _check_layer_counts(folder, cls, config, checkpoint)
    skeleton = _skeleton(cls, config)
    tied = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
    meta = skeleton.state_dict()
    expected = {k: tuple(v.shape) for k, v in meta.items()}
    renamer = Renamer(skeleton)
    names, unknown, pieces = _sort_keys(checkpoint, renamer, expected)
    dropped = dropped_on_load(skeleton, unknown)
    for name, key in unknown.items():
        if name not in dropped:
            raise CheckpointError(
                f"{str(folder)!r}: {checkpoint.files[key]} holds tensor {key!r} (shape {checkpoint.shapes[key]}), "
                f"which a {cls.__name__} with this config.json does not have; the checkpoint and the config come "
                "from different models (or the file was altered)"
            )
    ignored = {unknown[name]: why for name, why in dropped.items()}
    checkpoint.dropped = set(dropped)
    checkpoint.fused = {n for n in names if _stack_target(renamer, n)}
    for name, found in pieces.items():
        if name in names:
            raise CheckpointError(
                f"{str(folder)!r}: {checkpoint.files[names[name]]} holds {names[name]!r}, the experts of {name!r} "
                f"stacked, and {checkpoint.files[found[0].key]} holds them one by one as well ({found[0].key!r}); "
                "a checkpoint stores each tensor once"
            )
        checkpoint.stacks[name] = _check_experts(folder, cls, checkpoint, name, expected[name], found)
        names[name] = checkpoint.stacks[name].parts[0][0]
    absent = [n for n in expected if n not in names and n not in tied]
    checkpoint.made = made_on_load(skeleton, absent)
    checkpoint.initialised = initialised_on_load(skeleton, (n for n in absent if n not in checkpoint.made))
    _check_stored(folder, cls, checkpoint, names, meta, expected, tied | checkpoint.made | set(checkpoint.initialised))
    return names, ignored


def _sort_keys(
    checkpoint: Checkpoint, renamer: Renamer, expected: dict[str, tuple[int, ...]]
) -> tuple[dict[str, str], dict[str, str], dict[str, list[Piece]]]:
    """The checkpoint's keys by what the model makes of them, so that each kind gets its own check:
    (model name -> key) of the tensors the model has, (name -> key) of those it has not, and the
    experts' tensors stored one by one, by the model tensor they are stacked into."""
    names: dict[str, str] = {}
    unknown: dict[str, str] = {}  # model name -> checkpoint key
    pieces: dict[str, list[Piece]] = {}  # model name -> its experts' tensors stored one by one
    for key in checkpoint.shapes:
        piece = renamer.stacked(key, expected)
        if piece is not None and piece.name in expected:
            pieces.setdefault(piece.name, []).append(piece)
            continue
        name = renamer(key, expected)
        if name in expected:
            names[name] = key
        else:
            unknown[name] = key
    return names, unknown, pieces


def _check_stored(
    folder: Path,
    cls: type[PreTrainedModel],
    checkpoint: Checkpoint,
    names: Mapping[str, str],
    meta: Mapping[str, Tensor],
    expected: Mapping[str, tuple[int, ...]],
    tied: set[str],
) -> None:
    """The tensors the model has, as stored: a floating dtype where the model computes with one
    (a quantized checkpoint cannot be permuted), then every tensor present (a tied one may be left
    out) with the shape config.json implies (each expert stored apart is checked by `_check_experts`)."""
    for name, key in names.items():
        dtype = checkpoint.dtypes.get(key)
        if meta[name].is_floating_point() and dtype is not None and not dtype.is_floating_point:
            raise CheckpointError(
                f"{str(folder)!r}: tensor {key!r} in {checkpoint.files[key]} is stored as {dtype_name(dtype)}, where "
                f"a {cls.__name__} has floating weights: integer (quantized or packed) weights cannot be permuted, "
                "rotated or averaged. Use the model's unquantized release (float32, float16 or bfloat16 weights)"
            )
    for name, want in expected.items():
        stored = names.get(name)
        if stored is None:
            if name in tied:
                continue
            raise CheckpointError(
                f"{str(folder)!r}: tensor {name!r} (shape {want}) is missing from the checkpoint; transformers would "
                "initialise it at random and only warn, which would change what the model computes (a shard is "
                "missing, or the weights come from another model)"
            )
        got = checkpoint.shapes[stored]
        if name in checkpoint.stacks:
            continue  # each expert checked by _check_experts
        if got != want:
            raise CheckpointError(
                f"{str(folder)!r}: tensor {stored!r} has shape {got} in the checkpoint, but config.json "
                f"implies {want}; the config and the weights come from different models"
            )


def _stack_target(renamer: Renamer, name: str) -> bool:
    """Whether model tensor ``name`` is one transformers stacks from experts stored one by one
    (``mlp.experts.gate_up_proj``): a checkpoint holding it under this name stores them fused."""
    for converter in renamer.converters:
        if any(p in renamer.stacking for p in converter.source_patterns):
            target = str(converter.target_patterns[0]).lstrip("^")
            if name.endswith(target) or f"{target}." in f"{name}.":
                return True
    return False


def _check_experts(
    folder: Path,
    cls: type[PreTrainedModel],
    checkpoint: Checkpoint,
    name: str,
    want: tuple[int, ...],
    found: list[Piece],
) -> StackedKeys:
    """The tensors of a model tensor stored one per expert: every expert config.json implies, each
    part with its shape and a floating dtype, and no other; the keys to stack, by part and expert."""
    experts = want[0] if want else 0
    parts = found[0].parts
    rows = want[1] // parts if len(want) > 1 else 0
    shape = (rows, *want[2:])
    where = f"{str(folder)!r}"
    keys: dict[tuple[int, int], Piece] = {}
    for piece in sorted(found, key=lambda p: (p.part, p.expert)):
        file = checkpoint.files[piece.key]
        if piece.expert >= experts:
            raise CheckpointError(
                f"{where}: {file} holds tensor {piece.key!r} of expert {piece.expert}, but config.json implies "
                f"{experts} experts for {name!r} (shape {want}); the config and the weights come from different models"
            )
        got = checkpoint.shapes[piece.key]
        if got != shape:
            raise CheckpointError(
                f"{where}: tensor {piece.key!r} in {file} has shape {got}, but config.json implies {shape} for "
                f"each expert's part of {name!r} (shape {want}); the config and the weights come from different models"
            )
        dtype = checkpoint.dtypes.get(piece.key)
        if dtype is not None and not dtype.is_floating_point:
            raise CheckpointError(
                f"{where}: tensor {piece.key!r} in {file} is stored as {dtype_name(dtype)}, where a {cls.__name__} "
                "has floating weights: integer (quantized or packed) weights cannot be permuted, rotated or "
                "averaged. Use the model's unquantized release (float32, float16 or bfloat16 weights)"
            )
        keys[(piece.part, piece.expert)] = piece
    by_part = {p.part: p for p in found}
    for part in range(parts):
        held = sorted(e for p, e in keys if p == part)
        for expert in range(experts):
            if (part, expert) in keys:
                continue
            sibling = by_part.get(part) or found[0]
            missing = sibling.sibling(expert) if sibling.part == part else f"part {part} of expert {expert}"
            raise CheckpointError(
                f"{where}: tensor {missing!r} (expert {expert} of the {experts} that config.json implies for "
                f"{name!r}) is missing from the checkpoint, which holds {len(held)} experts of it; the config and "
                "the weights come from different models, or a shard is missing"
            )
    return StackedKeys(tuple(tuple(keys[(part, e)].key for e in range(experts)) for part in range(parts)))


def is_finite(t: Tensor) -> bool:
    """No NaN and no Inf in ``t``: its minimum and maximum are finite (NaN propagates through
    both), one pass in the stored dtype, 50× faster than ``isfinite`` on a float32 copy."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def check_finite(folder: Path, state: Mapping[str, Tensor], names: Mapping[str, str], checkpoint: Checkpoint) -> None:
    """Every floating weight finite: NaN compares false with everything, so a NaN would pass every
    later check and end up in the output. A streamed model is read once for it, a tensor at a time."""
    aliases = getattr(state, "aliases", {})
    for name in state:
        if name in aliases:
            continue  # read with the tensor it is tied to
        t = state.stored(name) if isinstance(state, CheckpointSource) else state[name]
        if not t.is_floating_point() or is_finite(t):
            continue
        key = names.get(name, name)
        where = checkpoint.files.get(key, "the checkpoint")
        kind = "NaN" if bool(torch.isnan(t).any()) else "Inf"
        count = int((~torch.isfinite(t)).sum())
        raise CheckpointError(
            f"{str(folder)!r}: tensor {key!r} in {where} holds {kind} ({count} of {t.numel()} values are not "
            "finite); the model is broken (a diverged training run or a damaged file) and cannot be aligned or merged"
        )


def check_same_shapes(
    sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], label_a: str = "model A", label_b: str = "model B"
) -> None:
    """Two state dicts of one architecture: same tensor names and shapes, or an error naming the
    first difference (in A's order) and both shapes."""
    for name in sd_a:
        shape = tuple(shape_of(sd_a, name))
        if name not in sd_b:
            raise IncompatibleModelsError(
                f"tensor {name!r} (shape {shape}) of {label_a} is missing from {label_b}: "
                "the models have different architectures or heads"
            )
        other = tuple(shape_of(sd_b, name))
        if other != shape:
            raise IncompatibleModelsError(
                f"tensor {name!r} has shape {shape} in {label_a} but {other} in {label_b}: "
                "only models of one architecture and size can be aligned"
            )
    extra = [k for k in sd_b if k not in sd_a]
    if extra:
        raise IncompatibleModelsError(
            f"tensor {extra[0]!r} (shape {tuple(shape_of(sd_b, extra[0]))}) of {label_b} does not exist in {label_a}: "
            "the models have different architectures or heads"
        )
