"""Tensors that a model's files lacked and transformers initialised when it loaded: a pooler
(sentence-embedding checkpoints are often saved without it) or a task head over a bare model's
weights. Their values are random. A merge must not average them with trained ones, so each takes
the value of the models that have it, in the merge's basis. A tensor that every model lacked is
left out of the written folder, so that loading it initialises that tensor again and says so.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from hf_rebasin.core.lazy import replaced

__all__ = ["fill_initialised", "fill_transport", "initialised_note", "left_out"]


def fill_initialised(
    states: Sequence[Mapping[str, Tensor]], initialised: Sequence[Collection[str]]
) -> list[Mapping[str, Tensor]]:
    """``states`` (every model in one basis, in the order of ``initialised``) with each tensor a
    model initialised replaced by the mean of the models that have it (two models: the other one's).
    A tensor no model has stays as it is; a lazy state stays lazy."""
    if len(states) != len(initialised):
        raise ValueError(f"{len(states)} states but {len(initialised)} sets of initialised tensors")
    values: list[dict[str, Tensor]] = [{} for _ in states]
    for name in sorted(set().union(*initialised)):
        present = [s[name] for s, init in zip(states, initialised, strict=True) if name not in init]
        if not present:
            continue
        mean = (
            present[0] if len(present) == 1 else torch.stack([p.double() for p in present]).mean(0).to(present[0].dtype)
        )
        for i, init in enumerate(initialised):
            if name in init:
                values[i][name] = mean
    return [replaced(s, v) for s, v in zip(states, values, strict=True)]


def fill_transport(
    target: Mapping[str, Tensor],
    tau: Mapping[str, Tensor],
    moved_base: Mapping[str, Tensor],
    initialised: tuple[Collection[str], Collection[str], Collection[str]],
) -> tuple[Mapping[str, Tensor], Mapping[str, Tensor]]:
    """B and π(τ) for ``B + α·π(τ)`` with the tensors a model's files lacked settled, in B's basis
    (``initialised``: the target's, the base's, the fine-tune's). The target's missing tensor starts
    from the moved base's; a fine-tune that lacks it moves nothing there (τ = 0); one whose base
    lacks it brings its own whole (π of the fine-tune's tensor, α = 1 or not)."""
    in_target, in_base, in_ft = (set(i) for i in initialised)
    new_target: dict[str, Tensor] = {}
    new_tau: dict[str, Tensor] = {}
    for name in sorted(in_target | in_base | in_ft):
        if name in in_target and name not in in_base:
            new_target[name] = moved_base[name]
        if name in in_ft:
            new_tau[name] = torch.zeros_like(tau[name])
        elif name in in_base:  # the base's is zeros, so π(τ) there is the fine-tune's own tensor
            new_target[name], new_tau[name] = tau[name], torch.zeros_like(tau[name])
    return replaced(target, new_target), replaced(tau, new_tau)


def left_out(initialised: Sequence[Collection[str]]) -> set[str]:
    """The tensors every model initialised: what no model's files hold, so no output should either."""
    return set.intersection(*(set(i) for i in initialised)) if initialised else set()


def initialised_note(model: str, initialised: Mapping[str, str]) -> str:
    """The record's line for one model: what its files lacked and what transformers made of it."""
    by_why: dict[str, list[str]] = {}
    for name, why in initialised.items():
        by_why.setdefault(why, []).append(name)
    parts = "; ".join(f"{why}: {', '.join(names)}" for why, names in by_why.items())
    return (
        f"{model}: its files lack tensors that transformers initialises at random when it loads them ({parts}); "
        "they are read as zeros: no alignment or lineage compares them, and a merge takes them from the models "
        "that have them"
    )
