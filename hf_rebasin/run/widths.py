"""Models of one family but different widths in one run: the narrower ones are written into the
widest one's shape (`embed.embed_model`) before anything aligns them, so every strategy, merge,
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

from ..adapters import get_adapter, graph_for
from ..embed import EPS_FIELDS, SUB_CONFIGS, WIDTH_FIELDS, Embedding, embed_model, sub_configs
from ..errors import IncompatibleModelsError
from ..files import read_config
from ..models import LoadedModel, rebuild, to_device
from ..verify import check_preserved, example_gap

__all__ = ["Embedded", "config_widths", "differ_in_width", "to_widest"]


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
    new.load_state_dict(model.state_dict(), strict=True)
    new.to(dtype=next(model.parameters()).dtype)
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
