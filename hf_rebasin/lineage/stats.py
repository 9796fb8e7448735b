"""The lineage statistic, as pure tensor functions: a weight's learned signal and its bulk, and how
much bulk two models share, space by space.

A trained weight matrix is a few large directions (what training learned) on top of a bulk that
still looks like its random initialisation. Two models trained apart on the same data learn alike
signal (the same token statistics, the same circuits), so their aligned signals agree in part;
their bulks are two independent draws and do not. A descendant (a fine-tune, continued
pretraining, a merge with A in it) keeps A's bulk. So the evidence of lineage is the bulk: each
tensor is split into its top singular directions (the signal) and the rest; the alignment is
fitted on the signals alone and the similarity is read on the bulks. A truncated SVD commutes with
every map of the symmetry catalogue (permutations, signed permutations, rotations: orthogonal on
each side), so the split of a transformed model is the transformed split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from scipy.stats import norm
from torch import Tensor

from ..symmetry import Fused, Space, SymmetryGraph, split_ref

__all__ = [
    "RESIDUAL",
    "SIGNAL_CAP",
    "SIGNAL_SHARE",
    "SpaceSums",
    "Split",
    "combined_z",
    "log10_sf",
    "signal_rank",
    "space_of",
    "split_state",
    "sums_by_space",
    "z_score",
]

SIGNAL_SHARE = 0.125  # share of a matrix's rank taken as its learned signal
SIGNAL_CAP = 64  # at most this many directions per matrix (a 7B MLP's 4,096: the SVD stays cheap)
EXACT_SVD = 1 << 20  # matrices with fewer entries take a full SVD; larger ones a randomized one
RESIDUAL = "embeddings"  # the evidence of tensors bound to the residual stream alone


def signal_rank(shape: tuple[int, ...], share: float = SIGNAL_SHARE, cap: int = SIGNAL_CAP) -> int:
    """How many top singular directions of a matrix of ``shape`` (its last two dims) count as signal."""
    return max(1, min(cap, math.ceil(share * min(shape[-2:]))))


def _signal(t: Tensor, rank: int) -> Tensor:
    """The rank-``rank`` truncated SVD of ``t`` (batched over leading dims), in float64."""
    x = t.detach().to(torch.float64)
    if x.shape[-1] * x.shape[-2] <= EXACT_SVD:
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        return (u[..., :rank] * s[..., None, :rank]) @ vh[..., :rank, :]
    flat = x.reshape(-1, *x.shape[-2:])
    parts = []
    for m in flat:  # randomized range finder: a few passes over the matrix, exact enough for a top-k
        u, s, v = torch.svd_lowrank(m, q=rank + 8, niter=3)
        parts.append((u[:, :rank] * s[:rank]) @ v[:, :rank].T)
    return torch.stack(parts).reshape(x.shape)


@dataclass
class Split:
    """One model's weights split into signal and bulk (weight matrices only; every other tensor is
    signal, and zero in the bulk), with each matrix's signal rank."""

    signal: dict[str, Tensor]
    bulk: dict[str, Tensor]
    ranks: dict[str, int]


def split_state(state: Mapping[str, Tensor], share: float = SIGNAL_SHARE, cap: int = SIGNAL_CAP) -> Split:
    """Every weight matrix (2 dims or more: stacked experts split one by one) split in two."""
    signal: dict[str, Tensor] = {}
    bulk: dict[str, Tensor] = {}
    ranks: dict[str, int] = {}
    for name, t in state.items():
        if not t.is_floating_point() or t.dim() < 2 or min(t.shape[-2:]) < 2:
            signal[name], bulk[name] = t, torch.zeros_like(t)
            continue
        ranks[name] = signal_rank(tuple(t.shape), share, cap)
        top = _signal(t, ranks[name])
        signal[name] = top.to(t.dtype)
        bulk[name] = (t.detach().to(torch.float64) - top).to(t.dtype)
    return Split(signal, bulk, ranks)


def space_of(graph: SymmetryGraph, name: str) -> str:
    """The space a tensor is evidence for: the first space it is bound to other than the residual
    stream (a layer's heads, units or experts); `RESIDUAL` for the tensors that only read or write
    the stream (embeddings, the output head)."""
    binding = graph.bindings.get(name)
    for ref in binding.axes if binding is not None else ():
        if ref is None:
            continue
        for part in ref.parts if isinstance(ref, Fused) else (ref,):
            space = split_ref(part)[0]
            sp = graph.spaces.get(space)
            if not (isinstance(sp, Space) and sp.kind == "residual"):
                return space
    return RESIDUAL


@dataclass
class SpaceSums:
    """One space's sums over its matrices' bulks: A·B, A·A and B·B, and the entries outside the
    signal (the bulk's degrees of freedom)."""

    dot: float = 0.0
    norm_a: float = 0.0
    norm_b: float = 0.0
    dof: float = 0.0

    @property
    def similarity(self) -> float:
        """The cosine of the two bulks (0 when either is empty)."""
        denom = math.sqrt(self.norm_a * self.norm_b)
        return self.dot / denom if denom > 0 else 0.0


def sums_by_space(
    graph: SymmetryGraph, bulk_a: Mapping[str, Tensor], bulk_b: Mapping[str, Tensor], ranks: Mapping[str, int]
) -> dict[str, SpaceSums]:
    """The bulk sums of every space over the weight matrices bound to it."""
    out: dict[str, SpaceSums] = {}
    for name, rank in ranks.items():
        a, b = bulk_a[name].to(torch.float64), bulk_b[name].to(torch.float64)
        s = out.setdefault(space_of(graph, name), SpaceSums())
        s.dot += float((a * b).sum())
        s.norm_a += float((a * a).sum())
        s.norm_b += float((b * b).sum())
        rows, cols = a.shape[-2:]
        s.dof += (rows - rank) * (cols - rank) * (a.numel() // (rows * cols))
    return out


def z_score(similarity: float, dof: float, null: float) -> float:
    """How far a bulk similarity lies above ``null`` in units of the spread of the cosine of two
    independent bulks of ``dof`` entries (1/√dof)."""
    return (similarity - null) * math.sqrt(max(dof, 1.0))


def combined_z(zs: list[float]) -> float:
    """Stouffer's combination of per-space z-scores."""
    return sum(zs) / math.sqrt(len(zs)) if zs else 0.0


def log10_sf(z: float) -> float:
    """log₁₀ of the standard normal's upper tail at ``z`` (a p-value that does not underflow)."""
    return float(norm.logsf(z)) / math.log(10)
