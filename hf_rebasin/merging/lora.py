"""PEFT LoRA adapters as task vectors: read, densify, transport factor by factor, write.

A LoRA update of a weight W is ``ΔW = s·B·A`` (``s = lora_alpha / r``, or ``/ √r`` with rsLoRA).
A transform ``W ↦ T_out W T_inᵀ`` maps it to ``s·(T_out B)(A T_inᵀ)``: the same rank, so the
transported update is still an adapter, for the target base, and ``PeftModel.from_pretrained``
loads it. Tensors an adapter stores whole (``modules_to_save``, trained biases) follow the
task-vector rule, target + π(saved − base).

Generalized-orthogonal rotates the residual stream in canonical form (norm scales folded, writers
centered), while an adapter applies to the target as stored. Its factors can follow anyway: a
reader's factor takes γ_A in and 1/γ_B out, a writer's is centered, and a folded β becomes a shift
of the reader's bias, stored whole (:func:`transport_adapter`). Where that is impossible
(:func:`canonical_blocker`) the residual stream is matched by permutation (:func:`lora_graph`).
Reading needs only ``safetensors``; ``peft`` is needed to *use* the result, not to make it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from hf_rebasin.core.errors import (
    CheckpointError,
    IncompatibleModelsError,
    ModelNotFoundError,
    PickleRefusedError,
    TransformError,
    named,
)
from hf_rebasin.io.files import read_header, read_json
from hf_rebasin.merging.interpolate import StorageKey, storage_key
from hf_rebasin.symmetry.canonical import RawStream, WriterScale, bias_of, gamma
from hf_rebasin.symmetry.graph import Norm, SymmetryGraph
from hf_rebasin.symmetry.spaces import AnySpace, Fused, Space, split_ref
from hf_rebasin.symmetry.transforms import Transform

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ADAPTER_CONFIG",
    "LoraAdapter",
    "LoraModule",
    "adapter_config",
    "adapter_from",
    "apply_adapter",
    "canonical_blocker",
    "is_adapter",
    "lora_graph",
    "read_adapter",
    "read_tensors",
    "save_adapter",
    "scaled_tensors",
    "transport_adapter",
    "whole_tensor_names",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"
PREFIX = "base_model.model."
# options whose adapters are not (only) a low-rank update of existing weights
UNSUPPORTED = {
    "use_dora": "DoRA rescales each column by a learned magnitude, which no transform carries exactly",
    "lora_bias": "a LoRA bias on lora_B",
    "use_qalora": "QA-LoRA pools inputs in groups",
    "use_bdlora": "block-diagonal LoRA",
    "target_parameters": "LoRA on raw parameters (MoE experts)",
    "layer_replication": "replicated layers change the base's depth",
    "trainable_token_indices": "trainable token rows",
    "alora_invocation_tokens": "activated LoRA",
}
Kind = Literal["linear", "conv1d", "embedding"]


@dataclass
class LoraModule:
    """One adapted module: its factors as stored, and how they map onto the base weight's axes.

    ``weight`` is the state-dict name of the base weight. In state-dict layout the update is
    ``scale · left @ right`` with ``left`` sharing the weight's axis 0 and ``right`` its axis 1
    (Linear: left = B, right = A; GPT-2 Conv1D and Embedding store the weight transposed).
    """

    module: str
    weight: str
    kind: Kind
    key_a: str
    key_b: str
    a: Tensor
    b: Tensor
    scale: float

    def left_right(self) -> tuple[Tensor, Tensor]:
        if self.kind == "linear":
            return self.b, self.a
        return self.a.T, self.b.T

    def factors(self, left: Tensor, right: Tensor) -> tuple[Tensor, Tensor]:
        """(A, B) as stored, from state-dict-layout factors."""
        if self.kind == "linear":
            return right.contiguous(), left.contiguous()
        return left.T.contiguous(), right.T.contiguous()

    def delta(self) -> Tensor:
        left, right = self.left_right()
        return self.scale * (left.to(torch.float32) @ right.to(torch.float32))

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoraAdapter:
    """A PEFT LoRA adapter checked against the base model it is meant for."""

    folder: Path
    config: dict[str, Any]
    modules: dict[str, LoraModule]
    full: dict[str, tuple[str, Tensor]] = field(default_factory=dict)  # file key → (state-dict name, tensor)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype most of the adapter's floating values are stored in: a transported adapter is
        written back in it (the moves themselves run in float32 or float64)."""
        sizes: dict[torch.dtype, int] = {}
        tensors = [t for m in self.modules.values() for t in (m.a, m.b)] + [t for _, t in self.full.values()]
        for t in tensors:
            if t.is_floating_point():
                sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
        return max(sizes.items(), key=lambda kv: (kv[1], kv[0] == torch.float32))[0] if sizes else torch.float32

    @property
    def base_name(self) -> str | None:
        value = self.config.get("base_model_name_or_path")
        return str(value) if value else None

    def summary(self) -> dict[str, Any]:
        """What ``rebasin.json`` and the card say about the adapter."""
        ranks = sorted({m.rank for m in self.modules.values()})
        return {
            "peft_type": "LORA",
            "modules": len(self.modules),
            "rank": ranks[0] if len(ranks) == 1 else ranks,
            "lora_alpha": self.config.get("lora_alpha"),
            "target_modules": self.config.get("target_modules"),
            "full_tensors": sorted(name for name, _ in self.full.values()),
        }


def is_adapter(folder: Path) -> bool:
    """Whether ``folder`` holds a PEFT adapter (``adapter_config.json``) rather than a full model."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_config(folder: Path, where: str = "finetuned", *, tokens: bool = False) -> dict[str, Any]:
    """``adapter_config.json``, checked to be a LoRA adapter hf-rebasin can transport (``tokens``:
    trainable tokens too, which `vocabulary.adapter_rows` merges into the base before the adapter moves)."""
    path = Path(folder) / ADAPTER_CONFIG
    with named(f"`{where}`"):
        config: dict[str, Any] = read_json(path)  # through the gate: confined, regular, typed
    kind = config.get("peft_type")
    if kind != "LORA":
        raise CheckpointError(
            f"`{where}`: {str(path)!r} is a PEFT {kind} adapter; hf-rebasin transports LoRA adapters (peft_type LORA)"
        )
    for key, what in UNSUPPORTED.items():
        if config.get(key) and not (tokens and key == "trainable_token_indices"):
            raise CheckpointError(
                f"`{where}`: {str(path)!r} sets {key}: {config[key]!r} ({what}); hf-rebasin transports plain LoRA "
                "updates only: train the adapter without it, or merge it into the base and transport the full model"
            )
    return config


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's `rank_pattern` / `alpha_pattern` lookup: a key matches a module name or its suffix."""
    for key in sorted(patterns, key=len, reverse=True):
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def read_tensors(folder: Path, allow_pickle: bool, where: str) -> dict[str, Tensor]:
    """An adapter's tensors by file key, read through the gate (safetensors, or a pickle when allowed), all finite."""
    from safetensors.torch import load_file

    path = folder / ADAPTER_WEIGHTS
    if path.is_file():
        read_header(path)  # through the gate: the header checked against the file before safetensors reads it
        try:
            tensors = load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"`{where}`: {str(path)!r} is not a readable safetensors file: {e}") from None
    elif (folder / ADAPTER_PICKLE).is_file():
        if not allow_pickle:
            raise PickleRefusedError(
                f"`{where}`: {str(folder)!r} holds only {ADAPTER_PICKLE} (a pickle, which can run code when loaded); "
                "set `allow_pickle: true` in the recipe if you trust its author"
            )
        path = folder / ADAPTER_PICKLE
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for corrupt or unsafe pickles
            raise CheckpointError(f"`{where}`: {str(path)!r} is not a readable PyTorch checkpoint: {e}") from None
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()
        ):
            raise CheckpointError(f"`{where}`: {str(path)!r} is not a state dict (tensor name -> tensor)")
        tensors = loaded
    else:
        raise ModelNotFoundError(f"`{where}`: {str(folder)!r} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    for key, t in tensors.items():  # NaN compares false with every check: found here, not in the output
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"`{where}`: the adapter's tensor {key!r} in {path.name} holds NaN or Inf; the adapter is broken"
            )
    return tensors


def _kind(module: nn.Module, name: str, where: str) -> Kind:
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, Conv1D):
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    raise CheckpointError(
        f"`{where}`: the adapter targets {name!r}, a {type(module).__name__}; hf-rebasin transports LoRA on "
        "Linear, Conv1D and Embedding layers"
    )


def _sort_tensors(
    tensors: Mapping[str, Tensor], state: Mapping[str, Tensor], model: nn.Module, where: str
) -> tuple[dict[str, dict[str, str]], dict[str, tuple[str, Tensor]]]:
    """The adapter's file keys sorted by what they are: LoRA factors, grouped by the module they adapt
    (module → {"A": key, "B": key}), and whole base tensors saved beside them (key → (state-dict
    name, tensor)); a key that is neither belongs to another architecture."""
    groups: dict[str, dict[str, str]] = {}
    full: dict[str, tuple[str, Tensor]] = {}
    for key in tensors:
        name = key[len(PREFIX) :] if key.startswith(PREFIX) else key
        name = name.replace(".base_layer.", ".")  # a whole base weight PEFT saved beside its factors
        m = re.fullmatch(
            r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight|(.+)\.(lora_embedding_A|lora_embedding_B)(?:\.[^.]+)?", name
        )
        if m:
            module, part = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            groups.setdefault(module, {})[part[-1]] = key
        elif name in state:
            full[key] = (name, tensors[key])
        else:
            raise IncompatibleModelsError(
                f"`{where}`: the adapter's tensor {key!r} matches no module of the base model "
                f"({type(model).__name__}): was it trained on another architecture?"
            )
    return groups, full


def _lora_module(
    module: str,
    parts: Mapping[str, str],
    tensors: Mapping[str, Tensor],
    model: nn.Module,
    state: Mapping[str, Tensor],
    config: Mapping[str, Any],
    alpha: float,
    rslora: bool,
    where: str,
) -> LoraModule:
    """The factors of ``module`` checked against the base (both present, a module of it, a weight of
    its own, shapes that fit) with their scale (``alpha_pattern``, rsLoRA): a wrong base fails here."""
    if set(parts) != {"A", "B"}:
        raise CheckpointError(f"`{where}`: the adapter holds only lora_{''.join(parts)} for {module!r}")
    try:
        target = model.get_submodule(module)
    except AttributeError:
        raise IncompatibleModelsError(
            f"`{where}`: the adapter adapts {module!r}, which the base model ({type(model).__name__}) does not have"
        ) from None
    weight = f"{module}.weight"
    kind = _kind(target, module, where)
    twins = [n for n, t in state.items() if n != weight and storage_key(t) == storage_key(state[weight])]
    if twins:
        raise CheckpointError(
            f"`{where}`: the adapter adapts {module!r}, whose weight is tied to {twins[0]!r}; PEFT applies such "
            "an update to one use of the weight only, so it is not a task vector of the weight. Merge it into "
            "the base and transport the full model instead"
        )
    a, b = tensors[parts["A"]], tensors[parts["B"]]
    w = state[weight]
    rank = int(a.shape[0])
    lora = LoraModule(module, weight, kind, parts["A"], parts["B"], a, b, 0.0)
    left, right = lora.left_right()
    if b.shape[-1] != rank or (left.shape[0], right.shape[1]) != tuple(w.shape):
        raise IncompatibleModelsError(
            f"`{where}`: the adapter's factors for {module!r} (A {tuple(a.shape)}, B {tuple(b.shape)}) do not fit "
            f"the base weight {weight!r} {tuple(w.shape)}: the adapter belongs to another base model"
        )
    r_alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, alpha))
    lora.scale = r_alpha / math.sqrt(rank) if rslora else r_alpha / rank
    return lora


def read_adapter(
    folder: Path, model: nn.Module, *, allow_pickle: bool = False, where: str = "finetuned"
) -> LoraAdapter:
    """Read a LoRA adapter and check every factor against ``model`` (the base it was trained on)."""
    folder = Path(folder)
    return adapter_from(folder, adapter_config(folder, where), read_tensors(folder, allow_pickle, where), model, where)


def adapter_from(
    folder: Path, config: dict[str, Any], tensors: Mapping[str, Tensor], model: nn.Module, where: str
) -> LoraAdapter:
    """An adapter's config and tensors checked against ``model``, every factor and whole tensor."""
    state = model.state_dict()
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))
    groups, full = _sort_tensors(tensors, state, model, where)
    modules = {
        module: _lora_module(module, parts, tensors, model, state, config, alpha, rslora, where)
        for module, parts in sorted(groups.items())
    }
    if not modules and not full:
        raise CheckpointError(f"`{where}`: the adapter in {str(folder)!r} holds no tensors")
    return LoraAdapter(folder, config, modules, full)


def apply_adapter(adapter: LoraAdapter, base: Mapping[str, Tensor], alpha: float = 1.0) -> dict[str, Tensor]:
    """The base with the adapter merged in (``base + α·ΔW``; saved tensors replace theirs).

    Names that alias one storage in ``base`` (a tied head) get one new tensor, so ties stay.
    """
    changed: dict[str, Tensor] = {m.weight: m.delta() for m in adapter.modules.values()}
    replaced: dict[str, Tensor] = {name: t for name, t in adapter.full.values()}
    new_by_storage: dict[StorageKey, Tensor] = {}
    for name, t in base.items():
        if name in changed:
            new_by_storage[storage_key(t)] = (t.to(torch.float32) + alpha * changed[name]).to(t.dtype)
        elif name in replaced:
            value = replaced[name].to(device=t.device, dtype=torch.float32)
            new_by_storage[storage_key(t)] = (t.to(torch.float32) + alpha * (value - t.to(torch.float32))).to(t.dtype)
    return {name: new_by_storage.get(storage_key(t), t) for name, t in base.items()}


def lora_graph(graph: SymmetryGraph) -> tuple[SymmetryGraph, list[str]]:
    """The graph with every orthogonal-capable plain space limited to permutations, and their names.

    Those spaces need the canonical form (γ folded into readers, writers centered), which the
    target base of an adapter does not have, and a LoRA factor cannot absorb a norm's β.
    """
    reason = "a LoRA adapter applies to the target as stored; it cannot follow norm folding"
    demoted = [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.max_class == "orthogonal"]
    spaces: dict[str, AnySpace] = {}
    for n, s in graph.spaces.items():
        spaces[n] = (
            dataclasses.replace(s, max_class="permutation", reason=reason)
            if isinstance(s, Space) and n in demoted
            else s
        )
    return dataclasses.replace(graph, spaces=spaces), demoted


def _map(
    graph: SymmetryGraph, name: str, t: Tensor, transform: Transform, skip_axis: int | None, cache: dict
) -> Tensor:
    source = graph.ties.get(name, name)
    if source not in graph.bindings:
        return t  # invariant (no hidden space on any axis)
    return graph.map_tensor(source, t, transform, skip_axis=skip_axis, cache=cache)


def _orthogonal_spaces(graph: SymmetryGraph) -> set[str]:
    return {n for n, s in graph.spaces.items() if isinstance(s, Space) and s.max_class == "orthogonal"}


def _reader_norms(graph: SymmetryGraph) -> dict[tuple[str, str], Norm]:
    return {(r, n.space): n for n in graph.norms for r in n.readers}


def canonical_blocker(adapter: LoraAdapter, graph: SymmetryGraph, base: Mapping[str, Tensor]) -> str | None:
    """Why the adapter cannot be moved in canonical coordinates (None: it can).

    A factor can take a norm's γ (a scale of one axis) and a writer's centering (a projection of
    one axis); a folded β becomes a shift of the reader's bias, which travels as a whole bias.
    What cannot follow: a β left in the norm (some reader has no bias), a rotated space inside a
    fused axis, and tensors the adapter stores whole.
    """
    orth = _orthogonal_spaces(graph)
    if adapter.full:
        return "it stores whole tensors (modules_to_save or biases)"
    readers = _reader_norms(graph)
    for m in adapter.modules.values():
        binding = graph.bindings.get(m.weight)
        for ref in binding.axes if binding is not None else ():
            if isinstance(ref, Fused) and any(split_ref(p)[0] in orth for p in ref.parts):
                return f"{m.weight!r} has a fused axis in a rotated space"
            norm = readers.get((m.weight, ref)) if isinstance(ref, str) and ref in orth else None
            if norm is not None and norm.bias is not None and not all(bias_of(r, base) for r in norm.readers):
                return f"the shift of {norm.bias!r} stays in the norm (a reader of it has no bias)"
    return None


def _scale(t: Tensor, axis: int, v: Tensor) -> Tensor:
    shape = [1] * t.dim()
    shape[axis] = -1
    return t * v.reshape(shape)


def _contract(left: Tensor, right: Tensor, scale: float, axis: int, vec: Tensor) -> Tensor:
    """``scale·left@right`` contracted with ``vec`` along ``axis``, without forming the product."""
    return scale * (left @ (right @ vec)) if axis == 1 else scale * ((vec @ left) @ right)


def _canonical_factors(
    weight: str,
    left: Tensor,
    right: Tensor,
    graph: SymmetryGraph,
    orth: set[str],
    readers: Mapping[tuple[str, str], Norm],
    base: Mapping[str, Tensor],
) -> tuple[list[Tensor], list[tuple[int, Norm]]]:
    """A module's state-dict-layout factors (float64) as canonical form sees them, on each axis in a
    rotated space of ``orth``: a reader's takes its norm's γ in, a writer's is centered. Returns the
    factors and the (axis, norm) pairs folded in: the move divides by the target's γ there again."""
    factors = [left, right]
    folded: list[tuple[int, Norm]] = []
    binding = graph.bindings.get(weight)
    for k, ref in enumerate(binding.axes if binding is not None else ()):
        if not (isinstance(ref, str) and ref in orth):
            continue
        norm = readers.get((weight, ref))
        if norm is not None:
            folded.append((k, norm))
            factors[k] = _scale(factors[k], k, gamma(norm, base[norm.weight]))
        # a writer is centered (after its LayerScale λ, which it takes in like a reader takes γ),
        # as canonical form centers it: not on a stream something also reads raw (`RawStream`)
        if norm is None or isinstance(norm, WriterScale):
            space = graph.spaces[ref]
            if isinstance(space, Space) and space.centered and not isinstance(space, RawStream):
                factors[k] = factors[k] - factors[k].mean(dim=k, keepdim=True)
    return factors, folded


def _shifted_bias(
    scale: float,
    shifted: Sequence[tuple[int, Norm]],
    before: tuple[Tensor, Tensor],
    after: Sequence[Tensor],
    bias: str,
    mapped: SymmetryGraph,
    transform: Transform,
    base: Mapping[str, Tensor],
    target: Mapping[str, Tensor],
    cache: dict[str, Any],
) -> Tensor:
    """The target's reader bias ``bias`` plus what the folded βs of ``shifted`` change in it:
    ``π(ΔW_A·β_A) − ΔW_B·β_B`` from the factors ``before`` and ``after`` the move, stored whole
    because a factor cannot carry a shift of the bias."""
    delta = torch.zeros(target[bias].shape, dtype=torch.float64, device=target[bias].device)
    for k, norm in shifted:
        assert norm.bias is not None
        shift = _contract(before[0], before[1], scale, k, base[norm.bias].to(torch.float64))
        delta += _map(mapped, bias, shift, transform, None, cache)
        delta -= _contract(after[0], after[1], scale, k, target[norm.bias].to(torch.float64))
    return (target[bias].to(torch.float64) + delta).to(target[bias].dtype)


def transport_adapter(
    adapter: LoraAdapter,
    graph: SymmetryGraph,
    transform: Transform,
    base: Mapping[str, Tensor],
    target: Mapping[str, Tensor],
    *,
    canonical_graph: SymmetryGraph | None = None,
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The adapter's tensors (file keys as stored) in the target's basis, and the whole tensors
    among them that the adapter did not store itself (file key → state-dict name).

    Factors: ``B ↦ T_out B``, ``A ↦ A T_inᵀ``, exact for any per-axis map. A tensor the adapter
    stores whole becomes ``target + π(saved − base)``, so loading it onto the target adds the moved
    update. With ``canonical_graph`` (the alignment's graph after generalized-orthogonal) the
    transform is one of canonical forms and the target is stored as it is: a reader's factor takes
    γ_A in and 1/γ_B out, a writer's factor is centered, and a folded β changes the reader's bias by
    ``π(ΔW_A·β_A) − ΔW_B·β_B``, stored whole. Check :func:`canonical_blocker` first.
    """
    if adapter.full and canonical_graph is not None:
        raise TransformError("an adapter that stores whole tensors cannot be moved in canonical form")
    orth = _orthogonal_spaces(graph) if canonical_graph is not None else set()
    mapped = canonical_graph if canonical_graph is not None else graph
    readers = _reader_norms(graph)
    out: dict[str, Tensor] = {}
    whole: dict[str, str] = {}
    cache: dict[str, Any] = {}
    for m in adapter.modules.values():
        left0, right0 = (t.to(torch.float64) for t in m.left_right())
        factors, folded = _canonical_factors(m.weight, left0, right0, graph, orth, readers, base)
        moved = [
            _map(mapped, m.weight, factors[0], transform, 1, cache),
            _map(mapped, m.weight, factors[1], transform, 0, cache),
        ]
        for k, norm in folded:
            moved[k] = _scale(moved[k], k, 1.0 / gamma(norm, target[norm.weight]))
        a, b = m.factors(moved[0], moved[1])
        out[m.key_a], out[m.key_b] = a.to(m.a.dtype), b.to(m.b.dtype)
        shifted = [(k, norm) for k, norm in folded if norm.bias is not None]
        bias = bias_of(m.weight, base)
        if shifted and bias is not None:
            key = f"{PREFIX}{m.module}.base_layer.bias"
            out[key] = _shifted_bias(
                m.scale, shifted, (left0, right0), moved, bias, mapped, transform, base, target, cache
            )
            whole[key] = bias
    for key, (name, t) in adapter.full.items():
        tau = t.to(torch.float32) - base[name].to(torch.float32)
        out[key] = (target[name].to(torch.float32) + _map(graph, name, tau, transform, None, cache)).to(t.dtype)
    return out, whole


def whole_tensor_names(adapter: LoraAdapter, whole: Mapping[str, str] | None = None) -> dict[str, str]:
    """File key → state-dict name of every tensor the adapter stores whole (its own and ``whole``)."""
    return {key: name for key, (name, _) in adapter.full.items()} | dict(whole or {})


def scaled_tensors(
    adapter: LoraAdapter,
    tensors: Mapping[str, Tensor],
    alpha: float,
    target: Mapping[str, Tensor] | None = None,
    whole: Mapping[str, str] | None = None,
) -> dict[str, Tensor]:
    """``tensors`` (file keys) for ``alpha``: B factors times α, whole tensors ``target + α·(saved − target)``."""
    out: dict[str, Tensor] = {}
    b_keys = {m.key_b for m in adapter.modules.values()}
    whole_names = whole_tensor_names(adapter, whole)
    for key, t in tensors.items():
        if alpha != 1.0 and key in b_keys:
            t = t * alpha
        elif alpha != 1.0 and key in whole_names and target is not None:
            base = target[whole_names[key]].to(torch.float32)
            t = (base + alpha * (t.to(torch.float32) - base)).to(t.dtype)
        out[key] = t
    return out


def save_adapter(
    adapter: LoraAdapter,
    tensors: Mapping[str, Tensor],
    folder: Path,
    *,
    base_model: str,
    alpha: float = 1.0,
    target: Mapping[str, Tensor] | None = None,
    whole: Mapping[str, str] | None = None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write a PEFT adapter folder for ``base_model`` holding ``tensors`` scaled by ``alpha``.

    α scales each update: B factors by α, whole tensors (the adapter's own and ``whole``: file key
    → state-dict name) as ``target + α·(saved − target)``. ``dtype`` casts every floating tensor
    for writing (None: as computed; the biases stored whole then come in the target's dtype).
    Returns the file names written.
    """
    from safetensors.torch import save_file

    whole_names = whole_tensor_names(adapter, whole)
    out = {
        key: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().contiguous().cpu()
        for key, t in scaled_tensors(adapter, tensors, alpha, target, whole).items()
    }
    config = dict(adapter.config)
    if set(whole_names) - set(adapter.full) and config.get("bias", "none") == "none":
        config["bias"] = "lora_only"  # the biases of adapted modules travel whole: PEFT loads them
    config["base_model_name_or_path"] = base_model
    config["revision"] = None
    folder = Path(folder)
    save_file(out, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
