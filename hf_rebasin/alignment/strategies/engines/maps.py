"""The maps learned matching optimises, and its settings.

Orthogonal maps (the residual stream, inner head maps) are free matrices. With ``rotations:
projected`` Adam moves them freely and each step ends by projecting them back onto the orthogonal
group (SVD); with ``polar`` the forward pass uses the free matrix's polar factor and the gradient
flows through it, as Theus et al.'s code learns its residual map. Permutations (MLP units, a
post-norm residual, which head of B goes to which head of A) are score matrices read through their
Hungarian solution: the backward pass takes the soft (Sinkhorn) permutation's gradient
(``straight_through: sinkhorn``) or passes the gradient to the scores as it is (``identity``, as
the reference does); or (``sinkhorn``) the soft matrix is used in both passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from hf_rebasin.alignment.solvers import lap, polar, procrustes, sinkhorn, svd
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import HeadSpace, Space, is_pinned
from hf_rebasin.symmetry.transforms import (
    AxisMap,
    ExpertMap,
    HeadMap,
    SpaceMap,
    Transform,
    inner_matrices,
    plane_scalings,
)


@dataclass(frozen=True)
class LearnedSettings:
    """How the refinement optimises: its own settings, so that this module needs nothing of the
    strategy that calls it (generalized-orthogonal fills them from its options)."""

    steps: int  # optimisation steps (unused when ``budget`` is set)
    lr: float  # peak Adam learning rate (cosine decay to 10 % of it)
    sinkhorn: bool  # soft (Sinkhorn) permutations during optimisation, projected once at the end
    temperature: float  # of the soft permutations
    seed: int  # of the λ samples
    sampler: tuple[float, float] = (0.4, 0.6)  # λ ~ U(a, b); a == b is a fixed λ
    heads: bool = True  # learn which head of B goes to which head of A (not only the maps inside)
    budget: int | None = None  # tokens (text) or examples (images) to train on; sets the steps
    holdout: float = 0.25  # share of the alignment batches held out for the stopping rule
    eval_every: int = 50  # steps between held-out scores
    patience: int = 4  # held-out scores without improvement before stopping (0: never stop early)
    # inner head maps are any invertible matrices (rotary Q/K: scaled plane rotations; fixed Q/K stay)
    invertible: bool = False
    # a positive scale per gated-MLP unit of B (exp(t) on up, exp(−t) on down), before the maps
    glu_scales: bool = False
    # orthogonal maps: "polar" (read through their polar factor, gradient through it) or "projected"
    # (Adam, then back onto the group after each step)
    rotations: str = "polar"
    # permutations' backward pass: "sinkhorn" (the soft permutation's gradient) or "identity"
    straight_through: str = "sinkhorn"
    warmup: float = 0.0  # share of the steps over which the rate rises linearly to its peak


def project_orthogonal(m: Tensor, centered: bool) -> Tensor:
    """The nearest orthogonal matrix (fixing 1 when ``centered``), batched over leading dims."""
    if m.dim() == 3:
        u, _s, vh = svd(m)
        return (u @ vh).to(m.dtype)
    o, _ = procrustes(m, fix_ones=centered)
    return o.to(m.dtype)


def _hard(scores: Tensor) -> Tensor:
    """The permutation matrix maximizing ``Σ scores[i, p(i)]`` (no gradient)."""
    hard = torch.zeros_like(scores)
    hard[torch.arange(scores.shape[0]), lap(scores)[0]] = 1.0
    return hard


@dataclass(frozen=True)
class RelaxedHeads(HeadMap):
    """A head map whose pairing of KV heads is a dense ``[G, G]`` matrix (new slot × old head):
    straight-through hard or Sinkhorn-soft while learned matching optimises it. The query order
    inside each group (``q_perm``) stays fixed; ``expand`` builds each role's dense map."""

    pairing: Tensor | None = None

    def expand(self, space: HeadSpace, role: str) -> AxisMap:
        assert self.pairing is not None
        p = self.pairing
        G, r, dh = space.num_kv_heads, space.group_size, space.head_dim
        if role == "h":  # one feature per query head: the pairing and the query order alone
            within = torch.eye(r, dtype=p.dtype)[self.q_perm]
            dense = torch.einsum("gh,gjk->gjhk", p, within).reshape(G * r, G * r)
            return AxisMap(dense.shape[0], blocks=dense[None])
        inner = inner_matrices(self.inner(role), p.dtype)
        if role in ("k", "v"):
            dense = torch.einsum("gh,gab->gahb", p, inner).reshape(G * dh, G * dh)
        else:
            within = torch.eye(r, dtype=p.dtype)[self.q_perm]  # [G, r, r]: slot j of group g ← query q_perm[g, j]
            dense = torch.einsum("gh,gjk,gab->gjahkb", p, within, inner).reshape(G * r * dh, G * r * dh)
        return AxisMap(dense.shape[0], blocks=dense[None])


SWAP_LIMIT = 120  # head pairs per layer the swap search tries at most (16 heads)


class LearnedMaps(torch.nn.Module):
    """The learnable maps: dense orthogonal matrices and permutation scores, per space."""

    def __init__(self, graph: SymmetryGraph, transform: Transform, settings: LearnedSettings) -> None:
        super().__init__()
        self.graph, self.soft, self.temperature = graph, settings.sinkhorn, settings.temperature
        self.invertible = settings.invertible
        self.polar, self.identity_grad = settings.rotations == "polar", settings.straight_through == "identity"
        self.orth = torch.nn.ParameterDict()  # orthogonal: projected back after every step
        self.free = torch.nn.ParameterDict()  # invertible inner head maps: not projected
        self.scores = torch.nn.ParameterDict()
        self.signs: dict[str, Tensor] = {}  # signed permutations: the sign of each old feature
        self.heads: dict[str, HeadMap] = {}
        self.fixed: dict[str, SpaceMap] = {}  # maps kept as they start (expert spaces)
        self.keys: dict[str, str] = {}
        # log-scales of B's gated units (in B's unit order: applied before the maps), by unit space
        self.log_scales = torch.nn.ParameterDict()
        self.unit_keys: dict[str, str] = {}
        if settings.glu_scales:
            for i, unit in enumerate(graph.glus):
                self.unit_keys[unit.space] = f"u{i}"
                self.log_scales[f"u{i}"] = torch.nn.Parameter(torch.zeros(graph.ref_size(unit.space)))
        for i, (name, m) in enumerate(transform.items()):
            key = f"s{i}"
            self.keys[name] = key
            sp = graph.spaces[name]
            if is_pinned(sp):  # only the identity survives a reload: nothing to learn
                self.fixed[name] = AxisMap(graph.ref_size(name))
            elif isinstance(m, ExpertMap):  # no relaxation of the two-level permutation: kept as it starts
                self.fixed[name] = m
            elif isinstance(m, HeadMap):
                assert isinstance(sp, HeadSpace)
                self.heads[name] = m
                if self.invertible:
                    self.free[key + "_vo"] = torch.nn.Parameter(inner_matrices(m.inner("v"), torch.float32).clone())
                    qk = inner_matrices(m.inner("q"), torch.float32)
                    if sp.qk == "planes":  # per plane (a, b): the scaled rotation [[a, -b], [b, a]]
                        half = sp.head_dim // 2
                        j = torch.arange(half)
                        planes = torch.stack([qk[:, j, j], qk[:, j + half, j]], dim=-1)
                        self.free[key + "_planes"] = torch.nn.Parameter(planes.clone())
                    elif sp.qk == "free":
                        self.free[key + "_qk"] = torch.nn.Parameter(qk.clone())
                    # fixed: Q/K keep their map (the identity), nothing to learn
                else:
                    if m.vo.dtype != torch.long:
                        self.orth[key + "_vo"] = torch.nn.Parameter(m.vo.to(torch.float32).clone())
                    if m.qk.dtype != torch.long and sp.qk == "free":
                        self.orth[key + "_qk"] = torch.nn.Parameter(m.qk.to(torch.float32).clone())
                if settings.heads and sp.num_kv_heads > 1:
                    g = sp.num_kv_heads
                    self.scores[key + "_heads"] = torch.nn.Parameter(torch.eye(g)[m.kv_perm].clone())
            elif isinstance(m, AxisMap):
                dense = m.matrix(torch.float32)
                if m.is_permutation:
                    self.scores[key] = torch.nn.Parameter(dense.clone())
                elif m.is_signed_permutation:  # learn the permutation; each B feature keeps its sign
                    self.signs[key] = dense.sum(0)
                    self.scores[key] = torch.nn.Parameter(dense.abs().clone())
                else:
                    self.orth[key] = torch.nn.Parameter(dense.clone())

    def _permutation(self, scores: Tensor, soft: bool) -> Tensor:
        if self.identity_grad and not soft:  # straight through: forward hard, the gradient as it is
            return _hard(scores) + scores - scores.detach()
        relaxed = sinkhorn(scores / self.temperature)
        if soft:
            return relaxed
        return _hard(scores) + relaxed - relaxed.detach()  # straight through: forward hard, backward soft

    def _orthogonal(self, key: str, centered: bool = False) -> Tensor:
        """Orthogonal parameter ``key`` as the forward pass reads it: as it is when projected after
        each step, its polar factor (differentiable) with ``rotations: polar``."""
        m = self.orth[key]
        return polar(m, fix_ones=centered and m.dim() == 2) if self.polar else m

    def current(self, soft: bool | None = None) -> dict[str, SpaceMap]:
        """Maps for the forward pass (differentiable in the parameters); ``soft`` overrides the
        setting (the held-out scores read both)."""
        soft = self.soft if soft is None else soft
        out: dict[str, SpaceMap] = {}
        for name, key in self.keys.items():
            if name in self.fixed:
                out[name] = self.fixed[name]
            elif name in self.heads:
                m = self.heads[name]
                qk, vo = self._inner(name, key)
                if key + "_heads" in self.scores:
                    pairing = self._permutation(self.scores[key + "_heads"], soft)
                    out[name] = RelaxedHeads(m.kv_perm, m.q_perm, qk, vo, self.invertible, pairing=pairing)
                else:
                    out[name] = HeadMap(m.kv_perm, m.q_perm, qk, vo, self.invertible)
            elif key in self.orth:
                o = self._orthogonal(key, self._centered(name))
                out[name] = AxisMap(o.shape[0], blocks=o[None])
            else:
                p = self._permutation(self.scores[key], soft)
                if key in self.signs:
                    p = p * self.signs[key][None, :]
                out[name] = AxisMap(p.shape[0], blocks=p[None])
        return out

    def logs(self) -> dict[str, Tensor]:
        """The log-scales of B's gated units by unit space (parameters: differentiable)."""
        return {space: self.log_scales[key] for space, key in self.unit_keys.items()}

    @torch.no_grad()
    def final_logs(self) -> dict[str, Tensor] | None:
        """The log-scales as they are now (float64 copies), or None when none are learned."""
        if not self.unit_keys:
            return None
        return {space: t.detach().to(torch.float64).clone() for space, t in self.logs().items()}

    def _inner(self, name: str, key: str) -> tuple[Tensor, Tensor]:
        """The Q/K and V/O inner maps of head space ``name`` (parameters where learned)."""
        m = self.heads[name]
        if self.invertible:
            vo = self.free[key + "_vo"]
            if key + "_qk" in self.free:
                qk = self.free[key + "_qk"]
            elif key + "_planes" in self.free:  # rotary: (a, b) per plane
                qk = plane_scalings(self.free[key + "_planes"])
            else:  # fixed Q/K
                qk = m.qk
            return qk, vo
        qk = self._orthogonal(key + "_qk") if key + "_qk" in self.orth else m.qk
        vo = self._orthogonal(key + "_vo") if key + "_vo" in self.orth else m.vo
        return qk, vo

    def _centered(self, name: str) -> bool:
        sp = self.graph.spaces[name]
        return isinstance(sp, Space) and sp.centered

    @torch.no_grad()
    def project(self) -> None:
        """Orthogonal parameters back onto the group after every step; not with ``rotations: polar``,
        whose free matrices are what is learned (the forward pass reads their polar factor)."""
        if self.polar:
            return
        for name, key in self.keys.items():
            for k in (key, key + "_qk", key + "_vo"):
                if k in self.orth:
                    self.orth[k].copy_(project_orthogonal(self.orth[k], self._centered(name)))

    @torch.no_grad()
    def swap_heads(self, loss: Callable[[Transform], float], limit: int = SWAP_LIMIT) -> int:
        """Greedy search over swaps of two heads' pairings, on ``loss`` of the hard maps: a swap that
        lowers it is kept by swapping the two rows of the head scores. Gradients cannot do this
        alone: two crossed heads average to two identical slots at λ = ½, a saddle whose gradient
        is the same for both. Layers with more than ``limit`` candidate swaps are skipped.
        Returns the number of swaps kept."""
        kept = 0
        base = self.final()  # swapping two rows of the scores swaps those slots' LAP heads, nothing else
        for name, key in self.keys.items():
            if key + "_heads" not in self.scores:
                continue
            s = self.scores[key + "_heads"]
            g = s.shape[0]
            if g * (g - 1) // 2 > limit:
                continue
            current = loss(base)
            for i in range(g):
                for j in range(i + 1, g):
                    m = base[name]
                    assert isinstance(m, HeadMap)
                    kv = m.kv_perm.clone()
                    kv[[i, j]] = kv[[j, i]]
                    trial = {**base, name: dataclasses.replace(m, kv_perm=kv)}
                    tried = loss(trial)
                    if tried < current - 1e-6:
                        s[[i, j]] = s[[j, i]]
                        base, current, kept = trial, tried, kept + 1
        return kept

    @torch.no_grad()
    def final(self) -> Transform:
        """Hard maps: permutations rounded by LAP, orthogonal maps as projected."""
        self.project()
        out: Transform = {}
        for name, key in self.keys.items():
            if name in self.fixed:
                out[name] = self.fixed[name]
            elif name in self.heads:
                m = self.heads[name]
                kv = lap(self.scores[key + "_heads"])[0] if key + "_heads" in self.scores else m.kv_perm
                qk, vo = (x.detach().double().clone() if x.is_floating_point() else x for x in self._inner(name, key))
                out[name] = HeadMap(kv, m.q_perm, qk, vo, self.invertible)
            elif key in self.orth:
                o = self._orthogonal(key, self._centered(name)).detach().to(torch.float64).clone()
                out[name] = AxisMap(o.shape[0], blocks=o[None])
            else:
                index = lap(self.scores[key])[0]
                if key in self.signs:
                    out[name] = AxisMap.signed(index, self.signs[key][index])
                else:
                    out[name] = AxisMap(self.scores[key].shape[0], index=index)
        return out
