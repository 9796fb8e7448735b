"""Sites: which module input or output carries a space's features.

Derived from the symmetry graph and the module types alone (Linear / Conv1D weights bound to
spaces): no per-architecture code, so every adapter gets activation statistics for free. A
:class:`HookPlan` gathers the sites one collection hooks, fixed before any model runs; the
residual mode (`ResidualMode`) says which of the residual stream's sites are kept.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import ExpertSpace, Fused, Space, split_ref

# which residual sites a collection keeps (see `activations.activation_stats`)
ResidualMode = Literal["none", "first", "last", "all", "separate"]
_LAYER = re.compile(r"\.\d+\.")
RESIDUAL_MODES: tuple[ResidualMode, ...] = ("none", "first", "last", "all", "separate")


@dataclass(frozen=True)
class Site:
    """Where the features of one space (or head-space role) are read.

    ``key``: a space ref (``"h.0.mlp"``, ``"h.0.attn:o"``), the residual space's name, or in
    :class:`~.moments.ActivationStats` a residual key such as ``"res@3"``. The features are
    the last axis of ``module``'s input or output, sliced ``[offset, offset + size)`` (GPT-2's
    fused ``c_attn`` output holds q | k | v); with ``groups`` > 1 the axis is that many blocks and
    the slice ``[offset, offset + size / groups)`` is taken in each (GPT-NeoX's per-head q | k | v).
    """

    key: str
    module: str
    where: Literal["input", "output"]
    offset: int
    size: int
    groups: int = 1
    channels: bool = False  # a convolution's: the features are axis 1 (``[batch, channels, time]``)

    def read(self, x: Any, out: Any) -> Any:
        """The tensor whose last axis holds the features: the module's input or output."""
        t = x if self.where == "input" else out
        return t.transpose(1, -1) if self.channels else t


def _linear_axes(module: torch.nn.Module) -> tuple[int, int] | None:
    """(input axis, output axis) of a linear module's weight; None for anything else. A 1-d
    convolution (Whisper's front end, ``[out, in, kernel]``) counts: its channels are features."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        return 0, 1  # [in, out]
    if isinstance(module, torch.nn.Linear | torch.nn.Conv1d):
        return 1, 0  # [out, in(, kernel)]
    return None


def _routers(graph: SymmetryGraph) -> set[str]:
    """Every router weight ``[E, d]`` of the graph's expert spaces."""
    return {r for n, s in graph.spaces.items() if isinstance(s, ExpertSpace) for r in graph.routers(n)}


def bound_linears(graph: SymmetryGraph, model: torch.nn.Module) -> dict[str, tuple[Any, Any]]:
    """Every Linear / Conv1D module with a bound weight: name -> (input ref, output ref), in the
    model's registration order. A MoE router (its own module class, ``[E, d]`` like a Linear) is
    one too: it reads the residual stream as a dense MLP's projections do."""
    rank = {name: i for i, (name, _) in enumerate(model.named_modules())}
    routers = _routers(graph)
    found: dict[str, tuple[Any, Any]] = {}
    for name, binding in graph.bindings.items():
        if not name.endswith(".weight") or len(binding.axes) not in (2, 3):
            continue
        module_name = name[: -len(".weight")]
        if module_name not in rank:
            continue
        module = model.get_submodule(module_name)
        axes = (1, 0) if name in routers else _linear_axes(module)
        if axes is not None and len(binding.axes) == (3 if isinstance(module, torch.nn.Conv1d) else 2):
            found[module_name] = (binding.axes[axes[0]], binding.axes[axes[1]])
    return dict(sorted(found.items(), key=lambda kv: rank[kv[0]]))


def is_residual(graph: SymmetryGraph, space: str) -> bool:
    """Whether ``space`` is a residual stream: its readers are grouped per input tensor, not keyed."""
    s = graph.spaces.get(space)
    return isinstance(s, Space) and s.kind == "residual"


def wanted_spaces(graph: SymmetryGraph, spaces: Collection[str] | None) -> set[str]:
    """The space names behind ``spaces`` (refs such as ``"h.0.attn:o"`` allowed); all when None."""
    if spaces is None:
        return set(graph.spaces)
    wanted = {split_ref(s)[0] for s in spaces}
    unknown = sorted(wanted - set(graph.spaces))
    if unknown:
        raise ValueError(f"no space(s) {unknown} in the {graph.family!r} graph; it has {sorted(graph.spaces)}")
    return wanted


def candidate_sites(graph: SymmetryGraph, model: torch.nn.Module, wanted: set[str]) -> list[Site]:
    """All sites of the wanted spaces, in module order: every input site, and output sites of
    non-residual spaces (a residual writer's output is only part of the stream). Expert spaces
    have no such site (their features are computed per expert: :func:`expert_sites`)."""
    wanted = {n for n in wanted if not isinstance(graph.spaces.get(n), ExpertSpace)}
    sites: list[Site] = []
    for module, (in_ref, out_ref) in bound_linears(graph, model).items():
        channels = isinstance(model.get_submodule(module), torch.nn.Conv1d)
        if isinstance(in_ref, str) and split_ref(in_ref)[0] in wanted:
            sites.append(Site(in_ref, module, "input", 0, graph.ref_size(in_ref), channels=channels))
        parts: tuple[str, ...] = out_ref.parts if isinstance(out_ref, Fused) else (out_ref,) if out_ref else ()
        groups = graph.groups(out_ref)
        offset = 0
        for part in parts:
            size = graph.ref_size(part)
            space = split_ref(part)[0]
            if space in wanted and not is_residual(graph, space):
                sites.append(Site(part, module, "output", offset // groups, size, groups, channels))
            offset += size
    return sites


def activation_sites(graph: SymmetryGraph, model: torch.nn.Module, spaces: Collection[str] | None = None) -> list[Site]:
    """The sites to hook, in module order: one per space / head role, plus every residual reader.

    Per key an *input* site is preferred (the reader sees exactly the space: the MLP down
    projection's input is the post-activation unit, o_proj's input the attention output before
    W_O); otherwise an output site (q and k from q_proj / k_proj or slices of a fused c_attn).
    Role v is skipped when o exists (they share the inner map). A space that every layer of a stack
    shares (T5's self-attention heads, which one position bias ties) is read at that site in every
    layer, and each layer's rows count. For a residual space (kind
    ``"residual"``) every input site is returned under the space's name: which of them are kept
    depends on forward order and tensor identity, known only when the model runs
    (:func:`~.activations.activation_stats`).
    """
    wanted = wanted_spaces(graph, spaces)
    candidates = candidate_sites(graph, model, wanted)
    residual = [s for s in candidates if is_residual(graph, split_ref(s.key)[0])]
    chosen: dict[str, Site] = {}
    for where in ("input", "output"):
        for s in candidates:
            if s.where == where and s.key not in chosen and not is_residual(graph, split_ref(s.key)[0]):
                chosen[s.key] = s
    for key in list(chosen):
        space, role = split_ref(key)
        if role == "v" and f"{space}:o" in chosen:
            del chosen[key]
    keep = set(chosen.values()) | set(residual)
    keep |= {s for s in candidates if s.key in chosen and _same_site(s, chosen[s.key])}
    return [s for s in candidates if s in keep]


def _same_site(s: Site, first: Site) -> bool:
    """``s`` is ``first``'s site in another layer (the module's name differs in layer indices only)."""
    return s.where == first.where and _LAYER.sub(".#.", s.module) == _LAYER.sub(".#.", first.module)


@dataclass(frozen=True)
class ExpertSite:
    """Where one MoE layer's expert features are computed.

    ``experts``: the module holding the stacked expert weights; a pre-hook reads its inputs (the
    stream as the experts see it, each token's top-k expert indices and routing weights) and
    computes every expert's units ``act(gate_e x) * (up_e x)`` from ``gate_up`` (the tensor name of
    ``[E, 2f, d]``, read through the graph's view as ``[gate units | up units, d]``). ``router``:
    the router module, whose first output is the logits ``[n, E]``; ``softmax`` (else sigmoid)
    turns them into routing probabilities.
    """

    space: str
    experts: str
    router: str
    gate_up: str
    num_experts: int
    units: int
    softmax: bool = True


def expert_sites(graph: SymmetryGraph, model: torch.nn.Module, wanted: Collection[str]) -> list[ExpertSite]:
    """One site per wanted expert space whose experts and router are modules of ``model``."""
    modules = {name for name, _ in model.named_modules()}
    sites: list[ExpertSite] = []
    for name in wanted:
        space = graph.spaces.get(name)
        if not isinstance(space, ExpertSpace):
            continue
        units = f"{name}:units"
        gate_up = [
            t
            for t, b in graph.bindings.items()
            if b.view is not None and isinstance(b.axes[0], Fused) and b.axes[0].parts == (units, units)
        ]
        routers = [r for r in graph.routers(name) if r.endswith(".weight")]
        if len(gate_up) != 1 or not routers:
            continue
        experts, router = gate_up[0].rsplit(".", 1)[0], routers[0][: -len(".weight")]
        if experts in modules and router in modules:
            sites.append(
                ExpertSite(name, experts, router, gate_up[0], space.num_experts, space.units, space.router == "softmax")
            )
    return sites


@dataclass(frozen=True)
class HookPlan:
    """What a collection hooks, fixed before any model runs.

    ``modules``: every bound Linear / Conv1D module, hooked in both models (residual readers of
    every residual space are needed to learn the groups, kept or not). ``plain``: module -> its
    chosen non-residual sites. ``residual``: module -> its residual input site. ``wanted``: the
    spaces whose residual keys are kept. ``final``: module -> the output site of a kept residual
    space's final state (``graph.last_hidden``: the stream as the encoder leaves it, at every
    position), hooked for the ``last`` and ``all`` modes. ``experts``: the wanted expert spaces'
    sites (their router and experts modules get hooks of their own).
    """

    modules: tuple[str, ...]
    plain: Mapping[str, tuple[Site, ...]]
    residual: Mapping[str, Site]
    wanted: frozenset[str]
    final: Mapping[str, Site] = field(default_factory=dict)
    experts: tuple[ExpertSite, ...] = ()
    graph: SymmetryGraph | None = field(default=None, compare=False, repr=False)  # reads the expert views

    @classmethod
    def of(cls, graph: SymmetryGraph, model: torch.nn.Module, spaces: Collection[str] | None) -> HookPlan:
        wanted = wanted_spaces(graph, spaces)
        sites = candidate_sites(graph, model, set(graph.spaces))
        chosen = set(activation_sites(graph, model, spaces))
        plain: dict[str, list[Site]] = {}
        for s in sites:
            if s in chosen and not is_residual(graph, split_ref(s.key)[0]):
                plain.setdefault(s.module, []).append(s)
        residual = {s.module: s for s in sites if s.where == "input" and is_residual(graph, split_ref(s.key)[0])}
        modules = tuple(bound_linears(graph, model))
        final = {
            module: Site(space, module, "output", 0, graph.ref_size(space))
            for space, module in graph.last_hidden.items()
            if space in wanted and is_residual(graph, space) and module not in modules and _has(model, module)
        }
        return cls(
            modules=modules,
            plain={m: tuple(v) for m, v in plain.items()},
            residual=residual,
            wanted=frozenset(wanted),
            final=final,
            experts=tuple(expert_sites(graph, model, [n for n in graph.spaces if n in wanted])),
            graph=graph,
        )


def _has(model: torch.nn.Module, module: str) -> bool:
    try:
        model.get_submodule(module)
    except AttributeError:
        return False
    return True
