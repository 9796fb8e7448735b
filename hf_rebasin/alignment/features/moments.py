"""Streamed cross moments of two feature sets, and their sum over processes.

:class:`CrossMoments` keeps float64 running sums, so memory is O(d²) per feature set whatever the
number of tokens, and batches and processes combine by plain addition. Per key, an accumulator
(`Pairing`; `ExpertPairing` for a MoE layer's units) holds A's features until B's arrive and
streams each pair into its moments; :class:`ActivationStats` is a collection's moments per key.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hf_rebasin.alignment.features.sites import ExpertSite
from hf_rebasin.core.errors import IncompatibleModelsError


@dataclass
class CrossMoments:
    """Running float64 sums for the correlation of two feature sets (like git re-basin's
    ``online_stats``): ``count``, ``Σx``, ``Σy``, ``Σx²``, ``Σy²`` and ``Σ x yᵀ``.

    Sums (not means) so that batches and processes combine by plain addition.
    """

    count: Tensor
    sum_a: Tensor
    sum_b: Tensor
    sq_a: Tensor
    sq_b: Tensor
    cross: Tensor

    @classmethod
    def zeros(cls, da: int, db: int, device: torch.device | str | None = None) -> CrossMoments:
        def z(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=device)

        return cls(z(), z(da), z(db), z(da), z(db), z(da, db))

    @classmethod
    def within(cls, parts: list[CrossMoments], eps: float = 1e-8) -> CrossMoments:
        """One set of moments whose correlation is that of the pooled *within-part* covariances:
        every part centred at its own means (sums zero), so differences between the parts' means
        add no spurious covariance. A feature constant in every part stays dead (zero variance)."""
        out = cls.zeros(parts[0].sum_a.shape[0], parts[0].sum_b.shape[0], device=parts[0].cross.device)
        live_a = torch.zeros_like(out.sum_a, dtype=torch.bool)
        live_b = torch.zeros_like(out.sum_b, dtype=torch.bool)
        for p in parts:
            if p.count.item() == 0:
                continue
            n = p.count
            ca, cb = p.sq_a - p.sum_a * p.sum_a / n, p.sq_b - p.sum_b * p.sum_b / n
            live_a |= ca > eps * p.sum_a * p.sum_a / n
            live_b |= cb > eps * p.sum_b * p.sum_b / n
            out.count += n
            out.sq_a += ca.clamp_min(0.0)
            out.sq_b += cb.clamp_min(0.0)
            out.cross += p.cross - torch.outer(p.sum_a, p.sum_b) / n
        out.sq_a[~live_a] = 0.0
        out.sq_b[~live_b] = 0.0
        out.cross[~live_a] = 0.0
        out.cross[:, ~live_b] = 0.0
        return out

    def _fields(self) -> tuple[Tensor, ...]:
        return (self.count, self.sum_a, self.sum_b, self.sq_a, self.sq_b, self.cross)

    def update(self, x: Tensor, y: Tensor) -> None:
        """Add ``n`` samples: row k of ``x`` [n, da] and of ``y`` [n, db] is the same token.

        The per-batch products run in the inputs' precision (at least float32, for speed) on data
        shifted by the batch mean, and the shift is added back in float64: products of centred
        data keep float32's relative error on the covariance instead of on the raw second moment,
        which large mean activations (residual streams) would otherwise swamp.
        """
        da, db = self.sum_a.shape[0], self.sum_b.shape[0]
        if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[1] != da or y.shape[1] != db:
            raise ValueError(
                f"CrossMoments({da}, {db}).update needs x [n, {da}] and y [n, {db}] with the same n; "
                f"got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        n = x.shape[0]
        if n == 0:
            return
        device = self.cross.device
        work = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
        x = x.to(device=device, dtype=work)
        y = y.to(device=device, dtype=work)
        sx = x.sum(0, dtype=torch.float64)
        sy = y.sum(0, dtype=torch.float64)
        cx = (sx / n).to(work)  # the shift, exactly representable in both precisions
        cy = (sy / n).to(work)
        xc, yc = x - cx, y - cy
        cx64, cy64 = cx.to(torch.float64), cy.to(torch.float64)
        # Σ x yᵀ = Σ (x − c)(y − d)ᵀ + c (Σy)ᵀ + (Σx − n c) dᵀ   (exact for any shift c, d), added in
        # place: a d×d float64 temporary per term would cost more than the product itself
        self.cross.add_(xc.T @ yc)
        self.cross.addr_(cx64, sy)
        self.cross.addr_(sx - n * cx64, cy64)
        self.sq_a += (xc * xc).sum(0, dtype=torch.float64) + 2 * cx64 * sx - n * cx64 * cx64
        self.sq_b += (yc * yc).sum(0, dtype=torch.float64) + 2 * cy64 * sy - n * cy64 * cy64
        self.sum_a += sx
        self.sum_b += sy
        self.count += n

    def _means(self) -> tuple[Tensor, Tensor]:
        n = self.count.clamp_min(1.0)
        return self.sum_a / n, self.sum_b / n

    def variances(self) -> tuple[Tensor, Tensor]:
        """Each feature's variance, A's ``[da]`` and B's ``[db]`` (float64, never negative)."""
        n = self.count.clamp_min(1.0)
        mean_a, mean_b = self._means()
        return (self.sq_a / n - mean_a * mean_a).clamp_min(0.0), (self.sq_b / n - mean_b * mean_b).clamp_min(0.0)

    def covariance(self) -> Tensor:
        """Cross-covariance ``E[(a − μa)(b − μb)ᵀ]`` ``[da, db]`` (float64): unlike the correlation,
        it turns with the features, so its Procrustes solution is the rotation between two rotated
        feature sets."""
        mean_a, mean_b = self._means()
        return self.cross / self.count.clamp_min(1.0) - torch.outer(mean_a, mean_b)

    def correlation(self, eps: float = 1e-8) -> Tensor:
        """Pearson correlation ``[da, db]`` (float64). A feature whose variance is at most
        ``eps · mean²`` (a constant, up to rounding) correlates 0 with everything: no NaN, and a
        LAP on it is indifferent, as it should be."""
        mean_a, mean_b = self._means()
        var_a, var_b = self.variances()
        live_a = var_a > eps * mean_a * mean_a
        live_b = var_b > eps * mean_b * mean_b
        if self.count.item() == 0:
            live_a = torch.zeros_like(live_a)
        cov = self.covariance()
        std_a = torch.where(live_a, var_a.sqrt(), torch.ones_like(var_a))
        std_b = torch.where(live_b, var_b.sqrt(), torch.ones_like(var_b))
        corr = (cov / torch.outer(std_a, std_b)).clamp(-1.0, 1.0)
        return torch.where(torch.outer(live_a, live_b), corr, torch.zeros_like(corr))

    def all_reduce(self) -> None:
        """Sum the moments over all processes (accelerate / torch.distributed); a no-op in one."""
        all_reduce_fields(self._fields())


def distributed() -> bool:
    """Whether a process group of more than one process is up (``accelerate launch``)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def all_reduce_fields(fields: tuple[Tensor, ...]) -> None:
    """Sum every tensor of ``fields`` over all processes, in place, in one collective (a no-op in one
    process)."""
    if not distributed():
        return
    buf = all_reduce_sum(torch.cat([t.reshape(-1) for t in fields]))
    offset = 0
    for t in fields:
        t.copy_(buf[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` over processes, on the device the backend needs (NCCL: the current GPU)."""
    import torch.distributed as dist

    device = t.device
    if dist.get_backend() == "nccl":
        work = t.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        work = t.cpu() if device.type != "cpu" else t.clone()
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(device)


@dataclass
class ExpertMoments:
    """Router-weighted cross moments of two models' expert units, for every pair (A's expert a,
    B's expert b) at once (float64 sums, like :class:`CrossMoments`).

    A token t counts towards the pair with weight ``w = r_A(t, a) · r_B(t, b)``: its routing weight
    to expert a in A times its routing weight to expert b in B (the top-k weights the experts'
    outputs are multiplied by; zero for an expert the token is not routed to). So a pair's
    statistics are those of the tokens both experts actually process, each counted as much as both
    outputs matter, and an expert's units are never judged on tokens it never sees (on those its
    activations exist but are discarded by the model). For the right pairing (B's expert b is A's
    expert a, moved) the weight is ``r²`` and the units' correlation is exactly 1.

    Sums over tokens, with ``f`` units per expert and ``x``, ``y`` A's and B's units: ``count``
    ``[E, E]`` = Σ w; ``sum_a`` ``[E·f, E]`` = Σ w x (A unit, B expert); ``sum_b`` ``[E, E·f]``;
    ``sq_a``, ``sq_b`` the same with x², y²; ``cross`` ``[E·f, E·f]`` = Σ w x yᵀ. Every sum is one
    matrix product of the batch's weighted features; memory O((E·f)²), as the unit view itself.
    """

    units: int
    count: Tensor
    sum_a: Tensor
    sum_b: Tensor
    sq_a: Tensor
    sq_b: Tensor
    cross: Tensor

    @classmethod
    def zeros(cls, experts: int, units: int, device: torch.device | str | None = None) -> ExpertMoments:
        def z(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=device)

        n = experts * units
        return cls(units, z(experts, experts), z(n, experts), z(experts, n), z(n, experts), z(experts, n), z(n, n))

    def _fields(self) -> tuple[Tensor, ...]:
        return (self.count, self.sum_a, self.sum_b, self.sq_a, self.sq_b, self.cross)

    def update(self, x: Tensor, ra: Tensor, y: Tensor, rb: Tensor) -> None:
        """Add ``n`` tokens: units ``x``, ``y`` ``[n, E·f]`` and routing weights ``ra``, ``rb``
        ``[n, E]`` of A and B (row k of each is the same token)."""
        if x.shape[0] == 0:
            return
        device, f = self.cross.device, self.units
        x, y, ra, rb = (t.to(device=device, dtype=torch.float64) for t in (x, y, ra, rb))
        xw = x * ra.repeat_interleave(f, dim=1)
        yw = y * rb.repeat_interleave(f, dim=1)
        self.count += ra.T @ rb
        self.sum_a += xw.T @ rb
        self.sum_b += ra.T @ yw
        self.sq_a += (xw * x).T @ rb
        self.sq_b += ra.T @ (yw * y)
        self.cross += xw.T @ yw

    def correlation(self, eps: float = 1e-8) -> Tensor:
        """Weighted Pearson correlation ``[E·f, E·f]``: block (a, b) correlates A's expert a units
        with B's expert b units over the tokens both see; a pair no token reached, or a unit
        constant on those tokens, correlates 0."""
        f = self.units
        w = self.count.repeat_interleave(f, 0).repeat_interleave(f, 1)
        seen = w > 0
        n = w.clamp_min(1e-300)
        mean_a = self.sum_a.repeat_interleave(f, 1) / n
        mean_b = self.sum_b.repeat_interleave(f, 0) / n
        var_a = (self.sq_a.repeat_interleave(f, 1) / n - mean_a * mean_a).clamp_min(0.0)
        var_b = (self.sq_b.repeat_interleave(f, 0) / n - mean_b * mean_b).clamp_min(0.0)
        live = seen & (var_a > eps * mean_a * mean_a) & (var_b > eps * mean_b * mean_b) & (var_a > 0) & (var_b > 0)
        cov = self.cross / n - mean_a * mean_b
        std = torch.where(live, (var_a * var_b).sqrt(), torch.ones_like(var_a))
        corr = (cov / std).clamp(-1.0, 1.0)
        return torch.where(live, corr, torch.zeros_like(corr))

    def all_reduce(self) -> None:
        """Sum the moments over all processes (accelerate / torch.distributed); a no-op in one."""
        all_reduce_fields(self._fields())


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


@dataclass
class Pairing:
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
class ExpertPairing:
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
