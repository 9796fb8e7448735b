"""Loading models from local folders and rebuilding them from transformed state dicts.

Checks happen before transformers sees the files, so that a user mistake becomes a typed error that
names the file or the tensor instead of a load report and a RuntimeError.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .adapters import get_adapter
from .configs import config_dtype, model_class, read_config, require_config
from .errors import (
    CheckpointError,
    ConfigError,
    IncompatibleModelsError,
    ModelNotFoundError,
    PickleRefusedError,
    RebasinUserError,
)
from .files import read_header
from .gate import check_folder
from .layout import PICKLE, PICKLE_INDEX, SAFETENSORS, SAFETENSORS_INDEX, index_shards
from .names import DEVICE_PATTERN
from .symmetry import SymmetryGraph
from .tensors import DTYPES, CheckpointSource, LazyState, StackedKeys, checkpoint_entries, shape_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PICKLE_FILES = (PICKLE, PICKLE_INDEX)


@dataclass
class LoadedModel:
    """A loaded model (float32 for every computation), its symmetry graph and folder.

    ``stored_dtype`` is the dtype of its floating weights on disk: what an output written from
    it is cast back to (a bf16 Hub model stays bf16), read without loading a weight; ``stored_dtypes``
    has each floating tensor's own (float32 norms beside bf16 matrices). ``ignored``: tensors of
    the files that stock ``from_pretrained`` drops on load (legacy buffers), with the reason. A *streamed*
    model has a ``source`` (its tensors read from disk when used) and a ``model`` whose parameters
    are on the meta device: its class, config and shapes, for `offload.offloaded` forward passes.
    ``expert_layout``: how its files store a mixture of experts' expert tensors (``per-expert`` or
    ``fused``, `_Checkpoint.expert_layout`), the layout an output written from it keeps.
    ``embedded``: set when the run wrote it into a wider model's shape (models of different widths).
    """

    model: PreTrainedModel
    graph: SymmetryGraph
    path: Path
    stored_dtype: torch.dtype = torch.float32
    source: CheckpointSource | None = None
    ignored: dict[str, str] = field(default_factory=dict)  # checkpoint key -> why loading drops it
    stored_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # model name -> dtype on disk (floating)
    expert_layout: str | None = None  # a mixture of experts' files: "per-expert" or "fused" (None: no experts)
    embedded: str | None = None  # written into a wider model's shape for this run: what grew (`run.widths`)

    def own_dtypes(self, main: torch.dtype) -> dict[str, torch.dtype]:
        """The tensors stored in a dtype other than ``main`` (that hf-rebasin writes), to write them as stored."""
        return {name: d for name, d in self.stored_dtypes.items() if d != main and d in WRITABLE_DTYPES}

    @property
    def weights(self) -> Mapping[str, Tensor]:
        """Its tensors by name: read from disk one at a time when streamed, else the module's."""
        return self.source if self.source is not None else self.model.state_dict()


# dtypes an output is written in; another stored dtype (float8) is written as float32
WRITABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how rebasin.json, the card and config.json name a dtype."""
    return str(dtype).removeprefix("torch.")


def _main_dtype(sizes: Mapping[torch.dtype, int]) -> torch.dtype | None:
    """The floating dtype holding the most values (a bf16 model may keep a few float32 tensors)."""
    if not sizes:
        return None
    return max(sizes.items(), key=lambda kv: (kv[1], kv[0] == torch.float32))[0]


@dataclass
class _Checkpoint:
    """What the checkpoint files say without loading a weight: tensor shapes and where each is."""

    shapes: dict[str, tuple[int, ...]]
    files: dict[str, str]  # tensor -> file name
    dtypes: dict[str, torch.dtype | None] = field(default_factory=dict)  # tensor -> stored dtype (None: unknown)
    dropped: set[str] = field(default_factory=set)  # model names of the tensors stock loading drops
    stacks: dict[str, StackedKeys] = field(default_factory=dict)  # model name -> its experts' keys, stored apart
    fused: set[str] = field(default_factory=set)  # model names of expert tensors stored stacked

    @property
    def expert_layout(self) -> str | None:
        """How the experts of a mixture-of-experts model are stored: ``per-expert`` (one tensor per
        expert and projection, as ``save_pretrained`` writes), ``fused`` (the model's 3-D tensors),
        None for a model without experts."""
        return "per-expert" if self.stacks else "fused" if self.fused else None

    def keys_of(self, names: Mapping[str, str]) -> list[str]:
        """The checkpoint keys holding the model tensors of ``names`` (every expert of a stacked one)."""
        return [k for name, key in names.items() for k in (self.stacks[name].keys if name in self.stacks else [key])]

    def floating(self, names: Mapping[str, str]) -> dict[str, torch.dtype]:
        """Model name -> stored dtype of each floating tensor that loading keeps."""
        found = {name: self.dtypes.get(key) for name, key in names.items()}
        return {name: d for name, d in found.items() if d is not None and d.is_floating_point}

    def stored_dtype(self, keys: Iterable[str] | None = None) -> torch.dtype | None:
        """The dtype most floating values (of ``keys``, default all) are stored in (None: no floating tensor)."""
        sizes: dict[torch.dtype, int] = {}
        for key in self.dtypes if keys is None else keys:
            dtype = self.dtypes.get(key)
            if dtype is not None and dtype.is_floating_point:
                sizes[dtype] = sizes.get(dtype, 0) + math.prod(self.shapes[key])
        return _main_dtype(sizes)


def _read_index(path: Path) -> list[Path]:
    """The shard files a ``*.index.json`` names, each inside the folder, or an error naming the index."""
    return [path.parent / shard for shard in index_shards(path, repr(str(path)))]


def _checkpoint_shapes(folder: Path, allow_pickle: bool) -> _Checkpoint:
    """Tensor shapes read from safetensors headers (no weights loaded), or from an allowed pickle."""
    from safetensors import safe_open

    if (folder / SAFETENSORS).is_file():
        files = [folder / SAFETENSORS]
    elif (folder / SAFETENSORS_INDEX).is_file():
        files = _read_index(folder / SAFETENSORS_INDEX)
    elif any((folder / f).is_file() for f in PICKLE_FILES):
        if not allow_pickle:
            raise PickleRefusedError(
                f"{str(folder)!r} holds only pickle weights (pytorch_model.bin), which can run code when "
                "loaded; convert them to safetensors, or set `allow_pickle: true` if you trust the source"
            )
        return _pickle_shapes(folder)
    else:
        raise ModelNotFoundError(f"no weights in {str(folder)!r}: expected model.safetensors (or a sharded index)")
    out = _Checkpoint({}, {})
    for f in files:
        if not f.is_file():
            raise ModelNotFoundError(f"weight shard {str(f)!r} named in the index is missing")
        read_header(f)  # through the gate: confined, regular, typed, spans inside the file
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    piece = h.get_slice(k)
                    out.shapes[k] = tuple(piece.get_shape())
                    out.files[k] = f.name
                    out.dtypes[k] = DTYPES.get(piece.get_dtype())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{str(f)!r} is not a readable safetensors file: {e}") from None
    return out


def _pickle_shapes(folder: Path) -> _Checkpoint:
    if (folder / PICKLE).is_file():
        files = [folder / PICKLE]
    else:
        files = _read_index(folder / PICKLE_INDEX)
    out = _Checkpoint({}, {})
    for f in files:
        if not f.is_file():
            raise ModelNotFoundError(f"weight shard {str(f)!r} named in the index is missing")
        try:
            sd = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises several types for corrupt or unsafe pickles
            raise CheckpointError(f"{str(f)!r} is not a readable PyTorch checkpoint: {e}") from None
        if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
            raise CheckpointError(f"{str(f)!r} is not a state dict (tensor name -> tensor)")
        for k, v in sd.items():
            out.shapes[str(k)] = tuple(v.shape)
            out.files[str(k)] = f.name
            out.dtypes[str(k)] = v.dtype
    return out


def _skeleton(cls: type[PreTrainedModel], config: Any) -> PreTrainedModel:
    """``cls(config)`` on the meta device (no memory); a config it cannot be built from is a user error."""
    try:
        with torch.device("meta"):
            return cls(config)
    except (ValueError, TypeError, RuntimeError, IndexError, ZeroDivisionError) as e:
        raise ConfigError(f"config.json does not describe a buildable {cls.__name__}: {e}") from None


def expert_pieces(model: PreTrainedModel, keys: Iterable[str]) -> dict[str, tuple[str, int, int, int]]:
    """The checkpoint ``keys`` that hold one expert's part of a 3-D expert tensor of ``model``
    (``save_pretrained`` writes them so, loading stacks them): key -> (model tensor, part, parts,
    expert)."""
    renamer = _Renamer(model)
    expected = dict.fromkeys(model.state_dict())
    found = {key: renamer.stacked(key, expected) for key in keys}
    return {key: (p.name, p.part, p.parts, p.expert) for key, p in found.items() if p is not None}


def _stacks_experts(converter: Any) -> bool:
    """Whether a transformers ``WeightConverter`` stacks tensors stored one per expert into one
    3-D tensor, as every MoE of transformers 5 loads: ``MergeModulelist(dim=0)`` over the experts,
    then (with two parts, gate and up) ``Concatenate(dim=1)``; the layouts `StackedKeys` reads."""
    try:
        from transformers.core_model_loading import Concatenate, MergeModulelist
    except ImportError:  # pragma: no cover
        return False
    ops = list(getattr(converter, "operations", []))
    patterns = list(getattr(converter, "source_patterns", []))
    if len(getattr(converter, "target_patterns", [])) != 1 or not patterns or not all("*" in p for p in patterns):
        return False
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return False
    if len(ops) == 1:
        return len(patterns) == 1
    return len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim == 1


@dataclass(frozen=True)
class _Piece:
    """One checkpoint tensor of an expert stored alone: part ``part`` (of ``parts``) of expert
    ``expert`` of model tensor ``name``; ``span``: where the expert number is in ``key``."""

    name: str
    part: int
    parts: int
    expert: int
    key: str
    pattern: str
    span: tuple[int, int] | None

    def sibling(self, expert: int) -> str:
        """The key expert ``expert``'s same part has (as stored)."""
        if self.span is None:
            return f"{self.pattern.replace('*', str(expert))} (of {self.name})"
        return f"{self.key[: self.span[0]]}{expert}{self.key[self.span[1] :]}"


class _Renamer:
    """Checkpoint tensor names as the model names them: transformers 5 renames legacy names while
    loading (ViT `encoder.layer.N.attention.attention.query` -> `layers.N.attention.q_proj`) and adds
    or strips the base-model prefix. The same conversion mapping, applied here to the names alone,
    lets every tensor be compared before a weight is loaded."""

    def __init__(self, skeleton: PreTrainedModel) -> None:
        self.prefix: str | None = getattr(skeleton, "base_model_prefix", None) or None
        self.renamings: list[Any] = []
        self.converters: list[Any] = []
        # source pattern of a converter that stacks experts -> (its part, its number of parts, expert number regex)
        self.stacking: dict[str, tuple[int, int, re.Pattern[str]]] = {}
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming

            for t in get_model_conversion_mapping(skeleton):
                if isinstance(t, WeightConverter):
                    self.converters.append(t)
                    if _stacks_experts(t):
                        for part, pattern in enumerate(t.source_patterns):
                            expert = re.compile(re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)"))
                            self.stacking[pattern] = (part, len(t.source_patterns), expert)
                elif isinstance(t, WeightRenaming):
                    self.renamings.append(t)
        except ImportError:  # pragma: no cover - another transformers layout: names as stored
            pass

    def __call__(self, key: str, expected: dict[str, Any] | None = None) -> str:
        try:
            from transformers.core_model_loading import rename_source_key
        except ImportError:  # pragma: no cover
            return key
        renamed, _ = rename_source_key(key, self.renamings, self.converters, self.prefix, expected)
        return str(renamed)

    def converts(self, keys: Iterable[str]) -> bool:
        """Whether transformers converts (not only renames) any of the checkpoint ``keys`` while
        loading in a way not followed here: DINOv2's converter splits a legacy ``mlp.weights_in``
        into gate and up, but a checkpoint with today's names loads as stored. Experts stored one
        by one, which transformers stacks (`stacked`), are followed."""
        if not self.converters:
            return False
        try:
            from transformers.core_model_loading import rename_source_key
        except ImportError:  # pragma: no cover
            return True
        for k in keys:
            pattern = rename_source_key(k, self.renamings, self.converters, self.prefix)[1]
            if pattern is not None and pattern not in self.stacking:
                return True
        return False

    def stacked(self, key: str, expected: dict[str, Any] | None = None) -> _Piece | None:
        """Where checkpoint ``key`` goes when transformers stacks experts stored one by one
        (Mixtral's ``experts.3.w1.weight``, Qwen-MoE's ``experts.3.gate_proj.weight``): the model
        tensor, the part of each expert it is, and the expert; None for any other key."""
        if not self.stacking:
            return None
        from transformers.core_model_loading import apply_renamings, rename_source_key

        name, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, expected)
        if pattern is None or pattern not in self.stacking:
            return None
        part, parts, expert = self.stacking[pattern]
        found = expert.search(apply_renamings(key, self.renamings)) or expert.search(key)
        if found is None:  # pragma: no cover - the converter matched, so its pattern does
            return None
        own = expert.search(key)  # the expert number in the key as stored, to name a sibling key
        span = own.span(1) if own is not None else None
        return _Piece(str(name), part, parts, int(found.group(1)), key, pattern, span)


# GPT-2's `attn.masked_bias`: the constant -1e4 that transformers 2.x-4.x GPT-2 classes stored in
# every layer. Transformers 5 still loads such files (its GPT-J and GPT-NeoX classes list the same buffer
# among their keys to ignore); for GPT-2 it only names it in its load report. A constant, never a weight.
_LEGACY_CONSTANTS = (r"(^|\.)attn\.masked_bias$",)


def dropped_on_load(skeleton: PreTrainedModel, keys: Iterable[str]) -> dict[str, str]:
    """Which of ``keys`` (tensor names the model does not have) stock ``from_pretrained`` drops,
    by transformers' own rules, with the reason: the class's ``_keys_to_ignore_on_load_unexpected``
    (gathered over its submodules when it is built) and the legacy buffers its loader forgives
    (``position_ids``, per-layer ``rotary_emb.inv_freq``: buffers that became non-persistent)."""
    import re

    keys = set(keys)
    kept = set(keys)
    adjust = getattr(skeleton, "_adjust_missing_and_unexpected_keys", None)
    try:
        from transformers.utils.loading_report import LoadStateDictInfo

        info = LoadStateDictInfo(
            missing_keys=set(),
            unexpected_keys=set(keys),
            mismatched_keys=set(),
            error_msgs=[],
            conversion_errors={},
            skipped_pp_keys=set(),
        )
        adjust(info)  # type: ignore[misc]
        kept = set(info.unexpected_keys)
    except (ImportError, TypeError):  # pragma: no cover - another transformers: the class's own list
        patterns = getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or []
        kept = {k for k in keys if not any(re.search(p, k) for p in patterns)}
    out = {k: "dropped by transformers when it loads this class (legacy buffer)" for k in sorted(keys - kept)}
    for key in sorted(kept):
        if any(re.search(p, key) for p in _LEGACY_CONSTANTS):
            out[key] = "legacy constant buffer (GPT-2 masked_bias); transformers loads the file and ignores it"
    return out


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
    folder: Path, cls: type[PreTrainedModel], config: Any, checkpoint: _Checkpoint
) -> _Renamer | None:
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
    renamer = _Renamer(base)
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


def _check_checkpoint(
    folder: Path, cls: type[PreTrainedModel], config: Any, checkpoint: _Checkpoint
) -> tuple[dict[str, str], dict[str, str]]:
    """Every tensor the config implies is in the checkpoint with its shape and a floating dtype
    where the model computes with it, and no other tensor is (after transformers' renames) but those
    stock loading drops; returns (model name -> checkpoint name, dropped checkpoint name -> why)."""
    _check_layer_counts(folder, cls, config, checkpoint)
    skeleton = _skeleton(cls, config)
    tied = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
    meta = skeleton.state_dict()
    expected = {k: tuple(v.shape) for k, v in meta.items()}
    renamer = _Renamer(skeleton)
    names: dict[str, str] = {}
    unknown: dict[str, str] = {}  # model name -> checkpoint key
    pieces: dict[str, list[_Piece]] = {}  # model name -> its experts' tensors stored one by one
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
            raise CheckpointError(f"{str(folder)!r}: tensor {name!r} (shape {want}) is missing from the checkpoint")
        got = checkpoint.shapes[stored]
        if name in checkpoint.stacks:
            continue  # each expert checked by _check_experts
        if got != want:
            raise CheckpointError(
                f"{str(folder)!r}: tensor {stored!r} has shape {got} in the checkpoint, but config.json "
                f"implies {want}; the config and the weights come from different models"
            )
    return names, ignored


def _stack_target(renamer: _Renamer, name: str) -> bool:
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
    checkpoint: _Checkpoint,
    name: str,
    want: tuple[int, ...],
    found: list[_Piece],
) -> StackedKeys:
    """The tensors of a model tensor stored one per expert: every expert config.json implies, each
    part with its shape and a floating dtype, and no other; the keys to stack, by part and expert."""
    experts = want[0] if want else 0
    parts = found[0].parts
    rows = want[1] // parts if len(want) > 1 else 0
    shape = (rows, *want[2:])
    where = f"{str(folder)!r}"
    keys: dict[tuple[int, int], _Piece] = {}
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


def _check_finite(folder: Path, state: Mapping[str, Tensor], names: Mapping[str, str], checkpoint: _Checkpoint) -> None:
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


def load_model(
    path: str | Path,
    *,
    allow_pickle: bool = False,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    stream: bool = False,
    device: torch.device | None = None,
) -> LoadedModel:
    """Load a model folder with its stock class, after checking every tensor against the config.

    ``trust_remote_code`` accepts a folder whose files name their own code (the code is never run:
    the stock class of the model_type is used). ``stream`` loads no weight: the model reads its
    tensors from its safetensors files when they are used (see `LoadedModel`), onto ``device``; a
    pickle checkpoint, or one that transformers converts while loading (other than by stacking
    experts stored one by one), is loaded whole instead.
    """
    from .remote_code import refuse_remote_code

    folder = Path(path)
    require_config(folder)  # the folder and its config.json named first when they are missing
    check_folder(folder, allow_pickle=allow_pickle)  # every file loading reads, before any is read
    refuse_remote_code(folder, trusted=trust_remote_code)
    config = read_config(folder)
    spec = get_adapter(getattr(config, "model_type", None))
    try:
        cls = model_class(config)
    except ConfigError as e:
        raise ConfigError(f"{str(folder)!r}: {e}") from None
    checkpoint = _checkpoint_shapes(folder, allow_pickle)
    names, ignored = _check_checkpoint(folder, cls, config, checkpoint)
    if stream and checkpoint.files and all(f.endswith(".safetensors") for f in checkpoint.files.values()):
        streamed = _streamed(folder, cls, config, checkpoint, names, device)
        if streamed is not None:
            streamed.ignored = ignored
            _check_finite(folder, streamed.weights, names, checkpoint)
            return streamed
    prev = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        loaded: Any = cls.from_pretrained(str(folder), dtype=dtype, trust_remote_code=False, output_loading_info=True)
        model: PreTrainedModel = loaded[0]
        info: dict[str, Any] = loaded[1]
    except RuntimeError as e:  # size mismatches under renamed keys
        raise CheckpointError(f"{str(folder)!r}: the weights do not match config.json: {e}") from None
    finally:
        logging.getLogger("transformers").setLevel(prev)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [k for k in info.get("missing_keys", ()) if k not in tied]
    if missing or info.get("mismatched_keys"):
        first = missing[0] if missing else info["mismatched_keys"][0]
        raise CheckpointError(
            f"{str(folder)!r}: tensor {first!r} is missing from the checkpoint or does not match config.json"
        )
    unexpected = sorted(set(info.get("unexpected_keys", ()) or ()) - checkpoint.dropped)
    if unexpected:  # a second line of defence behind _check_checkpoint
        raise CheckpointError(
            f"{str(folder)!r}: the checkpoint holds tensor {unexpected[0]!r}, which a {cls.__name__} with this "
            "config.json does not have"
        )
    model.eval()
    _check_finite(folder, model.state_dict(), names, checkpoint)
    state_dict = model.state_dict()
    graph = spec.graph(model.config, state_dict.keys())
    graph.check(state_dict, source=str(folder))
    return _loaded(model, graph, folder, checkpoint, names, ignored=ignored)


def _loaded(
    model: PreTrainedModel,
    graph: SymmetryGraph,
    folder: Path,
    checkpoint: _Checkpoint,
    names: Mapping[str, str],
    **extra: Any,
) -> LoadedModel:
    """The `LoadedModel` of a checked checkpoint: the dtypes and the expert layout its files store."""
    stored = checkpoint.stored_dtype(checkpoint.keys_of(names)) or config_dtype(folder) or torch.float32
    return LoadedModel(
        model,
        graph,
        folder,
        stored,
        stored_dtypes=checkpoint.floating(names),
        expert_layout=checkpoint.expert_layout,
        **extra,
    )


def _streamed(
    folder: Path,
    cls: type[PreTrainedModel],
    config: Any,
    checkpoint: _Checkpoint,
    names: Mapping[str, str],
    device: torch.device | None,
) -> LoadedModel | None:
    """The model as a tensor source over its files and a meta-device module; None when
    transformers would convert tensors while loading (renaming and the stacking of experts stored
    one by one are followed here)."""
    from .offload import empty_model

    model = empty_model(cls, config)
    if _Renamer(model).converts(checkpoint.shapes):
        return None
    files = sorted({folder / f for f in checkpoint.files.values()})
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    meta = model.state_dict()
    order = list(meta)
    aliases = {alias: source for alias, source in tied.items() if alias in order and alias not in names}
    source = CheckpointSource(
        folder,
        checkpoint_entries(files),
        {n: k for n, k in names.items() if n not in checkpoint.stacks},
        aliases=aliases,
        order=order,
        device=device,
        stacks=checkpoint.stacks,
    )
    spec = get_adapter(getattr(config, "model_type", None))
    graph = spec.graph(model.config, order)
    graph.check(meta, source=str(folder))  # shapes only: the parameters are on meta
    return _loaded(model, graph, folder, checkpoint, names, source=source)


def output_config(template: PreTrainedModel, untie: bool) -> Any:
    """A copy of ``template``'s config for a model built from transformed weights: with a tied LM
    head stored apart when ``untie`` (canonical forms)."""
    config = copy.deepcopy(template.config)
    if untie:
        config.tie_word_embeddings = False
    return config


def rebuild(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], *, untie: bool = False) -> PreTrainedModel:
    """A fresh model of the same stock class holding ``state_dict`` (untied when asked), in
    ``model``'s dtype (the caller casts for writing)."""
    new = type(model)(output_config(model, untie))
    new.load_state_dict(state_dict, strict=True)
    new.to(dtype=next(model.parameters()).dtype)  # type: ignore[call-arg]  # transformers wraps .to
    return new.eval()


def to_device(model: Any, device: torch.device) -> None:
    """``model.to(device)`` in place (transformers' typing of ``.to`` does not take a device)."""
    model.to(device)


@contextmanager
def running(
    template: PreTrainedModel, state: Mapping[str, Tensor], *, untie: bool = False, device: torch.device | None = None
) -> Iterator[PreTrainedModel]:
    """A model of ``template``'s class that computes with ``state``, for forward passes: rebuilt in
    memory beside ``template``, or for a `LazyState`, a meta-device module that reads each
    submodule's tensors when it runs (`offload.offloaded`, on ``device``)."""
    from .offload import empty_model, offloaded

    if not isinstance(state, LazyState):
        yield rebuilt(template, state, untie)
        return
    with offloaded(
        empty_model(type(template), output_config(template, untie)), state, device or torch.device("cpu")
    ) as model:
        yield model  # type: ignore[misc]  # offloaded yields the module it was given


def rebuilt(template: PreTrainedModel, sd: Mapping[str, Tensor], untie: bool) -> PreTrainedModel:
    """`rebuild` on ``template``'s device: a model of its class holding ``sd`` (a tied head stored
    apart when ``untie``), ready to run beside it."""
    model = rebuild(template, dict(sd), untie=untie)
    to_device(model, next(template.parameters()).device)
    return model


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


def check_compatible(a: LoadedModel, b: LoadedModel) -> None:
    """``b`` can be aligned to ``a``: same model type, class and tensor shapes."""
    type_a, type_b = a.model.config.model_type, b.model.config.model_type
    cls_a, cls_b = type(a.model).__name__, type(b.model).__name__
    if type_a != type_b or cls_a != cls_b:
        raise IncompatibleModelsError(
            f"{str(b.path)!r} is a {cls_b} (model_type {type_b!r}) but the reference {str(a.path)!r} is a "
            f"{cls_a} (model_type {type_a!r}): only models of one architecture can be aligned"
        )
    check_same_shapes(a.weights, b.weights, repr(str(a.path)), repr(str(b.path)))
    tied_a = dict(getattr(a.model, "all_tied_weights_keys", None) or {})
    tied_b = dict(getattr(b.model, "all_tied_weights_keys", None) or {})
    if set(tied_a) != set(tied_b):
        # the merge and the alignment work in A's form: a tensor tied in A but not in B would drop B's copy
        name = sorted(set(tied_a) ^ set(tied_b))[0]
        tied, untied = (a, b) if name in tied_a else (b, a)
        source = (tied_a if name in tied_a else tied_b)[name]

        def setting(lm: LoadedModel) -> str:
            value = getattr(lm.model.config.get_text_config(), "tie_word_embeddings", None)
            return f"tie_word_embeddings: {str(value).lower()}"

        raise IncompatibleModelsError(
            f"tensor {name!r} is tied to {source!r} in {str(tied.path)!r} ({setting(tied)}) but stored on its own "
            f"in {str(untied.path)!r} ({setting(untied)}); aligned in one form, the other model's {name} would be "
            "lost. Align models that tie their weights alike (save both with the same tie_word_embeddings)"
        )


def resolve_device(name: str | None, where: str = "`device`") -> torch.device:
    """``auto`` is CUDA when there is one, else the CPU; a device asked for but absent is a user error."""
    name = name or "auto"
    if not DEVICE_PATTERN.fullmatch(name):
        raise RebasinUserError(f"{where}: {name!r} is not a device; allowed: auto, cpu, cuda, cuda:N, mps")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RebasinUserError(f"{where}: {name!r} was asked for, but no CUDA device is available here")
    if name == "mps" and not torch.backends.mps.is_available():
        raise RebasinUserError(f"{where}: 'mps' was asked for, but MPS is not available here")
    return torch.device(name)
