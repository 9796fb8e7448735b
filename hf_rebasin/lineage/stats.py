"""The lineage statistic, as pure tensor functions: a weight's learned signal and its bulk, and how
much bulk two models share, space by space.

A trained weight matrix is a few large directions (what training learned) on top of a bulk that
looks random: what its initialisation and the path of its training left. Two models trained apart
on the same data learn alike signal (the same token statistics, the same circuits), so their
aligned signals agree in part; their bulks are two independent draws and do not, even from one
initialisation trained on other text. A descendant (a fine-tune, continued
pretraining, a merge with A in it) keeps A's bulk. So the evidence of lineage is the bulk: each
tensor is split into its top singular directions (the signal) and the rest; the alignment is
fitted on the signals alone and the similarity is read on the bulks. A truncated SVD commutes with
every map of the symmetry catalogue (permutations, signed permutations, rotations: orthogonal on
each side), so the split of a transformed model is the transformed split.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from scipy.stats import norm
from torch import Tensor

from hf_rebasin.alignment.features.lowrank import LowRank
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import Fused, Space, split_ref

__all__ = [
    "POSITIONS",
    "RESIDUAL",
    "SHARED_ORIGIN",
    "SIGNAL_CAP",
    "SIGNAL_SHARE",
    "Signals",
    "SpaceSums",
    "add_sums",
    "combined_z",
    "is_matrix",
    "log10_sf",
    "signal_of",
    "signal_rank",
    "signals",
    "space_of",
    "z_score",
]

SIGNAL_SHARE = 0.125  # share of a matrix's rank taken as its learned signal
SIGNAL_CAP = 64  # at most this many directions per matrix (a 7B MLP's 4,096: the SVD stays cheap)
EXACT_SVD = 1 << 20  # matrices with fewer entries take a full SVD; larger ones a randomized one
OVERSAMPLE = 2  # the randomized SVD carries this many times the rank (top 64 of a flat spectrum: 0.2 %)
POWER_ITERATIONS = 8  # 3 left a flat spectrum's top 64 unlike in a model and its moved copy (docs: lineage, At scale)
RESIDUAL = "embeddings"  # the evidence of tensors bound to the residual stream alone (token tables, LM head)
POSITIONS = "positions"  # of learned position tables, also bound to the stream alone
SHARED_ORIGIN = (RESIDUAL, POSITIONS)  # outside the layers: each tested against its own null
_POSITION_TABLE = re.compile(r"(^|\.)(wpe|position_embeddings|embed_positions)(\.|$)")


def signal_rank(shape: tuple[int, ...], share: float = SIGNAL_SHARE, cap: int = SIGNAL_CAP) -> int:
    """How many top singular directions of a matrix of ``shape`` (its last two dims) count as signal."""
    return max(1, min(cap, math.ceil(share * min(shape[-2:]))))


def _range_finder(m: Tensor, q: int, seed: int) -> Tensor:
    """An orthonormal basis of ``m``'s top-``q`` column space: a seeded randomized range finder with
    power iterations (Halko et al.), so that a model compared twice gets the same split."""
    g = torch.Generator().manual_seed(seed)
    y = m @ torch.randn(m.shape[1], q, generator=g, dtype=m.dtype).to(m.device)
    basis = torch.linalg.qr(y).Q
    for _ in range(POWER_ITERATIONS):
        basis = torch.linalg.qr(m @ torch.linalg.qr(m.T @ basis).Q).Q
    return basis


def signal_of(t: Tensor, rank: int, seed: int = 0) -> LowRank:
    """The rank-``rank`` truncated SVD of ``t`` (batched over leading dims) as float32 factors
    ``(U·S, Vᵀ)``: exact in float64 below `EXACT_SVD` entries, else randomized in float32 (a top-64
    of a 14,336 × 4,096 matrix in seconds)."""
    x = t.detach()
    if x.shape[-1] * x.shape[-2] <= EXACT_SVD:
        u, s, vh = torch.linalg.svd(x.to(torch.float64), full_matrices=False)
        left, right = u[..., :rank] * s[..., None, :rank], vh[..., :rank, :]
        return LowRank(left.to(torch.float32), right.to(torch.float32))
    lefts, rights = [], []
    for m in x.to(torch.float32).reshape(-1, *x.shape[-2:]):
        basis = _range_finder(m, OVERSAMPLE * rank, seed)
        u, s, vh = torch.linalg.svd(basis.T @ m, full_matrices=False)
        lefts.append((basis @ u[:, :rank]) * s[:rank])
        rights.append(vh[:rank])
    return LowRank(
        torch.stack(lefts).reshape(*x.shape[:-1], rank), torch.stack(rights).reshape(*x.shape[:-2], rank, -1)
    )


@dataclass
class Signals:
    """One model's learned signal: every weight matrix (2 dims or more: stacked experts split one by
    one) as its top singular directions, kept as factors (about 1 % of a 7B model's bytes); every
    other tensor (norms, biases) is all signal and kept whole. ``ranks``: each matrix's rank."""

    factors: dict[str, LowRank]
    whole: dict[str, Tensor]
    ranks: dict[str, int]

    def dense(self, name: str) -> Tensor:
        return self.factors[name].dense() if name in self.factors else self.whole[name]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.factors.values()) + sum(
            t.numel() * t.element_size() for t in self.whole.values()
        )


def is_matrix(shape: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether a tensor of this shape and dtype is split into signal and bulk."""
    return dtype.is_floating_point and len(shape) >= 2 and min(shape[-2:]) >= 2


def signals(
    state: Mapping[str, Tensor],
    ties: Mapping[str, str],
    *,
    share: float = SIGNAL_SHARE,
    cap: int = SIGNAL_CAP,
    progress: Callable[[int, int], None] | None = None,
) -> Signals:
    """Every tensor of ``state`` read once (a lazy state: one at a time) and kept as its signal;
    a tied alias (``ties``: alias → source) shares its source's."""
    out = Signals({}, {}, {})
    names = [n for n in state if not (n in ties and ties[n] in state)]
    for i, name in enumerate(names):
        t = state[name]
        if is_matrix(t.shape, t.dtype):
            out.ranks[name] = signal_rank(tuple(t.shape), share, cap)
            out.factors[name] = signal_of(t, out.ranks[name])
        else:
            out.whole[name] = t
        del t
        if progress is not None:
            progress(i + 1, len(names))
    for alias, source in ties.items():
        if alias in state and source in state:
            if source in out.factors:
                out.factors[alias], out.ranks[alias] = out.factors[source], out.ranks[source]
            elif source in out.whole:
                out.whole[alias] = out.whole[source]
    return out


def space_of(graph: SymmetryGraph, name: str) -> str:
    """The space a tensor is evidence for: the first space it is bound to other than the residual
    stream (a layer's heads, units or experts); for the tensors that only read or write the stream,
    `POSITIONS` (learned position tables) or `RESIDUAL` (token tables, the output head)."""
    binding = graph.bindings.get(name)
    for ref in binding.axes if binding is not None else ():
        if ref is None:
            continue
        for part in ref.parts if isinstance(ref, Fused) else (ref,):
            space = split_ref(part)[0]
            sp = graph.spaces.get(space)
            if not (isinstance(sp, Space) and sp.kind == "residual"):
                return space
    return POSITIONS if _POSITION_TABLE.search(name) else RESIDUAL


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


def add_sums(sums: SpaceSums, a: Tensor, b: Tensor, rank: int) -> None:
    """Add one matrix's bulks (A's and B's, one shape) to its space's sums: products in float32,
    summed in float64."""
    sums.dot += float((a * b).sum(dtype=torch.float64))
    sums.norm_a += float((a * a).sum(dtype=torch.float64))
    sums.norm_b += float((b * b).sum(dtype=torch.float64))
    rows, cols = a.shape[-2:]
    sums.dof += (rows - rank) * (cols - rank) * (a.numel() // (rows * cols))


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
