"""job: transport — move a fine-tune's task vector τ = A_ft − A from its old base A onto a new base
release B: align A to B, then B + α·π(τ) (or, for a LoRA fine-tune, its adapter with the factors
moved)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.core.names import VocabularyChoice
from hf_rebasin.core.roles import TransportRoles
from hf_rebasin.recipe.calibrate import Calibrate, calibrate_schema, parse_calibrate
from hf_rebasin.recipe.common import is_number, quoted
from hf_rebasin.recipe.describe import data_line, describe_auto
from hf_rebasin.recipe.jobs import CardPart, Job
from hf_rebasin.recipe.refs import FineTuneRef, ModelRef
from hf_rebasin.recipe.sections import AlignedRecipe
from hf_rebasin.recipe.tokenizer import TRANSPORT_SOURCES, TokenizerSection
from hf_rebasin.recipe.weights import MAX_ALPHA, Alpha, AutoAlpha, alpha_schema, parse_auto_alpha

__all__ = ["DEFAULT_TRANSPORT_STRATEGY", "JOB", "TransportRecipe"]

# data-free, and on the benchmark zoo's domain fine-tune (benchmarks/README.md) it moves about
# twice as much of the task vector as any permutation strategy: a rotated residual stream (one map)
DEFAULT_TRANSPORT_STRATEGY = "generalized-orthogonal"

_WHAT = {
    "base": "the base the fine-tune was trained from (A)",
    "finetuned": "the fine-tune of the base (A + τ)",
    "target": "the new base release (B) to move the task vector to",
}


class TransportRecipe(AlignedRecipe):
    """`job: transport`: move a fine-tune's task vector from its old base A onto a new base release B."""

    job: Literal["transport"] = Field(
        "transport", description="move a fine-tune's task vector from its old base onto a new base release"
    )
    base: ModelRef = Field(None, validate_default=True, description="the base the fine-tune was trained from (A)")
    finetuned: FineTuneRef = Field(
        None,
        validate_default=True,
        description="the fine-tune of `base` (A + τ): a full model (its head may differ) or a PEFT LoRA adapter",
    )
    target: ModelRef = Field(
        None, validate_default=True, description="the new base release (B) the task vector moves to"
    )
    alpha: Alpha | list[Alpha] | AutoAlpha = Field(
        1.0,
        validate_default=True,
        description="scale α of the task vector (default 1); a list is swept and reported, the first "
        "saved; `auto` (or {auto: [α, ...], support_budget: nats}) sweeps and saves the α whose task gain is worth "
        "its support cost (needs `evaluate.support`)",
        json_schema_extra=alpha_schema,
    )

    calibrate: Calibrate | None = Field(
        True,  # type: ignore[arg-type]  # `true`: the defaults (the validator makes the section)
        validate_default=True,
        description="after the weights move, fit part of the moved model to the fine-tune's next-token "
        "distributions (distillation, no labels) so it does what the fine-tune does, e.g. ends its chat turns: "
        "on by default (`true` or a mapping of settings); `false` gives the data-free transport",
        json_schema_extra=calibrate_schema,
    )
    tokenizer: TokenizerSection = Field(
        default_factory=lambda: TokenizerSection(source=None, pad_to_multiple_of=None),
        description="the output's vocabulary where the models' vocabularies differ (default: the target's tokens "
        "plus the fine-tune's)",
    )

    misplaced: ClassVar[Mapping[str, str]] = {
        "models": "job: transport names `base`, `finetuned` and `target` instead of `models`",
        "merge": "job: transport scales the task vector with `alpha`, not `merge.weight`: remove `merge`",
    }
    default_strategy: ClassVar[str | None] = DEFAULT_TRANSPORT_STRATEGY
    residual_maps: ClassVar[str] = "per-sublayer"
    scores_support: ClassVar[bool] = True

    @field_validator("tokenizer")
    @classmethod
    def _transport_source(cls, value: TokenizerSection) -> TokenizerSection:
        if value.source is None or value.source in TRANSPORT_SOURCES:
            return value
        raise PydanticCustomError(
            "recipe",
            "a transport takes its tokenizer from finetuned, target or union, not {s}",
            {"s": quoted(value.source), "at": "source"},
        )

    @field_validator("base", "finetuned", "target", mode="before")
    @classmethod
    def _given(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            raise PydanticCustomError(
                "recipe",
                "job: transport needs `{field}`: {what}",
                {"field": info.field_name, "what": _WHAT[str(info.field_name)]},
            )
        return value

    @field_validator("calibrate", mode="before")
    @classmethod
    def _calibrate(cls, value: Any) -> Any:
        return parse_calibrate(value)

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha(cls, value: Any) -> Any:
        if value is None:
            return 1.0
        if value == "auto" or isinstance(value, (Mapping, AutoAlpha)):
            return value if isinstance(value, AutoAlpha) else parse_auto_alpha(value)
        values = value if isinstance(value, list) else [value]
        if not values or not all(is_number(v) and abs(v) <= MAX_ALPHA for v in values):
            raise PydanticCustomError(
                "weight",
                "must be a number from -{max} to {max} (the scale of the task vector, e.g. 1.0), a list of them, "
                "or `auto` (sweep and save the α whose task gain is worth its support cost)",
                {"max": f"{MAX_ALPHA:g}"},
            )
        return value

    @model_validator(mode="after")
    def _what_alpha_and_compare_need(self) -> TransportRecipe:
        ev = self.evaluate
        if isinstance(self.alpha, AutoAlpha) and (ev is None or ev.support is None):
            raise PydanticCustomError(
                "recipe",
                "`alpha: auto` weighs each α's gain on the task against what it costs B on its support data, so "
                "it needs `evaluate.data` (the fine-tune's task) and `evaluate.support` (what B should keep, e.g. "
                "its pretraining text): add {missing}, or give `alpha` as a number or a list",
                {
                    "missing": "an `evaluate:` section with both" if ev is None else "`evaluate.support`",
                    "at": "alpha" if ev is None else "evaluate.support",
                },
            )
        if ev is not None and ev.plain != ev.compare:
            raise PydanticCustomError(
                "recipe",
                "job: transport compares with the naive B + α·τ (`vanilla`) only: `compare: [vanilla]` or `[]`",
                {"at": "evaluate"},
            )
        return self

    def roles(self) -> TransportRoles[tuple[str, ModelRef]]:
        """The target B (the reference: the old base is aligned to it), the base A, the fine-tune."""
        return TransportRoles(
            ("target.model", self.target), ("base.model", self.base), ("finetuned.model", self.finetuned)
        )

    @property
    def alphas(self) -> list[float]:
        """The task-vector scales (the first is the one saved, unless `auto` picks one): the list
        given, or `auto`'s grid."""
        if isinstance(self.alpha, AutoAlpha):
            return [float(a) for a in self.alpha.auto]
        return [float(a) for a in (self.alpha if isinstance(self.alpha, list) else [self.alpha])]

    @property
    def auto_alpha(self) -> AutoAlpha | None:
        """`alpha: auto`'s grid and budget; None when the recipe gives α itself."""
        return self.alpha if isinstance(self.alpha, AutoAlpha) else None


def _describe(recipe: TransportRecipe) -> list[str]:
    alphas = ", ".join(f"{a:g}" for a in recipe.alphas)
    auto = recipe.auto_alpha
    if auto is None:
        out = [f"transport: θ = B + α·π(A_ft − A), α = {alphas} (the first is saved); π aligns A to B"]
    else:
        out = [
            f"transport: θ = B + α·π(A_ft − A), α chosen automatically from {alphas}; π aligns A to B",
            f"  saved: {describe_auto(auto.support_budget)}",
        ]
    cal = recipe.calibrate
    out.append(f"calibrate: {cal.describe()}" if cal is not None else "calibrate: no (the data-free transport)")
    ev = recipe.evaluate
    if ev is None:
        return [*out, "evaluate: no"]
    out += [f"evaluate: {ev.task}, batch size {ev.batch_size}, seed {ev.seed}", f"  data: {data_line(ev.data)}"]
    if ev.support is not None:
        out.append(f"  support: {data_line(ev.support)}")
    naive = ", naive B + α·τ" if ev.plain else ""
    out.append(f"  scored: target B, old base A, fine-tune A + τ, transported B + α·π(τ){naive}")
    if ev.support is not None:
        out.append("  trade-off: task gain over B against support cost over B, per α (tradeoff.png)")
    return out


def _streams(recipe: TransportRecipe) -> bool:
    """Tensor by tensor without an evaluation or learned matching (and, checked on the files, for a full
    fine-tune of its base's class: `run.memory.streamed`). A calibration then loads only what it runs:
    the fine-tune, the target and the moved model it fits."""
    return recipe.evaluate is None and not recipe.strategy.runs_learned_matching


def _vocabulary(source: str | None, pad_to: int | None) -> VocabularyChoice:
    """The output's vocabulary (`Job.vocabulary`) of the target (0), base (1) and fine-tune (2):
    ``finetuned`` (default) the target's tokens plus the fine-tune's, ``target`` the target's,
    ``union`` every model's; the fine-tune's chat template goes with a tokenizer built."""
    source = source or "finetuned"
    if source == "target":
        return VocabularyChoice(source, "reference", candidates=(0,), pad_to=pad_to, chat_from=2)
    if source == "union":
        return VocabularyChoice(source, "union", candidates=(2, 0, 1), pad_to=pad_to, chat_from=2)
    return VocabularyChoice(source, "union", only=(2,), candidates=(2, 0), pad_to=pad_to, chat_from=2)


def _title(names: Sequence[str]) -> str:
    if len(names) == 3:
        return f"Transported: {names[2]} moved onto {names[0]}"
    return f"Re-basin transport: {', '.join(names)}"


JOB = Job(
    name="transport",
    summary="move a fine-tune's task vector onto a new base release: a model folder (or a LoRA adapter)",
    recipe=TransportRecipe,
    writes_model=True,
    vocabulary=_vocabulary,
    streams=_streams,
    describe=_describe,
    lineage_preview=True,
    card=CardPart(
        title=_title,
        intro="""{% if adapter -%}
This is a PEFT LoRA adapter for the target base B. It is the adapter of a fine-tune of an older
base A with its factors moved into B's basis: for each adapted weight, B_lora ↦ T_out·B_lora and
A_lora ↦ A_lora·T_inᵀ, where the maps T, found by the `{{ strategy_name }}` strategy of
hf-rebasin, take A onto B across their symmetries. The rank stays {{ adapter.rank }}; the update is
carried to the new release without its data and without retraining.
{%- else -%}
This model is the target base B plus the task vector of a fine-tune of an older base A, moved
into B's basis: θ = B + α·π(A_ft − A), where π, found by the `{{ strategy_name }}` strategy of
hf-rebasin, maps A onto B across their symmetries. The fine-tune's update is carried to the new
release without its data and without retraining.
{%- endif %}""",
        why="""Two releases of a base trained separately compute the same kind of function in different bases
(hidden units or attention heads in another order, a rotated residual stream), so a task vector
learned on one means something else on the other; aligning the bases first carries it over.""",
        preserved="Aligning the old base A only re-expresses its weights in B's basis; its outputs should not change.",
        pair="A and A in B's basis",
    ),
)
