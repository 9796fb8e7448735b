"""Activation statistics: models A and B see the same batches, forward hooks read each site's features.

A :class:`Collector` is a small state machine over one collection (see :class:`Phase`): per batch A
runs first and its hooks queue A's (masked, float32) features per key; B's hooks then pair each with
B's features into float64 :class:`~.moments.CrossMoments` and free A's copy. Nothing holds n×d
activations beyond one batch of A's. Mixture-of-experts layers have no linear module per expert:
their sites (:class:`~.sites.ExpertSite`) hook the router (its probabilities) and the experts module
(its inputs, from which every expert's units are computed), into router-weighted
:class:`~.moments.ExpertMoments`. The first forward of A also shows the structure that only a
run reveals: the hooked modules' firing order and the residual readers' groups (one per input
tensor). Hooks come off and the models' train/eval modes come back when the collector's ``with``
block ends, error or not.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import torch
from torch import Tensor

from ..errors import IncompatibleModelsError
from ..symmetry import SymmetryGraph, split_ref
from .moments import CrossMoments, ExpertMoments, all_reduce_sum, distributed
from .sites import (
    ExpertSite,
    Site,
    activation_sites,
    bound_linears,
    candidate_sites,
    expert_sites,
    is_residual,
    wanted_spaces,
)

ResidualMode = Literal["none", "first", "last", "all", "separate"]
RESIDUAL_MODES: tuple[ResidualMode, ...] = ("none", "first", "last", "all", "separate")
Side = Literal["a", "b", "ab"]


@dataclass
class ActivationStats:
    """Cross moments of A's and B's features per site key, and the structure seen in the forward.

    ``moments``: per key, :class:`~.moments.CrossMoments`; an expert space's ``"<space>:units"``
    key holds :class:`~.moments.ExpertMoments` (``"<space>:experts"``: the routing probabilities'
    plain moments). ``residual_groups``: residual readers in forward order, one group per input tensor (q/k/v of
    a layer read one tensor), over every residual space; ``residual_spaces[g]`` names the space of
    group g (CLIP has two), and ``"<space>@j"`` keys count that space's groups only.
    ``module_order``: every hooked module in firing order. ``tokens``: tokens counted after
    masking, over all processes. ``seconds``: wall time of the collection.
    """

    moments: dict[str, CrossMoments | ExpertMoments]
    residual_groups: list[list[str]]
    module_order: list[str]
    tokens: int
    seconds: float = 0.0
    residual_spaces: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# The collector's parts: what to hook, one batch, one key's accumulator, the structure
# --------------------------------------------------------------------------------------------


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


def _tensor(out: Any) -> Tensor:
    """A module's output tensor (an encoder returns a ModelOutput or tuple: its first item)."""
    return out if isinstance(out, Tensor) else out[0]


def kept_positions(batch: Mapping[str, Any], special: Tensor | None) -> Tensor | None:
    """The ``[batch, seq]`` positions whose features count: not padding (``attention_mask``) and,
    with ``special`` ids, not a special token; None when nothing is dropped (images)."""
    mask = batch.get("attention_mask")
    mask = mask.bool() if isinstance(mask, Tensor) else None
    ids = batch.get("input_ids")
    if special is not None and isinstance(ids, Tensor):
        plain = ~torch.isin(ids, special.to(ids.device))
        mask = plain if mask is None else mask & plain
    return mask


@dataclass
class _Batch:
    """One batch's mask of kept positions and its token count.

    ``tokens`` is None until known: text batches count kept tokens up front, image batches the rows
    of the first hooked activation. ``mask_on`` caches the mask per device (models may sit on
    different devices, or be split over several).
    """

    mask: Tensor | None
    tokens: int | None
    mask_on: dict[torch.device, Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: Mapping[str, Any], special: Tensor | None) -> _Batch:
        mask = kept_positions(batch, special)
        if mask is not None:
            return cls(mask, int(mask.sum()))
        ids = batch.get("input_ids")
        return cls(None, ids.numel() if isinstance(ids, Tensor) else None)

    def count(self, x: Tensor) -> None:
        """Count the batch from the first hooked activation when it has no token ids."""
        if self.tokens is None:
            self.tokens = x.numel() // x.shape[-1]

    def features(self, t: Tensor, offset: int, size: int, copy: bool, groups: int = 1) -> Tensor:
        """Masked features ``[n_tok, size]`` of the last axis of ``t``; a fresh float32 copy when
        asked (A's features must outlive the forward and survive in-place ops). With ``groups``,
        the axis is that many blocks, each giving ``size / groups`` features from ``offset``."""
        if groups > 1:
            t = t.unflatten(-1, (groups, -1))[..., offset : offset + size // groups].flatten(-2)
        elif offset != 0 or size != t.shape[-1]:
            t = t[..., offset : offset + size]
        mask = self.mask
        if mask is not None and tuple(t.shape[:-1]) == tuple(mask.shape):
            return t[self._mask(t.device)].to(torch.float32)
        flat = t.reshape(-1, size)
        rows = self.rows(flat)
        if rows is not None:  # [batch·seq, d]: a MoE block flattens the stream before its router
            return flat[rows].to(torch.float32)
        return flat.to(torch.float32, copy=True) if copy else flat

    def _mask(self, device: torch.device) -> Tensor:
        assert self.mask is not None
        if device not in self.mask_on:
            self.mask_on[device] = self.mask.to(device)
        return self.mask_on[device]

    def rows(self, t: Tensor) -> Tensor | None:
        """The kept rows of a flattened ``[batch·seq, …]`` tensor; None when nothing is masked or
        the rows are not the batch's positions."""
        if self.mask is None or t.dim() < 1 or t.shape[0] != self.mask.numel() or self.mask.dim() < 2:
            return None
        return self._mask(t.device).reshape(-1)


@dataclass
class _Pairing:
    """One key's accumulator: A's features waiting for B's, and the moments of the pairs so far.

    The moments live on the device of A's features, created at the first pair.
    """

    key: str
    size: int
    waiting: deque[Tensor] = field(default_factory=deque)
    moments: CrossMoments | None = None

    def take(self, module: str) -> Tensor:
        """A's oldest waiting features; B running a site more often than A is a model mismatch."""
        if not self.waiting:
            raise IncompatibleModelsError(
                f"model B ran {module!r} ({self.key}) more often than model A: the two models must share "
                "one architecture and configuration"
            )
        return self.waiting.popleft()

    def add(self, a: Tensor, b: Tensor) -> None:
        if self.moments is None:
            self.moments = CrossMoments.zeros(self.size, self.size, device=a.device)
        self.moments.update(a, b)

    def result(self) -> CrossMoments:
        """The moments; zeros (on the default device) for a key that never saw a token."""
        return self.moments if self.moments is not None else CrossMoments.zeros(self.size, self.size)


@dataclass
class _ExpertPairing:
    """One MoE layer's unit accumulator: A's (units, routing weights) waiting for B's."""

    site: ExpertSite
    waiting: deque[tuple[Tensor, Tensor]] = field(default_factory=deque)
    moments: ExpertMoments | None = None

    def take(self) -> tuple[Tensor, Tensor]:
        if not self.waiting:
            raise IncompatibleModelsError(
                f"model B ran {self.site.experts!r} more often than model A: the two models must share "
                "one architecture and configuration"
            )
        return self.waiting.popleft()

    def add(self, a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> None:
        if self.moments is None:
            self.moments = ExpertMoments.zeros(self.site.num_experts, self.site.units, device=a[0].device)
        self.moments.update(a[0], a[1], b[0], b[1])

    def result(self) -> ExpertMoments:
        if self.moments is not None:
            return self.moments
        return ExpertMoments.zeros(self.site.num_experts, self.site.units)


_EXPERT_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def expert_units(
    graph: SymmetryGraph, site: ExpertSite, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Tensor, Tensor]:
    """From the experts module's inputs: every expert's units ``act(gate_e x) * (up_e x)`` for
    every token ``[n, E·f]`` (expert e's unit u at ``e·f + u``, float32), and the dense routing
    weights ``[n, E]`` (each token's top-k weights, zero elsewhere). All experts run on all
    tokens (E / k times the layer's own expert compute); the weights say which count."""
    given = dict(zip(_EXPERT_ARGS, args, strict=False))
    given.update({k: kwargs[k] for k in _EXPERT_ARGS if k in kwargs})
    x, index, weights = given["hidden_states"], given["top_k_index"], given["top_k_weights"]
    x = x.reshape(-1, x.shape[-1])
    stored = getattr(module, site.gate_up.rsplit(".", 1)[1])
    w = graph.logical(site.gate_up, stored).to(x.dtype)  # [gate units | up units, d]
    n = site.num_experts * site.units
    act: Any = getattr(module, "act_fn", torch.nn.functional.silu)
    units = (act(x @ w[:n].T) * (x @ w[n:].T)).to(torch.float32)
    routing = torch.zeros(x.shape[0], site.num_experts, dtype=torch.float32, device=x.device)
    routing.scatter_(1, index.reshape(x.shape[0], -1).long(), weights.reshape(x.shape[0], -1).to(torch.float32))
    return units, routing


def router_probabilities(site: ExpertSite, out: Any) -> Tensor:
    """The routing probabilities ``[n, E]`` (float32) from the router module's logits."""
    logits = _tensor(out).reshape(-1, site.num_experts).to(torch.float32)
    return torch.softmax(logits, dim=-1) if site.softmax else torch.sigmoid(logits)


@dataclass
class _Group:
    """Residual readers of one input tensor (q/k/v of a layer), in firing order."""

    space: str
    modules: list[str]


@dataclass
class _Structure:
    """What the first forward of A shows: the hooked modules in firing order, the residual readers'
    groups (one per input tensor, over every residual space), and the key of each kept group, by
    the group's first module."""

    order: list[str] = field(default_factory=list)
    groups: list[_Group] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)


@dataclass
class _Discovery:
    """The first forward of A only: residual inputs seen so far (strong refs: ids get reused) and
    A's features of each new group, kept until the groups are named."""

    seen: list[tuple[Tensor, int]] = field(default_factory=list)
    first: dict[int, Tensor] = field(default_factory=dict)
    final: dict[str, Tensor] = field(default_factory=dict)  # final-state module -> A's features


# --------------------------------------------------------------------------------------------
# The state machine
# --------------------------------------------------------------------------------------------


class CollectorStateError(RuntimeError):
    """A collector was driven out of order (a bug in the caller, not in the models or data)."""


class Phase(Enum):
    """Where a collection stands; every call and every hook checks it."""

    IDLE = "idle"  # built; no hooks yet
    READY = "ready"  # hooks on, between batches
    PROBE = "probe"  # model A runs only to learn firing order and residual groups; nothing is kept
    FORWARD_A = "forward A"  # model A runs; its hooks queue A's features
    FORWARD_B = "forward B"  # model B runs; its hooks pair them with B's
    FORWARD_AB = "forward A=B"  # one model compared with itself: each hook queues and pairs at once
    CLOSED = "closed"  # hooks off between batches; the results may be read
    ABORTED = "aborted"  # hooks off in the middle of a batch (an error): nothing may be read


_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.READY}),
    Phase.READY: frozenset({Phase.PROBE, Phase.FORWARD_A, Phase.FORWARD_AB}),
    Phase.PROBE: frozenset({Phase.READY}),
    Phase.FORWARD_A: frozenset({Phase.FORWARD_B}),
    Phase.FORWARD_B: frozenset({Phase.READY}),
    Phase.FORWARD_AB: frozenset({Phase.READY}),
}
# the phases in which each kind of hook may fire (B's hooks never fire while A runs, and back)
_FIRES: dict[Side, frozenset[Phase]] = {
    "a": frozenset({Phase.PROBE, Phase.FORWARD_A}),
    "b": frozenset({Phase.FORWARD_B}),
    "ab": frozenset({Phase.PROBE, Phase.FORWARD_AB}),
}


class Collector:
    """Hooks on models A and B for one collection, driven batch by batch.

    IDLE → READY (``with``: hooks on, eval mode); per batch READY → FORWARD_A → FORWARD_B → READY
    (``begin``, ``to_b``, ``end_batch``), or READY → FORWARD_AB → READY when A is B (one forward
    serves both, after one PROBE that learns the keys); PROBE → READY also learns the structure of a
    process with no batch. Leaving the ``with`` block gives CLOSED (from READY) or ABORTED (from
    inside a batch). Any other move raises :class:`CollectorStateError`. The caller runs the models:
    the collector only watches them, so it does not care where or how they run.
    """

    def __init__(
        self,
        model_a: torch.nn.Module,
        model_b: torch.nn.Module,
        plan: HookPlan,
        residual: ResidualMode,
        special: Tensor | None,
    ) -> None:
        self.model_a, self.model_b, self.plan, self.residual, self.special = model_a, model_b, plan, residual, special
        self.same = model_a is model_b
        self._tokens = 0
        self._phase = Phase.IDLE
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._modes: tuple[bool, bool] | None = None
        self._batch: _Batch | None = None
        self._pairs: dict[str, _Pairing] = {
            s.key: _Pairing(s.key, s.size) for sites in plan.plain.values() for s in sites
        }
        for e in plan.experts:
            self._pairs[f"{e.space}:experts"] = _Pairing(f"{e.space}:experts", e.num_experts)
        self._experts: dict[str, _ExpertPairing] = {f"{e.space}:units": _ExpertPairing(e) for e in plan.experts}
        self._structure = _Structure()
        self._discovery: _Discovery | None = _Discovery()  # None once the structure is known
        self._final: Mapping[str, Site] = plan.final if residual in ("last", "all") else {}

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def tokens(self) -> int:
        """Tokens of the batches paired so far (after masking)."""
        return self._tokens

    @property
    def sealed(self) -> bool:
        """Whether the structure (firing order, residual groups and keys) is known."""
        return self._discovery is None

    def _move(self, to: Phase) -> None:
        if to not in _NEXT.get(self._phase, frozenset()):
            raise CollectorStateError(f"a collector cannot go from {self._phase.value!r} to {to.value!r}")
        self._phase = to

    # ---- context: hooks on, and always off again ---------------------------------------------

    def __enter__(self) -> Collector:
        if self._phase is not Phase.IDLE:  # checked before the cleanup below: never close a live one
            raise CollectorStateError(f"a collector is opened once; this one is {self._phase.value!r}")
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        self._modes = (self.model_a.training, self.model_b.training)
        self.model_a.eval()
        self.model_b.eval()
        for module in (*self.plan.modules, *self._final):
            if self.same:
                self._register(self.model_a, module, "ab")
                continue
            self._register(self.model_a, module, "a")
            self._register(self.model_b, module, "b")
        for site in self.plan.experts:
            for model, side in ((self.model_a, "ab"),) if self.same else ((self.model_a, "a"), (self.model_b, "b")):
                self._register_experts(model, site, side)  # type: ignore[arg-type]
        self._move(Phase.READY)

    def _register(self, model: torch.nn.Module, module: str, side: Side) -> None:
        def hook(_mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            x = args[0] if args else next(iter(kwargs.values()))
            self._fire(module, side, x, out)

        self._handles.append(model.get_submodule(module).register_forward_hook(hook, with_kwargs=True))

    def _register_experts(self, model: torch.nn.Module, site: ExpertSite, side: Side) -> None:
        """A hook on the router (its probabilities) and a pre-hook on the experts module (its
        inputs: run before the experts, so that the weights are there even when they are loaded
        per module for the forward and dropped after it)."""
        graph = self.plan.graph
        assert graph is not None

        def router(_mod: torch.nn.Module, _args: tuple[Any, ...], out: Any) -> None:
            if self._expert_phase(site.router, side):
                self._on_expert(f"{site.space}:experts", site.router, router_probabilities(site, out), None)

        def experts(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._expert_phase(site.experts, side):
                units, routing = expert_units(graph, site, mod, args, kwargs)
                self._on_expert(f"{site.space}:units", site.experts, units, routing)

        self._handles.append(model.get_submodule(site.router).register_forward_hook(router))
        self._handles.append(model.get_submodule(site.experts).register_forward_pre_hook(experts, with_kwargs=True))

    def _expert_phase(self, module: str, side: Side) -> bool:
        """Whether an expert hook keeps anything now (not while probing); refuses a hook out of turn."""
        if self._phase not in _FIRES[side]:
            raise CollectorStateError(f"{module!r} ran while the collector was {self._phase.value!r}")
        return self._phase is not Phase.PROBE

    def _on_expert(self, key: str, module: str, t: Tensor, routing: Tensor | None) -> None:
        """Queue A's features of an expert key, or pair B's with them (both at once for A = B)."""
        batch = self._batch
        assert batch is not None
        rows = batch.rows(t)
        if rows is not None:
            t = t[rows]
            routing = routing[rows] if routing is not None else None
        phase = self._phase
        if routing is None:
            pairing = self._pairs[key]
            if phase is not Phase.FORWARD_B:
                pairing.waiting.append(t.clone())
            if phase is not Phase.FORWARD_A:
                pairing.add(pairing.take(module), t)
            return
        experts = self._experts[key]
        if phase is not Phase.FORWARD_B:
            experts.waiting.append((t, routing))
        if phase is not Phase.FORWARD_A:
            experts.add(experts.take(), (t, routing))

    def close(self) -> None:
        """Remove every hook, drop queued features, restore the train/eval modes (idempotent)."""
        if self._phase in (Phase.CLOSED, Phase.ABORTED):
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self._pairs.values():
            p.waiting.clear()
        for e in self._experts.values():
            e.waiting.clear()
        self._discovery = None
        self._batch = None
        if self._modes is not None:
            self.model_a.train(self._modes[0])
            self.model_b.train(self._modes[1])
        self._phase = Phase.CLOSED if self._phase in (Phase.IDLE, Phase.READY) else Phase.ABORTED

    # ---- per batch ---------------------------------------------------------------------------

    def begin(self, batch: Mapping[str, Any], phase: Literal[Phase.PROBE, Phase.FORWARD_A, Phase.FORWARD_AB]) -> None:
        """Start a batch; the caller then runs model A (the one model, for FORWARD_AB) on it."""
        if phase is Phase.PROBE and self.sealed:
            raise CollectorStateError("a probe learns the structure, which this collector knows already")
        if phase is Phase.FORWARD_A and self.same:
            raise CollectorStateError("model A is model B: run each batch once, as FORWARD_AB")
        if phase is Phase.FORWARD_AB and not (self.same and self.sealed):
            raise CollectorStateError("FORWARD_AB needs one model compared with itself, after a probe")
        self._move(phase)
        self._batch = _Batch.of(batch, self.special)

    def to_b(self) -> None:
        """A's forward is done (its structure is known from now on); the caller then runs model B."""
        self._move(Phase.FORWARD_B)
        if not self.sealed:
            self._seal()

    def end_batch(self) -> None:
        """Close the batch: after a probe the structure is known; after a pair of forwards every
        feature of A found its B and the batch's tokens are counted."""
        phase, batch = self._phase, self._batch
        if phase in (Phase.FORWARD_B, Phase.FORWARD_AB):  # a mismatch leaves the batch open: ABORTED
            left = sorted(p.key for p in self._pairs.values() if p.waiting)
            left += sorted(k for k, e in self._experts.items() if e.waiting)
            if left:
                raise IncompatibleModelsError(
                    f"model A produced features for {left} that model B never did: the two models must share "
                    "one architecture and configuration"
                )
        self._move(Phase.READY)
        self._batch = None
        if phase is Phase.PROBE:
            self._seal()
            return
        assert batch is not None
        self._tokens += batch.tokens or 0

    # ---- hooks -------------------------------------------------------------------------------

    def _fire(self, module: str, side: Side, x: Tensor, out: Any) -> None:
        phase = self._phase
        if phase not in _FIRES[side]:
            model = {"a": "A", "b": "B", "ab": "A (= B)"}[side]
            raise CollectorStateError(f"model {model} ran {module!r} while the collector was {phase.value!r}")
        if phase is not Phase.FORWARD_B:
            self._on_a(module, x, out)
        if phase is not Phase.PROBE and phase is not Phase.FORWARD_A:
            self._on_b(module, x, out)

    def _stream(self, module: str, x: Tensor, out: Any) -> tuple[Tensor, int]:
        """A residual key's features at ``module``: a reader's input, or a final state's output."""
        final = self._final.get(module)
        if final is not None:
            return _tensor(out), final.size
        return x, self.plan.residual[module].size

    def _on_a(self, module: str, x: Tensor, out: Any) -> None:
        batch = self._batch
        assert batch is not None
        batch.count(x)
        keep = self._phase is not Phase.PROBE
        if self._discovery is not None:
            self._discover(self._discovery, batch, module, x, keep)
            if keep and module in self._final:
                t, size = self._stream(module, x, out)
                self._discovery.final[module] = batch.features(t, 0, size, True)
        elif keep and module in self._structure.keys:
            t, size = self._stream(module, x, out)
            self._pairs[self._structure.keys[module]].waiting.append(batch.features(t, 0, size, True))
        if keep:
            for site in self.plan.plain.get(module, ()):
                t = x if site.where == "input" else out
                self._pairs[site.key].waiting.append(batch.features(t, site.offset, site.size, True, site.groups))

    def _discover(self, d: _Discovery, batch: _Batch, module: str, x: Tensor, keep: bool) -> None:
        """First forward of A: firing order and residual groups (by identity of the input)."""
        st = self._structure
        if module not in st.order:
            st.order.append(module)
        site = self.plan.residual.get(module)
        if site is None:
            return
        for t, gi in d.seen:
            if t is x:
                st.groups[gi].modules.append(module)
                return
        gi = len(st.groups)
        d.seen.append((x, gi))
        st.groups.append(_Group(site.key, [module]))
        if keep and self.residual != "none" and site.key in self.plan.wanted:
            d.first[gi] = batch.features(x, 0, site.size, True)

    def _seal(self) -> None:
        """After the first forward of A: name the kept residual sites and queue their features.

        A space's sites are its reader groups; with a final state (``plan.final``) that fired,
        ``last`` is that state and ``all`` the groups read before it plus that state (the stream
        inside the encoder, not what heads after it read)."""
        d, st = self._discovery, self._structure
        assert d is not None
        keys: dict[int, str] = {}
        finals: dict[str, str] = {}
        if self.residual != "none":
            fired = {site.key: m for m, site in self._final.items() if m in st.order}
            for space in dict.fromkeys(g.space for g in st.groups):
                if space not in self.plan.wanted:
                    continue
                idx = [i for i, g in enumerate(st.groups) if g.space == space]
                final = fired.get(space)
                if final is not None:
                    end = st.order.index(final)
                    idx = [i for i in idx if st.order.index(st.groups[i].modules[0]) < end]
                if self.residual == "first" and idx:
                    keys[idx[0]] = space
                elif self.residual == "last":
                    if final is not None:
                        finals[final] = space
                    else:
                        keys[idx[-1]] = space
                elif self.residual == "all":
                    keys.update({i: f"{space}@{j}" for j, i in enumerate(idx)})
                    if final is not None:
                        finals[final] = f"{space}@{len(idx)}"
                elif self.residual == "separate":
                    keys.update({i: f"{space}@{j}" for j, i in enumerate(idx)})
        queued = [(st.groups[gi].modules[0], key, d.first.get(gi)) for gi, key in sorted(keys.items())]
        queued += [(module, key, d.final.get(module)) for module, key in finals.items()]
        for module, key, features in queued:
            st.keys[module] = key
            size = self._final[module].size if module in finals else self.plan.residual[module].size
            pairing = self._pairs.setdefault(key, _Pairing(key, size))
            if features is not None:
                pairing.waiting.append(features)
        self._discovery = None

    def _on_b(self, module: str, x: Tensor, out: Any) -> None:
        batch = self._batch
        assert batch is not None
        todo = [
            (s.key, x if s.where == "input" else out, s.offset, s.size, s.groups)
            for s in self.plan.plain.get(module, ())
        ]
        if module in self._structure.keys:
            t, size = self._stream(module, x, out)
            todo.append((self._structure.keys[module], t, 0, size, 1))
        for key, t, offset, size, groups in todo:
            pairing = self._pairs[key]
            a = pairing.take(module)
            pairing.add(a, batch.features(t, offset, size, False, groups))

    # ---- results -----------------------------------------------------------------------------

    def result(self) -> ActivationStats:
        """This process's statistics (``seconds`` left 0); only after a clean close."""
        if self._phase is not Phase.CLOSED:
            raise CollectorStateError(f"results are read after a clean close; the collector is {self._phase.value!r}")
        st = self._structure
        moments: dict[str, CrossMoments | ExpertMoments] = {key: p.result() for key, p in self._pairs.items()}
        moments.update({key: e.result() for key, e in self._experts.items()})
        return ActivationStats(
            moments=moments,
            residual_groups=[list(g.modules) for g in st.groups],
            module_order=list(st.order),
            tokens=self._tokens,
            residual_spaces=[g.space for g in st.groups],
        )


# --------------------------------------------------------------------------------------------
# Driving a collection
# --------------------------------------------------------------------------------------------


def _within_sites(moments: dict[str, CrossMoments | ExpertMoments]) -> None:
    """``residual: all``: each space's per-site keys (``res@0``, ``res@1``, …) become one key whose
    moments are centred at every site's own mean (the average of the sites' covariances, as Verma
    & Elbayad's code computes it) rather than pooled under one mean across sites."""
    sites: dict[str, list[str]] = {}
    for key in moments:
        space, at, index = key.rpartition("@")
        if at and index.isdigit():
            sites.setdefault(space, []).append(key)
    for space, keys in sites.items():
        parts = [moments.pop(k) for k in keys]
        moments[space] = CrossMoments.within([p for p in parts if isinstance(p, CrossMoments)])


def process_grid() -> tuple[int, int]:
    """(number of processes, this process's index) from accelerate's ``PartialState``.

    ``ACCELERATE_USE_CPU`` is honoured as ``Accelerator`` does (a bare ``PartialState()`` ignores
    it), so a CPU multi-process launch reduces over gloo instead of running P lone copies.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    return state.num_processes, state.process_index


def _device_of(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def _to(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


def _probe(col: Collector, batch: Mapping[str, Any], device: torch.device) -> None:
    """Run A once without keeping features, to learn firing order and residual groups."""
    col.begin(batch, Phase.PROBE)
    col.model_a(**_to(batch, device))
    col.end_batch()


def activation_stats(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    graph: SymmetryGraph,
    batches: Iterable[Mapping[str, Tensor]],
    *,
    spaces: Collection[str] | None = None,
    residual: ResidualMode = "all",
    special_ids: Collection[int] | None = None,
    progress: Callable[[int], None] | None = None,
    device: torch.device | None = None,
) -> ActivationStats:
    """Correlation statistics of A's and B's features on the same batches, for every site.

    Per batch A runs first and its hooks keep the (masked, float32) features of each site; B's
    hooks then add (A, B) pairs into float64 :class:`~.moments.CrossMoments` and free A's copy:
    extra memory is one batch of A's features plus O(d²) per key. Padded positions
    (``attention_mask == 0``) and, when ``special_ids`` is given, special tokens are dropped
    wherever an activation's leading dims are the batch's ``[batch, seq]``.

    ``residual`` picks the residual sites, under the space's name: ``first`` the first readers'
    input; ``last`` the stream as the encoder leaves it, at every position (the output of the
    adapter's ``last_hidden`` module: BERT's final encoder LayerNorm, GPT-2's ``ln_f``; else the
    last readers' input); ``all`` every site inside the encoder (the readers' inputs before the
    final state, and that state), each centred at its own mean (`CrossMoments.within`);
    ``separate`` one key per readers' group (``"res@0"``, …); ``none`` no residual key.

    Under ``accelerate launch`` process p takes batches p, p + P, p + 2P, … and the sums are
    reduced over processes, so every process returns the same statistics as one process would.
    ``device`` is where the batches go (default: where each model's parameters are; give it for
    models whose parameters are on the meta device, run by `offload.offloaded`).
    """
    if residual not in RESIDUAL_MODES:
        raise ValueError(f"residual must be one of {RESIDUAL_MODES}, got {residual!r}")
    start = time.perf_counter()
    nproc, rank = process_grid()
    plan = HookPlan.of(graph, model_a, spaces)
    special = torch.tensor(sorted(set(special_ids)), dtype=torch.long) if special_ids else None
    dev_a, dev_b = (device, device) if device is not None else (_device_of(model_a), _device_of(model_b))
    with Collector(model_a, model_b, plan, residual, special) as col, torch.no_grad():
        first: Mapping[str, Tensor] | None = None
        for i, batch in enumerate(batches):
            if i == 0:
                first = batch
            if i % nproc != rank:
                continue
            if col.same:
                if not col.sealed:
                    _probe(col, batch, dev_a)  # one hook does A and B: it must know the keys first
                col.begin(batch, Phase.FORWARD_AB)
                model_a(**_to(batch, dev_a))
            else:
                col.begin(batch, Phase.FORWARD_A)
                model_a(**_to(batch, dev_a))
                col.to_b()
                model_b(**_to(batch, dev_b))
            col.end_batch()
            if progress is not None:
                progress(col.tokens)
        if not col.sealed and first is not None:
            # fewer batches than processes: learn the structure so all processes hold the same keys
            _probe(col, first, dev_a)
    stats = col.result()
    if nproc > 1:
        if not distributed():
            raise RuntimeError(
                f"accelerate reports {nproc} processes but torch.distributed is not initialised: "
                "the statistics of the other processes' batches cannot be summed"
            )
        for m in stats.moments.values():
            m.all_reduce()
        stats.tokens = int(all_reduce_sum(torch.tensor(float(stats.tokens), dtype=torch.float64)).item())
    if residual == "all":
        _within_sites(stats.moments)
    stats.seconds = time.perf_counter() - start
    return stats
