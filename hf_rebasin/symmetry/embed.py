"""A narrower model written exactly into a wider shape of its family: zeros wherever the wide shape
has more (residual features, MLP or expert units, attention heads), and the scales that keep every
norm's output as it was.

Every feature of a space of the narrow graph goes to the same position in the wide graph's space
(the first features of a plain space; the first heads, each head's features in place, whole KV
groups with their query heads; expert e's unit u at e·f′ + u). An added feature is read by nothing
(its reader columns are zero) and written by nothing (its writer rows are zero), so the added units
and heads compute zeros that nothing reads. The residual stream's added features stay zero, but a
norm over the stream now averages over d′ features: RMSNorm divides by an rms √(d/d′) as large, so
each norm on the stream gets its scale times √(d/d′) (and its ε times d/d′ for exactness); a
LayerNorm also subtracts the mean, which the zeros change unless the stream has mean 0, which is
what the canonical form gives (writers centred): a LayerNorm stream is embedded from it. A stream
that cannot be centred (a LayerNorm on the residual path: post-norm BERT, ModernBERT's and CLIP's
embedding norms; a stream read raw: SigLIP's pooling head) cannot grow.

Two family facts are declared in the adapters: a tensor the model scales by d**p from its config
(Gemma's embeddings by √d) is scaled by (d/d′)**p, and where a tied reader sees it (Gemma's LM head)
its norm takes the inverse; a role norm over every head's queries or keys (OLMo 2's q_norm /
k_norm) takes γ × √(n/n′) and the projection it reads a scale that makes the config's one ε,
fitted to the residual norms, exact for it too.

`embed_state` is pure tensor code over the symmetry graph; `hf_rebasin.alignment.widths.embed_model`
does the rest for a transformers model: the wide config (the narrow one with the wide one's sizes),
the canonical form where a LayerNorm stream grows, and the ε that makes the embedding exact.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import IncompatibleModelsError
from hf_rebasin.symmetry.graph import Norm, SymmetryGraph
from hf_rebasin.symmetry.spaces import AxisRef, ExpertSpace, Fused, HeadSpace, Space, split_ref

__all__ = ["Embedding", "centrable", "check_spaces", "check_streams", "embed_state", "grown", "residual_ratio"]

LAYER = re.compile(r"\.\d+\.")  # a layer index in a space's name


def check_spaces(narrow: SymmetryGraph, wide: SymmetryGraph) -> None:
    """The same spaces, none smaller in the wide graph, and only the changes that embed exactly."""
    missing = sorted(set(narrow.spaces) - set(wide.spaces))
    if missing:
        raise IncompatibleModelsError(
            f"the wider model has no space(s) {missing[:3]}: a different depth or layout cannot be embedded"
        )
    for name, small in narrow.spaces.items():
        big = wide.spaces[name]
        if type(small) is not type(big):
            raise IncompatibleModelsError(f"space {name!r} is of another kind in the wider model")
        if isinstance(small, HeadSpace) and isinstance(big, HeadSpace):
            why = _head_dim_refusal(small, big)
            if why is not None:
                raise IncompatibleModelsError(
                    f"space {name!r}: head_dim {small.head_dim} → {big.head_dim} is not embedded ({why}); "
                    "keep head_dim and add heads (where the model computes head_dim as hidden size / heads, "
                    "grow both in proportion)"
                )
            if big.group_size != small.group_size or big.num_kv_heads < small.num_kv_heads:
                raise IncompatibleModelsError(
                    f"space {name!r}: {small.num_heads} heads in {small.num_kv_heads} KV groups cannot be embedded in "
                    f"{big.num_heads} heads in {big.num_kv_heads} groups (whole groups with their query heads only)"
                )
        elif isinstance(small, ExpertSpace) and isinstance(big, ExpertSpace):
            if big.num_experts != small.num_experts or big.units < small.units:
                raise IncompatibleModelsError(
                    f"space {name!r}: {small.num_experts} experts cannot become {big.num_experts} (an added expert "
                    "would take routing weight from the others); only each expert's units may grow"
                )
        elif isinstance(small, Space) and isinstance(big, Space) and big.size < small.size:
            raise IncompatibleModelsError(
                f"space {name!r} has {small.size} features in the model to embed but {big.size} in the shape given: only "
                "a narrower model embeds into a wider one (the other way round would drop features)"
            )


def _head_dim_refusal(small: HeadSpace, big: HeadSpace) -> str | None:
    """Why a head space's head_dim cannot grow from ``small`` to ``big`` (None: it can, or it stays).

    Without rotary embeddings a head pads exactly: zero features add nothing to a score, and the
    queries scaled by √(head_dim′/head_dim) undo the wider 1/√head_dim′ (`_query_scales`; T5 divides
    by nothing, so its queries stay)."""
    if big.head_dim == small.head_dim:
        return None
    if small.rotary:
        return "rotary embeddings' frequencies depend on it"
    if big.head_dim < small.head_dim:
        return "a narrower head would drop features"
    if small.qk == "fixed" or big.qk == "fixed":
        return small.reason or big.reason or "a per-feature scale inside each head reads every feature"
    return None


def _query_scales(graph: SymmetryGraph, ref: AxisRef, wide: SymmetryGraph) -> Tensor | None:
    """Per-feature factors of a narrow axis: √(head_dim′/head_dim) on the queries of every head
    space whose head_dim grows (the scores come out unchanged), 1 elsewhere; None when all are 1."""
    if ref is None:
        return None
    parts = ref.parts if isinstance(ref, Fused) else (ref,)
    pieces, scaled = [], False
    for part in parts:
        name, role = split_ref(part)
        small, big = graph.spaces[name], wide.spaces[name]
        factor = 1.0
        if role == "q" and isinstance(small, HeadSpace) and isinstance(big, HeadSpace) and small.scores_scaled:
            factor = math.sqrt(big.head_dim / small.head_dim)
        scaled = scaled or factor != 1.0
        pieces.append(torch.full((graph.ref_size(part),), factor, dtype=torch.float64))
    if scaled and isinstance(ref, Fused) and ref.interleaved:  # rotary layouts only, refused before
        raise IncompatibleModelsError(f"axis {ref}: a per-head interleaved layout cannot grow its head_dim")
    return torch.cat(pieces) if scaled else None


def _place(graph: SymmetryGraph, ref: str, wide: SymmetryGraph) -> Tensor:
    """Where each feature of ``ref`` (a space or a role) of the narrow graph lies in the wide one."""
    name, role = split_ref(ref)
    small, big = graph.spaces[name], wide.spaces[name]
    if isinstance(small, HeadSpace) and isinstance(big, HeadSpace) and small.head_dim != big.head_dim:
        heads = small.role_size(str(role)) // small.head_dim  # feature j of head h: h·head_dim′ + j
        return (torch.arange(heads)[:, None] * big.head_dim + torch.arange(small.head_dim)).reshape(-1)
    if isinstance(small, ExpertSpace) and isinstance(big, ExpertSpace) and role == "units":
        e = torch.arange(small.num_experts)[:, None]
        return (e * big.units + torch.arange(small.units)).reshape(-1)
    return torch.arange(graph.ref_size(ref))  # heads, experts, plain spaces: a prefix


def _axis_index(graph: SymmetryGraph, ref: AxisRef, wide: SymmetryGraph, size: int) -> Tensor:
    """Positions in the wide axis of every feature of a narrow axis (an unbound axis: the same)."""
    if ref is None:
        return torch.arange(size)
    parts = ref.parts if isinstance(ref, Fused) else (ref,)
    if isinstance(ref, Fused) and ref.interleaved:  # per KV head: [head 0: its parts | head 1: …]
        g, gw = graph.groups(ref), wide.groups(ref)
        small_sizes = [graph.ref_size(p) // g for p in parts]
        wide_sizes = [wide.ref_size(p) // gw for p in parts]
        if small_sizes != wide_sizes:
            raise IncompatibleModelsError(f"axis {ref} changes its per-head layout")
        per = sum(small_sizes)
        return torch.arange(g * per)  # whole heads appended: a prefix
    out, offset = [], 0
    for part in parts:
        out.append(offset + _place(graph, part, wide))
        offset += wide.ref_size(part)
    return torch.cat(out)


def residual_ratio(narrow: SymmetryGraph, wide: SymmetryGraph) -> dict[str, float]:
    """d / d′ of every residual space that grows, and of every other plain space with a norm on it
    (SigLIP's joint stream): what its norms' scales are multiplied by, squared."""
    normed = {n.space for n in narrow.norms if not _is_writer_scale(n)}
    out = {}
    for name, small in narrow.spaces.items():
        big = wide.spaces[name]
        if not (isinstance(small, Space) and isinstance(big, Space)) or big.size == small.size:
            continue
        if small.kind == "residual" or name in normed:
            out[name] = small.size / big.size
    return out


def _is_writer_scale(norm: Norm) -> bool:
    from hf_rebasin.symmetry.canonical import WriterScale

    return isinstance(norm, WriterScale)


def _role_ratios(narrow: SymmetryGraph, wide: SymmetryGraph) -> dict[str, float]:
    """n / n′ of every role norm (an RMSNorm over all heads' queries or keys) whose heads grow."""
    out = {}
    for norm in narrow.role_norms:
        n, n_wide = narrow.ref_size(norm.space), wide.ref_size(norm.space)
        if n != n_wide:
            out[norm.weight] = n / n_wide
    return out


def _norm_scales(narrow: SymmetryGraph, wide: SymmetryGraph) -> dict[str, tuple[Norm, float]]:
    """γ′ / γ of every norm on a growing space: √(d/d′) (an rms over d′ features, d of them
    nonzero, is √(d/d′) of the rms over d), times the inverse of an embedding scale that a tied
    reader of the norm would otherwise see (Gemma's tied LM head reads its embeddings, scaled)."""
    ratios = residual_ratio(narrow, wide)
    out = {
        n.weight: (n, math.sqrt(ratios[n.space])) for n in narrow.norms if n.space in ratios and not _is_writer_scale(n)
    }
    roles = _role_ratios(narrow, wide)
    out.update({n.weight: (n, math.sqrt(roles[n.weight])) for n in narrow.role_norms if n.weight in roles})
    for tensor, factor in _embedding_factors(narrow, wide).items():
        if tensor in narrow.ties:
            continue  # an alias: its source finds the norm
        aliases = {a for a, source in narrow.ties.items() if source == tensor}
        for alias in aliases - {tensor}:
            norms = [n for n in narrow.norms if alias in n.readers]
            if not norms or any(set(n.readers) - aliases for n in norms):
                raise IncompatibleModelsError(
                    f"{alias!r} is tied to {tensor!r}, which the model scales by a power of the hidden size: "
                    "no norm read by the tied tensor alone can take the inverse scale"
                )
            for n in norms:
                base = out.get(n.weight, (n, 1.0))[1]
                out[n.weight] = (n, base / factor)
    return out


def _role_factors(narrow: SymmetryGraph, wide: SymmetryGraph, role_eps: float) -> dict[str, float]:
    """The factor c of what a role norm reads (its q/k projection): the norm over n′ features, n of
    them nonzero, with ε × ``role_eps`` (the config's one ε, fitted to the residual norms), gives
    c·x / √(c²·ms·n/n′ + ε·role_eps); with c² = role_eps·n′/n that is c·x / (√role_eps·√(ms + ε)),
    and γ × √(n/n′) (`_norm_scales`) makes it what it was, whatever ``role_eps``."""
    out: dict[str, float] = {}
    weights = {n.weight for n in narrow.role_norms}
    for norm in narrow.role_norms:
        c = math.sqrt(role_eps * wide.ref_size(norm.space) / narrow.ref_size(norm.space))
        if c == 1.0:
            continue
        for b in narrow.bindings.values():
            if b.name in weights or b.name in narrow.ties:
                continue
            if any(isinstance(ref, Fused) and norm.space in ref.parts for ref in b.axes):
                raise IncompatibleModelsError(f"{b.name!r} writes {norm.space!r} in a fused axis: it cannot be scaled")
            if norm.space in b.axes:
                out[b.name] = out.get(b.name, 1.0) * c
    return out


def _embedding_factors(narrow: SymmetryGraph, wide: SymmetryGraph) -> dict[str, float]:
    """The factor (d/d′)**p of every tensor the model scales by d**p (d: its space's size), so that
    the wider model's d′**p gives what the narrower one computed."""
    out = {}
    for tensor, p in narrow.embedding_scales.items():
        for ref in narrow.bindings[tensor].axes:
            if isinstance(ref, str) and split_ref(ref)[0] in narrow.spaces:
                d, d_wide = narrow.ref_size(ref), wide.ref_size(ref)
                if d != d_wide:
                    out[tensor] = (d / d_wide) ** p
    out.update({alias: out[source] for alias, source in narrow.ties.items() if source in out})
    return out


def embed_state(
    narrow: SymmetryGraph,
    state: Mapping[str, Tensor],
    wide: SymmetryGraph,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    role_eps: float | None = None,
) -> dict[str, Tensor]:
    """``state`` (a model of graph ``narrow``) written into the shapes of graph ``wide`` (``shapes``:
    the wide model's tensors, as stored): the same function, given the wide config's norm ε scaled
    by d/d′. A LayerNorm stream must be in canonical form (its writers centred). ``role_eps``: the
    wide / narrow ε that role norms (OLMo 2's q_norm / k_norm) share with the residual norms; by
    default the residual streams' one d/d′ (1 if none grows)."""
    check_spaces(narrow, wide)
    scales = _norm_scales(narrow, wide)
    if role_eps is None:
        grown = {
            r
            for name, r in residual_ratio(narrow, wide).items()
            if getattr(narrow.spaces[name], "kind", "") == "residual"
        }
        role_eps = grown.pop() if len(grown) == 1 else 1.0
    factors = _embedding_factors(narrow, wide)
    for name, c in _role_factors(narrow, wide, role_eps).items():
        factors[name] = factors.get(name, 1.0) * c
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name not in shapes:
            continue
        binding = narrow.bindings.get(name)
        if binding is None:
            if tuple(t.shape) != tuple(shapes[name]):
                raise IncompatibleModelsError(
                    f"tensor {name!r} has no hidden axis and another shape in the wider model"
                )
            out[name] = t
            continue
        if name in scales:  # a norm on a growing stream: γ′ = γ·√(d/d′) (stored as γ − offset)
            norm, s = scales[name]
            t = ((t.to(torch.float64) + norm.offset) * s - norm.offset).to(t.dtype)
        if name in factors:  # scaled by d**p at run time (d′**p in the wider model), or a role norm's input
            t = (t.to(torch.float64) * factors[name]).to(t.dtype)
        small = narrow.logical(name, t)
        for k, ref in enumerate(binding.axes):  # queries of heads that widen: scaled so the scores stay
            factor = _query_scales(narrow, ref, wide)
            if factor is not None:
                shape = [1] * small.dim()
                shape[k] = -1
                small = (small.to(torch.float64) * factor.view(shape)).to(t.dtype)
        wide_binding = wide.bindings[name]
        wide_shape = wide_binding.view.shape if wide_binding.view is not None else tuple(shapes[name])
        index = [_axis_index(narrow, ref, wide, small.shape[k]) for k, ref in enumerate(binding.axes)]
        big = torch.zeros(wide_shape, dtype=t.dtype)
        if name in scales:  # the added features' scale: anything (they normalise zeros); the neutral one
            norm, _ = scales[name]
            big.fill_(1.0 - norm.offset)
        big[torch.meshgrid(*index, indexing="ij")] = small
        out[name] = wide.stored(name, big)
    return out


@dataclass
class Embedding:
    """What `embed_model` changed: every space that grew (narrow → wide size), whether the model
    was first written in canonical form (a LayerNorm stream that grows), the tied tensors that had
    to be stored apart, and the norm ε written for exactness (field → (narrow, written))."""

    grown: dict[str, tuple[int, int]] = field(default_factory=dict)
    canonical: bool = False
    untied: list[str] = field(default_factory=list)
    eps: dict[str, tuple[float, float]] = field(default_factory=dict)
    exact_eps: bool = True

    def describe(self) -> list[str]:
        """One line per change, for a card and rebasin.json."""
        lines = [f"{name}: {a} → {b}" for name, (a, b) in self.grown.items()]
        if self.canonical:
            lines.append(
                "written in canonical form first (LayerNorm γ/β folded into their readers, writers centred) so "
                "that the zero features leave every LayerNorm's mean unchanged"
            )
        if self.untied:
            lines.append(f"stored apart (no longer tied): {', '.join(self.untied)}")
        how = "ε × d/d′: exact" if self.exact_eps else "the wider config's ε: off by O(ε / mean square)"
        lines += [f"{name}: {a:g} → {b:g} ({how})" for name, (a, b) in self.eps.items()]
        return lines

    def as_dict(self) -> dict[str, Any]:
        """For rebasin.json."""
        return {
            "grown": {k: list(v) for k, v in self.grown.items()},
            "canonical_form": self.canonical,
            "untied": list(self.untied),
            "eps": {k: list(v) for k, v in self.eps.items()},
            "exact_eps": self.exact_eps,
        }


def _width(space: Any) -> tuple[int, str]:
    """What grows in a space: its features, its heads, or each expert's units."""
    if isinstance(space, HeadSpace):
        return space.num_heads, "heads"
    if isinstance(space, ExpertSpace):
        return space.units, "units per expert"
    return space.size, "residual features" if getattr(space, "kind", "") == "residual" else "units"


def grown(narrow: SymmetryGraph, wide: SymmetryGraph) -> dict[str, tuple[int, int]]:
    """``{"<space pattern> (<what>)": (narrow, wide)}``: layers that grow alike are named once."""
    out: dict[str, tuple[int, int]] = {}
    for name, small in narrow.spaces.items():
        if name not in wide.spaces:
            continue
        big = wide.spaces[name]
        (a, what), (b, _) = _width(small), _width(big)
        if a != b:
            out[f"{LAYER.sub('.*.', name)} ({what})"] = (a, b)
        if isinstance(small, HeadSpace) and isinstance(big, HeadSpace) and small.head_dim != big.head_dim:
            scale = f": queries × √({big.head_dim}/{small.head_dim})" if small.scores_scaled else ""
            out[f"{LAYER.sub('.*.', name)} (head_dim{scale})"] = (
                small.head_dim,
                big.head_dim,
            )
    return out


def check_streams(graph: SymmetryGraph, ratios: Mapping[str, float]) -> None:
    """No pinned stream may grow (the model regenerates what writes it). Every LayerNorm on a growing
    space must read a stream that canonical form centres: its mean over the added zero features is
    then still 0, and its variance d/d′ of the real one."""
    from hf_rebasin.symmetry.canonical import RawStream

    for name in ratios:
        space = graph.spaces[name]
        if isinstance(space, Space) and space.pinned:
            raise IncompatibleModelsError(
                f"hidden size of {name!r} cannot grow: the stream is pinned ({space.reason}), and the wider "
                "model makes its own table of that width, which no embedding of the narrow one matches; MLP "
                "units and attention heads can still grow"
            )
    if graph.norm_type != "layernorm":
        return
    for name in ratios:
        space = graph.spaces[name]
        if not isinstance(space, Space) or not any(n.space == name and not _is_writer_scale(n) for n in graph.norms):
            continue
        if isinstance(space, RawStream):
            raise IncompatibleModelsError(
                f"hidden size of {name!r} cannot grow: something reads this LayerNorm stream without a norm, so "
                "its mean cannot be removed and the added zero features would change every LayerNorm's mean "
                "(add MLP units or heads instead)"
            )
        if not space.centered:
            raise IncompatibleModelsError(
                f"hidden size of {name!r} cannot grow: its LayerNorms read a stream that is not centred "
                f"({space.reason or 'post-norm'}), so their mean and variance over the added zero features are no "
                "rescaling of the real ones; MLP units and attention heads can still grow"
            )


def centrable(graph: SymmetryGraph, ratios: Mapping[str, float]) -> SymmetryGraph:
    """``graph`` with every growing LayerNorm stream marked orthogonal, so that canonical form centres
    its writers: a stream limited to permutations only because a norm's γ has no reader to fold into
    (a bare model's final norm) centres as well, and that norm keeps its γ."""
    spaces = dict(graph.spaces)
    for name in ratios:
        space = spaces[name]
        if isinstance(space, Space) and space.centered and space.max_class != "orthogonal":
            spaces[name] = dataclasses.replace(space, max_class="orthogonal", reason="")
    return dataclasses.replace(graph, spaces=spaces)
