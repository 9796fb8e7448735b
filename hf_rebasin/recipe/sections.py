"""The sections of a recipe every job shares, and the base of every job's recipe model.

Each job declares its own recipe model (``hf_rebasin.recipe.jobs.<job>``) from these parts: `RecipeBase`
(the keys of every recipe: job, output, safety switches, device, cache) and `AlignedRecipe` (a
strategy, alignment data, an evaluation). Importing this module imports no torch (nor transformers,
datasets, scipy): names, defaults and strategy options come from torch-free modules, so validating
a recipe or printing its schema takes a fraction of a second (tests/test_imports.py keeps it so).

Parsing is strict on purpose: unknown keys are errors, every enumerated choice is a ``Literal``,
and a strategy's options are validated by that strategy's own options model (built from the
registry, never restated here).
"""

from __future__ import annotations

import functools
import operator
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from ..hub import is_repo_id, repo_id_problem, split_ref
from ..names import (
    BUILTIN_DATASETS,
    CLASSIFICATION_TASKS,
    DEFAULT_ITERATIONS,
    DEFAULT_SHARD_SIZE,
    DEFAULT_TOL,
    DEVICE_PATTERN,
    KINDS,
    LOCAL_BUILDERS,
    SampleBy,
    Task,
)
from ..roles import MergeRoles, Roles
from ..strategies import REGISTRY, Options, Strategy, get_strategy

TRANSPORT_MODELS = ("base", "finetuned", "target")  # job: transport names these instead of `models`
# `alpha: auto`: the α swept when the recipe gives no grid of its own. From a quarter of τ (little
# gained, little lost) to 1.5 (past the fine-tune's own step, where gains usually turn into losses)
AUTO_ALPHAS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)

# a model of the zoo (`hf_rebasin.zoo`, trained by `hf_rebasin.train` on first use, then cached)
ZOO_PATTERN = re.compile(rf"zoo:({'|'.join(KINDS)})-seed(\d+)")
# the largest zoo seed: training derives further seeds from it (seed × 100003 + epoch) for
# torch.Generator, which takes at most 2**64 - 1, and numpy takes at most 2**32 - 1
MAX_ZOO_SEED = 2**32 - 1
# λ values of a loss curve: each is a full evaluation pass, so a typo such as 1e9 must not start
MAX_POINTS = 1001
# values a recipe may hold once YAML aliases (*name) are expanded: a real recipe holds a few
# hundred; "billion laughs" aliases grow exponentially and would exhaust time and memory
MAX_YAML_VALUES = 100_000
_SIZE = re.compile(r"\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", re.IGNORECASE)
DEFAULT_WEIGHT = 0.5  # λ on the reference model: the plain average


def quoted(value: Any) -> str:
    """A value as error messages quote it (cut at 80 characters)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Models


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _base_dir(info: ValidationInfo) -> Path | None:
    context = info.context
    base = context.get("base_dir") if isinstance(context, Mapping) else None
    return Path(base) if base is not None else None


def _local(value: str, base: Path | None, *, force: bool = False) -> str:
    """``value`` resolved against the recipe's folder when it names a local path, else as given.

    Explicit paths (``./x``, ``../x``, ``/x``, ``~/x``) are always local; a bare ``org/name`` is a
    Hub id unless a folder of that name sits beside the recipe.
    """
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    if base is None or "://" in value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    explicit = value in (".", "..") or value.startswith(("./", "../", ".\\", "..\\"))
    candidate = base / path
    if force or explicit or candidate.exists():
        try:
            return str(candidate.resolve())
        except (RuntimeError, OSError):  # a symbolic link loop: the model's checks name it
            return os.path.abspath(candidate)
    return value


def _check_repo_id(value: str, kind: str) -> None:
    """Refuse what the Hub client would refuse later (a URL, ``a..b``, ``org/name/extra``), as ``kind``."""
    if "://" in value:
        raise PydanticCustomError(
            kind, "is a URL; give the Hub repo id instead (`name` or `org/name`, e.g. gpt2), or a folder as ./path"
        )
    problem = repo_id_problem(value)
    if problem is not None:
        raise PydanticCustomError(
            kind,
            "is neither a folder beside the recipe nor a valid Hub repo id (`name` or `org/name`): {problem}; "
            "give a folder as ./path",
            {"problem": problem},
        )


class ModelRef(_Section):
    """A model: Hub repo id or local folder, and an optional revision (branch, tag or commit)."""

    model: str = Field(min_length=1, description="Hub repo id (org/name) or local folder")
    revision: str | None = Field(None, min_length=1, description="branch, tag or commit; default: main")
    label: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="the model's name in the card and rebasin.json (default: a Hub id as is, a local folder by its own name)",
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            repo, revision = split_ref(value)
            return {"model": repo, "revision": revision} if revision else {"model": value}
        if not isinstance(value, (Mapping, ModelRef)):
            raise PydanticCustomError(
                "model_ref", "a model is a Hub id or folder (a string) or a mapping {model: ..., revision: ...}"
            )
        return value

    @field_validator("model")
    @classmethod
    def _resolve(cls, value: str, info: ValidationInfo) -> str:
        if value.startswith("zoo:"):
            match = ZOO_PATTERN.fullmatch(value)
            if not match:
                raise PydanticCustomError(
                    "model_ref",
                    "a zoo model is zoo:KIND-seedN with KIND one of {kinds} (e.g. zoo:gpt2-seed0)",
                    {"kinds": ", ".join(KINDS)},
                )
            if int(match.group(2)) > MAX_ZOO_SEED:
                raise PydanticCustomError(
                    "model_ref", "a zoo seed is an integer from 0 to {max} (e.g. zoo:gpt2-seed0)", {"max": MAX_ZOO_SEED}
                )
            return value
        resolved = _local(value, _base_dir(info))
        if not Path(resolved).is_absolute():  # not a local folder: it must be a Hub repo id
            _check_repo_id(resolved, "model_ref")
        return resolved

    @model_validator(mode="after")
    def _zoo_has_no_revision(self) -> ModelRef:
        if self.zoo is not None and self.revision is not None:
            raise PydanticCustomError(
                "model_ref", "a zoo model has no revisions: remove `revision` (the seed names the model)"
            )
        return self

    @property
    def is_local(self) -> bool:
        """True when ``model`` names a folder on disk rather than a Hub repo."""
        return Path(self.model).is_absolute()

    @property
    def zoo(self) -> tuple[str, int] | None:
        """(kind, seed) of a zoo model reference (``zoo:gpt2-seed0``), else None."""
        match = ZOO_PATTERN.fullmatch(self.model)
        return (match.group(1), int(match.group(2))) if match else None

    @property
    def source(self) -> Literal["zoo", "local", "hub"]:
        """Where the model comes from: the zoo, a local folder or the Hub."""
        return "zoo" if self.zoo is not None else "local" if self.is_local else "hub"

    def __str__(self) -> str:
        return self.model if self.revision is None else f"{self.model}@{self.revision}"


class FineTuneRef(ModelRef):
    """`finetuned` of a transport: a full fine-tune of `base`, or a PEFT LoRA adapter trained on it."""

    check_base: bool = Field(
        True,
        description="a LoRA adapter whose adapter_config.json names another base than `base` is refused; "
        "false: go on anyway (the run notes it)",
    )


DataFiles = Union[str, list[str], dict[str, Union[str, list[str]]]]  # noqa: UP007 (pydantic needs a runtime union)


class DataSpec(_Section):
    """A data set as ``datasets.load_dataset`` wants it, plus which columns to read and how much."""

    dataset: str = Field(
        min_length=1,
        description="a `datasets` builder reading local files (text, json, csv, parquet, imagefolder), "
        "a Hub dataset id, a local dataset folder, or a built-in data set (shakespeare, digits)",
    )
    name: str | None = Field(None, description="dataset configuration, e.g. wikitext-2-raw-v1")
    revision: str | None = Field(None, description="Hub dataset revision")
    data_files: DataFiles | None = Field(
        None, description="file, glob, list of files, or {split: files}; local builders read these"
    )
    data_dir: str | None = Field(None, description="folder of the data (imagefolder: one sub-folder per class)")
    split: str = Field("train", min_length=1, description="split to read, slices allowed: train[:1000]")
    column: str | None = Field(None, description="text column; default: `text`")
    image_column: str | None = Field(None, description="image column (image models); default: `image`")
    label_column: str | None = Field(None, description="label column (classification); default: `label`")
    max_tokens: int | None = Field(None, ge=1, description="read at most this many tokens")
    max_examples: int | None = Field(None, ge=1, description="read at most this many examples")
    block_size: int | None = Field(
        None,
        ge=2,
        description="tokens per block of text (language-model tasks), or at most per example (text "
        "classification); default 128, or the model's context when shorter",
    )
    sample_by: SampleBy | None = Field(
        None,
        description="text builder: one record per `document` (the default: each file whole), `line` or "
        "`paragraph`; line breaks are kept in every mode and records are joined as they are",
    )

    @field_validator("data_files", mode="before")
    @classmethod
    def _data_files_shape(cls, value: Any) -> Any:
        def files(v: Any) -> bool:
            return isinstance(v, str) or (isinstance(v, list) and bool(v) and all(isinstance(f, str) for f in v))

        if value is None or files(value):
            return value
        if isinstance(value, Mapping) and value and all(isinstance(k, str) and files(v) for k, v in value.items()):
            return value
        raise PydanticCustomError(
            "data_files", "must be a file or glob, a non-empty list of them, or a mapping {split: files}"
        )

    @model_validator(mode="after")
    def _resolve_local(self, info: ValidationInfo) -> DataSpec:
        base = _base_dir(info)
        if self.sample_by is not None and self.dataset != "text":
            raise PydanticCustomError(
                "recipe",
                "`sample_by` applies to the `text` builder only, not to `{dataset}`: remove it",
                {"dataset": self.dataset, "at": "sample_by"},
            )
        if self.dataset in BUILTIN_DATASETS:
            given = [k for k in ("data_files", "data_dir", "revision") if getattr(self, k) is not None]
            if given:
                raise PydanticCustomError(
                    "recipe",
                    "`{dataset}` is a built-in data set and reads no files: remove `{key}`",
                    {"dataset": self.dataset, "key": given[0], "at": given[0]},
                )
            return self
        if self.dataset not in LOCAL_BUILDERS:
            self.dataset = _local(self.dataset, base)
            return self
        if self.data_files is None and self.data_dir is None:
            raise PydanticCustomError(
                "recipe",
                "the `{builder}` builder reads local files: give `data_files` (a file, a glob, a list, "
                "or {split: files}) or `data_dir`",
                {"builder": self.dataset, "at": "data_files"},
            )
        if self.data_dir is not None:
            self.data_dir = _local(self.data_dir, base, force=True)
        if isinstance(self.data_files, str):
            self.data_files = _local(self.data_files, base, force=True)
        elif isinstance(self.data_files, list):
            self.data_files = [_local(f, base, force=True) for f in self.data_files]
        elif isinstance(self.data_files, dict):
            self.data_files = {
                k: _local(v, base, force=True) if isinstance(v, str) else [_local(f, base, force=True) for f in v]
                for k, v in self.data_files.items()
            }
        return self

    def load_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``datasets.load_dataset`` (``path`` included)."""
        kwargs: dict[str, Any] = {"path": self.dataset, "split": self.split}
        for key in ("name", "revision", "data_files", "data_dir"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return kwargs


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Universe(_Section):
    """Universe merging: align every model to the mean of the others, average, repeat (job: merge)."""

    iterations: int = Field(
        DEFAULT_ITERATIONS, ge=1, description="rounds of aligning every model and averaging, at most"
    )
    tol: float = Field(
        DEFAULT_TOL,
        ge=0,
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


class Merge(_Section):
    """How to weight the aligned models: λ on the reference model, or one weight per model."""

    weight: float | list[float] = Field(
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
        if _number(value):
            if not 0 <= value <= 1:
                raise PydanticCustomError("weight", "λ on the reference model must be in [0, 1]")
            return value
        if isinstance(value, list) and len(value) >= 2 and all(_number(w) for w in value):
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


class AutoAlpha(_Section):
    """`alpha: auto`: sweep a grid of α and save the one whose task gain is worth its support cost.

    Without ``support_budget``: the best task gain per nat of support cost (an α that gains at no
    support cost beats them all); with it: the largest task gain whose support cost fits the budget.
    """

    auto: list[float] = Field(
        default_factory=lambda: list(AUTO_ALPHAS),
        description="the α to sweep (each > 0), or true for the default grid "
        + ", ".join(f"{a:g}" for a in AUTO_ALPHAS),
        json_schema_extra=_grid_schema,
    )
    support_budget: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="nats of support loss the saved model may add to B's: the largest task gain within it is saved",
    )

    @field_validator("auto", mode="before")
    @classmethod
    def _grid(cls, value: Any) -> Any:
        if value is True:
            return list(AUTO_ALPHAS)
        values = value if isinstance(value, list) else None
        if not values or not all(_number(v) and 0 < v < 1e6 for v in values):
            raise PydanticCustomError(
                "recipe", "must be true (the default grid) or a non-empty list of α > 0, e.g. [0.5, 1, 1.5]"
            )
        if len(set(values)) != len(values):
            raise PydanticCustomError("recipe", "lists an α twice: list each α once")
        return values


def _alpha_schema(schema: JsonDict) -> None:
    """`alpha: auto` in editors too (the validator turns it into the default grid)."""
    given = schema.get("anyOf")
    schema["anyOf"] = [{"const": "auto"}, *(given if isinstance(given, list) else [])]


def _auto_alpha(value: Mapping[str, Any] | str) -> AutoAlpha:
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


if TYPE_CHECKING:
    StrategyName = str
else:
    StrategyName = Literal[tuple(REGISTRY.names)]


class MetricSpec(_Section):
    """An `evaluate` metric and the keyword arguments of its ``compute``."""

    name: str = Field(min_length=1, description="metric name on the Hub, or path of a local metric script")
    kwargs: dict[str, Any] = Field({}, description="keyword arguments of the metric's compute, e.g. {average: macro}")


class Evaluate(_Section):
    """The loss curve along λ ∈ [0, 1]: task, data, number of points, curves to compare against."""

    task: Task = Field(description="which loss to compute")
    data: DataSpec = Field(description="evaluation data")
    points: int = Field(
        21, ge=2, le=MAX_POINTS, description=f"evenly spaced λ values, both ends included (2 to {MAX_POINTS})"
    )
    compare: list[StrategyName] = Field(["vanilla"], description="extra curves, one per strategy (default options)")
    batch_size: int = Field(8, ge=1, description="examples per forward pass")
    max_tokens: int | None = Field(None, ge=1, description="evaluate at most this many tokens")
    max_examples: int | None = Field(None, ge=1, description="evaluate at most this many examples")
    seed: int = Field(0, description="seed of masks (masked-lm) and sampling")
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


class PushToHub(_Section):
    """Where to publish the result on the Hub (token from the environment or the login cache)."""

    repo: str = Field(description="Hub repo id: name or org/name")
    private: bool | None = Field(None, description="create the repo private; default: the account's default")
    revision: str | None = Field(None, description="branch to push to; default: main")
    commit_message: str | None = Field(None, description="default: a message naming the recipe")

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str) -> str:
        if not is_repo_id(value):
            problem = repo_id_problem(value)
            raise PydanticCustomError(
                "repo",
                "a Hub repo id is `name` or `org/name` (letters, digits, - _ .){why}",
                {"why": f": {problem}" if problem else ""},
            )
        return value


class Output(_Section):
    """The local result folder (written to a temporary folder, then renamed) and optional push."""

    dir: Path = Field(description="folder to write the result to (relative to the recipe file)")
    overwrite: bool = Field(False, description="replace the folder if it exists")
    max_shard_size: str | int = Field(
        DEFAULT_SHARD_SIZE,
        description="split model.safetensors into shards past this size: bytes, or a string such as 2GB or 500MB",
    )
    push_to_hub: PushToHub | None = Field(None, description="also publish the folder to the Hub")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="dtype of the written weights; default: the reference model's stored dtype "
        "(merge: model A, transport: the target B or the adapter's own); the work is done in float32",
    )

    @field_validator("max_shard_size")
    @classmethod
    def _shard_size(cls, value: str | int) -> str | int:
        ok = value > 0 if isinstance(value, int) else bool(_SIZE.fullmatch(value.strip()))
        if not ok:
            raise PydanticCustomError("size", "a size in bytes or with a unit: 500MB, 2GB, 10GiB")
        return value

    @field_validator("dir", mode="before")
    @classmethod
    def _dir(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and value:
            return _local(value, _base_dir(info), force=True)
        if isinstance(value, str):
            raise PydanticCustomError("dir", "must be a folder path, not empty")
        return value


class StrategySpec(BaseModel):
    """Base of every ``strategy:`` section: ``name`` plus that strategy's options, side by side."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str

    @property
    def strategy(self) -> Strategy:
        """The registered strategy this section names (paper, run, needs_data, exact)."""
        return get_strategy(self.name)

    @property
    def options(self) -> Options:
        """The options as the strategy's own ``Options`` instance (what ``align`` takes)."""
        return self.strategy.options.model_validate(self.model_dump(exclude={"name"}, exclude_unset=True))

    @property
    def needs_data(self) -> bool:
        """True when these options need alignment data (the recipe then needs `data:`)."""
        return bool(self.strategy.needs_data(self.options))

    @property
    def runs_learned_matching(self) -> bool:
        """True when these options run learned matching: whole models with gradients, never streamed."""
        return bool(self.strategy.memory.learned(self.options))


def _section_model(strategy: Strategy) -> type[StrategySpec]:
    clash = {"name", "strategy", "options", "needs_data", "runs_learned_matching"} & set(strategy.options.model_fields)
    if clash:
        raise RuntimeError(f"strategy {strategy.name!r} has options named {sorted(clash)}: reserved in recipes")
    title = "".join(part.title() for part in strategy.name.split("-")) + "Strategy"
    bases: Any = (StrategySpec, strategy.options)  # the section is both: name + that strategy's options
    return create_model(
        title,
        __base__=bases,
        __doc__=strategy.summary or strategy.paper,
        name=(Literal[strategy.name], Field(description=strategy.paper)),
    )


SECTIONS: dict[str, type[StrategySpec]] = {name: _section_model(REGISTRY.get(name)) for name in REGISTRY.names}

if TYPE_CHECKING:
    StrategySection = StrategySpec
else:
    StrategySection = Annotated[functools.reduce(operator.or_, SECTIONS.values()), Field(discriminator="name")]


def yamlish(value: Any) -> str:
    """A value as it would be written in the recipe (``true``, ``[ff, attn]``)."""
    text = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True)
    return str(text).strip().removesuffix("...").strip()


def _needs_data_message(spec: StrategySpec, at: str | None = None) -> PydanticCustomError:
    given = {k: getattr(spec, k) for k in sorted(spec.model_fields_set - {"name"})}
    with_opts = f" with {', '.join(f'{k}: {yamlish(v)}' for k, v in given.items())}" if given else ""
    return PydanticCustomError(
        "recipe",
        "strategy '{name}'{opts} needs alignment data: add a top-level `data:` section "
        "(dataset, data_files, split, column), or choose a data-free strategy or option",
        {"name": spec.name, "opts": with_opts, **({"at": at} if at else {})},
    )


class RecipeBase(_Section):
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
            raise _needs_data_message(spec)
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
                    raise _needs_data_message(spec, f"compare.{i}")
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
