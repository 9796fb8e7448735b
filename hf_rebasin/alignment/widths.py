"""Models of one family but different widths: a config widened to another's sizes (`widened_config`),
a model embedded in it exactly (`embed_model`, on `hf_rebasin.symmetry.embed`), and a run's models
brought to the widest: the narrower ones are written into the
widest one's shape (`embed_model`) before anything aligns them, so every strategy, merge,
barrier and transport works on models of one shape and the result has the wide shape.

The embedding is checked exact first (ε·d/d′); the embedded models then take the wide model's
config as it is (its norm ε: one config is written), so where a residual stream grows they compute
their function up to O(ε / rms²); that gap is measured on fixed example inputs and said in a note.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_rebasin.alignment.verify import check_preserved, example_gap
from hf_rebasin.core.errors import IncompatibleModelsError
from hf_rebasin.io.files import read_config
from hf_rebasin.io.models import LoadedModel, to_device
from hf_rebasin.io.offload import empty_model
from hf_rebasin.io.rebuild import cast_as_loaded, rebuild
from hf_rebasin.io.ties import keep_forced_ties
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.embed import (
    Embedding,
    centrable,
    check_spaces,
    check_streams,
    embed_state,
    grown,
    residual_ratio,
)

__all__ = [
    "Embedded",
    "config_widths",
    "differ_in_width",
    "embed_model",
    "sub_configs",
    "to_widest",
    "widened_config",
]

# config fields that set a width (copied from the wide config); the names transformers' families use
WIDTH_FIELDS = (
    "hidden_size", "n_embd", "dim", "d_model",  # the residual stream
    "intermediate_size", "n_inner", "hidden_dim", "mlp_ratio", "moe_intermediate_size",
    "shared_expert_intermediate_size",  # MLP / expert units
    "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "head_dim",  # heads
    "projection_dim", "projection_size",  # a joint embedding (CLIP, SigLIP)
    "encoder_ffn_dim", "decoder_ffn_dim", "encoder_attention_heads", "decoder_attention_heads",  # BART's stacks
    "d_ff", "d_kv", "num_heads",  # T5
)  # fmt: skip
# fields that must agree: what a wider shape cannot change (depth, vocabulary, experts)
FIXED_FIELDS = {
    "num_hidden_layers": "depth",
    "n_layer": "depth",
    "n_layers": "depth",
    "encoder_layers": "encoder depth",
    "decoder_layers": "decoder depth",
    "num_layers": "depth",
    "num_decoder_layers": "decoder depth",
    "relative_attention_num_buckets": "number of relative position buckets",
    "vocab_size": "vocabulary",
    "num_local_experts": "number of experts",
    "num_experts": "number of experts",
    "image_size": "image size",
    "patch_size": "patch size",
}
EPS_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps")
SUB_CONFIGS = ("text_config", "vision_config")


def sub_configs(config: Any) -> list[tuple[str, Any]]:
    """``config`` and its text / vision configs (CLIP, SigLIP), by where they are."""
    out = [("", config)]
    for name in SUB_CONFIGS:
        sub = getattr(config, name, None)
        if sub is not None and sub is not config:
            out.append((f"{name}.", sub))
    return out


def widened_config(narrow: Any, like: Any) -> Any:
    """``narrow``'s config with ``like``'s widths (hidden size, units, heads, head_dim); everything
    else (labels, vocabulary, rotary settings) stays ``narrow``'s. A different model type, depth,
    vocabulary or expert count is refused, each by its field."""
    if getattr(narrow, "model_type", None) != getattr(like, "model_type", None):
        raise IncompatibleModelsError(
            f"model_type {getattr(narrow, 'model_type', None)!r} cannot be embedded in a "
            f"{getattr(like, 'model_type', None)!r}: only models of one family embed"
        )
    _check_fixed_widths(narrow, like)
    wide = copy.deepcopy(narrow)
    for (where, small), (_, big), (_, out) in zip(
        sub_configs(narrow), sub_configs(like), sub_configs(wide), strict=False
    ):
        for name, what in FIXED_FIELDS.items():
            a, b = getattr(small, name, None), getattr(big, name, None)
            if a is not None and b is not None and a != b:
                raise IncompatibleModelsError(
                    f"`{where}{name}` is {a} in one model and {b} in the other: a different {what} cannot be "
                    "embedded (only hidden size, MLP units and attention heads can grow)"
                )
        for name in WIDTH_FIELDS:  # one ``like`` sets and ``narrow`` lacks is meant too (a head_dim kept)
            if hasattr(big, name) and (hasattr(out, name) or getattr(big, name) is not None):
                setattr(out, name, getattr(big, name))
    return wide


def _check_fixed_widths(narrow: Any, like: Any) -> None:
    """Refuse a width the family's adapter cannot embed at another value (T5's ``d_kv``), by name."""
    spec = get_adapter(getattr(narrow, "model_type", None)).for_config(narrow)
    for name, why in spec.fixed_widths.items():
        a, b = getattr(narrow, name, None), getattr(like, name, None)
        if a != b:
            raise IncompatibleModelsError(
                f"`{name}` is {a} in one model and {b} in the other: a {spec.family} model is not embedded at "
                f"another {name} ({why})"
            )


def embed_model(model: Any, like: Any, *, exact_eps: bool = True) -> tuple[Any, Embedding]:
    """``model`` (a transformers model) written into the shape of config ``like`` (its family, at
    least as wide in every width): a model of ``model``'s class computing the same function.

    With ``exact_eps`` every norm ε on a growing stream is scaled by d/d′ in the new config (exact);
    without it, the new config keeps ``like``'s ε (what a model merged into an existing wide one
    must use): the function then moves by O(ε / rms²)."""
    config = widened_config(model.config, like)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    # the wide graph from the same names first: a refused change (head_dim) may make no valid model
    check_spaces(graph, graph_for(config, sd.keys()))
    try:
        shapes = {k: tuple(t.shape) for k, t in empty_model(type(model), config).state_dict().items()}
    except (ValueError, TypeError) as e:  # the family's own check of a config (sizes that do not divide)
        raise IncompatibleModelsError(f"the wider config makes no {type(model).__name__}: {e}") from e
    wide_graph = graph_for(config, shapes.keys())
    check_spaces(graph, wide_graph)
    ratios = residual_ratio(graph, wide_graph)
    check_streams(graph, ratios)
    report = Embedding(grown=grown(graph, wide_graph), exact_eps=exact_eps)
    if graph.norm_type == "layernorm" and any(getattr(graph.spaces[n], "centered", False) for n in ratios):
        raw = sd
        sd, graph, report.untied = canonicalize(centrable(graph, ratios), sd)
        for readers in graph.output_readers.values():  # they read a norm that keeps γ: as they were
            sd.update({r: raw[r] for r in readers})
        report.canonical = True
        if report.untied:
            text = config.get_text_config()
            text.tie_word_embeddings = False
            if text is not config and hasattr(config, "tie_word_embeddings"):
                config.tie_word_embeddings = False
    role_eps = _write_eps(model.config, config, like, report, exact_eps)
    state = embed_state(graph, sd, wide_graph, shapes, role_eps=role_eps)
    wide = type(model)(config)
    keep_forced_ties(wide)
    wide.load_state_dict(state, strict=True)
    cast_as_loaded(wide, next(model.parameters()).dtype)
    return wide.eval(), report


def _write_eps(narrow: Any, config: Any, like: Any, report: Embedding, exact_eps: bool) -> float:
    """The norm ε of every (sub)config whose hidden size grows: ε × d/d′ (exact), or ``like``'s.
    Returns written / narrow ε of the top config (what role norms, which share it, are fitted to)."""
    top = 1.0
    for where, small in sub_configs(narrow):
        out = like_sub(config, where)
        d, d_wide = _hidden(small), _hidden(out)
        for name in EPS_FIELDS:
            value = getattr(out, name, None)
            if not isinstance(value, float) or isinstance(value, bool):
                continue
            if d and d_wide and d != d_wide:
                written = value * d / d_wide if exact_eps else getattr(like_sub(like, where), name, value)
                setattr(out, name, written)
                report.eps[f"{where}{name}"] = (value, written)
            elif not exact_eps:
                setattr(out, name, getattr(like_sub(like, where), name, value))
            if not where and value:
                top = getattr(out, name) / value
    return top


def _hidden(config: Any) -> int | None:
    for name in ("hidden_size", "n_embd", "dim", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def like_sub(like: Any, where: str) -> Any:
    """``like``'s (sub)config at ``where`` (``""``, ``"text_config."``)."""
    return getattr(like, where.rstrip("."), like) if where else like


def config_widths(folder: Path | None) -> dict[str, Any] | None:
    """The widths config.json sets (hidden size, units, heads; also in text / vision configs), or
    None when there is no readable config.json (an adapter, a model not downloaded yet)."""
    if folder is None:
        return None
    if not os.path.lexists(Path(folder) / "config.json"):
        return None
    return widths(read_config(folder))  # through the gate: confined, regular, typed


def widths(config: dict[str, Any]) -> dict[str, Any]:
    """The width fields of a config (as a dict), text / vision configs' prefixed by their name."""
    out = {k: config[k] for k in WIDTH_FIELDS if k in config}
    for sub in SUB_CONFIGS:
        if isinstance(config.get(sub), dict):
            out.update({f"{sub}.{k}": config[sub][k] for k in WIDTH_FIELDS if k in config[sub]})
    return out


def differ_in_width(folders: Sequence[Path | None]) -> bool:
    """Whether the config.json files of ``folders`` set different widths (unknown ones: no)."""
    widths = [w for w in map(config_widths, folders) if w is not None]
    return any(w != widths[0] for w in widths[1:])


@dataclasses.dataclass(frozen=True)
class Embedded:
    """One model written into the widest shape: what grew, and the largest change of its logits on
    fixed example inputs under the wide config's ε (None: a model without logits)."""

    index: int
    into: int  # the index of the model whose shape it took
    embedding: Embedding
    gap: float | None
    scale: float | None

    def note(self, names: Sequence[str]) -> str:
        """What the card and rebasin.json say about it."""
        grown = "; ".join(f"{k}: {a} → {b}" for k, (a, b) in self.embedding.grown.items())
        text = f"{names[self.index]} embedded into the shape of {names[self.into]} (zeros where it is wider): {grown}"
        if self.embedding.canonical:
            text += "; written in canonical form first (LayerNorm γ/β folded, writers centred)"
        if self.embedding.untied:
            text += f"; stored apart: {', '.join(self.embedding.untied)}"
        if self.gap is not None:
            text += (
                f"; with the wide config's norm ε its logits move by at most {self.gap:.2g} "
                f"(max |logits| {self.scale:.3g}) on example inputs"
            )
        return text


def _numel(lm: LoadedModel) -> int:
    return sum(int(t.numel()) for t in lm.model.state_dict().values())


def _gap(narrow: Any, wide: Any) -> tuple[float | None, float | None]:
    """max |Δ logits| of the narrow model and its embedding on `verify`'s example inputs."""
    if not any(v is None for v in get_adapter(narrow.config.model_type).outputs.values()):
        return None, None  # hidden states only: of two widths, not comparable feature by feature
    return example_gap(narrow, wide)


def to_widest(
    models: Sequence[LoadedModel], names: Sequence[str], into: int | None = None
) -> tuple[list[LoadedModel], list[Embedded]]:
    """``models`` (one family, loaded in memory) in one shape: that of model ``into`` (None: the
    largest). Models of its widths are returned as they are; the others are embedded into it. When
    an embedding had to store a tied tensor apart (a LayerNorm stream in canonical form), every
    model stores it apart.

    A model wider than the widest one in some width (more heads but a narrower stream) cannot be
    embedded: refused, naming both."""
    found = [widths(lm.model.config.to_dict()) for lm in models]
    kinds = {lm.model.config.model_type for lm in models}
    if all(w == found[0] for w in found[1:]) or len(kinds) > 1:  # other families: `check_compatible` says so
        return list(models), []
    widest = into if into is not None else max(range(len(models)), key=lambda i: _numel(models[i]))
    like = models[widest].model.config
    out: list[LoadedModel] = []
    embedded: list[Embedded] = []
    for i, lm in enumerate(models):
        if found[i] == found[widest]:
            out.append(lm)
            continue
        if lm.source is not None:  # the loader keeps runs of different widths in memory
            raise AssertionError(f"{names[i]} is streamed: it cannot be embedded")
        try:
            exact, embedding = embed_model(lm.model, like)
        except IncompatibleModelsError as e:
            raise IncompatibleModelsError(
                f"{names[i]} has other widths than {names[widest]} (the largest model) and cannot be written into its "
                f"shape: {e}"
            ) from None
        to_device(exact, next(lm.model.parameters()).device)
        gap, scale = _gap(lm.model, exact)
        if gap is not None and scale is not None:  # a family fact the embedding missed is a bug, not a result
            check_preserved(gap, scale, f"{names[i]} embedded into the shape of {names[widest]}")
        wide = _with_eps(exact, like) if embedding.eps else exact
        if wide is not exact:
            del exact
            gap, scale = _gap(lm.model, wide)
        done = Embedded(i, widest, embedding, gap, scale)
        embedded.append(done)
        graph = graph_for(wide.config, wide.state_dict().keys())
        out.append(dataclasses.replace(lm, model=wide, graph=graph, embedded=done.note(names)))
    untied = {name for e in embedded for name in e.embedding.untied}
    if untied:
        out = [_untie(lm, untied) for lm in out]
    return out, embedded


def _with_eps(model: Any, like: Any) -> Any:
    """``model`` with the norm ε of config ``like`` (one config is written for all the models)."""
    config = copy.deepcopy(model.config)
    for (_, out), (_, wide) in zip(sub_configs(config), sub_configs(like), strict=False):
        for name in EPS_FIELDS:
            if isinstance(getattr(wide, name, None), float):
                setattr(out, name, getattr(wide, name))
    new = type(model)(config)
    keep_forced_ties(new)
    new.load_state_dict(model.state_dict(), strict=True)
    cast_as_loaded(new, next(model.parameters()).dtype)
    to_device(new, next(model.parameters()).device)
    return new.eval()


def _untie(lm: LoadedModel, names: set[str]) -> LoadedModel:
    """``lm`` with its tied tensors ``names`` stored apart (already apart: as it is)."""
    tied = set(dict(getattr(lm.model, "all_tied_weights_keys", None) or {}))
    if not tied & names:
        return lm
    model = rebuild(lm.model, dict(lm.model.state_dict()), untie=True)
    to_device(model, next(lm.model.parameters()).device)
    return dataclasses.replace(lm, model=model, graph=graph_for(model.config, model.state_dict().keys()))
