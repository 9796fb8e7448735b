"""job: lineage — are the models related (a fine-tune, continued pretraining, a merge, a widened
copy), up to every symmetry their family has? A verdict per pair, with its p-value and the evidence
per layer; a report, no weights written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.core.names import DEFAULT_LINEAGE_STRATEGY
from hf_rebasin.recipe.jobs import CardPart, Job
from hf_rebasin.recipe.jobs.merge import models_not_roles
from hf_rebasin.recipe.sections import AlignedRecipe, ModelsRecipe

__all__ = ["JOB", "LineageRecipe"]

STRATEGY = DEFAULT_LINEAGE_STRATEGY


class LineageRecipe(ModelsRecipe, AlignedRecipe):
    """`job: lineage`: a verdict per pair of models (same basis, related up to symmetry, shared embeddings,
    independent)."""

    job: Literal["lineage"] = Field(
        "lineage", description="are the models related, up to every symmetry? a verdict per pair, no weights"
    )

    default_strategy: ClassVar[str | None] = STRATEGY
    misplaced: ClassVar[Mapping[str, str]] = {
        **models_not_roles("lineage"),
        "merge": "job: lineage merges nothing: remove `merge` (job: merge averages models)",
        "evaluate": "job: lineage reads weights only and scores no loss: remove `evaluate` (job: barrier does)",
    }

    @field_validator("strategy")
    @classmethod
    def _matching(cls, value: Any) -> Any:
        if value is not None and (value.name != STRATEGY or value.options.model_fields_set):
            raise PydanticCustomError(
                "recipe",
                "job: lineage aligns the models' signals with data-free generalized-orthogonal (every symmetry of the "
                "family) and takes no strategy options: remove `strategy`",
                {"at": "strategy"},
            )
        return value


def _describe(recipe: LineageRecipe) -> list[str]:
    n = len(recipe.models)
    how = "data-free" if recipe.data is None else f"alignments started from activations on {recipe.data.dataset}"
    return [
        f"lineage: {n * (n - 1) // 2} pair(s), {how}; writes lineage.json, lineage.png and the card (no weights)",
        "evaluate: no",
    ]


def _title(names: Sequence[str]) -> str:
    return f"Lineage: {', '.join(names)}"


JOB = Job(
    name="lineage",
    summary="a verdict per pair of models: same basis, related up to symmetry, shared embeddings or independent "
    "(no weights)",
    recipe=LineageRecipe,
    writes_model=False,
    streams=lambda _recipe: True,  # tensor by tensor from the files: two passes, the signals kept as factors
    vocabulary=None,  # no output: each pair is compared on the rows of the tokens both have (`lineage.pairs`)
    compares_depths=True,  # models of other depths are compared layer by layer (`lineage.depth`)
    describe=_describe,
    card=CardPart(
        title=_title,
        intro="""This folder is a report, not a model. For every pair of the models below it says whether they
share a basis (a plain average or a naive task vector is right), are related up to symmetry (one
descends from the other but its heads, units or residual stream were moved: align first), share only
their token and position tables (one origin, no layer in common: merged as independent models), or
were trained independently, with a p-value and the evidence per layer (`lineage.json`, `lineage.png`).""",
        why="""Training keeps most of a weight matrix's random initialisation outside its few learned
directions. Models trained apart learn alike directions but keep different bulks; a fine-tune,
continued pretraining or a merge keeps its parent's. hf-rebasin aligns the learned directions under
every symmetry of the family (permutations of heads and units, a rotated residual stream, rescaled
gated units, a wider shape) and compares the bulks.""",
        preserved="Lineage changes no weights; nothing is re-expressed, so there is no function to preserve.",
        pair="A and B",
    ),
)
