"""Rows a model lacks, filled in the merge's basis before anything is averaged or added.

Models brought to one vocabulary layout (`layout`) hold zeros where they have no token. Once they
are aligned, every row is in one basis and a missing row can be borrowed. The rules are mergekit's
(``tokenizer.source: union``): a token only one model has keeps that model's row in every model, so
the average is that row whatever the weights; a token several have, the reference among them,
takes the reference's row in the models that lack it; otherwise the mean of the models that have
it. So a row absent from a model contributes, in that model's share of the average, the row of the
reference (or the mean of those that have it), never zero.

A transport (θ = B + α·π(τ)) has its own rule, by what a task vector means. A token the fine-tune
added (the base lacks it) was started, as ``resize_token_embeddings`` starts it, from the mean of
the base's rows: its task vector is its row's change from that mean, π(row) − mean(π(base)), and
it lands on the target's row for it, or where the target has none on the target's own mean row
(the target resized the same way). Where the target is the base with its features moved, that is
the fine-tune's row moved, exactly (the means are over the rows base and target share). A token the target lacks but the base has starts from the moved
base's row and receives τ; a token the fine-tune lacks carries no task vector.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from hf_rebasin.core.lazy import LazyState, mean_rows, picked_rows, rowwise
from hf_rebasin.merging.interpolate import StorageKey, storage_key

__all__ = ["fill_merge", "fill_transport"]


def _rows(t: Tensor, axis: int) -> Tensor:
    return t.movedim(axis, 0)


def fill_merge(
    states: Sequence[Mapping[str, Tensor]], present: Sequence[Tensor], names: Mapping[str, int]
) -> list[dict[str, Tensor]] | list[LazyState]:
    """``states`` (model 0 the reference, all in one basis) with the rows each lacks filled:
    the reference's where it has the row, else the mean of the models that have it. ``present[i]``:
    model i's rows of its own (bool over the vocabulary axis); ``names``: the tensors with that axis
    and which axis it is. Streamed states stay streamed, filled a block of rows at a time."""
    have = torch.stack(list(present))  # [models, vocabulary]
    if all(isinstance(s, LazyState) for s in states):
        return [_lazy_merge(states, have, names, i) for i in range(len(states))]  # type: ignore[arg-type]
    out = [dict(s) for s in states]
    for name, axis in names.items():
        if any(name not in s for s in states):
            continue
        filled = _merge_rows([_rows(s[name], axis) for s in states], have)
        for i, r in enumerate(filled):
            out[i][name] = r.movedim(0, axis)
    return _retie(out, states)


def _merge_rows(rows: Sequence[Tensor], have: Tensor) -> list[Tensor]:
    """Every model's rows (vocabulary first) with those it lacks filled (`fill_merge`)."""
    rows = [r.clone() for r in rows]
    have = have.to(rows[0].device)
    count = have.sum(0)
    total = sum(r * _expand(h, r).to(r.dtype) for r, h in zip(rows, have, strict=True))
    mean = total / _expand(count.clamp(min=1), rows[0]).to(rows[0].dtype)
    fill = torch.where(_expand(have[0], rows[0]), rows[0], mean)
    for i, r in enumerate(rows):
        missing = ~have[i]
        if bool(missing.any()):
            r[missing] = fill[missing].to(r.dtype)
    return rows


def _lazy_merge(states: Sequence[LazyState], have: Tensor, names: Mapping[str, int], i: int) -> LazyState:
    """Model ``i`` of `fill_merge` over streamed states: each block of rows from the same block of
    every model."""

    def block(name: str, start: int, stop: int) -> Tensor:
        rows = [picked_rows(s, name, torch.arange(start, stop)) for s in states]
        return _merge_rows(rows, have[:, start:stop])[i]

    return rowwise(states[i], _first_axis(names, states), block)


def _expand(mask: Tensor, like: Tensor) -> Tensor:
    return mask.reshape(-1, *([1] * (like.dim() - 1)))


def _retie(out: list[dict[str, Tensor]], states: Sequence[Mapping[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Names that were one tensor in a state (a tied LM head) one tensor again."""
    for o, s in zip(out, states, strict=True):
        first: dict[StorageKey, str] = {}
        for name, t in s.items():
            key = storage_key(t)
            if key in first and name in o and first[key] in o:
                o[name] = o[first[key]]
            else:
                first.setdefault(key, name)
    return out


def fill_transport(
    target: Mapping[str, Tensor],
    tau: Mapping[str, Tensor],
    moved_base: Mapping[str, Tensor],
    present: tuple[Tensor, Tensor, Tensor],
    names: Mapping[str, int],
) -> tuple[Mapping[str, Tensor], Mapping[str, Tensor]]:
    """``(target, τ)`` with the rows the models lack settled (module docstring): ``tau`` is
    π(fine-tune) − π(base) with zeros where a model has no row, ``moved_base`` is π(base), and
    ``present`` the rows of their own of (target, base, fine-tune). Streamed states stay streamed."""
    if isinstance(target, LazyState) and isinstance(tau, LazyState) and isinstance(moved_base, LazyState):
        return _lazy_transport(target, tau, moved_base, present, names)
    new_target, new_tau = dict(target), dict(tau)
    for name, axis in names.items():
        if name not in target or name not in tau:
            continue
        t, d, b = _rows(target[name], axis), _rows(tau[name], axis), _rows(moved_base[name], axis)
        shared = present[1] & present[0]  # the means are taken over the rows base and target share
        d = _tau_rows(d, present, _mean(b, shared.to(b.device)))
        t = _target_rows(t, b, present, _mean(t, shared.to(t.device)))
        new_target[name], new_tau[name] = t.movedim(0, axis), d.movedim(0, axis)
    return _retie([new_target], [target])[0], _retie([new_tau], [tau])[0]


def _target_rows(t: Tensor, b: Tensor, present: tuple[Tensor, Tensor, Tensor], mean_t: Tensor) -> Tensor:
    """The target's rows (vocabulary first) settled as `fill_transport` says; ``mean_t``: its mean
    row over the rows base and target share."""
    t = t.clone()
    has_t, has_b, has_f = (p.to(t.device) for p in present)
    t[~has_b & has_f & ~has_t] = mean_t.to(t)  # the target's own mean row, as resizing starts it
    from_base = has_b & ~has_t
    t[from_base] = b[from_base.to(b.device)].to(t)
    return t


def _tau_rows(d: Tensor, present: tuple[Tensor, Tensor, Tensor], mean_b: Tensor) -> Tensor:
    """τ's rows (vocabulary first) settled as `fill_transport` says; ``mean_b``: the moved base's
    mean row over the rows base and target share."""
    d = d.clone()
    _, has_b, has_f = (p.to(d.device) for p in present)
    added = ~has_b & has_f  # the fine-tune's own tokens: τ there is π(fine-tune)'s row
    d[added] = (d[added] - mean_b.to(d)).to(d.dtype)  # its change from a mean row
    d[~has_f] = 0  # no task vector where the fine-tune has no row
    return d


def _lazy_transport(
    target: LazyState,
    tau: LazyState,
    moved_base: LazyState,
    present: tuple[Tensor, Tensor, Tensor],
    names: Mapping[str, int],
) -> tuple[LazyState, LazyState]:
    """`fill_transport` over streamed states, a block of rows at a time: the target's rows from the
    target's and the moved base's, τ's from τ's alone (each mean row taken once per tensor)."""
    todo = _first_axis(names, [target, tau])
    shared = torch.nonzero(present[0] & present[1]).squeeze(1)

    def part(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return present[0][rows], present[1][rows], present[2][rows]

    @functools.cache
    def mean_t(name: str) -> Tensor:
        return mean_rows(target, name, shared)

    @functools.cache
    def mean_b(name: str) -> Tensor:
        return mean_rows(moved_base, name, shared)

    def target_block(name: str, start: int, stop: int) -> Tensor:
        rows = torch.arange(start, stop)
        t, b = picked_rows(target, name, rows), picked_rows(moved_base, name, rows)
        return _target_rows(t, b, part(rows), mean_t(name))

    def tau_block(name: str, start: int, stop: int) -> Tensor:
        rows = torch.arange(start, stop)
        return _tau_rows(picked_rows(tau, name, rows), part(rows), mean_b(name))

    return rowwise(target, todo, target_block), rowwise(tau, todo, tau_block)


def _first_axis(names: Mapping[str, int], states: Sequence[Mapping[str, Tensor]]) -> set[str]:
    """The vocabulary tensors every state has, each with its rows on the first axis (the only axis
    a streamed state is read in blocks of)."""
    found = {n for n in names if all(n in s for s in states)}
    if any(names[n] != 0 for n in found):
        raise AssertionError("streamed vocabulary rows are filled on the first axis only")
    return found


def _mean(rows: Tensor, mask: Tensor) -> Tensor:
    """The mean of the rows ``mask`` marks (zeros when none)."""
    if not bool(mask.any()):
        return torch.zeros_like(rows[0])
    return rows[mask].to(torch.float64).mean(0).to(rows.dtype)
