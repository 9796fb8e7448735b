"""TransFusion (Rinaldi et al., "Update Your Transformer to the Latest Release: Re-Basin of Task
Vectors", ICML 2025): data-free weight matching with a two-level solve of attention.

Heads are paired by their singular-value spectra, ``Σ_roles ‖σ(head_i^B) − σ(head_j^A)‖``, which
no permutation of the residual stream or inside a head can change: the pairing is fixed once, before
the descent. Inside each matched pair a LAP on row inner products picks the inner permutation,
alternating with the residual and MLP spaces until a pass improves nothing. Everything stays a
permutation, so the result is a stock model (one residual permutation, no per-site matrices).
With ``residual_maps: per-sublayer`` (the paper's Step 3, the default in a transport) every stream
between sublayers then gets a permutation of its own, for moving a task vector.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from hf_rebasin.alignment.features import WeightViews
from hf_rebasin.alignment.solvers import lap, lap_batch, singular_values
from hf_rebasin.alignment.strategies.base import Alignment, Pair, Progress, matching_forms, timed
from hf_rebasin.alignment.strategies.engines.descent import (
    anchor_init,
    descend,
    finish_permutations,
    space_solver,
    view_graph,
)
from hf_rebasin.alignment.strategies.options import TRANSFUSION as STRATEGY  # noqa: F401 (re-exported: its registry entry)
from hf_rebasin.alignment.strategies.options import TransfusionOptions
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import HeadSpace
from hf_rebasin.symmetry.sublayers import PER_SUBLAYER_NOTE
from hf_rebasin.symmetry.transforms import HeadMap


def head_spectra(graph: SymmetryGraph, sd: Mapping[str, Tensor], space: str) -> dict[str, Tensor]:
    """Singular values of every head's weights per role, ``[heads, k]`` (weights and bias together)."""
    sp = graph.spaces[space]
    assert isinstance(sp, HeadSpace)
    parts: dict[str, list[Tensor]] = {}
    for tensor, axis, role, offset in graph.users(space):
        assert role is not None
        if role == "h":  # one number per head (T5's position bias): no spectrum
            continue
        size = sp.role_size(role)
        t = graph.part(tensor, sd[tensor], axis, offset, size).to(torch.float64).movedim(axis, 0)
        parts.setdefault(role, []).append(t.reshape(size // sp.head_dim, sp.head_dim, -1))
    return {role: singular_values(torch.cat(blocks, dim=-1)) for role, blocks in parts.items()}


def spectral_pairing(space: HeadSpace, spec_a: Mapping[str, Tensor], spec_b: Mapping[str, Tensor]) -> HeadMap:
    """KV heads and query heads of B paired with A's by spectral distance; inner maps left identity."""
    G, r, dh = space.num_kv_heads, space.group_size, space.head_dim

    def dist(role: str, heads: int) -> Tensor:
        if role not in spec_a:
            return torch.zeros(heads, heads, dtype=torch.float64, device=next(iter(spec_a.values())).device)
        return torch.cdist(spec_a[role], spec_b[role])

    kv_cost = dist("k", G) + dist("v", G)
    q_cost = (dist("q", G * r) + dist("o", G * r)).reshape(G, r, G, r).permute(0, 2, 1, 3)  # [a, b, i, j]
    if r > 1:
        tau = lap_batch(-q_cost.reshape(G * G, r, r)).reshape(G, G, r)
    else:
        tau = torch.zeros(G, G, 1, dtype=torch.long)
    chosen = q_cost.gather(-1, tau[..., None])[..., 0].sum(-1)
    kv, _ = lap(-(kv_cost + chosen))
    inner = torch.arange(dh).expand(G, dh).clone()
    return HeadMap(kv, tau[torch.arange(G), kv].clone(), inner, inner.clone())


def run(pair: Pair, options: TransfusionOptions, progress: Progress | None) -> Alignment:
    graph = pair.graph
    with timed() as timings:
        init = graph.identity()
        outer: dict[str, tuple[Tensor, Tensor]] = {}
        for name, sp in graph.spaces.items():
            if isinstance(sp, HeadSpace):
                hm = spectral_pairing(sp, head_spectra(graph, pair.sd_a, name), head_spectra(graph, pair.sd_b, name))
                init[name] = hm
                outer[name] = (hm.kv_perm, hm.q_perm)
        solve = space_solver(graph, "permutation", outer=outer)
        ma, mb, balanced = matching_forms(pair, pair.sd_a, pair.sd_b, options)
        vgraph = view_graph(graph, "permutation")
        views = WeightViews(vgraph, ma, mb)
        init = anchor_init(views, init, solve)
        transform, _ = descend(
            vgraph,
            ma,
            mb,
            solve,
            init=init,
            max_iter=options.max_iter,
            seed=options.seed,
            progress=progress,
            stage="transfusion",
            views=views,
        )
        matched = dataclasses.replace(pair, sd_a=ma, sd_b=mb)
        graph, transform, notes, sd_b = finish_permutations(  # head pairings stay
            pair, matched, balanced, transform, options, progress, outer
        )
    return Alignment(
        "transfusion",
        graph,
        pair.sd_a,
        sd_b,
        transform,
        exact=PER_SUBLAYER_NOTE not in notes,  # one global map stays exact
        glu_matched=balanced,
        notes=notes,
        timings=timings,
    )
