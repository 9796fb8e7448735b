"""Learned matching (Theus et al.; after Ainsworth et al.'s straight-through estimator and Peña et
al.'s Sinkhorn re-basin): refine a data-free solution on the loss of the interpolated model.

Each step samples λ ~ U(0.4, 0.6) and a batch of alignment data, and minimizes the loss of
``λ·θ_A + (1−λ)·T(θ_B)`` over the maps T. Orthogonal maps (residual stream, inner head maps) are
free matrices projected back onto the orthogonal group by SVD after every step. Permutations
(MLP units, a post-norm residual) are score matrices: the forward pass uses the Hungarian solution
with the scores' gradient passed straight through, or (``sinkhorn: true``) a soft doubly
stochastic matrix; they are rounded to hard permutations at the end. Head pairings stay those of
the data-free solution. The refined maps are kept only if they lower the midpoint loss.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from ..errors import MissingDataError
from ..evaluate import interpolate
from ..models import rebuild
from ..solvers import lap, procrustes, sinkhorn, svd
from ..symmetry import AxisMap, HeadMap, HeadSpace, Space, SpaceMap, SymmetryGraph, Transform
from .base import Pair, Progress


@dataclass(frozen=True)
class LearnedSettings:
    """How the refinement optimises: its own settings, so that this module needs nothing of the
    strategy that calls it (generalized-orthogonal fills them from its ``learned`` options)."""

    steps: int  # optimisation steps
    lr: float  # Adam learning rate
    sinkhorn: bool  # soft (Sinkhorn) permutations during optimisation instead of straight-through ones
    temperature: float  # of the soft permutations
    seed: int  # of the λ samples


def _project_orthogonal(m: Tensor, centered: bool) -> Tensor:
    """The nearest orthogonal matrix (fixing 1 when ``centered``), batched over leading dims."""
    if m.dim() == 3:
        u, _s, vh = svd(m)
        return (u @ vh).to(m.dtype)
    o, _ = procrustes(m, fix_ones=centered)
    return o.to(m.dtype)


class _Maps(torch.nn.Module):
    """The learnable maps: dense orthogonal matrices and permutation scores, per space."""

    def __init__(self, graph: SymmetryGraph, transform: Transform, soft: bool, temperature: float) -> None:
        super().__init__()
        self.graph, self.soft, self.temperature = graph, soft, temperature
        self.orth = torch.nn.ParameterDict()
        self.scores = torch.nn.ParameterDict()
        self.heads: dict[str, HeadMap] = {}
        self.keys: dict[str, str] = {}
        for i, (name, m) in enumerate(transform.items()):
            key = f"s{i}"
            self.keys[name] = key
            sp = graph.spaces[name]
            if isinstance(m, HeadMap):
                self.heads[name] = m
                assert isinstance(sp, HeadSpace)
                if m.vo.dtype != torch.long:
                    self.orth[key + "_vo"] = torch.nn.Parameter(m.vo.to(torch.float32).clone())
                if m.qk.dtype != torch.long and not sp.rotary:
                    self.orth[key + "_qk"] = torch.nn.Parameter(m.qk.to(torch.float32).clone())
            elif isinstance(m, AxisMap):
                dense = m.matrix(torch.float32)
                if m.is_permutation:
                    self.scores[key] = torch.nn.Parameter(dense.clone())
                else:
                    self.orth[key] = torch.nn.Parameter(dense.clone())

    def current(self) -> dict[str, SpaceMap]:
        """Maps for the forward pass (differentiable in the parameters)."""
        out: dict[str, SpaceMap] = {}
        for name, key in self.keys.items():
            if name in self.heads:
                m = self.heads[name]
                qk = self.orth[key + "_qk"] if key + "_qk" in self.orth else m.qk
                vo = self.orth[key + "_vo"] if key + "_vo" in self.orth else m.vo
                out[name] = HeadMap(m.kv_perm, m.q_perm, qk, vo)
            elif key in self.orth:
                out[name] = AxisMap(self.orth[key].shape[0], blocks=self.orth[key][None])
            else:
                s = self.scores[key]
                if self.soft:
                    p = sinkhorn(s / self.temperature)
                else:
                    hard = torch.zeros_like(s)
                    hard[torch.arange(s.shape[0]), lap(s)[0]] = 1.0
                    p = hard + s - s.detach()  # straight through: forward hard, gradient to the scores
                out[name] = AxisMap(s.shape[0], blocks=p[None])
        return out

    @torch.no_grad()
    def project(self) -> None:
        for name, key in self.keys.items():
            sp = self.graph.spaces[name]
            centered = isinstance(sp, Space) and sp.centered
            for k in (key, key + "_qk", key + "_vo"):
                if k in self.orth:
                    self.orth[k].copy_(_project_orthogonal(self.orth[k], centered))

    @torch.no_grad()
    def final(self) -> Transform:
        """Hard maps: permutations rounded by LAP, orthogonal maps as projected."""
        self.project()
        out: Transform = {}
        for name, key in self.keys.items():
            if name in self.heads:
                m = self.current()[name]
                assert isinstance(m, HeadMap)
                qk = m.qk.detach().to(torch.float64) if m.qk.dtype != torch.long else m.qk
                vo = m.vo.detach().to(torch.float64) if m.vo.dtype != torch.long else m.vo
                out[name] = HeadMap(m.kv_perm, m.q_perm, qk, vo)
            elif key in self.orth:
                o = self.orth[key].detach().to(torch.float64)
                out[name] = AxisMap(o.shape[0], blocks=o[None])
            else:
                out[name] = AxisMap(self.scores[key].shape[0], index=lap(self.scores[key])[0])
        return out


def _loss(model: Any, params: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
    out = functional_call(model, dict(params), args=(), kwargs=dict(batch), strict=False)
    loss = getattr(out, "loss", None)
    if loss is None:
        raise MissingDataError(
            "learned matching needs batches with `labels` (the model computes its own loss from them); "
            f"got keys {sorted(batch)}"
        )
    return loss  # type: ignore[no-any-return]


def refine(
    pair: Pair,
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    transform: Transform,
    untied: list[str],
    settings: LearnedSettings,
    progress: Progress | None,
) -> tuple[Transform, list[str]]:
    """Optimize ``transform`` on the loss of the interpolated model; returns it and report notes."""
    assert pair.data is not None and pair.model_a is not None
    batches = list(pair.data.batches)
    model = rebuild(pair.model_a, dict(sd_a), untie=bool(untied)).train(False)
    for p in model.parameters():
        p.requires_grad_(False)
    a = {k: v.detach().float() if v.is_floating_point() else v for k, v in sd_a.items()}
    b = {k: v.detach().float() if v.is_floating_point() else v for k, v in sd_b.items()}
    maps = _Maps(graph, transform, settings.sinkhorn, settings.temperature)
    opt = torch.optim.Adam(maps.parameters(), lr=settings.lr)
    rng = random.Random(settings.seed)

    def midpoint(t: Mapping[str, SpaceMap]) -> float:
        with torch.no_grad():
            mixed = interpolate(a, graph.apply(b, t, check=False), 0.5)
            return sum(float(_loss(model, mixed, x)) for x in batches) / len(batches)

    before = midpoint(transform)
    for step in range(settings.steps):
        lam = rng.uniform(0.4, 0.6)
        batch = batches[step % len(batches)]
        loss = _loss(model, interpolate(a, graph.apply(b, maps.current(), check=False), lam), batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        maps.project()
        if progress is not None:
            progress("learned matching", step + 1, settings.steps)
    learned = maps.final()
    after = midpoint(learned)
    if after < before:
        return learned, [f"learned matching: midpoint loss on the alignment data {before:.4f} → {after:.4f} nats"]
    return transform, [
        f"learned matching did not lower the midpoint loss ({before:.4f} → {after:.4f} nats); "
        "kept the data-free solution"
    ]
