"""job: barrier — align B to A, check that B still computes what it did, and draw the loss along
the line between them (a report: no weights written)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.recipe.describe import curve_lines
from hf_rebasin.recipe.jobs import CardPart, Job
from hf_rebasin.recipe.jobs.merge import ALIGNED_WHY, PRESERVED_PAIR, PRESERVED_SENTENCE, models_not_roles
from hf_rebasin.recipe.sections import AlignedRecipe, ModelsRecipe
from hf_rebasin.recipe.tokenizer import merge_vocabulary
from hf_rebasin.recipe.weights import DEFAULT_WEIGHT, Merge

__all__ = ["JOB", "BarrierRecipe"]


class BarrierRecipe(ModelsRecipe, AlignedRecipe):
    """`job: barrier`: align B to A and measure the loss along the line between them (no weights written)."""

    job: Literal["barrier"] = Field("barrier", description="measure the loss barrier between A and B")
    merge: Merge = Field(
        default_factory=lambda: Merge(weight=DEFAULT_WEIGHT), validate_default=True, description="merge weights"
    )

    misplaced: ClassVar[Mapping[str, str]] = models_not_roles("barrier")
    needs_evaluate: ClassVar[str | None] = (
        "job: barrier needs an `evaluate:` section (task, data, points) to compute the loss curves"
    )

    @field_validator("models")
    @classmethod
    def _two_models(cls, value: list[object]) -> list[object]:
        if len(value) != 2:
            raise PydanticCustomError(
                "recipe",
                "job: barrier compares two models (A and B) and this recipe lists {n}; keep two, or use job: merge",
                {"n": len(value)},
            )
        return value

    @field_validator("merge")
    @classmethod
    def _no_universe(cls, value: Merge) -> Merge:
        if value.universe is not None:
            raise PydanticCustomError(
                "recipe",
                "a universe merge belongs to job: merge; job: barrier compares two models and saves no merge: "
                "remove `universe`",
                {"at": "universe"},
            )
        return value


def _title(names: Sequence[str]) -> str:
    return f"Loss barrier: {' vs '.join(names[:2])}"


JOB = Job(
    name="barrier",
    summary="align B to A and measure the loss along the line between them: a report, no weights",
    recipe=BarrierRecipe,
    writes_model=False,
    vocabulary=merge_vocabulary,  # no `tokenizer` section: the reference's
    describe=curve_lines,
    card=CardPart(
        title=_title,
        intro="""This folder is a report, not a model. It measures the loss along the straight line between the
weights of model A and model B, after bringing B into A's basis with the `{{ strategy_name }}`
strategy of hf-rebasin.""",
        why=ALIGNED_WHY,
        preserved=PRESERVED_SENTENCE,
        pair=PRESERVED_PAIR,
    ),
)
