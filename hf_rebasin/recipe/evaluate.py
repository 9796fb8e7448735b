"""The ``evaluate:`` section: the loss curve along λ, its data, the curves to compare against, and
the classification metrics computed at every point.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.alignment.strategies import get_strategy
from hf_rebasin.alignment.strategies.options import MAX_SEED
from hf_rebasin.core.names import CLASSIFICATION_TASKS, Task
from hf_rebasin.recipe.common import Section
from hf_rebasin.recipe.data import MAX_DATA, DataSpec
from hf_rebasin.recipe.strategy import StrategyName

# λ values of a loss curve: each is a full evaluation pass, so a typo such as 1e9 must not start
MAX_POINTS = 1001
MAX_BATCH = 65_536  # examples per forward pass: past any accelerator's memory for a real model


class MetricSpec(Section):
    """An `evaluate` metric and the keyword arguments of its ``compute``."""

    name: str = Field(min_length=1, description="metric name on the Hub, or path of a local metric script")
    kwargs: dict[str, Any] = Field({}, description="keyword arguments of the metric's compute, e.g. {average: macro}")


class Evaluate(Section):
    """The loss curve along λ ∈ [0, 1]: task, data, number of points, curves to compare against."""

    task: Task = Field(description="which loss to compute")
    data: DataSpec = Field(description="evaluation data")
    points: int = Field(
        21,
        ge=2,
        le=MAX_POINTS,
        strict=True,
        description=f"evenly spaced λ values, both ends included (2 to {MAX_POINTS})",
    )
    compare: list[StrategyName] = Field(["vanilla"], description="extra curves, one per strategy (default options)")
    batch_size: int = Field(8, ge=1, le=MAX_BATCH, strict=True, description="examples per forward pass")
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_DATA, strict=True, description="evaluate at most this many tokens"
    )
    max_examples: int | None = Field(
        None, ge=1, le=MAX_DATA, strict=True, description="evaluate at most this many examples"
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, strict=True, description="seed of masks (masked-lm) and sampling")
    support: DataSpec | None = Field(
        None, description="transport: data of what the target should keep (e.g. its pretraining text), also scored"
    )
    metrics: list[Union[str, MetricSpec]] = Field(  # noqa: UP007 (pydantic needs a runtime union)
        [],
        description="classification: `evaluate` metrics computed at every λ (names such as accuracy or f1, or "
        "paths of local metric scripts relative to the recipe; {name, kwargs} to pass compute arguments)",
    )

    @field_validator("compare")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise PydanticCustomError("compare", "list each strategy at most once")
        return value

    @model_validator(mode="after")
    def _metrics_fit_the_task(self) -> Evaluate:
        if self.metrics and self.task not in CLASSIFICATION_TASKS:
            raise PydanticCustomError(
                "recipe",
                "`evaluate.metrics` apply to classification (sequence-classification, image-classification), "
                "not to {task}: its loss and perplexity are always reported; remove `metrics`",
                {"task": self.task, "at": "metrics"},
            )
        return self

    @property
    def plain(self) -> list[str]:
        """The strategies of ``compare`` that align nothing: the naive comparison (the plain
        average, B + α·τ), by the strategy's capability rather than its name."""
        return [name for name in self.compare if get_strategy(name).identity]

    def metric_specs(self) -> list[MetricSpec]:
        """``metrics`` with every plain name turned into ``{name, kwargs: {}}``."""
        return [MetricSpec(name=m, kwargs={}) if isinstance(m, str) else m for m in self.metrics]

    @model_validator(mode="after")
    def _one_budget(self) -> Evaluate:
        for key in ("max_tokens", "max_examples"):
            own, data = getattr(self, key), getattr(self.data, key)
            if own is not None and data is not None and own != data:
                raise PydanticCustomError(
                    "recipe", "`evaluate.{key}` and `evaluate.data.{key}` disagree: set one", {"key": key, "at": key}
                )
            if own is None:
                setattr(self, key, data)
        return self
