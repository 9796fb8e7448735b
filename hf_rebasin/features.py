"""Features for matching: weight views of a space (data-free) and streamed activation statistics.

For a space s and a current transform of every *other* space, the weight view is the cross
correlation ``M[i, j] = Σ_tensors ⟨A[.., i, ..], B'[.., j, ..]⟩`` along each axis bound to s, where
B' is model B with all other axes already mapped into A's basis. Head spaces give one matrix per
role (q, k, v, o).

Activation statistics feed the activation strategies (head-perm): models A and B see the same
batches, forward hooks on the linear layers read each space's features, and :class:`CrossMoments`
keeps float64 running sums, so memory is O(d²) per space whatever the number of tokens. Which
tensor carries a space's features is derived from the symmetry graph and the module types alone
(:func:`activation_sites`): no per-architecture code here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from .errors import IncompatibleModelsError
from .symmetry import AxisMap, Fused, Space, SpaceMap, SymmetryGraph, split_ref

ResidualMode = Literal["none", "first", "last", "all", "separate"]
RESIDUAL_MODES: tuple[ResidualMode, ...] = ("none", "first", "last", "all", "separate")


def spaces_of(graph: SymmetryGraph, tensor: str, skip_axis: int | None = None) -> set[str]:
    """Spaces bound to ``tensor``'s axes (all parts of fused axes), except ``skip_axis``."""
    out: set[str] = set()
    for axis, ref in enumerate(graph.bindings[tensor].axes):
        if ref is None or axis == skip_axis:
            continue
        for part in ref.parts if isinstance(ref, Fused) else (ref,):
            out.add(split_ref(part)[0])
    return out


class WeightViews:
    """Weight views of one pair of state dicts, for many transforms.

    A tensor's term depends only on the maps of its *other* axes; terms with no other symmetric
    axis (embeddings, LM head, biases) never change, so they are computed once. The rest is
    recomputed per call: caching every term would hold O(layers · d²) matrices. Products and sums
    run in the weights' dtype (at least float32: float32 GEMMs are twice as fast on CPU).
    """

    def __init__(self, graph: SymmetryGraph, sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor]) -> None:
        self.graph, self.sd_a, self.sd_b = graph, sd_a, sd_b
        self._static: dict[str, dict[str | None, Tensor]] = {}

    def _term(
        self,
        transform: Mapping[str, SpaceMap],
        space: str,
        use: tuple[str, int, str | None, int],
        cache: dict[str, AxisMap | None],
    ) -> Tensor:
        tensor, axis, role, offset = use
        a = self.sd_a[tensor]
        b = self.graph.map_tensor(tensor, self.sd_b[tensor], transform, skip_axis=axis, cache=cache)
        size = self.graph.ref_size(f"{space}:{role}" if role else space)
        work = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        a2 = a.narrow(axis, offset, size).movedim(axis, 0).reshape(size, -1).to(work)
        b2 = b.narrow(axis, offset, size).movedim(axis, 0).reshape(size, -1).to(work)
        return a2 @ b2.T

    def static(self, space: str) -> dict[str | None, Tensor]:
        """The terms of tensors with no other symmetric axis (anchors), computed once per space."""
        known = self._static.get(space)
        if known is None:
            known = {}
            for use in self.graph.users(space):
                if not spaces_of(self.graph, use[0], skip_axis=use[1]):
                    m = self._term({}, space, use, {})
                    known[use[2]] = known[use[2]] + m if use[2] in known else m
            self._static[space] = known
        return known

    def __call__(self, transform: Mapping[str, SpaceMap], space: str) -> dict[str | None, Tensor]:
        """Cross-correlation matrices of ``space`` keyed by role (``None`` for a plain space), float64."""
        out = {k: v.clone() for k, v in self.static(space).items()}
        cache: dict[str, AxisMap | None] = {}
        for use in self.graph.users(space):
            if spaces_of(self.graph, use[0], skip_axis=use[1]):
                m = self._term(transform, space, use, cache)
                out[use[2]] = out[use[2]] + m if use[2] in out else m
        return {k: v.to(torch.float64) for k, v in out.items()}


def neighbours(graph: SymmetryGraph) -> dict[str, set[str]]:
    """Spaces that share a tensor with each space: a space's weight view changes only when one of
    them gets a new map."""
    out: dict[str, set[str]] = {name: set() for name in graph.spaces}
    for tensor in graph.bindings:
        if tensor in graph.ties:
            continue
        spaces = spaces_of(graph, tensor)
        for s in spaces:
            if s in out:
                out[s] |= spaces - {s}
    return out


# --------------------------------------------------------------------------------------------
# Streamed moments
# --------------------------------------------------------------------------------------------


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

    def correlation(self, eps: float = 1e-8) -> Tensor:
        """Pearson correlation ``[da, db]`` (float64). A feature whose variance is at most
        ``eps · mean²`` (a constant, up to rounding) correlates 0 with everything: no NaN, and a
        LAP on it is indifferent, as it should be."""
        n = self.count.clamp_min(1.0)
        mean_a, mean_b = self.sum_a / n, self.sum_b / n
        var_a = (self.sq_a / n - mean_a * mean_a).clamp_min(0.0)
        var_b = (self.sq_b / n - mean_b * mean_b).clamp_min(0.0)
        live_a = var_a > eps * mean_a * mean_a
        live_b = var_b > eps * mean_b * mean_b
        if self.count.item() == 0:
            live_a = torch.zeros_like(live_a)
        cov = self.cross / n - torch.outer(mean_a, mean_b)
        std_a = torch.where(live_a, var_a.sqrt(), torch.ones_like(var_a))
        std_b = torch.where(live_b, var_b.sqrt(), torch.ones_like(var_b))
        corr = (cov / torch.outer(std_a, std_b)).clamp(-1.0, 1.0)
        return torch.where(torch.outer(live_a, live_b), corr, torch.zeros_like(corr))

    def all_reduce(self) -> None:
        """Sum the moments over all processes (accelerate / torch.distributed); a no-op in one."""
        if not _distributed():
            return
        fields = self._fields()
        buf = _all_reduce_sum(torch.cat([f.reshape(-1) for f in fields]))
        offset = 0
        for f in fields:
            f.copy_(buf[offset : offset + f.numel()].view_as(f))
            offset += f.numel()


def _distributed() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` over processes, on the device the backend needs (NCCL: the current GPU)."""
    import torch.distributed as dist

    device = t.device
    if dist.get_backend() == "nccl":
        work = t.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        work = t.cpu() if device.type != "cpu" else t.clone()
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(device)


# --------------------------------------------------------------------------------------------
# Sites: which module input / output carries a space's features
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """Where the features of one space (or head-space role) are read.

    ``key``: a space ref (``"h.0.mlp"``, ``"h.0.attn:o"``), the residual space's name, or in
    :class:`ActivationStats` a residual key such as ``"res@3"``. The features are the last axis of
    ``module``'s input or output, sliced ``[offset, offset + size)`` (GPT-2's fused ``c_attn``
    output holds q | k | v).
    """

    key: str
    module: str
    where: Literal["input", "output"]
    offset: int
    size: int


def _linear_axes(module: torch.nn.Module) -> tuple[int, int] | None:
    """(input axis, output axis) of a linear module's weight; None for anything else."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        return 0, 1  # [in, out]
    if isinstance(module, torch.nn.Linear):
        return 1, 0  # [out, in]
    return None


def _bound_linears(graph: SymmetryGraph, model: torch.nn.Module) -> dict[str, tuple[Any, Any]]:
    """Every Linear / Conv1D module with a bound weight: name -> (input ref, output ref), in the
    model's registration order."""
    rank = {name: i for i, (name, _) in enumerate(model.named_modules())}
    found: dict[str, tuple[Any, Any]] = {}
    for name, binding in graph.bindings.items():
        if not name.endswith(".weight") or len(binding.axes) != 2:
            continue
        module_name = name[: -len(".weight")]
        if module_name not in rank:
            continue
        axes = _linear_axes(model.get_submodule(module_name))
        if axes is not None:
            found[module_name] = (binding.axes[axes[0]], binding.axes[axes[1]])
    return dict(sorted(found.items(), key=lambda kv: rank[kv[0]]))


def _is_residual(graph: SymmetryGraph, space: str) -> bool:
    s = graph.spaces.get(space)
    return isinstance(s, Space) and s.kind == "residual"


def _wanted_spaces(graph: SymmetryGraph, spaces: Collection[str] | None) -> set[str]:
    if spaces is None:
        return set(graph.spaces)
    wanted = {split_ref(s)[0] for s in spaces}
    unknown = sorted(wanted - set(graph.spaces))
    if unknown:
        raise ValueError(f"no space(s) {unknown} in the {graph.family!r} graph; it has {sorted(graph.spaces)}")
    return wanted


def _candidate_sites(graph: SymmetryGraph, model: torch.nn.Module, wanted: set[str]) -> list[Site]:
    """All sites of the wanted spaces, in module order: every input site, and output sites of
    non-residual spaces (a residual writer's output is only part of the stream)."""
    sites: list[Site] = []
    for module, (in_ref, out_ref) in _bound_linears(graph, model).items():
        if isinstance(in_ref, str) and split_ref(in_ref)[0] in wanted:
            sites.append(Site(in_ref, module, "input", 0, graph.ref_size(in_ref)))
        parts: tuple[str, ...] = out_ref.parts if isinstance(out_ref, Fused) else (out_ref,) if out_ref else ()
        offset = 0
        for part in parts:
            size = graph.ref_size(part)
            space = split_ref(part)[0]
            if space in wanted and not _is_residual(graph, space):
                sites.append(Site(part, module, "output", offset, size))
            offset += size
    return sites


def activation_sites(graph: SymmetryGraph, model: torch.nn.Module, spaces: Collection[str] | None = None) -> list[Site]:
    """The sites to hook, in module order: one per space / head role, plus every residual reader.

    Per key an *input* site is preferred (the reader sees exactly the space: the MLP down
    projection's input is the post-activation unit, o_proj's input the attention output before
    W_O); otherwise an output site (q and k from q_proj / k_proj or slices of a fused c_attn).
    Role v is skipped when o exists (they share the inner map). For a residual space (kind
    ``"residual"``) every input site is returned under the space's name: which of them are kept
    depends on forward order and tensor identity, known only when the model runs
    (:func:`activation_stats`).
    """
    wanted = _wanted_spaces(graph, spaces)
    candidates = _candidate_sites(graph, model, wanted)
    residual = [s for s in candidates if _is_residual(graph, split_ref(s.key)[0])]
    chosen: dict[str, Site] = {}
    for where in ("input", "output"):
        for s in candidates:
            if s.where == where and s.key not in chosen and not _is_residual(graph, split_ref(s.key)[0]):
                chosen[s.key] = s
    for key in list(chosen):
        space, role = split_ref(key)
        if role == "v" and f"{space}:o" in chosen:
            del chosen[key]
    keep = set(chosen.values()) | set(residual)
    return [s for s in candidates if s in keep]


# --------------------------------------------------------------------------------------------
# Collection
# --------------------------------------------------------------------------------------------


@dataclass
class ActivationStats:
    """Cross moments of A's and B's features per site key, and the structure seen in the forward.

    ``residual_groups``: residual readers in forward order, one group per input tensor (q/k/v of
    a layer read one tensor), over every residual space; ``residual_spaces[g]`` names the space of
    group g (CLIP has two), and ``"<space>@j"`` keys count that space's groups only.
    ``module_order``: every hooked module in firing order. ``tokens``: tokens counted after
    masking, over all processes. ``seconds``: wall time of the collection.
    """

    moments: dict[str, CrossMoments]
    residual_groups: list[list[str]]
    module_order: list[str]
    tokens: int
    seconds: float = 0.0
    residual_spaces: list[str] = field(default_factory=list)


@dataclass
class _Group:
    space: str
    modules: list[str]


@dataclass
class _Collector:
    """Hook state shared by the two models for one collection."""

    plain: dict[str, list[Site]]  # module -> non-residual sites
    candidates: dict[str, Site]  # module -> residual input site
    residual: ResidualMode
    wanted: set[str]
    special: Tensor | None
    order: list[str] = field(default_factory=list)
    groups: list[_Group] = field(default_factory=list)
    rep: dict[str, str] | None = None  # representative module of a kept residual group -> key
    sizes: dict[str, int] = field(default_factory=dict)  # key -> feature size
    pending: dict[str, deque[Tensor]] = field(default_factory=dict)
    moments: dict[str, CrossMoments] = field(default_factory=dict)
    keep: Tensor | None = None
    keep_on: dict[torch.device, Tensor] = field(default_factory=dict)
    store: bool = True
    counted: bool = False
    batch_tokens: int = 0
    tokens: int = 0
    # first forward only: residual input tensors seen so far (strong refs: ids get reused)
    seen: list[tuple[Tensor, int]] = field(default_factory=list)
    first: dict[int, Tensor] = field(default_factory=dict)

    # ---- per batch --------------------------------------------------------------------------

    def set_batch(self, batch: Mapping[str, Any]) -> None:
        """The mask of kept positions, and the batch's token count: kept text tokens, or (image
        batches) the rows of the first hooked activation."""
        keep = batch.get("attention_mask")
        keep = keep.bool() if isinstance(keep, Tensor) else None
        ids = batch.get("input_ids")
        if self.special is not None and isinstance(ids, Tensor):
            plain = ~torch.isin(ids, self.special.to(ids.device))
            keep = plain if keep is None else keep & plain
        self.keep, self.keep_on = keep, {}
        if keep is not None:
            self.counted, self.batch_tokens = True, int(keep.sum())
        elif isinstance(ids, Tensor):
            self.counted, self.batch_tokens = True, ids.numel()
        else:
            self.counted, self.batch_tokens = False, 0

    def features(self, t: Tensor, offset: int, size: int, copy: bool) -> Tensor:
        """Masked features ``[n_tok, size]`` of the last axis of ``t``; a fresh float32 copy when
        asked (A's features must outlive the forward and survive in-place ops)."""
        if offset != 0 or size != t.shape[-1]:
            t = t[..., offset : offset + size]
        keep = self.keep
        if keep is not None and tuple(t.shape[:-1]) == tuple(keep.shape):
            if t.device not in self.keep_on:
                self.keep_on[t.device] = keep.to(t.device)
            return t[self.keep_on[t.device]].to(torch.float32)
        flat = t.reshape(-1, size)
        return flat.to(torch.float32, copy=True) if copy else flat

    # ---- hooks ------------------------------------------------------------------------------

    def hook(self, module: str, model: Literal["a", "b", "ab"]) -> Callable[..., None]:
        """A forward hook; ``"ab"`` serves a model compared with itself (one forward per batch)."""

        def run(_mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            x = args[0] if args else next(iter(kwargs.values()))
            if model != "b":
                self._on_a(module, x, out)
            if model != "a" and self.rep is not None and self.store:
                self._on_b(module, x, out)

        return run

    def probe(self, model: torch.nn.Module, batch: Mapping[str, Any], device: torch.device) -> None:
        """Run A once without storing features, to learn firing order and residual groups."""
        self.store = False
        self.set_batch(batch)
        model(**_to(batch, device))
        self.finish_structure()
        self.store = True

    def _on_a(self, module: str, x: Tensor, out: Tensor) -> None:
        if not self.counted:
            self.counted, self.batch_tokens = True, x.numel() // x.shape[-1]
        if self.rep is None:
            self._discover(module, x)
        elif self.store and module in self.rep:
            site = self.candidates[module]
            self.pending.setdefault(self.rep[module], deque()).append(self.features(x, 0, site.size, True))
        if self.store:
            for site in self.plain.get(module, ()):
                t = x if site.where == "input" else out
                self.pending.setdefault(site.key, deque()).append(self.features(t, site.offset, site.size, True))

    def _discover(self, module: str, x: Tensor) -> None:
        """First forward of A: firing order and residual groups (by identity of the input)."""
        if module not in self.order:
            self.order.append(module)
        site = self.candidates.get(module)
        if site is None:
            return
        for t, gi in self.seen:
            if t is x:
                self.groups[gi].modules.append(module)
                return
        gi = len(self.groups)
        self.seen.append((x, gi))
        self.groups.append(_Group(site.key, [module]))
        if self.store and self.residual != "none" and site.key in self.wanted:
            self.first[gi] = self.features(x, 0, site.size, True)

    def finish_structure(self) -> None:
        """After the first forward of A: name the kept residual groups and queue their features."""
        self.seen = []
        keys: dict[int, str] = {}
        if self.residual != "none":
            for space in dict.fromkeys(g.space for g in self.groups):
                if space not in self.wanted:
                    continue
                idx = [i for i, g in enumerate(self.groups) if g.space == space]
                if self.residual == "first":
                    keys[idx[0]] = space
                elif self.residual == "last":
                    keys[idx[-1]] = space
                elif self.residual == "all":
                    keys.update({i: space for i in idx})
                else:
                    keys.update({i: f"{space}@{j}" for j, i in enumerate(idx)})
        self.rep = {}
        for gi in sorted(keys):
            module = self.groups[gi].modules[0]
            self.rep[module] = keys[gi]
            self.sizes[keys[gi]] = self.candidates[module].size
            if gi in self.first:
                self.pending.setdefault(keys[gi], deque()).append(self.first[gi])
        self.first = {}

    def _on_b(self, module: str, x: Tensor, out: Tensor) -> None:
        assert self.rep is not None
        todo = [(s.key, x if s.where == "input" else out, s.offset, s.size) for s in self.plain.get(module, ())]
        if module in self.rep:
            todo.append((self.rep[module], x, 0, self.candidates[module].size))
        for key, t, offset, size in todo:
            queue = self.pending.get(key)
            if not queue:
                raise IncompatibleModelsError(
                    f"model B ran {module!r} ({key}) more often than model A: the two models must share "
                    "one architecture and configuration"
                )
            a = queue.popleft()
            y = self.features(t, offset, size, False)
            if key not in self.moments:
                self.moments[key] = CrossMoments.zeros(size, size, device=a.device)
            self.moments[key].update(a, y)

    def check_drained(self) -> None:
        left = sorted(k for k, q in self.pending.items() if q)
        self.pending = {}
        if left:
            raise IncompatibleModelsError(
                f"model A produced features for {left} that model B never did: the two models must share "
                "one architecture and configuration"
            )

    def all_keys(self) -> dict[str, int]:
        """Every key this collection yields and its size, in site then forward order."""
        out = {s.key: s.size for sites in self.plain.values() for s in sites}
        out.update(self.sizes)
        return out


def _process_grid() -> tuple[int, int]:
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
) -> ActivationStats:
    """Correlation statistics of A's and B's features on the same batches, for every site.

    Per batch A runs first and its hooks keep the (masked, float32) features of each site; B's
    hooks then add (A, B) pairs into float64 :class:`CrossMoments` and free A's copy: extra memory
    is one batch of A's features plus O(d²) per key. Padded positions (``attention_mask == 0``)
    and, when ``special_ids`` is given, special tokens are dropped wherever an activation's leading
    dims are the batch's ``[batch, seq]``.

    ``residual`` picks the residual readers' groups (one group per input tensor, forward order):
    ``first`` / ``last`` one group, ``all`` every group pooled under the space's name, ``separate``
    one key per group (``"res@0"``, …), ``none`` no residual key.

    Under ``accelerate launch`` process p takes batches p, p + P, p + 2P, … and the sums are
    reduced over processes, so every process returns the same statistics as one process would.
    """
    if residual not in RESIDUAL_MODES:
        raise ValueError(f"residual must be one of {RESIDUAL_MODES}, got {residual!r}")
    start = time.perf_counter()
    nproc, rank = _process_grid()
    wanted = _wanted_spaces(graph, spaces)
    sites = _candidate_sites(graph, model_a, set(graph.spaces))
    chosen = set(activation_sites(graph, model_a, spaces))
    plain: dict[str, list[Site]] = {}
    for s in sites:
        if s in chosen and not _is_residual(graph, split_ref(s.key)[0]):
            plain.setdefault(s.module, []).append(s)
    candidates = {s.module: s for s in sites if s.where == "input" and _is_residual(graph, split_ref(s.key)[0])}
    special = torch.tensor(sorted(set(special_ids)), dtype=torch.long) if special_ids else None
    col = _Collector(plain, candidates, residual, wanted, special)

    handles = []
    modes = (model_a.training, model_b.training)
    dev_a, dev_b = _device_of(model_a), _device_of(model_b)
    try:
        model_a.eval()
        model_b.eval()
        same = model_a is model_b
        for module in _bound_linears(graph, model_a):
            if same:
                handles.append(
                    model_a.get_submodule(module).register_forward_hook(col.hook(module, "ab"), with_kwargs=True)
                )
                continue
            handles.append(model_a.get_submodule(module).register_forward_hook(col.hook(module, "a"), with_kwargs=True))
            handles.append(model_b.get_submodule(module).register_forward_hook(col.hook(module, "b"), with_kwargs=True))
        first: Mapping[str, Tensor] | None = None
        with torch.no_grad():
            for i, batch in enumerate(batches):
                if i == 0:
                    first = batch
                if i % nproc != rank:
                    continue
                if same and col.rep is None:
                    col.probe(model_a, batch, dev_a)  # one hook does A and B: it must know the keys first
                col.set_batch(batch)
                model_a(**_to(batch, dev_a))
                if col.rep is None:
                    col.finish_structure()
                if not same:
                    model_b(**_to(batch, dev_b))
                col.check_drained()
                col.tokens += col.batch_tokens
                if progress is not None:
                    progress(col.tokens)
            if col.rep is None and first is not None:
                # fewer batches than processes: learn the structure so all processes hold the same keys
                col.probe(model_a, first, dev_a)
    finally:
        for h in handles:
            h.remove()
        col.pending, col.first, col.seen = {}, {}, []
        model_a.train(modes[0])
        model_b.train(modes[1])

    moments = {
        k: col.moments[k] if k in col.moments else CrossMoments.zeros(size, size) for k, size in col.all_keys().items()
    }
    tokens = col.tokens
    if nproc > 1:
        if not _distributed():
            raise RuntimeError(
                f"accelerate reports {nproc} processes but torch.distributed is not initialised: "
                "the statistics of the other processes' batches cannot be summed"
            )
        for m in moments.values():
            m.all_reduce()
        tokens = int(_all_reduce_sum(torch.tensor(float(tokens), dtype=torch.float64)).item())
    return ActivationStats(
        moments=moments,
        residual_groups=[list(g.modules) for g in col.groups],
        module_order=list(col.order),
        tokens=tokens,
        seconds=time.perf_counter() - start,
        residual_spaces=[g.space for g in col.groups],
    )
