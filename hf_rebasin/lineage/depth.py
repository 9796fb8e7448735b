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

An encoder-decoder has a stack of layers per module list (``model.encoder.layers``,
``model.decoder.layers``): each is scored and mapped on its own (`Stacks`: a map per stack), every
product read in the stream its matrices read (Whisper's cross-attention: queries in the decoder's,
keys in the encoder's), and its spaces' names (``dec.3.mlp``) renamed as its tensors' are.

Pure tensor functions over states and graphs; `lineage.compare` calls them.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
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
    "Stacks",
    "best_map",
    "layer_key",
    "layer_lists",
    "layer_of",
    "layer_scores",
    "renamed",
    "signals_view",
    "space_keys",
    "stack_key",
    "state_view",
    "stream_maps",
    "with_spaces",
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


# each stack's module list (``transformer.h``'s ``h``; an encoder-decoder's ``model.encoder.layers`` and
# ``model.decoder.layers``) and where each of its layers comes from
Stacks = Mapping[str, Sequence[Source]]


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


def stack_key(names: Iterable[str], prefix: str, layers: int) -> str | None:
    """The module list of one stack of an encoder-decoder by its full path (``model.decoder.layers``
    under ``model.decoder``): both stacks' lists share their last name (``layers``, ``block``), so
    only the path tells them apart."""
    seen: dict[str, set[int]] = {}
    for name in names:
        found = _INDEXED.search(name) if name.startswith(f"{prefix}.") else None
        if found is not None:
            seen.setdefault(name[: found.end(1)], set()).add(int(found.group(2)))
    return next((key for key, idx in seen.items() if idx == set(range(layers))), None)


def layer_lists(names: Collection[str], stacks: Sequence[str], depths: Sequence[int]) -> tuple[str | None, ...]:
    """The module list of each stack of layers (None where none holds its ``depths``): the first
    indexed one (``h``) for one stack, each stack's by its path under its prefix in ``stacks`` for an
    encoder-decoder (``model.encoder.layers``, ``model.decoder.layers``)."""
    if len(depths) == 1:
        return (layer_key(names, depths[0]),)
    return tuple(stack_key(names, prefix, n) for prefix, n in zip(stacks, depths, strict=True))


def _layer_match(name: str, key: str) -> re.Match[str] | None:
    """The name's first indexed module where its path ends with ``key`` (``h``, or a full path)."""
    found = _INDEXED.search(name)
    if found is None:
        return None
    path = name[: found.end(1)]
    return found if path == key or path.endswith(f".{key}") else None


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


def space_keys(graph: SymmetryGraph, keys: Iterable[str]) -> dict[str, str]:
    """How the graph names each stack's per-layer spaces (``dec`` in ``dec.3.mlp`` for
    ``model.decoder.layers``): the indexed prefix of the spaces whose tensors lie in its layers."""
    out: dict[str, str] = {}
    keys = list(keys)
    for name in graph.spaces:
        found = _INDEXED.search(f"{name}.")
        if found is None:
            continue
        tensors = [t for t, *_ in graph.users(name)]
        for key in keys:
            if key not in out and any(layer_of(t, key) is not None for t in tensors):
                out[key] = name[: found.end(1)]
    return out


def with_spaces(graph: SymmetryGraph, stacks: Stacks) -> dict[str, Sequence[Source]]:
    """``stacks`` also keyed by how the graph names each stack's spaces, so that a space's name is
    renamed as its tensors' are."""
    out = dict(stacks)
    for key, alias in space_keys(graph, stacks).items():
        out.setdefault(alias, stacks[key])
    return out


def _source_name(name: str, stacks: Stacks) -> tuple[int, str]:
    for key, sources in stacks.items():
        layer = layer_of(name, key)
        if layer is not None:
            s = sources[layer]
            return s.parent, renamed(name, key, s.layer)
    return next(iter(stacks.values()))[0].parent, name  # embeddings and head: the first layer's parent's


def _held(name: str, stacks: Stacks, has: Callable[[int, str], bool]) -> tuple[int, str]:
    """`_source_name`, or the parent's own tensor of that name where its source layer lacks it: a
    tensor only some layers hold (T5's relative attention bias, layer 0's alone) belongs to the stack."""
    parent, own = _source_name(name, stacks)
    return (parent, name) if not has(parent, own) and has(parent, name) else (parent, own)


def state_view(parents: Sequence[Mapping[str, Tensor]], like: Mapping[str, Tensor], stacks: Stacks) -> LazyState:
    """The parents' layers at B's depth: B's names and shapes (``like``), layer j of each stack read
    from its ``stacks[key][j]`` (nothing copied)."""
    where = {name: _held(name, stacks, lambda p, n: n in parents[p]) for name in like}

    def read(name: str) -> Tensor:
        parent, own = where[name]
        return parents[parent][own]

    names = list(like)
    for name in names:
        parent, own = where[name]
        if own not in parents[parent] or shape_of(parents[parent], own) != shape_of(like, name):
            raise ValueError(f"{name}: the parent's {own} is missing or of another shape")

    def rows(name: str) -> RowReader | None:  # an embedding read a block of rows at a time, as its parent's
        parent, own = where[name]
        state = parents[parent]
        return state.rows(own) if isinstance(state, LazyState) else None

    out = LazyState(
        {n: tuple(shape_of(like, n)) for n in names}, {n: dtype_of(like, n) for n in names}, read, rows=rows
    )
    out.device = getattr(parents[0], "device", out.device)
    return out


def signals_view(parents: Sequence[Signals], names: Iterable[str], stacks: Stacks) -> Signals:
    """The parents' signals renamed into B's depth as `state_view` renames their tensors."""
    out = Signals({}, {}, {})
    for name in names:
        parent, own = _held(name, stacks, lambda p, n: n in parents[p].factors or n in parents[p].whole)
        sig = parents[parent]
        if own in sig.factors:
            out.factors[name], out.ranks[name] = sig.factors[own], sig.ranks[own]
        elif own in sig.whole:
            out.whole[name] = sig.whole[own]
    return out


class ScalesView(Mapping[str, Tensor]):
    """The parents' gated-unit scales, keyed by B's unit spaces (``stacks`` keyed by how the graph
    names each stack's spaces: `with_spaces`)."""

    def __init__(self, parents: Sequence[Mapping[str, Tensor]], spaces: Iterable[str], stacks: Stacks):
        where = {s: _source_name(s, stacks) for s in spaces}
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
    graph_a: SymmetryGraph, a: Mapping[str, Tensor], b: Mapping[str, Tensor], keys: Sequence[str]
) -> dict[str, Tensor]:
    """Each residual stream's map of B into A's basis as a dense matrix ``P`` (a stream's vector
    ``x`` of B is ``P x`` in A's basis), from the tensors outside every stack's layers that read or
    write it alone (embeddings, LM head): they are the same at any depth. A stream they do not pin
    down (too few of them) keeps the identity."""
    outside = {n: bd for n, bd in graph_a.bindings.items() if all(layer_of(n, k) is None for k in keys) and n in b}
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


# a space's matrices by role, each ``[features, d]`` with the residual stream it reads or writes
Features = dict[str | None, list[tuple[Tensor, str]]]


def _features(graph: SymmetryGraph, space: str, bulk: Callable[[str], Tensor], tensors: Iterable[str]) -> Features:
    """Each of the space's 2-D matrices among ``tensors`` whose other axis is a residual stream, as
    ``[features, d]`` (features first), by role, with that stream (an encoder-decoder's
    cross-attention reads the decoder's stream with its queries, the encoder's with its keys)."""
    out: Features = {}
    wanted = set(tensors)
    for tensor, axis, role, offset in graph.users(space):
        binding = graph.bindings[tensor]
        if tensor not in wanted or len(binding.axes) != 2 or binding.view is not None:
            continue
        other = binding.axes[1 - axis]
        stream = split_ref(other)[0] if isinstance(other, str) else ""
        sp = graph.spaces.get(stream)
        if not (isinstance(sp, Space) and sp.kind == "residual"):
            continue
        size = graph.ref_size(f"{space}:{role}" if role else space)
        part = graph.part(tensor, bulk(tensor), axis, offset, size)
        out.setdefault(role, []).append((part.movedim(axis, 0), stream))
    return out


def _circuits(space: Space | HeadSpace, feats: Features, omegas: Mapping[str, Tensor]) -> list[tuple[str, Tensor]]:
    """The space's invariant products, each ``[d, SKETCH]`` (``X ᵀ (Y Ω)``, ``Ω`` in Y's stream's
    basis: ``omegas``), with X's stream (the map that brings its rows into A's basis)."""
    if isinstance(space, HeadSpace):
        kv, dh = space.num_kv_heads, space.head_dim
        out = []
        for wide, narrow in (("q", "k"), ("o", "v")):
            for x, sx in feats.get(wide, []):
                for y, sy in feats.get(narrow, []):
                    yo = (y.reshape(kv, dh, -1) @ omegas[sy]).reshape(kv, dh, -1)
                    out.append((sx, torch.einsum("kgir,kij->rj", x.reshape(kv, -1, dh, x.shape[-1]), yo)))
        return out
    mats = [m for ms in feats.values() for m in ms]
    return [
        (mats[u][1], mats[u][0].T @ (mats[v][0] @ omegas[mats[v][1]]))
        for u in range(len(mats))
        for v in range(u + 1, len(mats))
    ]


def _layer_tensors(graph: SymmetryGraph, space: str, key: str) -> dict[int, list[str]]:
    """The space's tensors in each layer of the stack ``key`` (one layer for a layer's own space;
    every layer for a space the stack shares: T5's heads, one permutation for the whole stack)."""
    out: dict[int, list[str]] = {}
    for tensor, *_ in graph.users(space):
        layer = layer_of(tensor, key)
        if layer is not None:
            out.setdefault(layer, []).append(tensor)
    return out


def _kind(space: str, layer: int) -> str:
    """The space's name with its layer index left out, the same at every layer (``h.#.attn``)."""
    return re.sub(rf"(^|\.){layer}(\.|$)", r"\1#\2", space, count=1)


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
    (``maps``: each of B's streams into A's; identity for A), every product read in the stream its
    matrices read: one for a decoder, the encoder's or the decoder's (Whisper), or one shared."""
    last: dict[str, Tensor] = {}

    def bulk(name: str) -> Tensor:  # a fused QKV is read once for its three roles
        if name not in last:
            last.clear()
            last[name] = _bulk(state, sig, name)
        return last[name]

    omegas = {stream: p.T @ omega for stream, p in maps.items()}
    spaces = [(n, s) for n, s in graph.spaces.items() if _counted(s)]
    layered = [(n, s, by) for n, s in spaces if (by := _layer_tensors(graph, n, key))]
    out: dict[int, dict[str, Tensor]] = {}
    for k, (name, space, by) in enumerate(layered):
        for layer, tensors in sorted(by.items()):
            circuits = _circuits(space, _features(graph, name, bulk, tensors), omegas)
            if circuits:
                sketch = torch.cat([maps[stream] @ c for stream, c in circuits], dim=1)
                out.setdefault(layer, {})[_kind(name, layer)] = sketch.flatten()
        if progress is not None:
            progress(k + 1, len(layered))
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
    keys: Sequence[str],
    progress: Callable[[str], None] | None = None,
    maps: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """For each stack (its module list in ``keys``), ``S[i, j]``: how alike layer i of A and layer
    j of B are, with every symmetry inside a layer quotiented out (the mean over the layer's kinds
    of space of the cosine of their invariant products; about 0 for layers trained apart, near 1 for
    a layer and its copy). ``maps``: B's residual streams in A's basis where an alignment found them
    (default: from the embeddings)."""
    found = maps if maps is not None else residual_maps(graph_a, a, b, keys)
    d = next(iter(found.values())).shape[0]
    omega = torch.randn(d, min(d, SKETCH), generator=torch.Generator().manual_seed(0)) / math.sqrt(min(d, SKETCH))
    say = progress or (lambda _stage: None)
    eye = {n: torch.eye(m.shape[0]) for n, m in found.items()}
    candidates = [found]
    if maps is None and any(float((m - eye[n]).abs().max()) > NOT_IDENTITY for n, m in found.items()):
        # layers copied as stored from a parent whose embeddings B does not carry (the second parent of a
        # passthrough stack) sit in that parent's basis: the identity scores them where the embeddings' map cannot
        candidates.append(eye)
    out = {}
    for key in keys:
        of = f", {key}" if len(keys) > 1 else ""
        inv_a = _invariants(graph_a, a, sig_a, key, eye, omega, _stage(say, f"layer circuits of A{of}"))
        scores = []
        for k, stream in enumerate(candidates):
            stage = f"layer circuits of B{' as stored' if k else ''}{of}"
            scores.append(_cosines(inv_a, _invariants(graph_b, b, sig_b, key, stream, omega, _stage(say, stage))))
        out[key] = functools.reduce(torch.maximum, scores)
    return out


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
