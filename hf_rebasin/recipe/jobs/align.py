"""job: align — bring every model into the basis of the first (A) and write each of them, not
their average: ``a/``, ``b/``, … as stock model folders, and a mergekit configuration that merges
them. For merging with another tool (mergekit's SLERP, TIES or DARE, a notebook) that averages
tensors by name and so needs models in one basis."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

from pydantic import Field

from hf_rebasin.recipe.jobs import CardPart, Job
from hf_rebasin.recipe.jobs.merge import PRESERVED_PAIR, PRESERVED_SENTENCE, models_not_roles
from hf_rebasin.recipe.sections import AlignedRecipe, ModelsRecipe
from hf_rebasin.recipe.tokenizer import merge_vocabulary

__all__ = ["JOB", "AlignRecipe", "folder_name"]


class AlignRecipe(ModelsRecipe, AlignedRecipe):
    """`job: align`: write every model in the basis of the first (A), for merging with another tool."""

    job: Literal["align"] = Field("align", description="write every model in the basis of the first")

    misplaced: ClassVar[Mapping[str, str]] = {
        **models_not_roles("align"),
        "merge": "job: align writes every model in one basis and averages nothing: remove `merge`, or use job: merge",
        "evaluate": "job: align writes the models and scores nothing: remove `evaluate` (job: barrier draws the "
        "loss between A and B)",
    }


def folder_name(i: int) -> str:
    """The subfolder of the i-th model: ``a``, ``b``, … (``m27``, … past z)."""
    return chr(ord("a") + i) if i < 26 else f"m{i + 1}"


def mergekit_method(n_models: int) -> str:
    """The merge `mergekit.yaml` asks for: SLERP at the midpoint for two models, else a linear average."""
    return "slerp" if n_models == 2 else "linear"


def _describe(recipe: AlignRecipe) -> list[str]:
    folders = ", ".join(f"{folder_name(i)}/" for i in range(len(recipe.models)))
    return [
        f"align: writes {folders} (A, and every other model in A's basis; each as its input is stored) "
        f"and mergekit.yaml ({mergekit_method(len(recipe.models))})",
        "evaluate: no",
    ]


def _title(names: Sequence[str]) -> str:
    return f"In one basis: {', '.join(names)}"


JOB = Job(
    name="align",
    summary="write every model in the basis of the first, for merging with another tool (mergekit)",
    recipe=AlignRecipe,
    writes_model=False,  # the folder holds one model per subfolder, not a model itself
    vocabulary=merge_vocabulary,  # no `tokenizer` section: the reference's (each model is written in its own)
    describe=_describe,
    card=CardPart(
        title=_title,
        intro="""This folder holds the models below written in one basis, not a merged model: `a/` is model A{% if canonical_form %}
in canonical form (norm scales folded into the next weights: the same function, stored differently){% endif %},
and `b/`, … are the other models with their heads, units and residual stream moved into A's basis by
the `{{ strategy_name }}` strategy of hf-rebasin. Each subfolder loads with the stock Transformers
class and computes what its input computed.""",
        why="""A merge tool averages tensors by name, which only makes sense once the models share a basis:
networks trained separately compute the same function up to symmetries of their weights (hidden
units or attention heads in another order, a rotated residual stream). Merge these folders with
any tool; with mergekit, in this folder: `mergekit-yaml mergekit.yaml merged/`.""",
        preserved=PRESERVED_SENTENCE,
        pair=PRESERVED_PAIR,
    ),
)
