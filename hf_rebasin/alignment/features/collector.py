"""The collector: hooks on models A and B that pair their features batch by batch.

A :class:`Collector` is a small state machine over one collection (see :class:`Phase`): per batch A
runs first and its hooks queue A's (masked, float32) features per key; B's hooks then pair each with
B's features into float64 :class:`~.moments.CrossMoments` and free A's copy. Nothing holds n×d
activations beyond one batch of A's. Mixture-of-experts layers have no linear module per expert:
their sites (:class:`~.sites.ExpertSite`) hook the router (its probabilities) and the experts module
(its inputs, from which every expert's units are computed, `expert_units`), into router-weighted
:class:`~.moments.ExpertMoments`. The first forward of A also shows the structure that only a
run reveals: the hooked modules' firing order and the residual readers' groups (one per input
tensor). Hooks come off and the models' train/eval modes come back when the collector's ``with``
block ends, error or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import torch
from torch import Tensor

from hf_rebasin.alignment.features.batches import Batch
from hf_rebasin.alignment.features.moments import ActivationStats, CrossMoments, ExpertMoments, ExpertPairing, Pairing
from hf_rebasin.alignment.features.sites import ExpertSite, HookPlan, ResidualMode, Site
from hf_rebasin.core.errors import IncompatibleModelsError
from hf_rebasin.symmetry.graph import SymmetryGraph

Side = Literal["a", "b", "ab"]


def _tensor(out: Any) -> Tensor:
    """A module's output tensor (an encoder returns a ModelOutput or tuple: its first item)."""
    return out if isinstance(out, Tensor) else out[0]


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


# one run of a hooked module within a forward: a layer whose weights are shared across depth (ALBERT's)
# runs once per step, and each run reads its own stream
Firing = tuple[str, int]


@dataclass
class _Group:
    """Residual readers of one input tensor (q/k/v of a layer), in firing order."""

    space: str
    firings: list[Firing]


@dataclass
class _Structure:
    """What the first forward of A shows: the hooked modules in first-firing order, every firing
    in order, the residual readers' groups (one per input tensor, over every residual space), and
    the key of each kept group, by the group's first firing."""

    order: list[str] = field(default_factory=list)
    firings: list[Firing] = field(default_factory=list)
    groups: list[_Group] = field(default_factory=list)
    keys: dict[Firing, str] = field(default_factory=dict)


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
        self._batch: Batch | None = None
        self._pairs: dict[str, Pairing] = {
            s.key: Pairing(s.key, s.size) for sites in plan.plain.values() for s in sites
        }
        for e in plan.experts:
            self._pairs[f"{e.space}:experts"] = Pairing(f"{e.space}:experts", e.num_experts)
        self._experts: dict[str, ExpertPairing] = {f"{e.space}:units": ExpertPairing(e) for e in plan.experts}
        self._structure = _Structure()
        self._discovery: _Discovery | None = _Discovery()  # None once the structure is known
        self._final: Mapping[str, Site] = plan.final if residual in ("last", "all") else {}
        # an encoder-decoder: its encoder's output, whose readers (cross-attention's keys and values) sit
        # in the decoder but read the sources' positions
        self._stacks = plan.graph.stacks if plan.graph is not None and len(plan.graph.stacks) > 1 else ()
        self._sources: list[Tensor] = []
        self._runs: dict[str, int] = {}  # each module's runs so far in the current forward

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
        if self._stacks:
            for model in (self.model_a,) if self.same else (self.model_a, self.model_b):
                encoder = model.get_submodule(self._stacks[0])
                self._handles.append(
                    encoder.register_forward_hook(lambda _m, _a, out: self._sources.append(_tensor(out)))
                )
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
        self._batch = Batch.of(batch, self.special)
        self._sources.clear()
        self._runs.clear()

    def to_b(self) -> None:
        """A's forward is done (its structure is known from now on); the caller then runs model B."""
        self._move(Phase.FORWARD_B)
        self._runs.clear()
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
        self._sources.clear()
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
        run = self._runs.get(module, 0)
        self._runs[module] = run + 1
        if phase is not Phase.FORWARD_B:
            self._on_a((module, run), x, out)
        if phase is not Phase.PROBE and phase is not Phase.FORWARD_A:
            self._on_b((module, run), x, out)

    def _stream(self, module: str, x: Tensor, out: Any) -> tuple[Tensor, int]:
        """A residual key's features at ``module``: a reader's input, or a final state's output."""
        final = self._final.get(module)
        if final is not None:
            return _tensor(out), final.size
        return x, self.plan.residual[module].size

    def _positions(self, module: str, x: Tensor) -> Batch:
        """The batch's positions that ``module`` reads: the sources' in an encoder and wherever the
        encoder's output is read, the targets' elsewhere in an encoder-decoder."""
        batch = self._batch
        assert batch is not None
        encoder = self._stacks[0] if self._stacks else ""
        if not encoder or module == encoder or module.startswith(f"{encoder}.") or any(x is t for t in self._sources):
            return batch
        return batch.at("target")

    def _on_a(self, firing: Firing, x: Tensor, out: Any) -> None:
        module = firing[0]
        batch = self._positions(module, x)
        batch.count(x)
        keep = self._phase is not Phase.PROBE
        if self._discovery is not None:
            self._discover(self._discovery, batch, firing, x, keep)
            if keep and module in self._final:
                t, size = self._stream(module, x, out)
                self._discovery.final[module] = batch.features(t, 0, size, True)
        elif keep and firing in self._structure.keys:
            t, size = self._stream(module, x, out)
            self._pairs[self._structure.keys[firing]].waiting.append(batch.features(t, 0, size, True))
        if keep:
            for site in self.plan.plain.get(module, ()):
                t = site.read(x, out)
                self._pairs[site.key].waiting.append(batch.features(t, site.offset, site.size, True, site.groups))

    def _discover(self, d: _Discovery, batch: Batch, firing: Firing, x: Tensor, keep: bool) -> None:
        """First forward of A: firing order and residual groups (by identity of the input)."""
        st, module = self._structure, firing[0]
        if module not in st.order:
            st.order.append(module)
        st.firings.append(firing)
        site = self.plan.residual.get(module)
        if site is None:
            return
        for t, gi in d.seen:
            if t is x:
                st.groups[gi].firings.append(firing)
                return
        gi = len(st.groups)
        d.seen.append((x, gi))
        st.groups.append(_Group(site.key, [firing]))
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
            fired = {site.key: m for m, site in self._final.items() if (m, 0) in st.firings}
            for space in dict.fromkeys(g.space for g in st.groups):
                if space not in self.plan.wanted:
                    continue
                idx = [i for i, g in enumerate(st.groups) if g.space == space]
                final = fired.get(space)
                if final is not None:
                    end = st.firings.index((final, 0))
                    idx = [i for i in idx if st.firings.index(st.groups[i].firings[0]) < end]
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
        queued = [(st.groups[gi].firings[0], key, d.first.get(gi)) for gi, key in sorted(keys.items())]
        queued += [((module, 0), key, d.final.get(module)) for module, key in finals.items()]
        for firing, key, features in queued:
            st.keys[firing] = key
            module = firing[0]
            size = self._final[module].size if module in finals else self.plan.residual[module].size
            pairing = self._pairs.setdefault(key, Pairing(key, size))
            if features is not None:
                pairing.waiting.append(features)
        self._discovery = None

    def _on_b(self, firing: Firing, x: Tensor, out: Any) -> None:
        module = firing[0]
        batch = self._positions(module, x)
        todo = [(s.key, s.read(x, out), s.offset, s.size, s.groups) for s in self.plan.plain.get(module, ())]
        if firing in self._structure.keys:
            t, size = self._stream(module, x, out)
            todo.append((self._structure.keys[firing], t, 0, size, 1))
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
            residual_groups=[[module for module, _ in g.firings] for g in st.groups],
            module_order=list(st.order),
            tokens=self._tokens,
            residual_spaces=[g.space for g in st.groups],
        )
