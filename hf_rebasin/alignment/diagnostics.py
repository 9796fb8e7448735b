"""How well an alignment matched each space: the similarity of matched features before and after.

For every space (the residual stream, each layer's heads and MLP units) a feature of A and the
feature of B in the same slot are compared by the cosine of their weight vectors: every weight
that reads or writes the feature, concatenated over all tensors bound to the space (for heads, per
role Q, K, V, O), with every other axis in A's basis. "Before" compares B as it is, "after" B under
the transform. The mean over a space's features says where the alignment is strong and where the
two models simply learned different features: the weakest space is where a barrier comes from
(Verma & Elbayad's Fig. 4 does this with activation correlations; this needs no data, so every
strategy gets it). Strategies that collect activation statistics (head-perm) report that instead:
`matched_correlation` reads the correlation of matched features off the matrices they solved on.

Torch only; one pass over the tensors per side (a lazy state dict is read tensor by tensor), each
compared in blocks of features, so a streamed run holds one tensor per side, never a float64 copy
of the embedding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.lazy import dtype_of, give_back_freed, row_blocks, shape_of
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import AxisRef, ExpertSpace, Fused, HeadSpace, Space, split_ref
from hf_rebasin.symmetry.transforms import AxisMap, ExpertMap, HeadMap, SpaceMap

__all__ = ["feature_similarity", "matched_correlation"]


def _accumulate(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    transform: Mapping[str, SpaceMap] | None,
) -> dict[tuple[str, str | None], list[Tensor]]:
    """Per (space, role): per-feature ``[Σ a·b, Σ a², Σ b²]`` over every tensor axis bound to it."""
    sums: dict[tuple[str, str | None], list[Tensor]] = {}
    cache: dict[str, AxisMap | None] = {}
    passed = 0  # bytes of float32 tensors (A and B) read since the heap was last given back
    for name, binding in graph.bindings.items():
        if name in graph.ties or name not in sd_a or name not in sd_b:
            continue
        nbytes = 8 * math.prod(shape_of(sd_a, name))  # float32, A and B
        if passed and passed + nbytes > GIVE_BACK_BYTES:
            give_back_freed()
            passed = 0
        passed += nbytes
        if not dtype_of(sd_a, name).is_floating_point:
            continue
        # an unbound first axis (an embedding's vocabulary): every sum below is over it, so blocks of its rows add up
        pairs = row_blocks([sd_a, sd_b], name) if binding.axes[0] is None else iter([[sd_a[name], sd_b[name]]])
        for a, b in pairs:
            if transform is not None:
                b = graph.map_tensor(name, b, transform, cache=cache)
            _add_sums(graph, sums, name, binding.axes, a, b)
            del a, b
    return sums


def _add_sums(
    graph: SymmetryGraph,
    sums: dict[tuple[str, str | None], list[Tensor]],
    name: str,
    axes: tuple[AxisRef | None, ...],
    a: Tensor,
    b: Tensor,
) -> None:
    """Add one tensor's (or block of rows') per-feature sums to ``sums``."""
    for axis, ref in enumerate(axes):
        if ref is None:
            continue
        parts = ref.parts if isinstance(ref, Fused) else (ref,)
        offset = 0
        for part in parts:
            size = graph.ref_size(part)
            space, role = split_ref(part)
            pa = graph.part(name, a, axis, offset, size).movedim(axis, 0)
            pb = graph.part(name, b, axis, offset, size).movedim(axis, 0)
            acc = sums.setdefault(
                (space, role), [torch.zeros(size, dtype=torch.float64, device=pa.device) for _ in range(3)]
            )
            for start, stop in _blocks(size, math.prod(pa.shape[1:])):
                xa, xb = _float64_rows(pa[start:stop]), _float64_rows(pb[start:stop])
                acc[0][start:stop] += (xa * xb).sum(1)
                acc[1][start:stop] += (xa * xa).sum(1)
                acc[2][start:stop] += (xb * xb).sum(1)
                del xa, xb
            offset += size


BLOCK_ELEMENTS = 1 << 22  # float64 values per block of features (32 MB): the sums' working memory
# A streamed pass frees every tensor it reads, many of them small enough for glibc to keep in its
# heap, fragmented: without a give-back the pass over TinyLlama peaked 1 GB above what it held.
# Given back once per GIVE_BACK_BYTES read (Qwen3-0.6B: ~24 times a pass), the trims cost within
# noise; once per GB, the heap of a Qwen3-0.6B pass still grew 0.6 GB above what it held.
GIVE_BACK_BYTES = 1 << 28


def _blocks(features: int, per_feature: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of features holding at most `BLOCK_ELEMENTS` values each (one
    feature at least). Each feature's sums are over its own row alone, so blocks change no value;
    a whole float64 copy of the embedding, moved axis first, was the peak of a streamed run."""
    step = max(1, BLOCK_ELEMENTS // max(1, per_feature))
    return [(i, min(i + step, features)) for i in range(0, features, step)]


def _float64_rows(x: Tensor) -> Tensor:
    """``x`` (features first) as contiguous float64 rows, one per feature, in one copy."""
    return x.to(torch.float64, memory_format=torch.contiguous_format).reshape(x.shape[0], -1)


def _means(graph: SymmetryGraph, sums: Mapping[tuple[str, str | None], list[Tensor]]) -> dict[str, float]:
    """Mean cosine per space (over all features of all its roles)."""
    cosines: dict[str, list[Tensor]] = {}
    for (space, _role), (dot, na, nb) in sums.items():
        cos = dot / (na * nb).sqrt().clamp_min(1e-30)
        cosines.setdefault(space, []).append(cos)
    return {space: float(torch.cat(cosines[space]).mean()) for space in graph.spaces if space in cosines}


def feature_similarity(
    graph: SymmetryGraph,
    sd_a: Mapping[str, Tensor],
    sd_b: Mapping[str, Tensor],
    transform: Mapping[str, SpaceMap],
) -> dict[str, Any]:
    """``{"measure": ..., "spaces": [{"space", "kind", "features", "before", "after"}, ...]}`` for every
    space with bound tensors, in the graph's order (a list: ``rebasin.json`` sorts object keys);
    ``sd_a`` / ``sd_b`` in the form ``transform`` refers to."""
    before = _means(graph, _accumulate(graph, sd_a, sd_b, None))
    identity = all(m.is_identity() for m in transform.values())
    after = before if identity else _means(graph, _accumulate(graph, sd_a, sd_b, transform))
    spaces: list[dict[str, Any]] = []
    for name, sp in graph.spaces.items():
        if name not in before:
            continue
        if isinstance(sp, HeadSpace):
            features, kind = sp.num_heads * sp.head_dim, "heads"
        elif isinstance(sp, ExpertSpace):
            features, kind = sp.num_experts * sp.units, sp.kind
        else:
            features, kind = sp.size, sp.kind
        spaces.append({"space": name, "kind": kind, "features": features, "before": before[name], "after": after[name]})
    return {"measure": "weight cosine of matched features", "spaces": spaces}


def matched_correlation(
    graph: SymmetryGraph, corr: Mapping[str, Tensor], transform: Mapping[str, SpaceMap]
) -> list[dict[str, Any]]:
    """Per space, the mean activation correlation of A's feature i with B's feature in slot i,
    before (B as it is) and after (B's feature the transform puts there), over every feature of
    every role that has statistics. ``corr`` keys are spaces, ``"space:role"`` or residual sites
    (``"res@3"``, with a map of their own); ``[A feature, B feature]`` matrices. Entries are in the
    form of `feature_similarity`'s ``spaces``; spaces without statistics or a permutation are left
    out."""
    before: dict[str, list[Tensor]] = {}
    after: dict[str, list[Tensor]] = {}
    kinds: dict[str, str] = {}
    for key, c in corr.items():
        space, role = split_ref(key)
        m = transform.get(space)
        if isinstance(m, HeadMap | ExpertMap):
            sp = graph.spaces.get(space)
            if not isinstance(sp, HeadSpace | ExpertSpace) or role is None:
                continue
            m = m.expand(sp, role)  # type: ignore[arg-type]  # a head map with its head space, experts with theirs
        if m is None or not m.is_permutation:
            continue
        rows = torch.arange(c.shape[0])
        before.setdefault(space, []).append(c.diagonal().double())
        after.setdefault(space, []).append(c[rows, rows if m.index is None else m.index].double())
        base = graph.spaces.get(space.partition("@")[0])
        kinds[space] = (
            "experts"
            if isinstance(base, ExpertSpace)
            else "heads"
            if role is not None
            else base.kind
            if isinstance(base, Space)
            else "residual"
        )
    return [
        {
            "space": space,
            "kind": kinds[space],
            "features": int(before[space][0].numel()),
            "before": float(torch.cat(before[space]).mean()),
            "after": float(torch.cat(after[space]).mean()),
        }
        for space in before
    ]
