"""Declarative architecture specs and their expansion into a :class:`SymmetryGraph`.

An adapter is data: space templates, tensor templates (``{i}`` loops over layers, ``{base}`` is the
base-model prefix such as ``"transformer."``, empty for a bare base model), norms with the tensors
that read them, ties and tensors that carry no hidden axis. The one Python escape hatch is ``dims``:
reading sizes from a config.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hf_rebasin.symmetry.canonical import WriterScale
from hf_rebasin.symmetry.graph import Glu, Norm, Sublayer, SymmetryGraph
from hf_rebasin.symmetry.spaces import (
    AnySpace,
    AxisRef,
    Binding,
    ExpertSpace,
    Fused,
    HeadSpace,
    QKMode,
    Router,
    Space,
    TransformClass,
    View,
    split_ref,
)

_VAR = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class SpaceT:
    """Template of a :class:`Space`; ``size`` names a key of the dims."""

    name: str
    size: str
    max_class: TransformClass = "permutation"
    centered: bool = False
    kind: str = "plain"
    reason: str = ""
    # no map but the identity is exact (a stream written by a table regenerated on load); ``reason`` says why
    pinned: bool = False


@dataclass(frozen=True)
class HeadsT:
    """Template of a :class:`HeadSpace`; sizes name keys of the dims."""

    name: str
    heads: str = "heads"
    kv_heads: str = "heads"
    head_dim: str = "head_dim"
    rotary: bool = False
    # which Q/K inner maps keep the scores: "free", "planes" (what rotary implies), "fixed" (q/k norms);
    # ``reason`` says why, for messages
    qk: QKMode = "free"
    reason: str = ""
    # dims key of the features per head that rotate (partial rotary: fewer than head_dim fixes Q/K)
    rotary_dim: str | None = None
    # the model divides its scores by √head_dim (T5 does not)
    scores_scaled: bool = True


@dataclass(frozen=True)
class ExpertsT:
    """Template of an :class:`ExpertSpace` (a mixture-of-experts layer); sizes name keys of the dims."""

    name: str
    experts: str = "experts"
    units: str = "expert_ff"
    router: Router = "softmax"


Dims = Mapping[str, int]


def stacked_readers(experts: str, units: str, d: str, parts: int = 2) -> Callable[[Dims], View]:
    """The view of a 3-D expert tensor that reads the stream, ``[E, parts·f, d]`` (transformers 5's
    ``gate_up_proj``: each expert's gate rows then its up rows), as ``[parts·E·f, d]``: all gate
    units (expert by expert), then all up units."""

    def view(dims: Dims) -> View:
        E, f, n = dims[experts], dims[units], dims[d]
        return View((E, parts * f, n), (E, parts, f, n), (1, 0, 2, 3), (parts * E * f, n))

    return view


def stacked_writer(experts: str, units: str, d: str) -> Callable[[Dims], View]:
    """The view of a 3-D expert tensor that writes the stream, ``[E, d, f]`` (``down_proj``), as
    ``[d, E·f]``."""

    def view(dims: Dims) -> View:
        E, f, n = dims[experts], dims[units], dims[d]
        return View((E, n, f), (E, n, f), (1, 0, 2), (n, E * f))

    return view


@dataclass(frozen=True)
class NormT:
    """A norm (``prefix.weight`` / ``prefix.bias``) on ``space``; ``readers`` are the weights that
    read its output only (empty when the norm sits on the residual path itself)."""

    prefix: str
    space: str
    readers: tuple[str, ...] = ()
    bias: bool = True
    # the model's last norm: in a bare base model its output is the model's output, so not foldable
    final: bool = False
    # the norm multiplies by weight + offset (Gemma's RMSNorm: x·(1 + w), offset 1)
    offset: float = 0.0


@dataclass(frozen=True)
class ScaleT:
    """A per-feature scale ``param`` on what ``writers`` write to ``space`` (DINOv2's LayerScale
    ``layer_scale1.lambda1``: the sublayer's output times λ); canonical form folds it into them."""

    param: str
    space: str
    writers: tuple[str, ...]


@dataclass(frozen=True)
class SublayerT:
    """Template of a :class:`Sublayer`: module prefixes that read the residual stream and that
    write it, with loop variables; one per block kind, listed in forward order within a layer."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]


TensorAt = str | tuple[str, int]  # a tensor template, or (template, occurrence of the space on a fused axis)


@dataclass(frozen=True)
class GluT:
    """Template of a :class:`Glu`: a gated MLP ``down(act(gate·x) ⊙ (up·x))`` on unit space
    ``space``. Each of ``gate``/``up``/``down`` is a tensor template, or ``(template, k)`` where the
    unit axis is fused: the k-th copy of ``space`` on it (Phi-3's ``gate_up_proj``: gate 0, up 1).
    Its units' free scaling is what :mod:`hf_rebasin.symmetry.glu` brings to a canonical form."""

    space: str
    gate: TensorAt
    up: TensorAt
    down: TensorAt


# "seq2seq": token ids for an encoder-decoder, each row ending in its end-of-sentence token (a
# classifier reads the decoder there); the decoder reads the source shifted right. "speech-seq2seq":
# log-mel features (Whisper's encoder takes exactly 2·max_source_positions frames) and decoder ids
Inputs = Literal["text", "image", "text-image", "seq2seq", "speech-seq2seq"]


# an encoder-decoder whose one ``shared`` table feeds both stacks and the LM head (BART, T5)
SHARED_TABLE_TIES = {
    "{base}encoder.embed_tokens.weight": "{base}shared.weight",
    "{base}decoder.embed_tokens.weight": "{base}shared.weight",
    "lm_head.weight": "{base}shared.weight",
}


@dataclass(frozen=True)
class ArchitectureSpec:
    family: str
    model_types: tuple[str, ...]
    base_prefix: str
    dims: Callable[[Any], dict[str, int]]
    loops: Mapping[str, str]
    spaces: tuple[SpaceT | HeadsT | ExpertsT, ...]
    tensors: Mapping[str, tuple[AxisRef, ...]]
    norms: tuple[NormT, ...] = ()
    ties: Mapping[str, str] = field(default_factory=dict)
    invariant: tuple[str, ...] = ()
    norm_type: Literal["layernorm", "rmsnorm"] = "layernorm"
    inputs: Inputs = "text"
    # output key -> space of its last axis (None: basis free, e.g. logits)
    outputs: Mapping[str, str | None] = field(default_factory=lambda: {"logits": None})
    # the residual stream's sublayers (forward order within a layer) and what writes it first
    sublayers: tuple[SublayerT, ...] = ()
    embeddings: tuple[str, ...] = ()
    # residual space -> the module whose output is the stream as the encoder leaves it, at every
    # position (the final encoder norm; Verma & Elbayad's `last` residual site)
    last_hidden: Mapping[str, str] = field(default_factory=dict)
    # Optional escape hatch: tensor templates that depend on which other tensors exist.
    alternatives: Callable[[Collection[str]], Mapping[str, tuple[AxisRef, ...]]] | None = None
    # per-feature scales on the output of writers of a space (LayerScale)
    scales: tuple[ScaleT, ...] = ()
    # Optional escape hatch: fields that depend on the config, replaced before the graph is built
    # (GPT-NeoX's sublayers without a parallel residual).
    configured: Callable[[Any], Mapping[str, Any]] | None = None
    # gated MLPs: their units' free scaling (up row × s, down column ÷ s)
    glus: tuple[GluT, ...] = ()
    # tensor template -> how the stored tensor reads as its axes describe it (3-D expert tensors)
    views: Mapping[str, Callable[[Dims], View]] = field(default_factory=dict)
    # tensor template -> p: the model multiplies its output by hidden_size**p (Gemma's embeddings: 0.5)
    embedding_scales: Mapping[str, float] = field(default_factory=dict)
    # RMSNorms over a role of a head space, e.g. ``NormT("{L}.q_norm", "{ATTN}:q")`` (OLMo 2: over every
    # head's features); their weight is bound in ``tensors``
    role_norms: tuple[NormT, ...] = ()
    # module templates of the stacks that run one after the other on the residual stream (an
    # encoder-decoder's: encoder, then decoder); empty for one stack
    stacks: tuple[str, ...] = ()
    # tensor templates of the task heads: a model with none of them is a bare base model (its final
    # norm's output is an output). Empty: a model is bare when it lacks ``base_prefix`` (T5's
    # conditional-generation class has no prefix, so its head's presence says it)
    head_tensors: tuple[str, ...] = ()
    # tie aliases the config class re-ties on load whatever ``tie_word_embeddings`` says (T5Config
    # forces the tie): they stay tied when a tied LM head is read or written apart
    forced_ties: tuple[str, ...] = ()
    # config width fields a model of this family cannot be embedded at another value of, with why
    # (``embed`` and runs of models of different widths refuse them by name)
    fixed_widths: Mapping[str, str] = field(default_factory=dict)

    def for_config(self, config: Any) -> ArchitectureSpec:
        """The spec as one model's config settles it (``configured``'s fields)."""
        return dataclasses.replace(self, **self.configured(config)) if self.configured is not None else self

    def graph(self, config: Any, keys: Collection[str]) -> SymmetryGraph:
        """The symmetry graph of a concrete model (its config and state-dict keys)."""
        return _build(self.for_config(config), config, set(keys))


def _expansions(strings: list[str], loops: Mapping[str, str], dims: Mapping[str, int]) -> list[dict[str, str]]:
    names = sorted({v for s in strings for v in _VAR.findall(s) if v in loops})
    ranges = [range(dims[loops[v]]) for v in names]
    return [dict(zip(names, (str(i) for i in combo), strict=False)) for combo in itertools.product(*ranges)]


def _fmt(s: str, env: Mapping[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), s)


def _fmt_ref(ref: AxisRef, env: Mapping[str, str]) -> AxisRef:
    if ref is None:
        return None
    if isinstance(ref, Fused):
        return Fused(tuple(_fmt(p, env) for p in ref.parts), ref.interleaved)
    return _fmt(ref, env)


def _ref_strings(ref: AxisRef) -> list[str]:
    if ref is None:
        return []
    return list(ref.parts) if isinstance(ref, Fused) else [ref]


def _build(spec: ArchitectureSpec, config: Any, keys: set[str]) -> SymmetryGraph:
    """Expand ``spec`` for one concrete model: every template instantiated for the layers its config
    has and kept where the model has the tensor, then spaces no tensor uses dropped."""
    dims = spec.dims(config)
    base = spec.base_prefix if any(k.startswith(spec.base_prefix) for k in keys) else ""
    env0 = {"base": base}
    if spec.head_tensors:
        bare = not any(_fmt(t, env0) in keys for t in spec.head_tensors)
    else:
        bare = bool(spec.base_prefix) and not base

    spaces = _spaces(spec, dims)
    bindings = _bindings(spec, dims, env0, keys)
    norm_bindings, norms, output_readers = _norms(spec, dims, env0, keys, bare=bare)
    bindings.update(norm_bindings)
    scale_bindings, scales = _scales(spec, dims, env0, keys)
    bindings.update(scale_bindings)
    ties = _ties(spec, config, env0, keys)
    invariant = _invariant(spec, dims, env0)

    graph = SymmetryGraph(
        spec.family,
        spaces,
        bindings,
        ties,
        [*norms, *scales],
        frozenset(invariant),
        spec.norm_type,
        _sublayers(spec, dims, env0),
        tuple(_fmt(e, env0) for e in spec.embeddings),
        {space: _fmt(module, env0) for space, module in spec.last_hidden.items()},
    )
    graph.embedding_scales = {_fmt(t, env0): p for t, p in spec.embedding_scales.items() if _fmt(t, env0) in keys}
    graph.role_norms = _role_norms(spec, dims, env0, keys)
    graph.output_readers = output_readers
    stacks = (_fmt(st, env0) for st in spec.stacks)  # those the model has (T5EncoderModel: one)
    graph.stacks = tuple(st for st in stacks if any(k.startswith(st + ".") for k in keys))
    used = {name for name in spaces if graph.users(name)}
    graph.spaces = {k: v for k, v in spaces.items() if k in used}
    graph.glus = _glus(spec, dims, env0, graph)
    _limit_unfoldable(graph)
    return graph


def _spaces(spec: ArchitectureSpec, dims: Mapping[str, int]) -> dict[str, AnySpace]:
    """Every space of the spec's templates, one per value of its loop variables (used or not)."""
    spaces: dict[str, AnySpace] = {}
    for st in spec.spaces:
        for env in _expansions([st.name], spec.loops, dims):
            name = _fmt(st.name, env)
            if isinstance(st, HeadsT):
                spaces[name] = _head_space(st, name, dims)
            elif isinstance(st, ExpertsT):
                spaces[name] = ExpertSpace(name, dims[st.experts], dims[st.units], st.router)
            else:
                spaces[name] = Space(name, dims[st.size], st.max_class, st.centered, st.kind, st.reason, st.pinned)
    return spaces


def _bindings(
    spec: ArchitectureSpec, dims: Mapping[str, int], env0: Mapping[str, str], keys: set[str]
) -> dict[str, Binding]:
    """The binding of every tensor template (and of the alternatives the present keys choose) that
    the model has: a model may lack some (no biases, no pooler)."""
    templates = dict(spec.tensors)
    if spec.alternatives is not None:
        templates.update(spec.alternatives(keys))
    bindings: dict[str, Binding] = {}
    for tmpl, axes in templates.items():
        strings = [tmpl] + [s for ref in axes for s in _ref_strings(ref)]
        for env in _expansions(strings, spec.loops, dims):
            env = {**env0, **env}
            name = _fmt(tmpl, env)
            if name in keys:
                view = spec.views[tmpl](dims) if tmpl in spec.views else None
                bindings[name] = Binding(name, tuple(_fmt_ref(r, env) for r in axes), view=view)
    return bindings


def _norms(
    spec: ArchitectureSpec, dims: Mapping[str, int], env0: Mapping[str, str], keys: set[str], *, bare: bool
) -> tuple[dict[str, Binding], list[Norm], dict[str, tuple[str, ...]]]:
    """Every norm the model has, with the bindings of its weight (a norm scale) and bias. A reader
    may loop over a variable the norm lacks (T5's encoder output, read by every decoder layer's
    cross-attention): one norm, its readers gathered over that variable. In a bare base model
    (``bare``) the final norm's output is the model's output: its readers are kept apart (norm
    weight -> readers), never folded into."""
    bindings: dict[str, Binding] = {}
    norms: list[Norm] = []
    output_readers: dict[str, tuple[str, ...]] = {}
    for nt in spec.norms:
        for env in _expansions([nt.prefix, nt.space], spec.loops, dims):
            env = {**env0, **env}
            weight = _fmt(nt.prefix, env) + ".weight"
            if weight not in keys:
                continue
            bias = _fmt(nt.prefix, env) + ".bias" if nt.bias else None
            bias = bias if bias in keys else None
            space = _fmt(nt.space, env)
            readers = tuple(r for r in _fanned(nt.readers, env, spec.loops, dims) if r in keys)
            if nt.final and bare:
                if readers:
                    output_readers[weight] = readers
                readers = ()
            bindings[weight] = Binding(weight, (space,), norm_scale=True)
            if bias is not None:
                bindings[bias] = Binding(bias, (space,))
            norms.append(Norm(weight, bias, space, readers, nt.offset))
    return bindings, norms, output_readers


def _fanned(
    templates: tuple[str, ...], env: Mapping[str, str], loops: Mapping[str, str], dims: Mapping[str, int]
) -> list[str]:
    """``templates`` formatted with ``env``, each expanded over the loop variables ``env`` leaves open."""
    out: list[str] = []
    for tmpl in templates:
        partial = _fmt(tmpl, env)
        out.extend(_fmt(partial, more) for more in _expansions([partial], loops, dims))
    return out


def _scales(
    spec: ArchitectureSpec, dims: Mapping[str, int], env0: Mapping[str, str], keys: set[str]
) -> tuple[dict[str, Binding], list[Norm]]:
    """Every per-feature scale on a sublayer's output (LayerScale) the model has, bound like a norm
    scale and folded into its writers as a :class:`WriterScale`."""
    bindings: dict[str, Binding] = {}
    scales: list[Norm] = []
    for sc in spec.scales:
        for env in _expansions([sc.param, sc.space, *sc.writers], spec.loops, dims):
            env = {**env0, **env}
            param = _fmt(sc.param, env)
            if param not in keys:
                continue
            space = _fmt(sc.space, env)
            writers = tuple(w for w in (_fmt(x, env) for x in sc.writers) if w in keys)
            bindings[param] = Binding(param, (space,), norm_scale=True)
            scales.append(WriterScale(param, None, space, writers))
    return bindings, scales


def _ties(spec: ArchitectureSpec, config: Any, env0: Mapping[str, str], keys: set[str]) -> dict[str, str]:
    """The tied aliases (alias -> source) the model has: none where its config unties its
    embeddings, except those its config class forces (``forced_ties``)."""
    ties: dict[str, str] = {}
    tie_on = getattr(config, "tie_word_embeddings", True) is not False
    for alias, source in spec.ties.items():
        forced = alias in spec.forced_ties
        alias, source = _fmt(alias, env0), _fmt(source, env0)
        if (tie_on or forced) and alias in keys and source in keys:
            ties[alias] = source
    return ties


def _invariant(spec: ArchitectureSpec, dims: Mapping[str, int], env0: Mapping[str, str]) -> set[str]:
    """Every tensor the spec names as carrying no hidden axis, expanded over its loops."""
    invariant = set()
    for tmpl in spec.invariant:
        for env in _expansions([tmpl], spec.loops, dims):
            invariant.add(_fmt(tmpl, {**env0, **env}))
    return invariant


def _role_norms(
    spec: ArchitectureSpec, dims: Mapping[str, int], env0: Mapping[str, str], keys: set[str]
) -> tuple[Norm, ...]:
    """Every norm over a head space's role that the model has."""
    out = []
    for nt in spec.role_norms:
        for env in _expansions([nt.prefix, nt.space], spec.loops, dims):
            full = {**env0, **env}
            weight = _fmt(nt.prefix, full) + ".weight"
            if weight in keys:
                out.append(Norm(weight, None, _fmt(nt.space, full), (), nt.offset))
    return tuple(out)


def _at(ref: TensorAt) -> tuple[str, int]:
    return (ref, 0) if isinstance(ref, str) else ref


def _glus(
    spec: ArchitectureSpec, dims: Mapping[str, int], env0: Mapping[str, str], graph: SymmetryGraph
) -> tuple[Glu, ...]:
    """Every gated MLP of the model whose space and tensors it has (a model may lack one)."""
    out: list[Glu] = []
    for gt in spec.glus:
        parts = (_at(gt.gate), _at(gt.up), _at(gt.down))
        for env in _expansions([gt.space, *(t for t, _ in parts)], spec.loops, dims):
            env = {**env0, **env}
            space = _fmt(gt.space, env)
            gate, up, down = [(_fmt(t, env), k) for t, k in parts]
            if split_ref(space)[0] in graph.spaces and all(t in graph.bindings for t, _ in (gate, up, down)):
                out.append(Glu(space, gate, up, down))
    return tuple(out)


def _head_space(st: HeadsT, name: str, dims: Mapping[str, int]) -> HeadSpace:
    """The head space of a template: partial rotary embeddings (rotated and pass-through features in
    one head) fix its Q/K inner maps."""
    qk, reason, dh = st.qk, st.reason, dims[st.head_dim]
    if st.rotary_dim is not None and dims[st.rotary_dim] < dh:
        qk = "fixed"
        reason = reason or f"partial rotary embeddings: {dims[st.rotary_dim]} of {dh} features per head rotate"
    return HeadSpace(
        name, dims[st.heads], dims[st.kv_heads], dh, st.rotary, qk=qk, reason=reason, scores_scaled=st.scores_scaled
    )


def _sublayers(spec: ArchitectureSpec, dims: Mapping[str, int], env0: Mapping[str, str]) -> tuple[Sublayer, ...]:
    """Every sublayer in forward order: by stack (the order of ``loops``: an encoder's layers run
    before its decoder's), then layer index, then the spec's order within a layer."""
    rank = {v: k for k, v in enumerate(spec.loops)}
    found: list[tuple[tuple[int, ...], tuple[int, ...], int, Sublayer]] = []
    for order, st in enumerate(spec.sublayers):
        for env in _expansions([*st.reads, *st.writes], spec.loops, dims):
            full = {**env0, **env}
            sub = Sublayer(tuple(_fmt(r, full) for r in st.reads), tuple(_fmt(w, full) for w in st.writes))
            stack = tuple(sorted(rank[v] for v in env))
            found.append((stack, tuple(int(v) for _, v in sorted(env.items())), order, sub))
    return tuple(sub for *_, sub in sorted(found, key=lambda f: f[:3]))


def _limit_unfoldable(graph: SymmetryGraph) -> None:
    """A space whose norm has no reader (a bare base model's final norm, a norm on the residual
    path, a post-sublayer norm writing the stream) cannot be rotated: downgrade it and say why. An
    RMSNorm is blind to signs, so there it keeps signed permutations; a LayerNorm keeps permutations."""
    for norm in graph.norms:
        space = graph.spaces.get(norm.space)
        if isinstance(space, Space) and space.max_class == "orthogonal" and not norm.readers:
            signed = graph.norm_type == "rmsnorm" and not space.centered
            graph.spaces[norm.space] = dataclasses.replace(
                space,
                max_class="signed-permutation" if signed else "permutation",
                reason=space.reason
                if space.pinned
                else f"norm {norm.weight!r} has no linear reader to fold its scale into",
            )


def as_choices(model: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multiple-choice head reads ``[questions, choices, length]``: a batch's rows become the
    choices of one question (other models take ``inputs`` as they are)."""
    if not type(model).__name__.endswith("ForMultipleChoice"):
        return dict(inputs)
    return {k: v[None] if v.dim() == 2 else v for k, v in inputs.items() if k != "labels"}


def token_inputs(
    vocab: int, max_len: int, generator: torch.Generator, batch: int = 2, length: int = 12
) -> dict[str, torch.Tensor]:
    n = min(length, max_len)
    ids = torch.randint(0, vocab, (batch, n), generator=generator)
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[-1, n - 3 :] = 0  # one padded row: padding must not matter either
    return {"input_ids": ids, "attention_mask": mask}


def image_inputs(channels: int, size: int, generator: torch.Generator, batch: int = 2) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(batch, channels, size, size, generator=generator)}
