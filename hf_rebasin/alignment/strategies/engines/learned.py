"""Learned matching (Theus et al.; after Ainsworth et al.'s straight-through estimator and Peña et
al.'s Sinkhorn re-basin): refine a data-free solution on the loss of the interpolated model.

Each step samples λ (``uniform(a, b)`` or ``fixed(x)``) and a batch of alignment data, and lowers
the loss of ``λ·θ_A + (1−λ)·T(θ_B)`` over the maps T (`maps.LearnedMaps`: orthogonal maps as free
matrices, projected after each step or read through their polar factor; permutations as score
matrices read through their Hungarian solution, straight through). Head pairings also get a greedy
search over swaps on the loss at every score (see `maps.LearnedMaps.swap_heads` for why gradients
alone cannot). The learning rate decays on a cosine, after an optional linear warm-up.

With ``glu_scales`` the per-unit scaling of gated MLPs is learned too: B's unit i is scaled by
exp(tᵢ) on ``up`` (row and bias) and exp(−tᵢ) on ``down`` (column) before the maps, so the model
interpolated is ``λ·θ_A + (1−λ)·T(S(θ_B))`` with S(θ_B) computing exactly what θ_B computes. The t
start at 0 (B as the data-free start left it) and exp keeps every sign: signs come from the start
(``glu: balance`` gives B's units the signs of the A units they land on). The kept scales come back
as float64 `LearnedResult.unit_scales`, to be applied once to B (`glu.apply_unit_scales`).

Part of the alignment data is held out. Every ``eval_every`` steps the hard maps are scored there
(the midpoint barrier); the best maps are kept, and training stops after ``patience`` scores without
a better one (better by more than float noise: `GAIN_TOLERANCE`). The data-free start is such a
score too, so the result is never worse than it on the held-out batches. The scores form the curve the run draws (barrier against steps).

Mixture-of-experts layers are not learned: a relaxed two-level permutation (experts with their
router rows, units inside each expert) is left for later. Each expert space keeps the map it starts
from (the data-free two-level assignment, with its router shift) while every other space is
learned around it, and the run says so in its notes.
"""

from __future__ import annotations

import dataclasses
import math
import random
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from hf_rebasin.alignment.strategies.base import Pair, Progress
from hf_rebasin.alignment.strategies.engines.maps import LearnedMaps, LearnedSettings
from hf_rebasin.core.errors import MissingDataError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.transforms import SpaceMap, Transform


@dataclass
class LearnedResult:
    """The refined transform, report notes and the curve of held-out barrier against steps.

    ``unit_scales``: with ``glu_scales``, the learned scale of each of B's gated units (float64, by
    unit space, B's unit order, all positive), to apply to B before ``transform``; empty when none
    were learned or the data-free start was kept."""

    transform: Transform
    notes: list[str]
    history: dict[str, Any] = field(default_factory=dict)
    unit_scales: dict[str, Tensor] = field(default_factory=dict)


_ALIASES: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def _aliases(model: Any) -> frozenset[str]:
    """Names of parameters that are another name's tensor (BERT's ``cls.predictions.decoder.bias``
    is ``cls.predictions.bias``): `functional_call` refuses two values for one tied tensor, and
    fills an alias from its source when given only the source."""
    known = _ALIASES.get(model)
    if known is None:
        seen: set[int] = set()
        aliases = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                aliases.add(name)
            seen.add(id(p))
        known = _ALIASES[model] = frozenset(aliases)
    return known


def _loss(model: Any, params: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
    aliases = _aliases(model)
    given = {k: v for k, v in params.items() if k not in aliases}
    out = functional_call(model, given, args=(), kwargs=dict(batch), strict=False)
    loss = getattr(out, "loss", None)
    if loss is None:
        raise MissingDataError(
            "learned matching needs batches with `labels` (the model computes its own loss from them); "
            f"got keys {sorted(batch)}"
        )
    return loss  # type: ignore[no-any-return]


def batch_size(batch: Mapping[str, Tensor]) -> tuple[int, str]:
    """What one batch counts towards a budget: its real tokens (text) or its examples (images)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum()), "tokens"
    if "input_ids" in batch:
        return int(batch["input_ids"].numel()), "tokens"
    first = next(iter(batch.values()))
    return int(first.shape[0]), "examples"


def split(batches: Sequence[Mapping[str, Tensor]], holdout: float) -> tuple[list[Any], list[Any], bool]:
    """(training batches, held-out batches, whether they differ): the last ``holdout`` share,
    at least one batch, is held out when there are two or more."""
    items = list(batches)
    if len(items) < 2:
        return items, items, False
    k = min(len(items) - 1, max(1, round(len(items) * holdout)))
    return items[:-k], items[-k:], True


GAIN_TOLERANCE = 1e-4  # a held-out score must beat the best by this share of the parents' mean loss


def _lr_factor(step: int, steps: int, warmup: float = 0.0) -> float:
    """Cosine decay from 1 to 0.1 over the run, after a linear rise over its first ``warmup`` share."""
    rise = math.floor(warmup * steps)
    if step < rise:
        return (step + 1) / (rise + 1)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - rise) / max(1, steps - rise))))


def _mix(
    graph: SymmetryGraph,
    bases: Sequence[Mapping[str, Tensor]],
    transforms: Sequence[Mapping[str, SpaceMap] | None],
    weights: Sequence[float],
) -> dict[str, Tensor]:
    """``Σ wᵢ·Tᵢ(θᵢ)`` (a model without a transform as it is): differentiable in the maps."""
    mapped = [b if t is None else graph.apply(b, t, check=False) for b, t in zip(bases, transforms, strict=True)]
    out: dict[str, Tensor] = {}
    for name, first in mapped[0].items():
        if not first.is_floating_point():
            out[name] = first
            continue
        out[name] = sum((w * m[name] for w, m in zip(weights, mapped, strict=True)), torch.zeros_like(first))
    for alias, source in graph.ties.items():  # a tie the form keeps (nothing folded) stays one tensor
        if alias in out and source in out:
            out[alias] = out[source]
    return out


@dataclass
class _Run:
    """One optimisation: the models (``maps[i]`` None for a model that stays as it is), how each
    step weighs them, and the fixed weightings whose held-out barrier decides what is kept."""

    model: Any
    graph: SymmetryGraph
    bases: list[dict[str, Tensor]]
    maps: list[LearnedMaps | None]
    starts: list[Transform | None]
    sample: Callable[[random.Random], list[float]]
    scored: list[list[float]]
    what: str  # how the barrier is named in notes


def _floats(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().float() if v.is_floating_point() else v for k, v in sd.items()}


Logs = dict[str, Tensor] | None  # one model's gated-unit log-scales (None: as it is)


def _scaled(graph: SymmetryGraph, bases: Sequence[Mapping[str, Tensor]], logs: Sequence[Logs]) -> list[Any]:
    """Each base with its gated units scaled by exp(log-scales) (S(θ) before the maps T)."""
    return [b if t is None else glu.log_scaled(graph, b, t) for b, t in zip(bases, logs, strict=True)]


def _scale_note(logs: Mapping[str, Tensor]) -> str:
    """How far the kept unit scales moved from 1, for the notes."""
    t = torch.cat([v.reshape(-1) for v in logs.values()]).abs()
    return (
        f"learned gated-unit scales of B ({t.numel()} units): median |log s| {float(t.median()):.3f}, "
        f"max {float(t.max()):.3f}"
    )


class _SharedAdam:
    """Adam with one second moment per tensor, not per entry: the step of the gated-unit
    log-scales. A unit then moves in proportion to its share of the gradient, so units the loss
    hardly sees stay near where they started; per-entry Adam moves every unit at the full rate,
    and those units wander on noise. On a tiny Qwen3 whose B is A with rescaled units
    (``tests/alignment/test_learned_glu.py``, 30 steps) per-entry Adam took the barrier from 0.106 to 0.020
    nats and left the mean error of the log-scales at 0.81 (0.79 before); this takes it to 0.015
    and the error to 0.66."""

    def __init__(self, params: Sequence[Tensor], betas: tuple[float, float] = (0.9, 0.999)) -> None:
        self.params, self.betas, self.steps = list(params), betas, 0
        self.first = [torch.zeros_like(p) for p in self.params]
        self.second = [0.0 for _ in self.params]

    @torch.no_grad()
    def step(self, rate: float) -> None:
        self.steps += 1
        b1, b2 = self.betas
        for k, p in enumerate(self.params):
            if p.grad is None:
                continue
            self.first[k].mul_(b1).add_(p.grad, alpha=1 - b1)
            self.second[k] = b2 * self.second[k] + (1 - b2) * float(p.grad.square().mean())
            scale = (self.second[k] / (1 - b2**self.steps)) ** 0.5 + 1e-12
            p.sub_(rate * self.first[k] / ((1 - b1**self.steps) * scale))


def _loss_on(run: _Run, xs: Sequence[Mapping[str, Tensor]], params: Mapping[str, Tensor]) -> float:
    """The mean loss of ``params`` over the batches ``xs``."""
    return sum(float(_loss(run.model, params, x)) for x in xs) / len(xs)


@dataclass
class _Steppers:
    """One run's optimisers: Adam on the orthogonal and free matrices, `_SharedAdam` on the
    gated-unit log-scales, scaled gradient steps on the permutation scores."""

    learners: list[LearnedMaps]
    opt: torch.optim.Adam | None
    unit_opt: _SharedAdam
    # permutation scores: plain gradient steps, each scaled so its largest entry moves by the rate.
    # The Hungarian solution of the accumulated scores then follows the summed gradient's linear
    # model of the loss; Adam's per-entry scaling would let entries with negligible gradients
    # move as fast as the ones that matter, and pairings then wander.
    scores: list[torch.nn.Parameter]

    @classmethod
    def of(cls, run: _Run, lr: float) -> _Steppers:
        learners = [m for m in run.maps if m is not None]
        dense = [p for m in learners for p in (*m.orth.values(), *m.free.values())]
        opt = torch.optim.Adam(dense, lr=lr) if dense else None
        unit_opt = _SharedAdam([p for m in learners for p in m.log_scales.values()])
        scores = [p for m in learners for p in m.scores.values()]
        return cls(learners, opt, unit_opt, scores)

    def step(self, run: _Run, batch: Mapping[str, Tensor], rate: float, rng: random.Random) -> Tensor:
        """One training step at learning rate ``rate`` on the loss of one sampled weighting; returns
        that loss."""
        for group in self.opt.param_groups if self.opt is not None else []:
            group["lr"] = rate
        current = [m.current() if m is not None else None for m in run.maps]
        bases = _scaled(run.graph, run.bases, [m.logs() if m is not None and m.unit_keys else None for m in run.maps])
        loss = _loss(run.model, _mix(run.graph, bases, current, run.sample(rng)), batch)
        for m in self.learners:
            for p in m.parameters():
                p.grad = None
        loss.backward()
        if self.opt is not None:
            self.opt.step()
        self.unit_opt.step(rate)
        with torch.no_grad():
            for p in self.scores:
                if p.grad is not None:
                    p.sub_(rate * p.grad / p.grad.abs().max().clamp_min(1e-30))
        for m in self.learners:
            m.project()
        return loss


class _Training:
    """One run of the training loop: its batches, optimisers, held-out scores and the best maps so
    far. Split out of `_optimise` so that a step, a score and the outcome each read on their own."""

    def __init__(self, run: _Run, batches: Sequence[Mapping[str, Tensor]], settings: LearnedSettings) -> None:
        self.run, self.settings = run, settings
        self.train, self.held, apart = split(batches, settings.holdout)
        self.steppers = _Steppers.of(run, settings.lr)
        self.rng = random.Random(settings.seed)
        self.sizes = [batch_size(x) for x in self.train]
        self.unit = self.sizes[0][1]
        per_step = sum(n for n, _ in self.sizes) / len(self.sizes)
        self.steps = settings.steps if settings.budget is None else max(1, math.ceil(settings.budget / per_step))
        with torch.no_grad():
            self.ends = [
                _loss_on(run, self.held, _mix(run.graph, [b], [t], [1.0]))
                for b, t in zip(run.bases, run.starts, strict=True)
            ]
        # a gain smaller than this is float noise: on an exact start, function-keeping drift of the unit
        # scales "lowers" a barrier of ~1e-6 nats by as much, and would be kept instead of the start
        self.tolerance = max(1e-6, GAIN_TOLERANCE * sum(self.ends) / len(self.ends))
        self.unscaled: list[Logs] = [None] * len(run.bases)
        self.best_ts: list[Transform | None] = list(run.starts)
        self.best_logs = self.unscaled
        self.best = self.start = self.barrier(self.best_ts, self.best_logs)
        held_out = "held-out alignment batches" if apart else "the alignment batch (too few batches to hold one out)"
        self.history: dict[str, Any] = {
            "unit": self.unit,
            "held_out": held_out,
            "measure": run.what,
            "steps": [0],
            self.unit: [0],
            "barrier": [self.best],
            "train_loss": [None],
        }
        if settings.sinkhorn:
            self.history["soft_barrier"] = [self.best]
        self.seen, self.since, self.running, self.stale, self.step, self.swaps = 0, 0, 0.0, 0, 0, 0

    def barrier(self, ts: Sequence[Mapping[str, SpaceMap] | None], logs: Sequence[Logs]) -> float:
        """The held-out barrier of maps ``ts`` with log-scales ``logs``, averaged over the scored
        weightings."""
        run = self.run
        with torch.no_grad():
            bases = _scaled(run.graph, run.bases, logs)
            total = 0.0
            for w in run.scored:
                total += _loss_on(run, self.held, _mix(run.graph, bases, ts, w)) - sum(
                    x * e for x, e in zip(w, self.ends, strict=True)
                )
            return total / len(run.scored)

    def hard(self) -> list[Transform | None]:
        """Every model's hard maps now (None for a model that stays as it is)."""
        return [m.final() if m is not None else None for m in self.run.maps]

    def hard_logs(self) -> list[Logs]:
        """Every model's gated-unit log-scales now."""
        return [m.final_logs() if m is not None else None for m in self.run.maps]

    def train_step(self, progress: Progress | None) -> None:
        """One step on the next training batch, counted towards the next score."""
        rate = self.settings.lr * _lr_factor(self.step, self.steps, self.settings.warmup)
        i = self.step % len(self.train)
        loss = self.steppers.step(self.run, self.train[i], rate, self.rng)
        self.step += 1
        self.seen += self.sizes[i][0]
        self.running, self.since = self.running + float(loss.detach()), self.since + 1
        if progress is not None:
            progress("learned matching", self.step, self.steps)

    def swap_heads(self, logs: Sequence[Logs]) -> None:
        """Greedy head swaps of each learner in turn, on the loss of one training batch (the
        held-out ones only score), each after the previous learners' swaps."""
        run = self.run
        probe = self.train[self.step % len(self.train)]
        with torch.no_grad():
            scaled = _scaled(run.graph, run.bases, logs)
        for i, learner in enumerate(run.maps):
            if learner is None:
                continue
            others = self.hard()  # after the previous learners' swaps

            def probe_loss(
                t: Transform,
                i: int = i,
                x: Mapping[str, Tensor] = probe,
                others: list[Transform | None] = others,
                bases: list[Any] = scaled,
            ) -> float:
                ts = [t if j == i else h for j, h in enumerate(others)]
                return sum(float(_loss(run.model, _mix(run.graph, bases, ts, w), x)) for w in run.scored)

            self.swaps += learner.swap_heads(probe_loss)

    def score(self) -> bool:
        """Score the hard maps on the held-out batches, record the point and keep the maps when
        they beat the best; False when ``patience`` scores passed without a gain."""
        logs = self.hard_logs()
        if self.settings.heads:
            self.swap_heads(logs)
        ts = self.hard()
        score = self.barrier(ts, logs)
        history = self.history
        history["steps"].append(self.step)
        history[self.unit].append(self.seen)
        history["barrier"].append(score)
        history["train_loss"].append(self.running / self.since)
        if self.settings.sinkhorn:
            history["soft_barrier"].append(
                self.barrier([m.current(soft=True) if m is not None else None for m in self.run.maps], logs)
            )
        self.running, self.since = 0.0, 0
        if score < self.best - self.tolerance:
            self.best, self.best_ts, self.best_logs, self.stale = score, ts, logs, 0
            return True
        self.stale += 1
        return not (self.settings.patience and self.stale >= self.settings.patience)

    def outcome(self) -> tuple[list[Transform | None], list[Logs], list[str], dict[str, Any]]:
        """(kept transforms, kept log-scales, notes, history): the data-free start when no score
        beat it."""
        run, settings, history, start, best = self.run, self.settings, self.history, self.start, self.best
        history["best"] = best
        where = history["held_out"]
        trained = f"{self.step} steps, {self.seen:,} {self.unit}" + (
            f", {self.swaps} head swaps" if settings.heads else ""
        )
        if best == start:
            note = f"learned matching ({trained}) did not lower the {run.what} on {where} ({start:.4f} nats); kept the data-free solution"
            return list(run.starts), self.unscaled, [note], history
        notes = [f"learned matching ({trained}): {run.what} on {where} {start:.4f} → {best:.4f} nats"]
        notes += [_scale_note(logs) for logs in self.best_logs if logs]
        if settings.sinkhorn:
            notes.append(
                f"learned matching with soft permutations: held-out {run.what} {history['soft_barrier'][-1]:.4f} "
                f"nats with the soft maps, {history['barrier'][-1]:.4f} projected to permutations"
            )
        return self.best_ts, self.best_logs, notes, history


def _optimise(
    run: _Run, batches: Sequence[Mapping[str, Tensor]], settings: LearnedSettings, progress: Progress | None
) -> tuple[list[Transform | None], list[Logs], list[str], dict[str, Any]]:
    """The training loop shared by pairs and universes; returns (kept transforms, kept gated-unit
    log-scales, notes, history)."""
    training = _Training(run, batches, settings)
    while training.step < training.steps:
        training.train_step(progress)
        if training.step % settings.eval_every and training.step < training.steps:
            continue
        if not training.score():
            break
    return training.outcome()


def _fixed_note(maps: Sequence[LearnedMaps | None]) -> list[str]:
    """The note on expert spaces kept at their starting maps, if any."""
    fixed = sorted({name for m in maps if m is not None for name in m.fixed})
    if not fixed:
        return []
    return [
        f"learned matching kept the experts of {len(fixed)} mixture-of-experts layer(s) ({', '.join(fixed)}) at "
        "their data-free two-level assignment (experts with their router rows, units inside each, the router's "
        "shift) and learned the other spaces around them: soft permutations of experts are not implemented"
    ]


def _frozen_model(template: Any, sd: Mapping[str, Tensor], untied: list[str]) -> Any:
    model = rebuild(template, dict(sd), untie=bool(untied)).train(False)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def refine(
    pair: Pair,
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    transform: Transform,
    untied: list[str],
    settings: LearnedSettings,
    progress: Progress | None,
) -> LearnedResult:
    """Optimize ``transform`` on the loss of the interpolated model; see the module docstring."""
    assert pair.data is not None and pair.model_a is not None
    maps = LearnedMaps(graph, transform, settings)
    if not list(maps.parameters()):
        return LearnedResult(
            transform,
            ["learned matching: no map here can be learned; kept the data-free solution", *_fixed_note([maps])],
        )
    low, high = settings.sampler

    def sample(rng: random.Random) -> list[float]:
        lam = rng.uniform(low, high) if high > low else low
        return [lam, 1.0 - lam]

    run = _Run(
        _frozen_model(pair.model_a, sd_a, untied),
        graph,
        [_floats(sd_a), _floats(sd_b)],
        [None, maps],
        [None, transform],
        sample,
        [[0.5, 0.5]],
        "midpoint barrier",
    )
    kept, logs, notes, history = _optimise(run, pair.data.batches, settings, progress)
    notes += _fixed_note([maps])
    result = kept[1]
    assert result is not None
    scales = {space: t.exp() for space, t in (logs[1] or {}).items()}  # float64, applied once by the caller
    return LearnedResult(result, notes, history, scales)


def refine_many(
    template: Any,
    graph: SymmetryGraph,
    state_dicts: Sequence[Mapping[str, Tensor]],
    transforms: Sequence[Transform],
    weights: Sequence[float],
    untied: list[str],
    data: Sequence[Mapping[str, Tensor]],
    settings: LearnedSettings,
    concentration: float,
    progress: Progress | None,
) -> tuple[list[Transform], list[str], dict[str, Any]]:
    """Every model's maps refined together on the loss of ``Σ wᵢ·Tᵢ(θᵢ)`` with w ~ Dirichlet(α)
    per step (Theus et al.'s multi-model learned matching): the whole simplex, not only the merge's
    weights, is pulled towards low loss. Kept by the held-out barrier averaged over the merge's
    ``weights`` and seven fixed Dirichlet draws; returns (transforms, notes, history).

    Gated-unit scales (``glu_scales``) are not learned here: the caller keeps each model's state
    dict and replaces only its transform, so scales would be lost (the pairwise alignments before
    it may have learned theirs)."""
    n = len(state_dicts)
    skipped = []
    if settings.glu_scales:
        settings = dataclasses.replace(settings, glu_scales=False)
        if graph.glus:
            skipped = ["learned gated-unit scales are kept from the pairwise alignments, not refined across models"]

    def dirichlet(rng: random.Random) -> list[float]:  # normalised Gamma(α) draws
        g = [rng.gammavariate(float(concentration), 1.0) for _ in range(n)]
        total = sum(g) or 1.0
        return [x / total for x in g]

    fixed = random.Random(settings.seed + 1)
    scored = [list(weights)] + [dirichlet(fixed) for _ in range(7)]
    maps: list[LearnedMaps | None] = [LearnedMaps(graph, t, settings) for t in transforms]
    run = _Run(
        _frozen_model(template, state_dicts[0], untied),
        graph,
        [_floats(sd) for sd in state_dicts],
        maps,
        list(transforms),
        dirichlet,
        scored,
        f"barrier over Dirichlet({concentration:g}) weightings",
    )
    kept, _logs, notes, history = _optimise(run, data, settings, progress)
    history["models"] = n
    return [t for t in kept if t is not None], notes + _fixed_note(maps) + skipped, history
