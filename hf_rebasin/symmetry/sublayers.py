"""Per-sublayer residual streams (TransFusion's residual maps, Rinaldi et al., ICML 2025, Step 3).

One residual map for the whole depth is what keeps a transformed model a stock model, but the
stream's basis drifts with depth: the map that fits layer 2's readers best is not the one that fits
layer 10's. For a *transport* B stays as it is and only τ moves, so nothing needs the maps to agree
across a skip connection: ``per_sublayer`` gives stream ``k`` (what sublayer ``k`` reads, and what
sublayer ``k − 1`` writes into it) a space of its own, ``res#k``. ``res#0`` also holds the
embeddings, and the last one the final norm and the heads. The result is an ordinary graph with
more residual spaces, so every data-free strategy aligns on it unchanged; it does not preserve a
model's function (the skips would need maps of their own), so it serves transports only.
"""

from __future__ import annotations

import dataclasses

from hf_rebasin.core.errors import AdapterError
from hf_rebasin.symmetry.graph import Sublayer, SymmetryGraph
from hf_rebasin.symmetry.spaces import AxisRef, Fused, Space, split_ref
from hf_rebasin.symmetry.transforms import Transform

__all__ = ["PER_SUBLAYER_NOTE", "depth_order", "is_per_sublayer", "is_stream", "per_sublayer", "spread", "stream_of"]

# a transport's default on an encoder-decoder: one global map instead (said, never silent)
PER_SUBLAYER_STACKS_NOTE = (
    "residual maps per sublayer are not defined for an encoder-decoder (the decoder's stream starts again after "
    "the encoder's, and cross-attention reads the encoder's last one): one global residual map is used"
)
PER_SUBLAYER_NOTE = (
    "residual maps per sublayer: every stream between sublayers has its own map, refined from the "
    "global one, so they move a task vector's tensors (each by its own sublayer's maps) but no whole model"
)

SEP = "#"  # res#3: stream 3 (head-perm's per-site spaces are res@k)


def _under(tensor: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``tensor`` belongs to one of the modules ``prefixes`` (or is one of them: a MoE
    layer's stacked expert tensors are parameters of one module, told apart by name)."""
    return any(tensor == p or tensor.startswith(p + ".") for p in prefixes)


def _residuals(graph: SymmetryGraph) -> list[str]:
    return [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual"]


def stream_of(graph: SymmetryGraph, space: str) -> dict[str, int]:
    """The stream index of every tensor bound to residual ``space`` (0: before the first sublayer;
    ``k``: read by sublayer ``k`` or written by sublayer ``k − 1``; the last: the final norm and
    the heads). A norm joins its readers; a tied alias its source."""
    users = {t for t, *_ in graph.users(space)}
    subs: list[Sublayer] = [s for s in graph.sublayers if any(_under(t, s.reads) or _under(t, s.writes) for t in users)]
    last = len(subs)
    out: dict[str, int] = {}
    for tensor in users:
        if _under(tensor, graph.embeddings):
            out[tensor] = 0
            continue
        for k, s in enumerate(subs):
            if _under(tensor, s.reads):
                out[tensor] = k
            elif _under(tensor, s.writes):
                out[tensor] = k + 1
        out.setdefault(tensor, last)
    read_by: dict[str, int] = {}  # a tied reader (an LM head) that canonical form unties reads its norm's stream
    for norm in graph.norms:
        if norm.space != space or not norm.readers:
            continue
        read = {out[r] for r in norm.readers if r in out} or {out.get(norm.weight, last)}
        if len(read) > 1:
            raise AdapterError(f"norm {norm.weight!r} is read by tensors of different sublayers")
        stream = read.pop()
        for p in (norm.weight, norm.bias, *norm.readers):
            if p is not None and p not in graph.ties:
                out[p] = stream
            elif p is not None:
                read_by[p] = stream
    for alias, source in graph.ties.items():
        if alias in read_by:
            out[alias] = read_by[alias]
        elif source in out:
            out[alias] = out[source]
    return out


def per_sublayer(graph: SymmetryGraph) -> SymmetryGraph:
    """``graph`` with every residual space split into one space per stream between sublayers.

    Needs the adapter's sublayer description (every built-in adapter has one); a graph already split
    is returned as it is."""
    if is_per_sublayer(graph):
        return graph
    if len(graph.stacks) > 1:
        raise AdapterError(
            f"residual maps per sublayer are not defined for an encoder-decoder ({graph.family!r}): the decoder's "
            "stream starts again after the encoder's, and cross-attention reads the encoder's last one; use "
            "`strategy.residual_maps: global`"
        )
    residuals = _residuals(graph)
    if not graph.sublayers:
        raise AdapterError(
            f"the {graph.family!r} adapter does not describe its sublayers, so the residual stream cannot be split per sublayer"
        )
    spaces = dict(graph.spaces)
    bindings = dict(graph.bindings)
    norms = list(graph.norms)
    for res in residuals:
        streams = stream_of(graph, res)
        base = graph.spaces[res]
        assert isinstance(base, Space)
        del spaces[res]
        for k in sorted(set(streams.values())):
            name = f"{res}{SEP}{k}"
            spaces[name] = dataclasses.replace(base, name=name)
        for tensor, stream in streams.items():
            b = bindings.get(tensor)
            if b is not None:  # a whole axis, or its copies in a fused axis (DINOv2's [CLS, mean] head)
                axes = tuple(_renamed(a, res, f"{res}{SEP}{stream}") for a in b.axes)
                bindings[tensor] = dataclasses.replace(b, axes=axes)
        norms = [dataclasses.replace(n, space=f"{res}{SEP}{streams[n.weight]}") if n.space == res else n for n in norms]
    return dataclasses.replace(graph, spaces=spaces, bindings=bindings, norms=norms)


def _renamed(ref: AxisRef, space: str, new: str) -> AxisRef:
    if isinstance(ref, Fused):
        return dataclasses.replace(ref, parts=tuple(new if p == space else p for p in ref.parts))
    return new if ref == space else ref


def is_per_sublayer(graph: SymmetryGraph) -> bool:
    """Whether ``graph``'s residual stream is already split per sublayer."""
    return any(is_stream(n) for n in _residuals(graph))


def is_stream(space: str) -> bool:
    """Whether ``space`` names one stream of a residual split per sublayer."""
    return SEP in space


def spread(transform: Transform, split: SymmetryGraph) -> Transform:
    """A transform of the unsplit graph on its split ``split``: every stream starts at the map of
    its residual. Refining from there never matches worse than the one global map."""
    return {name: transform[name if name in transform else name.split(SEP)[0]] for name in split.spaces}


def depth_order(split: SymmetryGraph) -> list[str]:
    """The spaces of a split graph in forward order: stream 0, the first sublayer's own space (its
    heads or MLP units), stream 1, … (then whatever else there is). A sweep in this order solves a
    chain from its anchored start (the embeddings) instead of waiting for information to diffuse."""
    order: list[str] = []
    streams = _residuals(split)
    for res in dict.fromkeys(n.split(SEP)[0] for n in streams):
        for stream in sorted((n for n in streams if n.startswith(res + SEP)), key=lambda n: int(n.split(SEP)[1])):
            order.append(stream)
            order.extend(s for s in _inner(split, stream) if s not in order)
    return order + [n for n in split.spaces if n not in order]


def _inner(split: SymmetryGraph, stream: str) -> list[str]:
    """The non-residual spaces read from ``stream`` (the next sublayer's heads or units)."""
    found: list[str] = []
    for tensor, *_ in split.users(stream):
        b = split.bindings[tensor]
        for a in b.axes:
            for p in a.parts if isinstance(a, Fused) else (a,):
                if p is None:
                    continue
                space = split_ref(p)[0]
                if space != stream and SEP not in space and space not in found:
                    found.append(space)
    return found
