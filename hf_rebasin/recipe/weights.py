"""How much of each model a result takes: a merge's weights (λ, or one per model, and universe
merging) and a transport's α (a number, a list, or ``alpha: auto`` with its grid and support budget).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from hf_rebasin.alignment.strategies.options import MAX_PASSES
from hf_rebasin.core.names import DEFAULT_ITERATIONS, DEFAULT_TOL
from hf_rebasin.recipe.common import Section, is_number, quoted

DEFAULT_WEIGHT = 0.5  # λ on the reference model: the plain average
# `alpha: auto`: the α swept when the recipe gives no grid of its own. From a quarter of τ (little
# gained, little lost) to 1.5 (past the fine-tune's own step, where gains usually turn into losses)
AUTO_ALPHAS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
# |α| at most: past 1.5 gains usually turn into losses, so 100 τ is far beyond any use (-1 negates τ)
MAX_ALPHA = 100.0
# nats of support loss: a uniform guess over 16M tokens costs 17, so 100 means "no budget"
MAX_SUPPORT_BUDGET = 100.0

# a weight of the average: a number in [0, 1] (strict: YAML's `true` and "0.5" are no weights)
Weight = Annotated[float, Field(ge=0, le=1, strict=True)]
# a transport's α, negative included (-1 subtracts the task vector)
Alpha = Annotated[float, Field(ge=-MAX_ALPHA, le=MAX_ALPHA, strict=True)]


class Universe(Section):
    """Universe merging: align every model to the mean of the others, average, repeat (job: merge)."""

    iterations: int = Field(
        DEFAULT_ITERATIONS,
        ge=1,
        le=MAX_PASSES,
        strict=True,
        description="rounds of aligning every model and averaging, at most",
    )
    tol: float = Field(
        DEFAULT_TOL,
        ge=0,
        le=1,
        strict=True,
        allow_inf_nan=False,
        description="stop when a round moves the mean by less than this, relative to its norm",
    )
    leave_one_out: bool = Field(
        True,
        description="align each model to the mean of the others, model after model (true), or every model "
        "to the mean of all (false: its own share pulls it back to the map it has)",
    )


def _universe_schema(schema: JsonDict) -> None:
    """`universe: true` in editors too (the validator turns it into the default settings)."""
    given = schema.get("anyOf")
    schema["anyOf"] = [{"type": "boolean"}, *(given if isinstance(given, list) else [])]


class Merge(Section):
    """How to weight the aligned models: λ on the reference model, or one weight per model."""

    weight: Weight | list[Weight] = Field(
        DEFAULT_WEIGHT,
        description="λ in [0, 1] on the reference model (the rest shared by the others), or one weight per model summing to 1",
    )
    universe: Universe | None = Field(
        default=None,
        description="true, or {iterations, tol, leave_one_out}: after aligning every model to the reference, "
        "realign all to their evolving mean and average again until it settles (for three or more models)",
        json_schema_extra=_universe_schema,
    )

    @field_validator("universe", mode="before")
    @classmethod
    def _universe(cls, value: Any) -> Any:
        if value is True:
            return {}
        if value is False or value is None:
            return None
        if isinstance(value, (Mapping, Universe)):
            return value
        raise PydanticCustomError(
            "recipe",
            "must be true, false, or a mapping with `iterations`, `tol` and/or `leave_one_out`; given {given}",
            {"given": quoted(value)},
        )

    @field_validator("weight", mode="before")
    @classmethod
    def _weight(cls, value: Any) -> Any:
        if is_number(value):
            if not 0 <= value <= 1:
                raise PydanticCustomError("weight", "λ on the reference model must be in [0, 1]")
            return value
        if isinstance(value, list) and len(value) >= 2 and all(is_number(w) for w in value):
            if any(not 0 <= w <= 1 for w in value) or abs(sum(value) - 1) > 1e-6:
                raise PydanticCustomError(
                    "weight",
                    "per-model weights must each be in [0, 1] and sum to 1 (they sum to {total})",
                    {"total": sum(value)},
                )
            return value
        raise PydanticCustomError(
            "weight",
            "must be a number in [0, 1] (λ on the reference model) or a list of numbers, one per model, summing to 1",
        )

    def weights(self, n_models: int) -> list[float]:
        """One weight per model, the reference first."""
        if isinstance(self.weight, list):
            return list(self.weight)
        rest = (1.0 - self.weight) / max(n_models - 1, 1)
        return [float(self.weight)] + [rest] * (n_models - 1)


def _grid_schema(schema: JsonDict) -> None:
    """`auto: true` in editors too (the validator turns it into the default grid)."""
    items = schema.pop("items", {"type": "number"})
    schema.pop("type", None)
    schema["anyOf"] = [{"const": True}, {"type": "array", "items": items, "minItems": 1}]


class AutoAlpha(Section):
    """`alpha: auto`: sweep a grid of α and save the one whose task gain is worth its support cost.

    Without ``support_budget``: the best task gain per nat of support cost (an α that gains at no
    support cost beats them all); with it: the largest task gain whose support cost fits the budget.
    """

    auto: list[Annotated[float, Field(gt=0, le=MAX_ALPHA, strict=True)]] = Field(
        default_factory=lambda: list(AUTO_ALPHAS),
        description="the α to sweep (each > 0), or true for the default grid "
        + ", ".join(f"{a:g}" for a in AUTO_ALPHAS),
        json_schema_extra=_grid_schema,
    )
    support_budget: float | None = Field(
        None,
        ge=0,
        le=MAX_SUPPORT_BUDGET,
        strict=True,
        allow_inf_nan=False,
        description="nats of support loss the saved model may add to B's: the largest task gain within it is saved",
    )

    @field_validator("auto", mode="before")
    @classmethod
    def _grid(cls, value: Any) -> Any:
        if value is True:
            return list(AUTO_ALPHAS)
        values = value if isinstance(value, list) else None
        if not values or not all(is_number(v) and 0 < v <= MAX_ALPHA for v in values):
            raise PydanticCustomError(
                "recipe",
                "must be true (the default grid) or a non-empty list of α in (0, {max}], e.g. [0.5, 1, 1.5]; "
                "given {given}",
                {"max": f"{MAX_ALPHA:g}", "given": quoted(value)},
            )
        if len(set(values)) != len(values):
            raise PydanticCustomError("recipe", "lists an α twice: list each α once")
        return values


def alpha_schema(schema: JsonDict) -> None:
    """`alpha: auto` in editors too (the validator turns it into the default grid)."""
    given = schema.get("anyOf")
    schema["anyOf"] = [{"const": "auto"}, *(given if isinstance(given, list) else [])]


def parse_auto_alpha(value: Mapping[str, Any] | str) -> AutoAlpha:
    """``alpha: auto`` or ``alpha: {auto: [...], support_budget: ...}`` as an `AutoAlpha`; a problem
    inside the mapping is reported at its own key (``alpha.support_budget``)."""
    if isinstance(value, str):
        return AutoAlpha(support_budget=None)
    if "auto" not in value:
        raise PydanticCustomError(
            "recipe",
            "a mapping picks α automatically and needs `auto`: the grid to sweep, e.g. "
            "{auto: [0.5, 1, 1.5], support_budget: 0.1}, or `auto: true` for the default grid",
        )
    try:
        return AutoAlpha.model_validate(dict(value))
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        key = ".".join(str(p) for p in err["loc"]) or "auto"
        if err["type"] == "extra_forbidden":
            message = "is not a key of an automatic α; allowed: auto, support_budget"
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
            message = f"{msg[:1].lower()}{msg[1:]}; given {quoted(err.get('input'))}"
        raise PydanticCustomError("recipe", "{message}", {"message": message, "at": key}) from None
