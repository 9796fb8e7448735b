"""Rows a model lacks, filled in the merge's basis before anything is averaged or added.

Models brought to one vocabulary layout (`io.rows`) hold zeros where they have no token. Once they
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

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from hf_rebasin.merging.interpolate import StorageKey, storage_key

__all__ = ["fill_merge", "fill_transport"]


def _rows(t: Tensor, axis: int) -> Tensor:
    return t.movedim(axis, 0)


def fill_merge(
    states: Sequence[Mapping[str, Tensor]], present: Sequence[Tensor], names: Mapping[str, int]
) -> list[dict[str, Tensor]]:
    """``states`` (model 0 the reference, all in one basis) with the rows each lacks filled:
    the reference's where it has the row, else the mean of the models that have it. ``present[i]``:
    model i's rows of its own (bool over the vocabulary axis); ``names``: the tensors with that axis
    and which axis it is."""
    out = [dict(s) for s in states]
    for name, axis in names.items():
        if any(name not in s for s in states):
            continue
        rows = [_rows(s[name], axis).clone() for s in states]
        have = torch.stack([p.to(rows[0].device) for p in present])  # [models, vocabulary]
        count = have.sum(0)
        total = sum(r * _expand(h, r).to(r.dtype) for r, h in zip(rows, have, strict=True))
        mean = total / _expand(count.clamp(min=1), rows[0]).to(rows[0].dtype)
        fill = torch.where(_expand(have[0], rows[0]), rows[0], mean)
        for i, r in enumerate(rows):
            missing = ~have[i]
            if bool(missing.any()):
                r[missing] = fill[missing].to(r.dtype)
            out[i][name] = r.movedim(0, axis)
    return _retie(out, states)


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
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(target, τ)`` with the rows the models lack settled (module docstring): ``tau`` is
    π(fine-tune) − π(base) with zeros where a model has no row, ``moved_base`` is π(base), and
    ``present`` the rows of their own of (target, base, fine-tune)."""
    new_target, new_tau = dict(target), dict(tau)
    has_t, has_b, has_f = present
    for name, axis in names.items():
        if name not in target or name not in tau:
            continue
        t, d = _rows(target[name], axis).clone(), _rows(tau[name], axis).clone()
        b = _rows(moved_base[name], axis)
        dev = t.device
        shared = (has_b & has_t).to(dev)  # the means are taken over the rows base and target share
        added = (~has_b & has_f).to(dev)  # the fine-tune's own tokens: τ there is π(fine-tune)'s row
        d[added] = (d[added] - _mean(b, shared).to(d.dtype)).to(d.dtype)  # its change from a mean row
        fresh = added & ~has_t.to(dev)
        t[fresh] = _mean(t, shared).to(t.dtype)  # the target's own mean row, as resizing starts it
        from_base = (has_b & ~has_t).to(dev)
        t[from_base] = b[from_base].to(t.dtype)
        d[(has_b & ~has_f).to(dev) | (~has_b & ~has_f).to(dev)] = 0  # no task vector where the fine-tune has no row
        new_target[name], new_tau[name] = t.movedim(0, axis), d.movedim(0, axis)
    return _retie([new_target], [target])[0], _retie([new_tau], [tau])[0]


def _mean(rows: Tensor, mask: Tensor) -> Tensor:
    """The mean of the rows ``mask`` marks (zeros when none)."""
    if not bool(mask.any()):
        return torch.zeros_like(rows[0])
    return rows[mask].to(torch.float64).mean(0).to(rows.dtype)
