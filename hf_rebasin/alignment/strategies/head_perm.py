"""Activation matching with head permutations (Verma & Elbayad, "Merging Text Transformer Models
from Different Initializations", TMLR 2024).

Alignment data are streamed through both models; features are matched by the correlation of their
activations (running float64 moments, never the activations themselves). MLP units: LAP on the
correlation of post-activation features. Attention: the correlation of the attention output before
W_O, one LAP inside every (A head, B head) block gives that pair's cost, an outer LAP picks the
pairing (``heads: head-perm``); the Q/K inner permutation comes from the correlation of query and
key features. Residual: a permutation from the stream read by the layers (``first``, ``last`` or
``all`` reading sites), or none (``identity``). ``ignore-heads`` and ``residual: separate`` do not
preserve the function of model B; they are there for experiments and reports flag them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.alignment.diagnostics import matched_correlation
from hf_rebasin.alignment.experts import solve_experts
from hf_rebasin.alignment.features import ActivationStats, activation_stats
from hf_rebasin.alignment.features.lockstep import LockstepPlan, lockstep_plan, lockstep_stats
from hf_rebasin.alignment.solvers import lap
from hf_rebasin.alignment.strategies.base import Alignment, AlignmentData, Pair, Progress, require_data, timed
from hf_rebasin.alignment.strategies.engines.descent import solve_heads, solve_plain
from hf_rebasin.alignment.strategies.options import HEAD_PERM as STRATEGY  # noqa: F401 (re-exported: its registry entry)
from hf_rebasin.alignment.strategies.options import Component as Component  # re-exported, as before
from hf_rebasin.alignment.strategies.options import HeadPermOptions, Heads, unset_residual
from hf_rebasin.alignment.strategies.options import Residual as Residual
from hf_rebasin.alignment.strategies.options import head_perm_exact as exact
from hf_rebasin.core.errors import StrategyOptionError
from hf_rebasin.core.lazy import is_lazy
from hf_rebasin.io.offload import offloaded
from hf_rebasin.io.tensors import CheckpointSource
from hf_rebasin.symmetry.adapters.base import as_choices
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import (
    Binding,
    ExpertSpace,
    Fused,
    HeadSpace,
    Space,
    TransformClass,
    is_pinned,
    split_ref,
)
from hf_rebasin.symmetry.transforms import AxisMap, HeadMap, Transform


def _check_applicable(graph: SymmetryGraph, options: HeadPermOptions, batches_have_tokens: bool) -> None:
    if not options.special_tokens and not batches_have_tokens:
        raise StrategyOptionError(
            "strategy.special_tokens: false applies to text models (it drops special token ids); "
            f"this {graph.family!r} model's alignment data has no input_ids"
        )
    if options.heads == "ignore-heads":
        gqa = [n for n, s in graph.spaces.items() if isinstance(s, HeadSpace) and s.num_kv_heads != s.num_heads]
        if gqa:
            raise StrategyOptionError(
                f"strategy.heads: ignore-heads needs as many key/value heads as query heads (one permutation "
                f"of all features), but {gqa[0]!r} uses grouped-query attention; use head-perm or monotonic"
            )
        per_head = [t for t, b in graph.bindings.items() if any(isinstance(a, Fused) and a.interleaved for a in b.axes)]
        if per_head:
            raise StrategyOptionError(
                f"strategy.heads: ignore-heads moves features across heads, which {per_head[0]!r} (q, k and v "
                "laid out per head) cannot follow; use head-perm or monotonic"
            )


def _residual_names(graph: SymmetryGraph) -> list[str]:
    """The residual streams a map may be found for (a pinned one keeps the identity)."""
    return [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual" and not s.pinned]


def _spaces_to_collect(graph: SymmetryGraph, options: HeadPermOptions) -> list[str]:
    names: list[str] = []
    for n, s in graph.spaces.items():
        if isinstance(s, HeadSpace):
            if "attn" in options.components and options.heads != "vanilla-attention":
                names.append(n)
        elif s.kind == "residual":
            if "residual" in options.components and options.residual != "identity" and not is_pinned(s):
                names.append(n)
        elif "ff" in options.components:
            names.append(n)  # MLP units and pooler-like dense spaces
    return names


def _solve_attention(space: HeadSpace, corr: Mapping[str | None, Tensor], heads: Heads, qk_maps: str) -> HeadMap:
    """Pair heads on the attention-output correlation (the input of W_O), with each pair's inner
    permutation; Q/K take that permutation too (``qk: shared``) or their own from the query/key
    correlation (``separate``, and always for heads whose Q/K maps are not free: under rotary
    embeddings or fixed Q/K the solver keeps them the identity)."""
    G, r = space.num_kv_heads, space.group_size
    o_only: dict[str | None, Tensor] = {"o": corr["o"]} if "o" in corr else {}
    fixed = (torch.arange(G), torch.arange(r).expand(G, r).clone()) if heads == "monotonic" else None
    vo = solve_heads(space, o_only, "permutation", outer=fixed)
    if qk_maps == "shared" and space.qk == "free":
        return HeadMap(vo.kv_perm, vo.q_perm, vo.vo.clone(), vo.vo)
    qk_views: dict[str | None, Tensor] = {k: v for k, v in corr.items() if k in ("q", "k")}
    if not qk_views or space.qk != "free":  # rotary or fixed: no Q/K permutation but the identity
        return vo
    qk = solve_heads(space, qk_views, "permutation", outer=(vo.kv_perm, vo.q_perm))
    return HeadMap(vo.kv_perm, vo.q_perm, qk.qk, vo.vo)


def flatten_heads(graph: SymmetryGraph, names: list[str]) -> SymmetryGraph:
    """The graph where each listed head space is one plain space shared by Q, K, V and O (features
    may move across heads: not function preserving; ``ignore-heads``)."""
    spaces = dict(graph.spaces)
    for n in names:
        sp = graph.spaces[n]
        assert isinstance(sp, HeadSpace)
        spaces[n] = Space(n, sp.num_heads * sp.head_dim, kind="attention (heads ignored)")

    def fix(ref: str) -> str:
        space, _role = split_ref(ref)
        return space if space in names else ref

    bindings = {
        k: dataclasses.replace(
            b,
            axes=tuple(
                None
                if a is None
                else dataclasses.replace(a, parts=tuple(fix(p) for p in a.parts))
                if isinstance(a, Fused)
                else fix(a)
                for a in b.axes
            ),
        )
        for k, b in graph.bindings.items()
    }
    return dataclasses.replace(graph, spaces=spaces, bindings=bindings)


def _module_positions(model: torch.nn.Module, batch: Mapping[str, Tensor]) -> dict[str, int]:
    """Forward order of every module that owns parameters (one probe pass of model A)."""
    order: dict[str, int] = {}
    handles = []

    def note(name: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: object) -> None:
            order.setdefault(name, len(order))

        return hook

    for name, mod in model.named_modules():
        if any(True for _ in mod.parameters(recurse=False)):
            handles.append(mod.register_forward_pre_hook(note(name)))
    try:
        with torch.no_grad():
            model(**as_choices(model, batch))
    finally:
        for h in handles:
            h.remove()
    return order


def split_residual(
    graph: SymmetryGraph, space: str, groups: list[list[str]], positions: Mapping[str, int]
) -> SymmetryGraph:
    """The graph with one residual space per reading site (``residual: separate``). A tensor joins
    the first site read at or after its module in forward order: readers their own site, writers and
    post-norms the site that reads their output next, embeddings the first."""
    starts = [min(positions.get(m, 10**9) for m in group) for group in groups]
    site_names = [f"{space}@{k}" for k in range(len(groups))]
    member = {m: k for k, group in enumerate(groups) for m in group}

    def site_of(tensor: str) -> int:
        module = tensor.rsplit(".", 1)[0]
        if module in member:
            return member[module]
        pos = positions.get(module)
        if pos is None:
            return len(groups) - 1
        later = [k for k, s in enumerate(starts) if s >= pos]
        return later[0] if later else len(groups) - 1

    base = graph.spaces[space]
    assert isinstance(base, Space)
    spaces = {k: v for k, v in graph.spaces.items() if k != space}
    for n in site_names:
        kept: TransformClass = "signed-permutation" if base.max_class == "signed-permutation" else "permutation"
        spaces[n] = dataclasses.replace(base, name=n, max_class=kept)
    bindings: dict[str, Binding] = {}
    for k, b in graph.bindings.items():
        if space in b.axes:
            site = site_names[site_of(k)]
            b = dataclasses.replace(b, axes=tuple(site if a == space else a for a in b.axes))
        bindings[k] = b
    return dataclasses.replace(graph, spaces=spaces, bindings=bindings)


def _solve(
    graph: SymmetryGraph, names: list[str], corr: Mapping[str, Tensor], options: HeadPermOptions, transform: Transform
) -> list[str]:
    """The maps of ``names`` from their correlations, into ``transform``; the head spaces flattened
    (``ignore-heads``)."""
    flat: list[str] = []
    for name in names:
        sp = graph.spaces[name]
        if isinstance(sp, HeadSpace):
            roles: dict[str | None, Tensor] = {
                role: corr[f"{name}:{role}"] for role in ("q", "k", "o") if f"{name}:{role}" in corr
            }
            if options.heads == "ignore-heads":  # one permutation of the attention output's features
                flat.append(name)
                transform[name] = AxisMap(roles["o"].shape[0], index=lap(roles["o"])[0])
            else:
                transform[name] = _solve_attention(sp, roles, options.heads, options.qk)
        elif isinstance(sp, ExpertSpace):  # experts by their units' and router rows' correlations
            views: dict[str | None, Tensor] = {
                role: corr[f"{name}:{role}"] for role in ("experts", "units") if f"{name}:{role}" in corr
            }
            if views:
                transform[name] = solve_experts(sp, views)
        elif name in corr:  # MLP units, pooler, and the residual unless `separate` (keyed per site)
            transform[name] = solve_plain(sp, corr[name], "permutation")
    return flat


def _by_layer(
    pair: Pair,
    plan: LockstepPlan,
    collect: list[str],
    options: HeadPermOptions,
    data: AlignmentData,
    progress: Progress | None,
) -> tuple[Transform, list[str], list[dict[str, Any]], float]:
    """Streamed models: statistics and maps one layer at a time (see `features.lockstep`), each
    layer's moments dropped once its spaces are solved; (transform, flattened, matched features'
    correlations, seconds)."""
    assert pair.model_a is not None and pair.model_b is not None
    transform: Transform = pair.graph.identity()
    flat: list[str] = []
    matched: list[dict[str, Any]] = []
    seconds = 0.0
    for layer in lockstep_stats(
        pair.model_a,
        pair.model_b,
        pair.sd_a,
        pair.sd_b,
        pair.graph,
        plan,
        data.batches,
        special_ids=None if options.special_tokens else data.special_ids,
        device=_source_device(pair),
        progress=(lambda i, n: progress("activation statistics, layer by layer", i, n)) if progress else None,
    ):
        corr = {key: m.correlation() for key, m in layer.stats.moments.items()}
        flat += _solve(pair.graph, [n for n in collect if n in layer.spaces], corr, options, transform)
        matched += matched_correlation(pair.graph, corr, transform)
        seconds += layer.stats.seconds
    return transform, flat, matched, seconds


def _source_device(pair: Pair) -> torch.device | None:
    """Where streamed models compute (their tensor source's device); None for models in memory."""
    if not is_lazy(pair.sd_a):
        return None
    return pair.sd_a.device if isinstance(pair.sd_a, CheckpointSource) else torch.device("cpu")


def _lockstep(pair: Pair, collect: list[str], residual_mode: str, notes: list[str]) -> LockstepPlan | None:
    """How streamed models are run layer by layer, or None (models in memory; or why not, noted)."""
    if not is_lazy(pair.sd_a) or pair.model_a is None:
        return None
    if residual_mode != "identity":
        notes.append(
            f"residual: {residual_mode} reads the residual stream across layers, so the streamed models ran whole "
            "forward passes (one submodule's weights at a time) with every layer's statistics in memory at once"
        )
        return None
    plan = lockstep_plan(pair.graph, pair.model_a, collect)
    if isinstance(plan, str):
        notes.append(f"statistics could not be collected layer by layer ({plan}): whole forward passes instead")
        return None
    notes.append("activation statistics collected layer by layer: A and B in lockstep, one layer of each in memory")
    return plan


def default_residual(graph: SymmetryGraph, model: Any, streamed: bool) -> Residual:
    """`unset_residual` for ``model``: its layers, widest residual space and parameter count."""
    layers = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    hidden = max((graph.ref_size(n) for n in _residual_names(graph)), default=0)
    params = sum(p.numel() for p in model.parameters())  # a streamed model's skeleton has its shapes
    return unset_residual(layers, hidden, params, streamed)


def _settle(pair: Pair, options: HeadPermOptions, notes: list[str]) -> tuple[HeadPermOptions, dict[str, Any]]:
    """``options`` with `residual` chosen when it was left unset, and what was chosen."""
    if options.residual is not None or "residual" not in options.components:
        return options, {}
    assert pair.model_a is not None
    streamed = is_lazy(pair.sd_a)
    chosen = default_residual(pair.graph, pair.model_a, streamed)
    if not streamed:
        why = "the models are in memory"
    elif chosen == "all":
        why = "streamed, and its statistics are small beside the model"
    else:
        why = (
            "streamed, and every reading site's statistics would outweigh 1 GiB and half of one model: set "
            "`residual: all` to trade that memory for a lower barrier"
        )
    notes.append(f"residual: {chosen} (unset in the recipe; {why})")
    return options.model_copy(update={"residual": chosen}), {"residual": chosen}


def _whole_forwards(
    pair: Pair,
    collect: list[str],
    residual_mode: Residual,
    options: HeadPermOptions,
    data: AlignmentData,
    progress: Progress | None,
) -> ActivationStats:
    """The statistics of whole forward passes of both models (streamed models one submodule's
    weights at a time, when they cannot go layer by layer)."""
    assert pair.model_a is not None and pair.model_b is not None
    with ExitStack() as running:
        models: list[torch.nn.Module] = [pair.model_a, pair.model_b]
        device = _source_device(pair)
        if device is not None:  # streamed models that cannot go layer by layer: whole forwards
            states = (pair.sd_a, pair.sd_b)
            models = [running.enter_context(offloaded(m, sd, device)) for m, sd in zip(models, states, strict=True)]
        stats: ActivationStats = activation_stats(
            models[0],
            models[1],
            pair.graph,
            data.batches,
            spaces=collect,
            residual="none" if residual_mode == "identity" else residual_mode,
            special_ids=None if options.special_tokens else data.special_ids,
            progress=(lambda n: progress("activation statistics", n, 0)) if progress is not None else None,
            device=device,
        )
    return stats


def _check_unshared(groups: list[list[str]]) -> None:
    """A site per reading group needs a module per group: a layer shared across depth cannot take a
    map of its own at each step."""
    first = [g[0] for g in groups]
    shared = next((m for m in first if first.count(m) > 1), None)
    if shared is not None:
        raise StrategyOptionError(
            f"strategy.residual: separate gives each reading site its own map, but {shared!r} reads the stream "
            f"at {first.count(shared)} steps of the depth (its weights are shared across layers); use all, first or last"
        )


def _separate_residual(
    graph: SymmetryGraph,
    out_graph: SymmetryGraph,
    stats: ActivationStats,
    corr: Mapping[str, Tensor],
    transform: Transform,
    positions: Mapping[str, int],
) -> SymmetryGraph:
    """``residual: separate``: each residual space split into one space per reading site, each
    permuted on its own site's correlation (in ``transform``); returns the split graph."""
    for res in _residual_names(graph):
        groups = [g for g, sp in zip(stats.residual_groups, stats.residual_spaces, strict=True) if sp == res]
        _check_unshared(groups)
        keys = [f"{res}@{k}" for k in range(len(groups))]
        if not groups or any(k not in corr for k in keys):
            continue
        out_graph = split_residual(out_graph, res, groups, positions)
        transform.pop(res, None)
        for k in keys:
            transform[k] = AxisMap(corr[k].shape[0], index=lap(corr[k])[0])
    return out_graph


def run(pair: Pair, options: HeadPermOptions, progress: Progress | None) -> Alignment:
    """Align ``pair`` by the correlation of its activations on the alignment data."""
    data = require_data(pair, "head-perm", "matches features by the correlation of their activations")
    assert pair.model_a is not None and pair.model_b is not None
    graph = pair.graph
    _check_applicable(graph, options, any("input_ids" in b for b in data.batches))
    notes: list[str] = []
    options, resolved = _settle(pair, options, notes)
    if options.form == "canonical" and (options.heads == "ignore-heads" or options.residual == "separate"):
        raise StrategyOptionError(
            "head-perm: `form: canonical` folds the norms of a model whose function it keeps, so it takes neither "
            "`heads: ignore-heads` nor `residual: separate`"
        )
    with timed() as timings:
        collect = _spaces_to_collect(graph, options)
        residual_mode = options.residual if "residual" in options.components and options.residual else "identity"
        plan = _lockstep(pair, collect, residual_mode, notes)
        if plan is not None:
            transform, flat, matched, timings["features"] = _by_layer(pair, plan, collect, options, data, progress)
        else:
            stats = _whole_forwards(pair, collect, residual_mode, options, data, progress)
            timings["features"] = stats.seconds
            corr = {key: m.correlation() for key, m in stats.moments.items()}
            transform = graph.identity()
            flat = _solve(graph, collect, corr, options, transform)
        out_graph = graph
        if flat:
            out_graph = flatten_heads(out_graph, flat)
            notes.append(
                "heads: ignore-heads permutes the attention output's features across heads (Q, K and V with them): "
                "the aligned model B computes a different function"
            )
        if residual_mode == "separate":
            assert plan is None  # residual statistics need whole forwards
            positions = _module_positions(pair.model_a, data.batches[0])
            out_graph = _separate_residual(graph, out_graph, stats, corr, transform, positions)
            notes.append(
                "residual: separate gives each residual reading site its own permutation, so residual connections "
                "no longer line up: the aligned model B computes a different function"
            )
        if plan is None:
            matched = matched_correlation(graph, corr, transform)
    diagnostics = {"alignment": {"measure": "activation correlation of matched features", "spaces": matched}}
    forms = _forms(pair, out_graph, options)
    return Alignment(
        "head-perm",
        *forms[:3],
        transform,
        exact=exact(options),
        canonical=options.form == "canonical",
        untied=forms[3],
        notes=notes,
        timings=timings,
        diagnostics=diagnostics,
        resolved=resolved,
    )


def _forms(
    pair: Pair, graph: SymmetryGraph, options: HeadPermOptions
) -> tuple[SymmetryGraph, Mapping[str, Tensor], Mapping[str, Tensor], list[str]]:
    """The graph and the two state dicts the permutations apply to, and the aliases untied: as
    stored, or (``form: canonical``) with the norm scales folded into their readers. Permutations
    commute with the fold, so the matching found on the stored models holds in either form."""
    if options.form == "stored":
        return graph, pair.sd_a, pair.sd_b, []
    sd_a, cgraph, untied = canonicalize(graph, pair.sd_a)
    sd_b, _, _ = canonicalize(graph, pair.sd_b)
    return cgraph, sd_a, sd_b, untied
