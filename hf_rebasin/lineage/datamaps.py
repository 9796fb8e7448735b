"""Lineage with data: the alignment's start fitted on what the two models compute.

Both models run in canonical form (norm scales folded, routers centred, gated units balanced: the
forms lineage compares) on the same batches, and their activations' cross moments are streamed:
models in memory by whole forward passes (`features.activation_stats`), models read from their
files layer by layer in lockstep (`features.lockstep`: one layer of each and one layer's moments in
memory, the stream's moments from the hidden states between layers). Each space of the symmetry
graph then takes its map from them:

* the residual stream: the orthogonal map of the cross-covariance of the stream the layers read
  (Procrustes, inside 1⊥ for LayerNorm), pooled over every reading site; a permutation or signed
  permutation from their correlation where norms sit after sublayers;
* heads: KV heads paired, and their inner maps, from the cross-covariance of queries, keys and the
  attention output before W_O, each head's block scaled by its activations' size (so that a loud
  head does not win every pairing; Procrustes inside a block does not see the scale);
* MLP units and experts: permutations from the correlation of their activations.

These maps start the signal alignment in place of its permutations (a space no batch reaches
starts at the identity), and the alignment refines every space on the weights' learned directions
as it does without data. Data-fitted maps alone would compare the bulks of independent models under
their functional alignment, which lifts what they share past the test's null level (0.16–0.26 on
the testbed's trained seed pairs, against 0.02–0.06 refined); started from them, the alignment
finds maps that the signals alone cannot, on random weights under heavy noise, whose top
directions the noise has reshuffled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.alignment.experts import solve_experts
from hf_rebasin.alignment.features import activation_stats
from hf_rebasin.alignment.features.batches import kept_positions, process_grid
from hf_rebasin.alignment.features.lockstep import LockstepPlan, lockstep_plan, lockstep_stats
from hf_rebasin.alignment.features.moments import CrossMoments, ExpertMoments
from hf_rebasin.alignment.solvers import lap_sparse
from hf_rebasin.alignment.strategies.engines.descent import Views, solve_heads, solve_plain
from hf_rebasin.core.lazy import is_lazy
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.io.offload import empty_model
from hf_rebasin.io.rebuild import output_config, running
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import ExpertSpace, HeadSpace, Space
from hf_rebasin.symmetry.transforms import AxisMap, Transform

__all__ = ["LineageData", "data_bytes", "data_maps", "data_tokens", "space_stats_bytes"]

RUN_BYTES_PER_PARAMETER = 8  # models in memory: both canonical forms rebuilt as float32 models, to run


@dataclass(frozen=True)
class LineageData:
    """What lineage needs to run both models: the batches they read (tokens or images, as a recipe's
    ``data`` makes them), the special token ids to skip, and a model of their class (A's: a
    streamed model's meta skeleton will do) to run each state in."""

    batches: Sequence[Mapping[str, Tensor]]
    template: Any
    special_ids: frozenset[int] | None = None


def head_view(m: CrossMoments, head_dim: int) -> Tensor:
    """The cross-covariance with each (A head, B head) block divided by √(total variance of A's head ·
    B's): pairings compare like with like, and each block's best rotation is unchanged."""
    var_a, var_b = m.variances()
    per_a = var_a.view(-1, head_dim).sum(1).clamp_min(1e-30).sqrt().repeat_interleave(head_dim)
    per_b = var_b.view(-1, head_dim).sum(1).clamp_min(1e-30).sqrt().repeat_interleave(head_dim)
    return m.covariance() / torch.outer(per_a, per_b)


def solve_from_moments(graph: SymmetryGraph, moments: Mapping[str, CrossMoments | ExpertMoments]) -> Transform:
    """Every space whose activations were collected, mapped (see the module docstring); the others
    are left out of the result."""
    out: Transform = {}
    for name, sp in graph.spaces.items():
        if isinstance(sp, HeadSpace):
            roles = {r: moments[f"{name}:{r}"] for r in ("q", "k", "o") if f"{name}:{r}" in moments}
            if "o" in roles:
                views: Views = {r: head_view(m, sp.head_dim) for r, m in roles.items() if isinstance(m, CrossMoments)}
                out[name] = solve_heads(sp, views, "orthogonal", ranking="inner")
        elif isinstance(sp, ExpertSpace):
            expert_views: Views = {
                r: moments[f"{name}:{r}"].correlation() for r in ("experts", "units") if f"{name}:{r}" in moments
            }
            if expert_views:
                out[name] = solve_experts(sp, expert_views)
        elif isinstance(sp, Space) and sp.pinned:
            out[name] = AxisMap(sp.size)  # only the identity survives a reload
        elif isinstance(sp, Space) and name in moments:
            m = moments[name]
            assert isinstance(m, CrossMoments)
            rotates = sp.max_class == "orthogonal"
            view = m.covariance() if rotates else m.correlation()
            out[name] = solve_plain(sp, view, "orthogonal", assign=lap_sparse)  # exact below 2,048 units
    return out


def space_stats_bytes(graph: SymmetryGraph, names: Sequence[str] | None = None) -> int:
    """Float64 cross moments of the features of ``names`` (default: every space) held at once: heads
    count queries, keys and attention output; experts all their units at once."""
    total = 0
    for name in graph.spaces if names is None else names:
        sp = graph.spaces[name]
        if isinstance(sp, HeadSpace):
            total += sum(sp.role_size(r) ** 2 for r in ("q", "k", "o"))
        elif isinstance(sp, ExpertSpace):
            total += (sp.num_experts * sp.units) ** 2
        elif isinstance(sp, Space):
            total += sp.size**2
    return 8 * total


def data_tokens(batches: Sequence[Mapping[str, Any]], config: Any) -> int:
    """The positions the batches feed a model (tokens; an image's patches and its class token)."""
    n = 0
    for batch in batches:
        ids, pixels = batch.get("input_ids"), batch.get("pixel_values")
        if isinstance(ids, Tensor):
            n += ids.numel()
        elif isinstance(pixels, Tensor):
            patch = int(getattr(config, "patch_size", 16) or 16)
            n += pixels.shape[0] * ((pixels.shape[-2] // patch) * (pixels.shape[-1] // patch) + 1)
    return n


def data_bytes(lm: LoadedModel, tokens: int) -> int:
    """What reading ``tokens`` positions of activations adds to a comparison's peak. Layer by layer
    (streamed): the largest layer's statistics, the stream's (pooled and current layer) and both
    models' hidden states with a layer's output beside them. Whole forward passes: every space's
    statistics and, for models in memory, the two float32 models they run in."""
    plan = layer_plan(lm.graph, lm.model) if lm.source is not None else "in memory"
    stream = residual_space(lm.graph)
    if not isinstance(plan, str) and stream is not None:
        d = stream.size
        layer = max((space_stats_bytes(lm.graph, names) for names in plan.spaces.values()), default=0)
        return layer + 2 * 8 * d * d + 4 * 4 * tokens * d
    params = sum(p.numel() for p in lm.model.parameters())
    return space_stats_bytes(lm.graph) + (RUN_BYTES_PER_PARAMETER * params if lm.source is None else 0)


def residual_space(graph: SymmetryGraph) -> Space | None:
    """The one residual stream of a graph that has one (None with several: CLIP's two towers)."""
    found = [sp for sp in graph.spaces.values() if isinstance(sp, Space) and sp.kind == "residual"]
    return found[0] if len(found) == 1 else None


def layer_plan(graph: SymmetryGraph, skeleton: Any) -> LockstepPlan | str:
    """How two streamed models run layer by layer for lineage: every space but the residual stream
    inside one stack of layers, and one residual stream (read as the hidden states between layers);
    or why not."""
    if residual_space(graph) is None:
        return "it has more than one residual stream"
    others = [n for n, sp in graph.spaces.items() if not (isinstance(sp, Space) and sp.kind == "residual")]
    return lockstep_plan(graph, skeleton, others)


class _StreamMoments:
    """Cross moments of the residual stream between layers, every layer centred at its own mean and
    pooled (as `activation_stats`' ``all`` mode pools reading sites); each token's state normalized as
    a norm normalizes it (centred under LayerNorm, divided by its RMS), so that the moments are those
    of what canonical readers read, and a rotation of the stream turns them."""

    def __init__(self, space: Space, special: frozenset[int] | None) -> None:
        self.space, self.special = space, torch.tensor(sorted(special)) if special else None
        self.pooled: CrossMoments | None = None
        self.layer: CrossMoments | None = None
        self.at = -1

    def __call__(self, layer: int, batch: Mapping[str, Any], a: Tensor, b: Tensor) -> None:
        if layer != self.at:
            self._close()
            self.at, self.layer = layer, CrossMoments.zeros(self.space.size, self.space.size)
        keep = kept_positions(batch, self.special)  # as `activation_stats` masks text batches
        if keep is not None and tuple(keep.shape) != tuple(a.shape[:-1]):
            keep = None
        assert self.layer is not None
        self.layer.update(self._normed(a if keep is None else a[keep]), self._normed(b if keep is None else b[keep]))

    def _normed(self, x: Tensor) -> Tensor:
        x = x.to(torch.float32).reshape(-1, x.shape[-1])
        if self.space.max_class != "orthogonal":
            return x
        if self.space.centered:
            x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp_min(1e-12))

    def _close(self) -> None:
        if self.layer is not None:
            parts = [self.layer] if self.pooled is None else [self.pooled, self.layer]
            self.pooled, self.layer = CrossMoments.within(parts), None

    def result(self) -> CrossMoments | None:
        self._close()
        return self.pooled


def _by_layer(
    graph: SymmetryGraph,
    skeletons: tuple[Any, Any],
    states: tuple[Mapping[str, Tensor], Mapping[str, Tensor]],
    plan: LockstepPlan,
    data: LineageData,
    progress: Callable[[str], None] | None,
) -> tuple[Transform, int]:
    """Streamed models in lockstep, one layer of each in memory: each layer's spaces solved from its
    moments, which are then dropped; the residual stream's moments pooled over the layers."""
    space = residual_space(graph)
    assert space is not None
    stream = _StreamMoments(space, data.special_ids)
    out: Transform = {}
    tokens = 0
    for layer in lockstep_stats(
        *skeletons, *states, graph, plan, data.batches, special_ids=data.special_ids, on_stream=stream
    ):
        out.update(solve_from_moments(graph, layer.stats.moments))
        tokens = max(tokens, layer.stats.tokens)
        if progress is not None:
            progress(f"activations, layer by layer ({layer.layer + 1}/{plan.layers})")
    pooled = stream.result()
    if pooled is not None:
        if process_grid()[0] > 1:  # under accelerate launch each process streamed its share of the batches
            pooled.all_reduce()
        out.update(solve_from_moments(graph, {space.name: pooled}))
    return out, tokens


def data_maps(
    graph: SymmetryGraph,
    state_a: Mapping[str, Tensor],
    state_b: Mapping[str, Tensor],
    untie: bool,
    data: LineageData,
    progress: Callable[[str], None] | None = None,
) -> tuple[Transform, int]:
    """The maps of every space the batches reach, from the two canonical states run as models of
    ``data.template``'s class; and the tokens (or images) read. States read from files run layer by
    layer in lockstep where the model allows it (one layer's statistics at a time), else whole
    forward passes reading one submodule's weights at a time."""
    device = torch.device("cpu") if is_lazy(state_a) else None
    if device is not None:
        skeletons = tuple(empty_model(type(data.template), output_config(data.template, untie)) for _ in "ab")
        plan = layer_plan(graph, skeletons[0])
        if not isinstance(plan, str):
            return _by_layer(graph, (skeletons[0], skeletons[1]), (state_a, state_b), plan, data, progress)
    with ExitStack() as stack:
        model_a = stack.enter_context(running(data.template, state_a, untie=untie, device=device))
        model_b = stack.enter_context(running(data.template, state_b, untie=untie, device=device))
        stats = activation_stats(
            model_a,
            model_b,
            graph,
            data.batches,
            residual="all",
            special_ids=data.special_ids,
            progress=None if progress is None else lambda n: progress(f"activations ({n:,} tokens)"),
            device=device,
        )
    return solve_from_moments(graph, stats.moments), stats.tokens
