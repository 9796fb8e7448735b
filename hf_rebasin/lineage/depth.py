"""Layer maps between models of other depths: which layer of B descends from which layer of A.

A depth-pruned model keeps some of its parent's layers (every second one, or all but the last k), a
depth up-scaled one repeats them (SOLAR stacks two copies of Mistral's layers, the middle ones
dropped), a `passthrough` merge interleaves layer ranges of two parents. Each of B's layers is
scored against each of A's with what the layer's own symmetries cannot change: for the units of an
MLP, the products ``Xᵀ Y`` of every two of its matrices over the units (a permutation, signs or a
rotation of the units cancel in them), for heads the Q·Kᵀ and O·V circuits summed over heads (head
permutations and the maps inside heads cancel). They are read on the bulks (each matrix less its
learned signal, as the bulk test reads them), in A's residual basis (B's stream mapped by the map its
embeddings give), sketched to ``d × SKETCH``. The best map is solved from the scores (each of B's
layers its best match, or the best increasing map where it scores as well), then the pair is compared
once more as for equal depths, with A's layers renamed into B's depth under that map: the bulk test
per space gives each matched layer its p-value, and the verdict.

Pure tensor functions over states and graphs; `lineage.compare` calls them.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeGuard

import torch
from torch import Tensor

from hf_rebasin.alignment.features.weights import WeightViews
from hf_rebasin.alignment.strategies.engines.descent import solve_plain
from hf_rebasin.core.lazy import LazyState, RowReader, dtype_of, shape_of
from hf_rebasin.lineage.stats import Signals
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import HeadSpace, Space, split_ref
from hf_rebasin.symmetry.transforms import AxisMap, SpaceMap

__all__ = [
    "SKETCH",
    "ScalesView",
    "Source",
    "best_map",
    "layer_key",
    "layer_of",
    "layer_scores",
    "renamed",
    "signals_view",
    "state_view",
    "stream_maps",
]

SKETCH = 256  # columns each d × d circuit is sketched to: the scores' relative error is about 1/√SKETCH
MONOTONE_SHARE = 0.98  # an increasing map is taken when it scores at least this share of the best map's
_INDEXED = re.compile(r"(?:^|\.)([A-Za-z_]\w*)\.(\d+)\.")


@dataclass(frozen=True)
class Source:
    """Where one of B's layers comes from: layer ``layer`` of parent ``parent`` (an index into the
    parents given)."""

    parent: int
    layer: int


# --------------------------------------------------------------------------------------------
# Layer names
# --------------------------------------------------------------------------------------------


def layer_key(names: Iterable[str], layers: int) -> str | None:
    """The module list that holds the layers (``layers`` in ``model.layers.3.mlp``, ``h`` in
    ``transformer.h.3.mlp``): the first indexed module of the names whose indices are
    ``0 … layers − 1``."""
    seen: dict[str, set[int]] = {}
    for name in names:
        found = _INDEXED.search(name)
        if found is not None:
            seen.setdefault(found.group(1), set()).add(int(found.group(2)))
    return next((key for key, idx in seen.items() if idx == set(range(layers))), None)


def _layer_match(name: str, key: str) -> re.Match[str] | None:
    found = _INDEXED.search(name)
    return found if found is not None and found.group(1) == key else None


def layer_of(name: str, key: str) -> int | None:
    """The layer a tensor or space belongs to (None outside the layers: embeddings, head)."""
    found = _layer_match(name, key)
    return int(found.group(2)) if found is not None else None


def renamed(name: str, key: str, layer: int) -> str:
    """``name`` with its layer index replaced (outside the layers: itself)."""
    found = _layer_match(name, key)
    if found is None:
        return name
    return f"{name[: found.start(2)]}{layer}{name[found.end(2) :]}"


def _source_name(name: str, key: str, sources: Sequence[Source]) -> tuple[int, str]:
    layer = layer_of(name, key)
    if layer is None:
        return sources[0].parent, name  # embeddings and head: the first layer's parent's
    s = sources[layer]
    return s.parent, renamed(name, key, s.layer)


def state_view(
    parents: Sequence[Mapping[str, Tensor]], like: Mapping[str, Tensor], key: str, sources: Sequence[Source]
) -> LazyState:
    """The parents' layers at B's depth: B's names and shapes (``like``), layer j read from
    ``sources[j]`` (nothing copied)."""

    def read(name: str) -> Tensor:
        parent, own = _source_name(name, key, sources)
        return parents[parent][own]

    names = list(like)
    for name in names:
        parent, own = _source_name(name, key, sources)
        if own not in parents[parent] or shape_of(parents[parent], own) != shape_of(like, name):
            raise ValueError(f"{name}: the parent's {own} is missing or of another shape")

    def rows(name: str) -> RowReader | None:  # an embedding read a block of rows at a time, as its parent's
        parent, own = _source_name(name, key, sources)
        state = parents[parent]
        return state.rows(own) if isinstance(state, LazyState) else None

    out = LazyState(
        {n: tuple(shape_of(like, n)) for n in names}, {n: dtype_of(like, n) for n in names}, read, rows=rows
    )
    out.device = getattr(parents[0], "device", out.device)
    return out


def signals_view(parents: Sequence[Signals], names: Iterable[str], key: str, sources: Sequence[Source]) -> Signals:
    """The parents' signals renamed into B's depth as `state_view` renames their tensors."""
    out = Signals({}, {}, {})
    for name in names:
        parent, own = _source_name(name, key, sources)
        sig = parents[parent]
        if own in sig.factors:
            out.factors[name], out.ranks[name] = sig.factors[own], sig.ranks[own]
        elif own in sig.whole:
            out.whole[name] = sig.whole[own]
    return out


class ScalesView(Mapping[str, Tensor]):
    """The parents' gated-unit scales, keyed by B's unit spaces."""

    def __init__(
        self, parents: Sequence[Mapping[str, Tensor]], spaces: Iterable[str], key: str, sources: Sequence[Source]
    ):
        where = {s: _source_name(s, key, sources) for s in spaces}
        self._where = {s: (p, own) for s, (p, own) in where.items() if own in parents[p]}
        self._parents = parents

    def __getitem__(self, space: str) -> Tensor:
        parent, own = self._where[space]
        return self._parents[parent][own]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# --------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------


def residual_maps(
    graph_a: SymmetryGraph, a: Mapping[str, Tensor], b: Mapping[str, Tensor], key: str
) -> dict[str, Tensor]:
    """Each residual stream's map of B into A's basis as a dense matrix ``P`` (a stream's vector
    ``x`` of B is ``P x`` in A's basis), from the tensors outside the layers that read or write it
    alone (embeddings, LM head): they are the same at any depth. A stream they do not pin down
    (too few of them) keeps the identity."""
    outside = {n: bd for n, bd in graph_a.bindings.items() if layer_of(n, key) is None and n in b}
    views = WeightViews(replace(graph_a, bindings=outside), a, b)
    found: dict[str, SpaceMap] = {}
    for name, space in graph_a.spaces.items():
        if not isinstance(space, Space) or space.kind != "residual":
            continue
        view = views.static(name).get(None)
        if view is not None and torch.linalg.matrix_rank(view.to(torch.float64)) == space.size:
            found[name] = solve_plain(space, view.to(torch.float64), "orthogonal")
    return stream_maps(graph_a, found)


def stream_maps(graph: SymmetryGraph, transform: Mapping[str, SpaceMap]) -> dict[str, Tensor]:
    """The residual maps of an alignment's transform as dense matrices (as `residual_maps` gives them)."""
    out = {}
    for name, space in graph.spaces.items():
        if isinstance(space, Space) and space.kind == "residual":
            m = transform.get(name)
            eye = torch.eye(space.size)
            out[name] = m.apply(eye, 0) if isinstance(m, AxisMap) else eye
    return out


def _bulk(state: Mapping[str, Tensor], sig: Signals, name: str) -> Tensor:
    t = state[name].to(torch.float32)
    return t - sig.factors[name].dense() if name in sig.factors else t


def _features(graph: SymmetryGraph, space: str, bulk: Callable[[str], Tensor]) -> dict[str | None, list[Tensor]]:
    """Each of the space's 2-D matrices whose other axis is a residual stream, as ``[features,
    d]`` (features first), by role."""
    out: dict[str | None, list[Tensor]] = {}
    for tensor, axis, role, offset in graph.users(space):
        binding = graph.bindings[tensor]
        if len(binding.axes) != 2 or binding.view is not None:
            continue
        other = binding.axes[1 - axis]
        sp = graph.spaces.get(split_ref(other)[0]) if isinstance(other, str) else None
        if not (isinstance(sp, Space) and sp.kind == "residual"):
            continue
        size = graph.ref_size(f"{space}:{role}" if role else space)
        part = graph.part(tensor, bulk(tensor), axis, offset, size)
        out.setdefault(role, []).append(part.movedim(axis, 0))
    return out


def _circuits(space: Space | HeadSpace, feats: dict[str | None, list[Tensor]], omega: Tensor) -> list[Tensor]:
    """The space's invariant products, each ``[d, SKETCH]`` (``X ᵀ (Y Ω)``)."""
    if isinstance(space, HeadSpace):
        kv, dh = space.num_kv_heads, space.head_dim
        out = []
        for wide, narrow in (("q", "k"), ("o", "v")):
            for x in feats.get(wide, []):
                for y in feats.get(narrow, []):
                    yo = (y.reshape(kv, dh, -1) @ omega).reshape(kv, dh, -1)
                    out.append(torch.einsum("kgir,kij->rj", x.reshape(kv, -1, dh, x.shape[-1]), yo))
        return out
    mats = [m for ms in feats.values() for m in ms]
    return [mats[u].T @ (mats[v] @ omega) for u in range(len(mats)) for v in range(u + 1, len(mats))]


def _invariants(
    graph: SymmetryGraph,
    state: Mapping[str, Tensor],
    sig: Signals,
    key: str,
    maps: Mapping[str, Tensor],
    omega: Tensor,
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, dict[str, Tensor]]:
    """Each layer's invariant products by kind of space (``attn``, ``mlp``), in A's residual basis
    (``maps``: B's stream into A's; identity for A)."""
    last: dict[str, Tensor] = {}

    def bulk(name: str) -> Tensor:  # a fused QKV is read once for its three roles
        if name not in last:
            last.clear()
            last[name] = _bulk(state, sig, name)
        return last[name]

    stream = next(iter(maps))  # one stream per layer stack
    p = maps[stream]
    spaces = [(n, s) for n, s in graph.spaces.items() if layer_of(n, key) is not None and _counted(s)]
    out: dict[int, dict[str, Tensor]] = {}
    for k, (name, space) in enumerate(spaces):
        feats = _features(graph, name, bulk)
        circuits = _circuits(space, feats, p.T @ omega)
        if circuits:
            sketch = torch.cat([p @ c for c in circuits], dim=1)
            out.setdefault(layer_of(name, key) or 0, {})[renamed(name, key, 0)] = sketch.flatten()
        if progress is not None:
            progress(k + 1, len(spaces))
    return out


def _counted(space: object) -> TypeGuard[Space | HeadSpace]:
    return isinstance(space, HeadSpace) or (isinstance(space, Space) and space.kind != "residual")


def layer_scores(
    graph_a: SymmetryGraph,
    a: Mapping[str, Tensor],
    sig_a: Signals,
    graph_b: SymmetryGraph,
    b: Mapping[str, Tensor],
    sig_b: Signals,
    key: str,
    progress: Callable[[str], None] | None = None,
    maps: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """``S[i, j]``: how alike layer i of A and layer j of B are, with every symmetry inside a layer
    quotiented out (the mean over the layer's kinds of space of the cosine of their invariant
    products; about 0 for layers trained apart, near 1 for a layer and its copy). ``maps``: B's
    residual streams in A's basis where an alignment found them (default: from the embeddings)."""
    found = maps if maps is not None else residual_maps(graph_a, a, b, key)
    d = next(iter(found.values())).shape[0]
    omega = torch.randn(d, min(d, SKETCH), generator=torch.Generator().manual_seed(0)) / math.sqrt(min(d, SKETCH))
    say = progress or (lambda _stage: None)
    eye = {n: torch.eye(m.shape[0]) for n, m in found.items()}
    inv_a = _invariants(graph_a, a, sig_a, key, eye, omega, _stage(say, "layer circuits of A"))
    candidates = [found]
    if maps is None and any(float((m - eye[n]).abs().max()) > NOT_IDENTITY for n, m in found.items()):
        # layers copied as stored from a parent whose embeddings B does not carry (the second parent of a
        # passthrough stack) sit in that parent's basis: the identity scores them where the embeddings' map cannot
        candidates.append(eye)
    scores = []
    for k, stream in enumerate(candidates):
        stage = f"layer circuits of B{' as stored' if k else ''}"
        scores.append(_cosines(inv_a, _invariants(graph_b, b, sig_b, key, stream, omega, _stage(say, stage))))
    return functools.reduce(torch.maximum, scores)


def _stage(say: Callable[[str], None], stage: str) -> Callable[[int, int], None]:
    return lambda i, n: say(f"{stage} ({i}/{n})")


NOT_IDENTITY = 0.05  # a residual map with an entry this far from the identity's is not the identity


def _cosines(inv_a: Mapping[int, Mapping[str, Tensor]], inv_b: Mapping[int, Mapping[str, Tensor]]) -> Tensor:
    """``S[i, j]``: the mean over the kinds of space both layers have of their circuits' cosine."""
    scores = torch.zeros(len(inv_a), len(inv_b), dtype=torch.float64)
    for i, kinds_a in inv_a.items():
        for j, kinds_b in inv_b.items():
            shared = [k for k in kinds_a if k in kinds_b]
            cos = [float(torch.nn.functional.cosine_similarity(kinds_a[k], kinds_b[k], dim=0)) for k in shared]
            scores[i, j] = sum(cos) / len(cos) if cos else 0.0
    return scores


# --------------------------------------------------------------------------------------------
# The map
# --------------------------------------------------------------------------------------------


def best_map(scores: Tensor) -> tuple[list[int], bool]:
    """For each of B's layers (columns) the layer of A (row) it comes from: the best increasing map
    (pruning keeps layers in order) where it scores at least `MONOTONE_SHARE` of the best map's
    total, else each layer's best match (many-to-one: up-scaling repeats layers). Also: whether the
    map taken is increasing."""
    free = scores.argmax(dim=0).tolist()
    best = float(scores.max(dim=0).values.sum())
    mono = _increasing(scores)
    if mono is not None and float(scores[mono, torch.arange(scores.shape[1])].sum()) >= MONOTONE_SHARE * best:
        return mono, True
    return free, all(x < y for x, y in itertools.pairwise(free))


def _increasing(scores: Tensor) -> list[int] | None:
    """The strictly increasing map (B's layer j ← A's layer i_j, i_j < i_{j+1}) of largest total
    score, by dynamic programming; None where B is deeper than A."""
    rows, cols = scores.shape
    if cols > rows:
        return None
    total = torch.full((rows, cols), -math.inf, dtype=torch.float64)
    total[:, 0] = scores[:, 0]
    for j in range(1, cols):
        before = torch.cummax(total[:, j - 1], dim=0)
        total[1:, j] = before.values[:-1] + scores[1:, j]
    out = [int(total[:, cols - 1].argmax())]
    for j in range(cols - 1, 0, -1):
        out.append(int(total[: out[-1], j - 1].argmax()))
    return out[::-1]
