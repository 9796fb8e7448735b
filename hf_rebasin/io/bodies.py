"""Classifiers compared on their bodies: two task heads over other label sets have nothing in common
to compare, but the bodies under them (``bert.``…) may well descend from one another."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import combinations
from typing import TYPE_CHECKING, cast

from hf_rebasin.core.lazy import under
from hf_rebasin.io.models import LoadedModel, label_counts

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["bodies", "body", "compared_bodies"]


def _stripped(names: dict[str, str], prefix: str) -> dict[str, str]:
    """A name -> name map kept where both sides lie under ``prefix``, named without it."""
    n = len(prefix)
    return {a[n:]: b[n:] for a, b in names.items() if a.startswith(prefix) and b.startswith(prefix)}


def body(lm: LoadedModel) -> LoadedModel:
    """``lm`` as its bare model (``model.base_model``): the tensors under ``base_model_prefix``,
    named as the bare model names them, with the graph of that model. A streamed model stays
    streamed (a renamed view of its files, `core.lazy.under`); the head is left out."""
    from hf_rebasin.symmetry.adapters import graph_for

    base = cast("PreTrainedModel", lm.model.base_model)
    if base is lm.model:  # a bare model is its own body
        return lm
    prefix = f"{lm.model.base_model_prefix}."
    n = len(prefix)
    source = None if lm.source is None else under(lm.source, prefix)
    meta = base.state_dict()  # shapes only where streamed: the parameters are on meta
    graph = graph_for(base.config, list(meta))
    graph.check(meta, source=str(lm.path))
    return dataclasses.replace(
        lm,
        model=base,
        graph=graph,
        source=source,
        ignored={k[n:]: v for k, v in lm.ignored.items() if k.startswith(prefix)},
        stored_dtypes={k[n:]: v for k, v in lm.stored_dtypes.items() if k.startswith(prefix)},
        untied=_stripped(lm.untied, prefix),
        initialised={k[n:]: v for k, v in lm.initialised.items() if k.startswith(prefix)},
    )


def bodies(a: LoadedModel, b: LoadedModel) -> tuple[LoadedModel, LoadedModel] | None:
    """Both classifiers' bodies where their task heads are over other label sets (heads of other
    shapes), else None: they are compared as they are."""
    if label_counts(a, b) is None:
        return None
    return body(a), body(b)


def compared_bodies(models: Sequence[LoadedModel]) -> tuple[list[LoadedModel], str | None]:
    """``models`` as they are (and None), or, where two of them have task heads over other label
    sets, every model's body and a note naming the label counts: lineage compares what all have."""
    if not any(label_counts(models[i], models[j]) for i, j in combinations(range(len(models)), 2)):
        return list(models), None
    counts = ", ".join(f"model {i + 1}: {getattr(lm.model.config, 'num_labels', None)}" for i, lm in enumerate(models))
    prefix = f"{models[0].model.base_model_prefix}."
    note = (
        f"the task heads (over other label sets: {counts} labels) are left out: the bodies (the tensors under "
        f"{prefix}) are compared"
    )
    return [body(lm) for lm in models], note
