"""A narrower model written exactly into a wider shape of its family: zeros wherever the wide shape
has more (residual features, MLP or expert units, attention heads), and the scales that keep every
norm's output as it was.

Every feature of a space of the narrow graph goes to the same position in the wide graph's space
(the first features of a plain space; the first heads, each head's features in place, whole KV
groups with their query heads; expert e's unit u at e·f′ + u). An added feature is read by nothing
(its reader columns are zero) and written by nothing (its writer rows are zero), so the added units
and heads compute zeros that nothing reads. The residual stream's added features stay zero, but a
norm over the stream now averages over d′ features: RMSNorm divides by an rms √(d/d′) as large, so
each norm on the stream gets its scale times √(d/d′) (and its ε times d/d′ for exactness); a
LayerNorm also subtracts the mean, which the zeros change unless the stream has mean 0, which is
what the canonical form gives (writers centred): a LayerNorm stream is embedded from it.

`embed_state` is pure tensor code over the symmetry graph; `embed_model` does the rest for a
transformers model: the wide config (the narrow one with the wide one's sizes), the canonical form
where a LayerNorm stream grows, and the ε that makes the embedding exact.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .errors import IncompatibleModelsError
from .symmetry import AxisRef, ExpertSpace, Fused, HeadSpace, Space, SymmetryGraph, split_ref

__all__ = ["Embedding", "embed_model", "embed_state", "residual_ratio", "widened_config"]

# config fields that set a width (copied from the wide config); the names transformers' families use
WIDTH_FIELDS = (
    "hidden_size", "n_embd", "dim", "d_model",  # the residual stream
    "intermediate_size", "n_inner", "hidden_dim", "mlp_ratio", "moe_intermediate_size",
    "shared_expert_intermediate_size",  # MLP / expert units
    "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "head_dim",  # heads
    "projection_dim",  # a joint embedding (CLIP, SigLIP)
)  # fmt: skip
# fields that must agree: what a wider shape cannot change (depth, vocabulary, experts)
FIXED_FIELDS = {
    "num_hidden_layers": "depth",
    "n_layer": "depth",
    "n_layers": "depth",
    "vocab_size": "vocabulary",
    "num_local_experts": "number of experts",
    "num_experts": "number of experts",
    "num_experts_per_tok": "experts per token",
    "image_size": "image size",
    "patch_size": "patch size",
}
EPS_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps")
SUB_CONFIGS = ("text_config", "vision_config")
LAYER = re.compile(r"\.\d+\.")  # a layer index in a space's name


def _check_spaces(narrow: SymmetryGraph, wide: SymmetryGraph) -> None:
    """The same spaces, none smaller in the wide graph, and only the changes that embed exactly."""
    missing = sorted(set(narrow.spaces) - set(wide.spaces))
    if missing:
        raise IncompatibleModelsError(
            f"the wider model has no space(s) {missing[:3]}: a different depth or layout cannot be embedded"
        )
    for name, small in narrow.spaces.items():
        big = wide.spaces[name]
        if type(small) is not type(big):
            raise IncompatibleModelsError(f"space {name!r} is of another kind in the wider model")
        if isinstance(small, HeadSpace) and isinstance(big, HeadSpace):
            if big.head_dim != small.head_dim:
                why = (
                    "rotary embeddings' frequencies depend on it" if small.rotary else "the scores scale by 1/√head_dim"
                )
                raise IncompatibleModelsError(
                    f"space {name!r}: head_dim {small.head_dim} → {big.head_dim} is not embedded ({why}); "
                    "keep head_dim and add heads"
                )
            if big.group_size != small.group_size or big.num_kv_heads < small.num_kv_heads:
                raise IncompatibleModelsError(
                    f"space {name!r}: {small.num_heads} heads in {small.num_kv_heads} KV groups cannot be embedded in "
                    f"{big.num_heads} heads in {big.num_kv_heads} groups (whole groups with their query heads only)"
                )
        elif isinstance(small, ExpertSpace) and isinstance(big, ExpertSpace):
            if big.num_experts != small.num_experts or big.units < small.units:
                raise IncompatibleModelsError(
                    f"space {name!r}: {small.num_experts} experts cannot become {big.num_experts} (an added expert "
                    "would take routing weight from the others); only each expert's units may grow"
                )
        elif isinstance(small, Space) and isinstance(big, Space) and big.size < small.size:
            raise IncompatibleModelsError(f"space {name!r} is narrower in the wider model ({small.size} > {big.size})")


def _place(graph: SymmetryGraph, ref: str, wide: SymmetryGraph) -> Tensor:
    """Where each feature of ``ref`` (a space or a role) of the narrow graph lies in the wide one."""
    name, role = split_ref(ref)
    small, big = graph.spaces[name], wide.spaces[name]
    if isinstance(small, ExpertSpace) and isinstance(big, ExpertSpace) and role == "units":
        e = torch.arange(small.num_experts)[:, None]
        return (e * big.units + torch.arange(small.units)).reshape(-1)
    return torch.arange(graph.ref_size(ref))  # heads, experts, plain spaces: a prefix


def _axis_index(graph: SymmetryGraph, ref: AxisRef, wide: SymmetryGraph, size: int) -> Tensor:
    """Positions in the wide axis of every feature of a narrow axis (an unbound axis: the same)."""
    if ref is None:
        return torch.arange(size)
    parts = ref.parts if isinstance(ref, Fused) else (ref,)
    if isinstance(ref, Fused) and ref.interleaved:  # per KV head: [head 0: its parts | head 1: …]
        g, gw = graph.groups(ref), wide.groups(ref)
        small_sizes = [graph.ref_size(p) // g for p in parts]
        wide_sizes = [wide.ref_size(p) // gw for p in parts]
        if small_sizes != wide_sizes:
            raise IncompatibleModelsError(f"axis {ref} changes its per-head layout")
        per = sum(small_sizes)
        return torch.arange(g * per)  # whole heads appended: a prefix
    out, offset = [], 0
    for part in parts:
        out.append(offset + _place(graph, part, wide))
        offset += wide.ref_size(part)
    return torch.cat(out)


def residual_ratio(narrow: SymmetryGraph, wide: SymmetryGraph) -> dict[str, float]:
    """d / d′ of every residual space that grows (what its norms' scales are multiplied by, squared)."""
    out = {}
    for name, small in narrow.spaces.items():
        big = wide.spaces[name]
        if isinstance(small, Space) and isinstance(big, Space) and small.kind == "residual" and big.size != small.size:
            out[name] = small.size / big.size
    return out


def embed_state(
    narrow: SymmetryGraph,
    state: Mapping[str, Tensor],
    wide: SymmetryGraph,
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, Tensor]:
    """``state`` (a model of graph ``narrow``) written into the shapes of graph ``wide`` (``shapes``:
    the wide model's tensors, as stored): the same function, given the wide config's norm ε scaled
    by d/d′. A LayerNorm stream must be in canonical form (its writers centred)."""
    _check_spaces(narrow, wide)
    ratios = residual_ratio(narrow, wide)
    scales = {n.weight: (n, math.sqrt(ratios[n.space])) for n in narrow.norms if n.space in ratios}
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name not in shapes:
            continue
        binding = narrow.bindings.get(name)
        if binding is None:
            if tuple(t.shape) != tuple(shapes[name]):
                raise IncompatibleModelsError(
                    f"tensor {name!r} has no hidden axis and another shape in the wider model"
                )
            out[name] = t
            continue
        if name in scales:  # a norm on a growing stream: γ′ = γ·√(d/d′) (stored as γ − offset)
            norm, s = scales[name]
            t = ((t.to(torch.float64) + norm.offset) * s - norm.offset).to(t.dtype)
        small = narrow.logical(name, t)
        wide_binding = wide.bindings[name]
        wide_shape = wide_binding.view.shape if wide_binding.view is not None else tuple(shapes[name])
        index = [_axis_index(narrow, ref, wide, small.shape[k]) for k, ref in enumerate(binding.axes)]
        big = torch.zeros(wide_shape, dtype=t.dtype)
        if name in scales:  # the added features' scale: anything (they normalise zeros); the neutral one
            norm, _ = scales[name]
            big.fill_(1.0 - norm.offset)
        big[torch.meshgrid(*index, indexing="ij")] = small
        out[name] = wide.stored(name, big)
    return out


def _sub_configs(config: Any) -> list[tuple[str, Any]]:
    """``config`` and its text / vision configs (CLIP, SigLIP), by where they are."""
    out = [("", config)]
    for name in SUB_CONFIGS:
        sub = getattr(config, name, None)
        if sub is not None and sub is not config:
            out.append((f"{name}.", sub))
    return out


def widened_config(narrow: Any, like: Any) -> Any:
    """``narrow``'s config with ``like``'s widths (hidden size, units, heads, head_dim); everything
    else (labels, vocabulary, rotary settings) stays ``narrow``'s. A different model type, depth,
    vocabulary or expert count is refused, each by its field."""
    if getattr(narrow, "model_type", None) != getattr(like, "model_type", None):
        raise IncompatibleModelsError(
            f"model_type {getattr(narrow, 'model_type', None)!r} cannot be embedded in a "
            f"{getattr(like, 'model_type', None)!r}: only models of one family embed"
        )
    wide = copy.deepcopy(narrow)
    for (where, small), (_, big), (_, out) in zip(
        _sub_configs(narrow), _sub_configs(like), _sub_configs(wide), strict=False
    ):
        for name, what in FIXED_FIELDS.items():
            a, b = getattr(small, name, None), getattr(big, name, None)
            if a is not None and b is not None and a != b:
                raise IncompatibleModelsError(
                    f"`{where}{name}` is {a} in one model and {b} in the other: a different {what} cannot be "
                    "embedded (only hidden size, MLP units and attention heads can grow)"
                )
        for name in WIDTH_FIELDS:
            if hasattr(big, name) and hasattr(out, name):
                setattr(out, name, getattr(big, name))
    return wide


@dataclass
class Embedding:
    """What `embed_model` changed: every space that grew (narrow → wide size), whether the model
    was first written in canonical form (a LayerNorm stream that grows), the tied tensors that had
    to be stored apart, and the norm ε written for exactness (field → (narrow, written))."""

    grown: dict[str, tuple[int, int]] = field(default_factory=dict)
    canonical: bool = False
    untied: list[str] = field(default_factory=list)
    eps: dict[str, tuple[float, float]] = field(default_factory=dict)

    def describe(self) -> list[str]:
        """One line per change, for a card and rebasin.json."""
        lines = [f"{name}: {a} → {b}" for name, (a, b) in self.grown.items()]
        if self.canonical:
            lines.append(
                "written in canonical form first (LayerNorm γ/β folded into their readers, writers centred) so "
                "that the zero features leave every LayerNorm's mean unchanged"
            )
        if self.untied:
            lines.append(f"stored apart (no longer tied): {', '.join(self.untied)}")
        lines += [f"{name}: {a:g} → {b:g} (ε × d/d′: exact)" for name, (a, b) in self.eps.items()]
        return lines

    def as_dict(self) -> dict[str, Any]:
        """For rebasin.json."""
        return {
            "grown": {k: list(v) for k, v in self.grown.items()},
            "canonical_form": self.canonical,
            "untied": list(self.untied),
            "eps": {k: list(v) for k, v in self.eps.items()},
        }


def _width(space: Any) -> tuple[int, str]:
    """What grows in a space: its features, its heads, or each expert's units."""
    if isinstance(space, HeadSpace):
        return space.num_heads, "heads"
    if isinstance(space, ExpertSpace):
        return space.units, "units per expert"
    return space.size, "residual features" if getattr(space, "kind", "") == "residual" else "units"


def _grown(narrow: SymmetryGraph, wide: SymmetryGraph) -> dict[str, tuple[int, int]]:
    """``{"<space pattern> (<what>)": (narrow, wide)}``: layers that grow alike are named once."""
    out: dict[str, tuple[int, int]] = {}
    for name, small in narrow.spaces.items():
        if name not in wide.spaces:
            continue
        (a, what), (b, _) = _width(small), _width(wide.spaces[name])
        if a != b:
            out[f"{LAYER.sub('.*.', name)} ({what})"] = (a, b)
    return out


def _check_streams(graph: SymmetryGraph, ratios: Mapping[str, float]) -> None:
    """A growing LayerNorm stream must have an exact canonical form (writers centred)."""
    from .canonical import RawStream

    for name in ratios:
        space = graph.spaces[name]
        if not isinstance(space, Space) or not space.centered:
            continue
        if isinstance(space, RawStream):
            raise IncompatibleModelsError(
                f"hidden size of {name!r} cannot grow: something reads this LayerNorm stream without a norm, so "
                "its mean cannot be removed and the added zero features would change every LayerNorm's mean "
                "(add MLP units or heads instead)"
            )
        if space.max_class != "orthogonal":
            raise IncompatibleModelsError(
                f"hidden size of {name!r} cannot grow: its LayerNorms read a stream that is not centred "
                f"({space.reason or 'post-norm'}), so their mean and variance over the added zero features are no "
                "rescaling of the real ones; MLP units and attention heads can still grow"
            )


def embed_model(model: Any, like: Any, *, exact_eps: bool = True) -> tuple[Any, Embedding]:
    """``model`` (a transformers model) written into the shape of config ``like`` (its family, at
    least as wide in every width): a model of ``model``'s class computing the same function.

    With ``exact_eps`` every norm ε on a growing stream is scaled by d/d′ in the new config (exact);
    without it, the new config keeps ``like``'s ε (what a model merged into an existing wide one
    must use): the function then moves by O(ε / rms²)."""
    from .adapters import graph_for
    from .canonical import canonicalize
    from .offload import empty_model

    config = widened_config(model.config, like)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    shapes = {k: tuple(t.shape) for k, t in empty_model(type(model), config).state_dict().items()}
    wide_graph = graph_for(config, shapes.keys())
    _check_spaces(graph, wide_graph)
    ratios = residual_ratio(graph, wide_graph)
    _check_streams(graph, ratios)
    report = Embedding(grown=_grown(graph, wide_graph))
    if any(getattr(graph.spaces[n], "centered", False) for n in ratios):
        sd, graph, report.untied = canonicalize(graph, sd)
        report.canonical = True
        if report.untied:
            text = config.get_text_config()
            text.tie_word_embeddings = False
            if text is not config and hasattr(config, "tie_word_embeddings"):
                config.tie_word_embeddings = False
    for (where, small), (_, out) in zip(_sub_configs(model.config), _sub_configs(config), strict=False):
        d, d_wide = _hidden(small), _hidden(out)
        if not d or not d_wide or d == d_wide:
            continue
        for name in EPS_FIELDS:
            value = getattr(out, name, None)
            if isinstance(value, float) and not isinstance(value, bool):
                written = value * d / d_wide if exact_eps else getattr(like_sub(like, where), name, value)
                setattr(out, name, written)
                report.eps[f"{where}{name}"] = (value, written)
    state = embed_state(graph, sd, wide_graph, shapes)
    wide = type(model)(config)
    wide.load_state_dict(state, strict=True)
    wide.to(dtype=next(model.parameters()).dtype)
    return wide.eval(), report


def _hidden(config: Any) -> int | None:
    for name in ("hidden_size", "n_embd", "dim", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def like_sub(like: Any, where: str) -> Any:
    """``like``'s (sub)config at ``where`` (``""``, ``"text_config."``)."""
    return getattr(like, where.rstrip("."), like) if where else like
