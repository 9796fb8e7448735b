"""job: merge — align every model to the first (A), average them with the recipe's weights (or a
universe merge), and write the result as a model folder."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.recipe.common import quoted
from hf_rebasin.recipe.describe import curve_lines
from hf_rebasin.recipe.jobs import CardPart, Job
from hf_rebasin.recipe.sections import AlignedRecipe, ModelsRecipe
from hf_rebasin.recipe.tokenizer import MERGE_SOURCES, TokenizerSection, merge_vocabulary, model_index
from hf_rebasin.recipe.weights import DEFAULT_WEIGHT, Merge

__all__ = [
    "ALIGNED_WHY",
    "JOB",
    "PRESERVED_PAIR",
    "PRESERVED_SENTENCE",
    "MergeRecipe",
    "models_not_roles",
    "universe_lines",
]

TRANSPORT_KEYS = ("base", "finetuned", "target")
# the card of a job that aligns B (C, …) to A: why, and what its function-preservation check compares
ALIGNED_WHY = """Networks trained separately often compute the same function up to symmetries of their weights
(hidden units or attention heads in another order, a rotated residual stream), so averaging them
unaligned mixes unrelated units and the loss rises on the way from one to the other: the loss
barrier. Aligning first removes that mismatch and lowers the barrier."""
PRESERVED_SENTENCE = "Aligning B only re-expresses its weights in A's basis; its outputs should not change."
PRESERVED_PAIR = "B and aligned B"


def models_not_roles(job: str) -> dict[str, str]:
    """What a recipe of a job on `models` is told when it holds a transport's keys."""
    found = {key: f"`{key}` belongs to job: transport; job: {job} lists `models`" for key in TRANSPORT_KEYS}
    found["alpha"] = "`alpha` belongs to job: transport; merges weigh models with merge.weight"
    return found


class MergeRecipe(ModelsRecipe, AlignedRecipe):
    """`job: merge`: align every model to the first (A) and average them into one model."""

    job: Literal["merge"] = Field("merge", description="align the models to the first and average them")
    merge: Merge = Field(
        default_factory=lambda: Merge(weight=DEFAULT_WEIGHT), validate_default=True, description="merge weights"
    )
    tokenizer: TokenizerSection = Field(
        default_factory=lambda: TokenizerSection(source=None, pad_to_multiple_of=None),
        description="the output's vocabulary where the models' vocabularies differ",
    )

    misplaced: ClassVar[Mapping[str, str]] = models_not_roles("merge")

    @field_validator("merge")
    @classmethod
    def _weights_per_model(cls, value: Merge, info: ValidationInfo) -> Merge:
        models = info.data.get("models")
        if isinstance(value.weight, list) and models is not None and len(value.weight) != len(models):
            raise PydanticCustomError(
                "recipe",
                "lists {n} weights for {m} models: give one weight per model, or a single λ on the reference",
                {"n": len(value.weight), "m": len(models), "at": "weight"},
            )
        return value

    @field_validator("tokenizer")
    @classmethod
    def _merge_source(cls, value: TokenizerSection, info: ValidationInfo) -> TokenizerSection:
        source, models = value.source, info.data.get("models")
        i = model_index(source) if source is not None else None
        if source is None or source in MERGE_SOURCES or (i is not None and (models is None or i < len(models))):
            return value
        raise PydanticCustomError(
            "recipe",
            "a merge takes its tokenizer from base, union or models[i] (i below the number of models), not {s}",
            {"s": quoted(source), "at": "source"},
        )


def universe_lines(recipe: MergeRecipe) -> list[str]:
    """The plan of a universe merge (none without one)."""
    universe = recipe.merge.universe
    if universe is None:
        return []
    target = "the mean of the others (model after model)" if universe.leave_one_out else "the mean of all"
    out = [
        f"  universe: from the reference merge, realign every model to {target}, average, repeat; "
        f"at most {universe.iterations} rounds, until the mean moves by less than {universe.tol:g} (relative)"
    ]
    if len(recipe.models) == 2:
        out.append(
            "  note: with two models there is no third to share a basis with: universe only refines the pairwise "
            "alignment (each model aligned to the other in turn) and re-centres the merge between them"
        )
    if recipe.strategy.strategy.identity:
        out.append(
            f"  note: {recipe.strategy.name} aligns nothing, so universe rounds leave the plain average as it is"
        )
    return out


def _describe(recipe: MergeRecipe) -> list[str]:
    weights = recipe.merge.weights(len(recipe.models))
    out = ["merge: weights " + ", ".join(f"{w:g}" for w in weights) + " (reference first)"]
    return [*out, *universe_lines(recipe), *curve_lines(recipe)]


def _streams(recipe: MergeRecipe) -> bool:
    """Tensor by tensor unless something needs whole models: an evaluation, a universe merge, learned matching."""
    return recipe.evaluate is None and recipe.merge.universe is None and not recipe.strategy.runs_learned_matching


def _title(names: Sequence[str]) -> str:
    return f"Re-basin merge: {' + '.join(names)}"


JOB = Job(
    name="merge",
    summary="align every model to the first and average them: a model folder",
    recipe=MergeRecipe,
    writes_model=True,
    vocabulary=merge_vocabulary,
    streams=_streams,
    describe=_describe,
    lineage_preview=True,
    card=CardPart(
        title=_title,
        intro="""{% if aligns_nothing -%}
This model is a weighted average of the weights of the models below, taken as they are
(`{{ strategy_name }}`: no alignment). It is the baseline that the re-basin strategies of hf-rebasin are
measured against.
{%- else -%}
This model is a weighted average of the weights of the models below, taken after bringing every
model into the basis of the first one (the reference, A) with the `{{ strategy_name }}` strategy
of hf-rebasin.
{%- endif %}""",
        why=ALIGNED_WHY,
        preserved=PRESERVED_SENTENCE,
        pair=PRESERVED_PAIR,
        relation="merge",
    ),
)
