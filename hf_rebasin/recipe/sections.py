"""The bases of every job's recipe model, built from the sections the jobs share.

Each job declares its own recipe model (``hf_rebasin.recipe.jobs.<job>``) from these parts: `RecipeBase`
(the keys of every recipe: job, output, safety switches, device, cache), `ModelsRecipe` (a list of
models) and `AlignedRecipe` (a strategy, alignment data, an evaluation). The sections themselves live
in `refs`, `data`, `weights`, `evaluate`, `output` and `strategy`. Importing this module imports no torch
(nor transformers, datasets, scipy): names, defaults and strategy options come from torch-free modules,
so validating a recipe or printing its schema takes a fraction of a second (tests/test_imports.py keeps it so).

Parsing is strict on purpose: unknown keys are errors, every enumerated choice is a ``Literal``,
and a strategy's options are validated by that strategy's own options model (built from the
registry, never restated here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.alignment.strategies import REGISTRY
from hf_rebasin.core.names import DEVICE_PATTERN
from hf_rebasin.core.roles import MergeRoles, Roles
from hf_rebasin.recipe.common import Section, shown
from hf_rebasin.recipe.data import DataSpec
from hf_rebasin.recipe.evaluate import Evaluate
from hf_rebasin.recipe.output import Output
from hf_rebasin.recipe.refs import ModelRef
from hf_rebasin.recipe.strategy import SECTIONS, StrategySection, StrategySpec, needs_data_message

TRANSPORT_MODELS = ("base", "finetuned", "target")  # job: transport names these instead of `models`
# values a recipe may hold once YAML aliases (*name) are expanded: a real recipe holds a few
# hundred; "billion laughs" aliases grow exponentially and would exhaust time and memory
MAX_YAML_VALUES = 100_000


class RecipeBase(Section):
    """What every recipe holds, whatever its job. Each job's model (``hf_rebasin.recipe.jobs.<job>``)
    narrows ``job`` to its name and adds its own keys."""

    version: Literal[1] = Field(1, description="schema version")
    job: str = Field(description="what to do")
    output: Output = Field(description="where results go")
    allow_pickle: bool = Field(False, description="allow loading pickle (.bin) checkpoints")
    trust_remote_code: bool = Field(
        False,
        description="accept models whose config names custom code (auto_map): their weights are loaded into the "
        "stock class of their model_type; repository code is never run",
    )
    allow_different_tokenizers: bool = Field(
        False,
        description="run although the models' tokenizers differ (vocabulary, special tokens or merges) or one "
        "of them (not the reference's) does not load: their token ids may mean different things; the card says so",
    )
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N or mps")
    cache: bool = Field(
        True,
        description="reuse alignments from the alignment cache ($HF_REBASIN_CACHE/alignments) and store new "
        "ones; false computes every alignment afresh",
    )

    # keys of other jobs that a recipe of this job may hold by mistake -> what to do instead
    # (reported as problems of their own, beside the rest of the recipe's)
    misplaced: ClassVar[Mapping[str, str]] = {}

    _source: str = PrivateAttr("<recipe>")
    _text: str | None = PrivateAttr(None)

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        """The integer 1: `true` and 1.0 equal 1 in Python, but are no version numbers (others: Literal's message)."""
        if isinstance(value, (bool, float)):
            raise PydanticCustomError("recipe", "must be one of 1; given {given}", {"given": shown(value)})
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not DEVICE_PATTERN.fullmatch(value):
            raise PydanticCustomError("device", "allowed: auto, cpu, cuda, cuda:N (N a GPU index), mps")
        return value

    def roles(self) -> Roles[tuple[str, ModelRef]]:
        """``(recipe field, reference)`` of every model, by role (the field names the model in errors)."""
        raise NotImplementedError(f"job {self.job!r} names no models")

    @property
    def refs(self) -> list[tuple[str, ModelRef]]:
        """(recipe path, reference) of every model the job reads, in order; the reference model first."""
        return list(self.roles().all)

    @property
    def source(self) -> str:
        """The file (or label) the recipe was read from."""
        return self._source

    @property
    def text(self) -> str | None:
        """The YAML the recipe was parsed from, verbatim (the model card quotes it); None if built in code."""
        return self._text


_NUMBERS = {1: "one", 2: "two", 3: "three"}


class ModelsRecipe(RecipeBase):
    """A job on a list of models (`models:`); the first is the reference A."""

    models: list[ModelRef] = Field(
        None, validate_default=True, description="two or more models; the first is the reference A"
    )

    # the fewest models the job takes
    min_models: ClassVar[int] = 2

    @field_validator("models", mode="before")
    @classmethod
    def _enough_models(cls, value: Any) -> Any:
        if value is None or (isinstance(value, list) and len(value) < cls.min_models):
            raise PydanticCustomError(
                "recipe",
                "job: {job} needs `models`: at least {n} (a list of Hub ids or folders; the first is the reference)",
                {"job": cls.model_fields["job"].default, "n": _NUMBERS.get(cls.min_models, str(cls.min_models))},
            )
        return value

    def roles(self) -> MergeRoles[tuple[str, ModelRef]]:
        """The reference A (``models.0``) and the others, each with its recipe field."""
        models = [(f"models.{i}.model", m) for i, m in enumerate(self.models)]
        return MergeRoles(models[0], tuple(models[1:]))


class AlignedRecipe(RecipeBase):
    """A job that aligns models with a strategy: alignment data when the strategy needs them, and an
    optional evaluation."""

    strategy: StrategySection = Field(
        None, validate_default=True, description="alignment strategy: `name` and its options side by side"
    )
    data: DataSpec | None = Field(
        None, validate_default=True, description="alignment data (activation-based strategies)"
    )
    evaluate: Evaluate | None = Field(None, validate_default=True, description="loss curves")

    # the strategy of a recipe that names none (None: the recipe must name one)
    default_strategy: ClassVar[str | None] = None
    # the default of `residual_maps` (strategies that have it), and whether per-sublayer maps are allowed
    residual_maps: ClassVar[str] = "global"
    # why the job needs an `evaluate:` section (None: it is optional)
    needs_evaluate: ClassVar[str | None] = None
    # whether `evaluate.support` (what the target should keep) means anything to the job
    scores_support: ClassVar[bool] = False

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy_shorthand(cls, value: Any) -> Any:
        if value is None:
            if cls.default_strategy is not None:
                return {"name": cls.default_strategy}
            raise PydanticCustomError(
                "recipe", "a recipe needs `strategy`: one of {names}", {"names": ", ".join(REGISTRY.names)}
            )
        return {"name": value} if isinstance(value, str) else value

    @field_validator("data")
    @classmethod
    def _data_when_needed(cls, value: DataSpec | None, info: ValidationInfo) -> DataSpec | None:
        spec = info.data.get("strategy")
        if value is None and isinstance(spec, StrategySpec) and spec.needs_data:
            raise needs_data_message(spec)
        return value

    @field_validator("evaluate")
    @classmethod
    def _evaluate_when_needed(cls, value: Evaluate | None, info: ValidationInfo) -> Evaluate | None:
        if value is None:
            if cls.needs_evaluate is not None:
                raise PydanticCustomError("recipe", cls.needs_evaluate)
            return value
        if "data" in info.data and info.data["data"] is None:
            for i, name in enumerate(value.compare):
                spec = SECTIONS[name](name=name)
                if spec.needs_data:
                    raise needs_data_message(spec, f"compare.{i}")
        return value

    @model_validator(mode="after")
    def _job_rules(self) -> AlignedRecipe:
        if self.evaluate is not None and not self.scores_support and self.evaluate.support is not None:
            raise PydanticCustomError("recipe", "`evaluate.support` belongs to job: transport", {"at": "evaluate"})
        maps = getattr(self.strategy, "residual_maps", None)
        if maps == "per-sublayer" and self.residual_maps != "per-sublayer":
            raise PydanticCustomError(
                "recipe",
                "`residual_maps: per-sublayer` moves a task vector (job: transport); a {job} needs one residual map "
                "so that the aligned model computes what it did: remove it or use `global`",
                {"job": self.job, "at": "strategy"},
            )
        if "residual_maps" in type(self.strategy).model_fields and maps is None:
            self.strategy = self.strategy.model_copy(update={"residual_maps": self.residual_maps})
        return self
