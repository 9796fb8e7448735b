"""The YAML recipe, schema v1: pydantic models, loading, and errors that teach.

The README documents every key; `recipe_json_schema` (``hf-rebasin schema``) is built from these
models. Importing this module imports no torch (nor transformers, datasets, scipy): names, defaults
and strategy options come from torch-free modules, so validating a recipe or printing its schema
takes a fraction of a second (tests/test_imports.py keeps it so).

Parsing is strict on purpose: unknown keys are errors, every enumerated choice is a ``Literal``,
and a strategy's options are validated by that strategy's own options model (built from the
registry, never restated here). Every problem is reported at once, one paragraph each, with the
file, the dotted path (``strategy.residual``), the line, what was given and what is allowed.
"""

from __future__ import annotations

import difflib
import functools
import operator
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

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

from .datafiles import check_files
from .errors import DataError, RebasinUserError
from .hub import is_repo_id, repo_id_problem, split_ref
from .names import (
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
from .strategies import REGISTRY, Options, Strategy, get_strategy
from .zoo import is_trained, zoo_folder

__all__ = [
    "AUTO_ALPHAS",
    "JOBS",
    "AutoAlpha",
    "DataSpec",
    "Evaluate",
    "Merge",
    "ModelRef",
    "Output",
    "Problem",
    "PushToHub",
    "Recipe",
    "RecipeError",
    "StrategySpec",
    "Universe",
    "describe",
    "describe_auto",
    "load_recipe",
    "loads_recipe",
    "parse_recipe",
    "recipe_json_schema",
    "strategy_spec",
]

Job = Literal["merge", "barrier", "transport"]
JOBS: tuple[str, ...] = get_args(Job)
TRANSPORT_MODELS = ("base", "finetuned", "target")  # job: transport names these instead of `models`
# data-free, and on the benchmark zoo's domain fine-tune (README, "On the benchmark zoo") it moves about
# twice as much of the task vector as any permutation strategy: a rotated residual stream (one map)
DEFAULT_TRANSPORT_STRATEGY = "generalized-orthogonal"
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
# error types raised by this module's own checks: their message says it all
_OWN_ERRORS = frozenset({"model_ref", "data_files", "weight", "compare", "repo", "dir", "device", "size"})

Lines = Mapping[tuple[str, ...], int]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe: where (dotted path, line) and what."""

    path: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}, " if self.line is not None else ""
        return f"{where}`{self.path or '(top level)'}`: {self.message}"


class RecipeError(RebasinUserError, ValueError):
    """A recipe that cannot be read or does not validate; ``problems`` lists each one."""

    def __init__(self, source: str, problems: Iterable[Problem]) -> None:
        self.source = source
        self.problems = list(problems)
        count = len(self.problems)
        head = f"recipe {source} is invalid ({count} problem{'s' if count != 1 else ''}):"
        super().__init__("\n".join([head, *(f"- {p}" for p in self.problems)]))


# ---------------------------------------------------------------------------------------------
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
        return str(candidate.resolve())
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
            {"given": _given(value)},
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
            message = f"{msg[:1].lower()}{msg[1:]}; given {_given(err.get('input'))}"
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


def _section_model(strategy: Strategy) -> type[StrategySpec]:
    clash = {"name", "strategy", "options", "needs_data"} & set(strategy.options.model_fields)
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


def _yamlish(value: Any) -> str:
    """A value as it would be written in the recipe (``true``, ``[ff, attn]``)."""
    text = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True)
    return str(text).strip().removesuffix("...").strip()


def _needs_data_message(spec: StrategySpec, at: str | None = None) -> PydanticCustomError:
    given = {k: getattr(spec, k) for k in sorted(spec.model_fields_set - {"name"})}
    with_opts = f" with {', '.join(f'{k}: {_yamlish(v)}' for k, v in given.items())}" if given else ""
    return PydanticCustomError(
        "recipe",
        "strategy '{name}'{opts} needs alignment data: add a top-level `data:` section "
        "(dataset, data_files, split, column), or choose a data-free strategy or option",
        {"name": spec.name, "opts": with_opts, **({"at": at} if at else {})},
    )


class Recipe(_Section):
    """A whole recipe: which job, on which models, with which strategy, written where."""

    version: Literal[1] = Field(1, description="schema version")
    job: Job = Field(description="what to do")
    models: list[ModelRef] | None = Field(
        None, validate_default=True, description="merge, barrier: two or more models; the first is the reference A"
    )
    base: ModelRef | None = Field(
        None, validate_default=True, description="transport: the base the fine-tune was trained from (A)"
    )
    finetuned: FineTuneRef | None = Field(
        None,
        validate_default=True,
        description="transport: the fine-tune of `base` (A + τ): a full model (its head may differ) or a PEFT LoRA adapter",
    )
    target: ModelRef | None = Field(
        None, validate_default=True, description="transport: the new base release (B) the task vector moves to"
    )
    alpha: float | list[float] | AutoAlpha | None = Field(
        None,
        validate_default=True,
        description="transport: scale α of the task vector (default 1); a list is swept and reported, the first "
        "saved; `auto` (or {auto: [α, ...], support_budget: nats}) sweeps and saves the α whose task gain is worth "
        "its support cost (needs `evaluate.support`)",
        json_schema_extra=_alpha_schema,
    )
    strategy: StrategySection = Field(
        None,
        validate_default=True,
        description="alignment strategy: `name` and its options side by side (transport default: generalized-orthogonal)",
    )
    data: DataSpec | None = Field(
        None, validate_default=True, description="alignment data (activation-based strategies)"
    )
    merge: Merge = Field(
        default_factory=lambda: Merge(weight=DEFAULT_WEIGHT), validate_default=True, description="merge weights"
    )
    evaluate: Evaluate | None = Field(None, validate_default=True, description="loss curves; required by job: barrier")
    output: Output = Field(description="where results go")
    allow_pickle: bool = Field(False, description="allow loading pickle (.bin) checkpoints")
    trust_remote_code: bool = Field(
        False,
        description="accept models whose config names custom code (auto_map): their weights are loaded into the "
        "stock class of their model_type; repository code is never run",
    )
    allow_different_tokenizers: bool = Field(
        False,
        description="run although the models' tokenizers differ (vocabulary, special tokens or merges): their "
        "token ids may mean different things; the card says so",
    )
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N or mps")
    cache: bool = Field(
        True,
        description="reuse alignments from the alignment cache ($HF_REBASIN_CACHE/alignments) and store new "
        "ones; false computes every alignment afresh",
    )

    _source: str = PrivateAttr("<recipe>")
    _text: str | None = PrivateAttr(None)

    @field_validator("models")
    @classmethod
    def _models_for_the_job(cls, value: list[ModelRef] | None, info: ValidationInfo) -> list[ModelRef] | None:
        job = info.data.get("job")
        if job == "transport":
            if value is not None:
                raise PydanticCustomError(
                    "recipe", "job: transport names `base`, `finetuned` and `target` instead of `models`"
                )
            return value
        if value is None or len(value) < 2:
            raise PydanticCustomError(
                "recipe",
                "job: {job} needs `models`: at least two (a list of Hub ids or folders; the first is the reference)",
                {"job": job or "merge"},
            )
        if job == "barrier" and len(value) != 2:
            raise PydanticCustomError(
                "recipe",
                "job: barrier compares two models (A and B) and this recipe lists {n}; keep two, or use job: merge",
                {"n": len(value)},
            )
        return value

    @field_validator("base", "finetuned", "target")
    @classmethod
    def _transport_models(cls, value: ModelRef | None, info: ValidationInfo) -> ModelRef | None:
        job = info.data.get("job")
        if job == "transport" and value is None:
            what = {
                "base": "the base the fine-tune was trained from (A)",
                "finetuned": "the fine-tune of the base (A + τ)",
                "target": "the new base release (B) to move the task vector to",
            }[str(info.field_name)]
            raise PydanticCustomError(
                "recipe", "job: transport needs `{field}`: {what}", {"field": info.field_name, "what": what}
            )
        if job in ("merge", "barrier") and value is not None:
            raise PydanticCustomError(
                "recipe",
                "`{field}` belongs to job: transport; job: {job} lists `models`",
                {"field": info.field_name, "job": job},
            )
        return value

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha(cls, value: Any, info: ValidationInfo) -> Any:
        job = info.data.get("job")
        if value is None:
            return 1.0 if job == "transport" else None
        if job in ("merge", "barrier"):
            raise PydanticCustomError(
                "recipe", "`alpha` belongs to job: transport; merges weigh models with merge.weight"
            )
        if value == "auto" or isinstance(value, (Mapping, AutoAlpha)):
            return value if isinstance(value, AutoAlpha) else _auto_alpha(value)
        values = value if isinstance(value, list) else [value]
        if not values or not all(_number(v) and abs(v) < 1e6 for v in values):
            raise PydanticCustomError(
                "weight",
                "must be a number (the scale of the task vector, e.g. 1.0), a list of them, or `auto` "
                "(sweep and save the α whose task gain is worth its support cost)",
            )
        return value

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy_shorthand(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            if info.data.get("job") == "transport":
                return {"name": DEFAULT_TRANSPORT_STRATEGY}
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

    @field_validator("merge")
    @classmethod
    def _universe_merges(cls, value: Merge, info: ValidationInfo) -> Merge:
        if value.universe is not None and info.data.get("job") == "barrier":
            raise PydanticCustomError(
                "recipe",
                "a universe merge belongs to job: merge; job: barrier compares two models and saves no merge: "
                "remove `universe`",
                {"at": "universe"},
            )
        return value

    @field_validator("evaluate")
    @classmethod
    def _evaluate_when_needed(cls, value: Evaluate | None, info: ValidationInfo) -> Evaluate | None:
        if value is None:
            if info.data.get("job") == "barrier":
                raise PydanticCustomError(
                    "recipe",
                    "job: barrier needs an `evaluate:` section (task, data, points) to compute the loss curves",
                )
            return value
        if "data" in info.data and info.data["data"] is None:
            for i, name in enumerate(value.compare):
                spec = SECTIONS[name](name=name)
                if spec.needs_data:
                    raise _needs_data_message(spec, f"compare.{i}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not DEVICE_PATTERN.fullmatch(value):
            raise PydanticCustomError("device", "allowed: auto, cpu, cuda, cuda:N (N a GPU index), mps")
        return value

    @model_validator(mode="after")
    def _job_sections(self) -> Recipe:
        if self.job == "transport" and "merge" in self.model_fields_set:
            raise PydanticCustomError(
                "recipe",
                "job: transport scales the task vector with `alpha`, not `merge.weight`: remove `merge`",
                {"at": "merge"},
            )
        maps = getattr(self.strategy, "residual_maps", None)
        if self.job != "transport" and maps == "per-sublayer":
            raise PydanticCustomError(
                "recipe",
                "`residual_maps: per-sublayer` moves a task vector (job: transport); a {job} needs one residual map "
                "so that the aligned model computes what it did: remove it or use `global`",
                {"job": self.job, "at": "strategy"},
            )
        if "residual_maps" in type(self.strategy).model_fields and maps is None:
            default = "per-sublayer" if self.job == "transport" else "global"
            self.strategy = self.strategy.model_copy(update={"residual_maps": default})
        ev = self.evaluate
        if ev is not None and self.job != "transport" and ev.support is not None:
            raise PydanticCustomError("recipe", "`evaluate.support` belongs to job: transport", {"at": "evaluate"})
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
        if ev is not None and self.job == "transport" and set(ev.compare) - {"vanilla"}:
            raise PydanticCustomError(
                "recipe",
                "job: transport compares with the naive B + α·τ (`vanilla`) only: `compare: [vanilla]` or `[]`",
                {"at": "evaluate"},
            )
        return self

    @property
    def alphas(self) -> list[float]:
        """The task-vector scales of a transport (the first is the one saved, unless `auto` picks one):
        the list given, or `auto`'s grid; empty for other jobs."""
        if self.alpha is None:
            return []
        if isinstance(self.alpha, AutoAlpha):
            return [float(a) for a in self.alpha.auto]
        return [float(a) for a in (self.alpha if isinstance(self.alpha, list) else [self.alpha])]

    @property
    def auto_alpha(self) -> AutoAlpha | None:
        """`alpha: auto`'s grid and budget; None when the recipe gives α itself."""
        return self.alpha if isinstance(self.alpha, AutoAlpha) else None

    @property
    def refs(self) -> list[tuple[str, ModelRef]]:
        """(recipe path, reference) of every model the job reads, in order; the reference model first.

        merge / barrier: ``models.N.model``; transport: target (the reference), base, finetuned.
        """
        if self.job == "transport":  # the target is the reference: the old base is aligned to it
            return [(f"{k}.model", r) for k in ("target", "base", "finetuned") if (r := getattr(self, k)) is not None]
        return [(f"models.{i}.model", m) for i, m in enumerate(self.models or [])]

    @property
    def source(self) -> str:
        """The file (or label) the recipe was read from."""
        return self._source

    @property
    def text(self) -> str | None:
        """The YAML the recipe was parsed from, verbatim (the model card quotes it); None if built in code."""
        return self._text


# ---------------------------------------------------------------------------------------------
# Errors


def _model_at(loc: tuple[str, ...], strategy: str | None) -> type[BaseModel] | None:
    """The model class that validates the mapping at ``loc`` (for listing its allowed keys)."""
    model: type[BaseModel] = Recipe
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if model is Recipe and part == "strategy":
            return SECTIONS.get(strategy or "") if not parts else None
        field = model.model_fields.get(part)
        if field is None:
            return None
        annotation: Any = field.annotation
        if get_origin(annotation) in (Union, types.UnionType):
            members = [a for a in get_args(annotation) if a is not type(None)]
            annotation = members[0] if len(members) == 1 else None
        if get_origin(annotation) is list:
            if not parts or not parts.pop(0).isdigit():
                return None
            annotation = get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _given(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _problem(err: Mapping[str, Any], lines: Lines) -> Problem:
    loc = tuple(str(p) for p in err["loc"])
    if len(loc) >= 2 and loc[0] == "strategy" and loc[1] in SECTIONS:
        strategy, loc = loc[1], (loc[0], *loc[2:])
    else:
        strategy = None
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if "at" in ctx:  # a check on a whole section that names the field at fault
        loc = (*loc, *str(ctx["at"]).split("."))
    path = ".".join(loc)
    line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
    model = _model_at(loc[:-1], strategy) if loc else None
    field = model.model_fields.get(loc[-1]) if model is not None and loc else None
    about = f" ({field.description})" if field is not None and field.description else ""

    if kind == "missing":
        message = f"is required but missing{about}"
    elif kind == "extra_forbidden":
        allowed = sorted(model.model_fields) if model is not None else []
        owner = f"an option of strategy '{strategy}'" if strategy else "a known key here"
        message = f"is not {owner}; allowed: {', '.join(allowed) or 'none'}"
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        if close:
            message += f" (did you mean `{close[0]}`?)"
        if strategy and loc[-1] == "options":
            message += "; options sit directly under `strategy`, not in a nested `options:` mapping"
    elif kind == "literal_error":
        expected = str(ctx.get("expected", "")).replace(" or ", ", ")
        message = f"must be one of {expected}; given {_given(value)}"
    elif kind == "union_tag_invalid":
        path, line = f"{path}.name", lines.get((*loc, "name"), line)
        message = f"unknown strategy {_given(ctx.get('tag'))}; allowed: {ctx.get('expected_tags', '')}"
        close = difflib.get_close_matches(str(ctx.get("tag")), REGISTRY.names, n=1)
        if close:
            message += f" (did you mean `{close[0]}`?)"
    elif kind == "union_tag_not_found":
        message = f"needs a `name`: one of {', '.join(REGISTRY.names)}"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        message = f"must be a mapping of keys{about}; given {_given(value)}"
    elif kind == "recipe":
        message = err["msg"]
    elif kind in _OWN_ERRORS:
        message = f"{err['msg']}; given {_given(value)}"
    else:
        msg = str(err["msg"]).removeprefix("Value error, ")
        given = (
            "" if isinstance(value, Mapping) else f"; given {_given(value)}"
        )  # a whole section: the message names the key
        message = f"{msg[:1].lower()}{msg[1:]}{given}{about}"
    return Problem(path, line, message)


# ---------------------------------------------------------------------------------------------
# Loading


def parse_recipe(data: Mapping[str, Any], source: str, base_dir: Path, *, lines: Lines | None = None) -> Recipe:
    """Validate an in-memory recipe; relative paths resolve against ``base_dir``.

    ``lines`` maps dotted paths (as tuples of keys) to YAML line numbers, for error messages.
    """
    if not isinstance(data, Mapping):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise RecipeError(
            source, [Problem("", None, f"a recipe is a mapping of keys (job:, models:, ...); this one is {kind}")]
        )
    try:
        recipe = Recipe.model_validate(dict(data), context={"base_dir": Path(base_dir)})
    except ValidationError as e:
        errors = e.errors(include_url=False)
        problems = [_problem(err, lines or {}) for err in errors]
        raise RecipeError(source, problems) from None
    recipe._source = source
    return recipe


def strategy_spec(name: str, options: Mapping[str, Any], given: Mapping[str, str] | None = None) -> StrategySpec:
    """A strategy and its options from the command line (``--strategy``, ``--set``), checked as a
    recipe's ``strategy:`` section is: a wrong name or option gets the same message (allowed
    values, "did you mean"), naming the option as it was typed (``given``: key -> ``--set`` item)."""
    from pydantic import TypeAdapter

    from .errors import StrategyOptionError

    try:
        return TypeAdapter(StrategySection).validate_python({**options, "name": name})
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            problem = _problem({**err, "loc": ("strategy", *err["loc"])}, {})
            parts = problem.path.split(".")
            key = parts[1] if len(parts) > 1 else "name"
            label = "--strategy" if key == "name" else f"--set {(given or {}).get(key, key)}"
            problems.append(str(Problem(label, None, problem.message)))
        raise StrategyOptionError("; ".join(problems)) from None


def _line_map(node: yaml.Node, path: tuple[str, ...], lines: dict[tuple[str, ...], int], source: str) -> None:
    """Record the line of every mapping key and sequence item; refuse duplicate keys."""
    if len(path) > 32:
        return
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name, line = str(key.value), key.start_mark.line + 1
            if name in seen and isinstance(key, yaml.ScalarNode):
                where = ".".join((*path, name))
                raise RecipeError(
                    source, [Problem(where, line, f"appears twice (first on line {seen[name]}): keep one")]
                )
            seen[name] = line
            here = (*path, name)
            lines[here] = line
            _line_map(value, here, lines, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            here = (*path, str(i))
            lines[here] = item.start_mark.line + 1
            _line_map(item, here, lines, source)


def _expanded_size(node: yaml.Node) -> int:
    """How many values ``node`` holds with every alias expanded, counted without expanding them.

    An alias is the same node object as its anchor, so sizes are memoised by identity: the count
    takes time linear in the YAML text however far the aliases would multiply it.
    """
    sizes: dict[int, int] = {}

    def size(n: yaml.Node, depth: int) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if depth > 200:  # a recursive alias (&a [*a]): no recipe has it; count it as too large
            return MAX_YAML_VALUES + 1
        sizes[id(n)] = MAX_YAML_VALUES + 1  # in progress: a cycle counts as too large
        total = 1
        if isinstance(n, yaml.MappingNode):
            total += sum(size(k, depth + 1) + size(v, depth + 1) for k, v in n.value)
        elif isinstance(n, yaml.SequenceNode):
            total += sum(size(item, depth + 1) for item in n.value)
        sizes[id(n)] = total = min(total, MAX_YAML_VALUES + 1)
        return total

    return size(node, 0)


def loads_recipe(text: str, source: str = "<string>", base_dir: Path | None = None) -> Recipe:
    """Parse and validate recipe YAML text (``load_recipe`` without the file)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None and _expanded_size(node) > MAX_YAML_VALUES:
            raise RecipeError(
                source,
                [
                    Problem(
                        "",
                        None,
                        f"YAML aliases (*name) expand this recipe to more than {MAX_YAML_VALUES} values, which no "
                        "recipe needs (an alias bomb?): write the repeated values out, or use fewer aliases",
                    )
                ],
            )
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        what = " ".join(str(s) for s in (getattr(e, "context", None), getattr(e, "problem", None)) if s) or str(e)
        raise RecipeError(source, [Problem("", line, f"YAML syntax error: {what}")]) from None
    lines: dict[tuple[str, ...], int] = {}
    if node is not None:
        _line_map(node, (), lines, source)
    recipe = parse_recipe(data, source, base_dir or Path.cwd(), lines=lines)
    recipe._text = text
    return recipe


def load_recipe(path: str | Path) -> Recipe:
    """Read a recipe file; relative paths inside it resolve against the file's folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(str(path), [Problem("", None, "the recipe file does not exist")]) from None
    except IsADirectoryError:
        raise RecipeError(str(path), [Problem("", None, "is a folder: give the recipe's YAML file")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(str(path), [Problem("", None, f"cannot be read: {e}")]) from None
    return loads_recipe(text, str(path), path.resolve().parent)


def recipe_json_schema() -> dict[str, Any]:
    """JSON Schema of recipe files, for editors: strategy options are a union tagged by ``name``."""
    schema = Recipe.model_json_schema()
    props = schema["properties"]
    ref = {
        "anyOf": [
            {
                "type": "string",
                "description": f"Hub id[@revision], folder or zoo:KIND-seedN (N from 0 to {MAX_ZOO_SEED})",
            },
            {"$ref": "#/$defs/ModelRef"},
        ]
    }
    props["models"] = {k: v for k, v in props["models"].items() if k not in ("anyOf", "default")}
    props["models"].update(type="array", items=ref, minItems=2)
    for key in TRANSPORT_MODELS:
        props[key] = {k: v for k, v in props[key].items() if k not in ("anyOf", "default")} | ref
    props["strategy"] = {"anyOf": [{"type": "string", "enum": REGISTRY.names}, props["strategy"]]}
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "hf-rebasin recipe (schema v1)"
    return schema


# ---------------------------------------------------------------------------------------------
# Plan


def _data_line(spec: DataSpec) -> str:
    parts = [spec.dataset + (" (built in)" if spec.dataset in BUILTIN_DATASETS else "")]
    for key in ("name", "revision", "data_files", "data_dir"):
        if getattr(spec, key) is not None:
            parts.append(f"{key}={getattr(spec, key)}")
    parts.append(f"split={spec.split}")
    for key in ("column", "image_column", "label_column", "max_tokens", "max_examples", "sample_by"):
        if getattr(spec, key) is not None:
            parts.append(f"{key}={getattr(spec, key)}")
    try:
        check_files(spec.data_files, spec.data_dir, Path.cwd())
    except DataError as e:
        parts.append(f"MISSING: {e}")
    return ", ".join(parts)


def _universe_lines(recipe: Recipe) -> list[str]:
    """The plan of a universe merge (none without one)."""
    universe = recipe.merge.universe
    if universe is None:
        return []
    target = "the mean of the others (model after model)" if universe.leave_one_out else "the mean of all"
    out = [
        f"  universe: from the reference merge, realign every model to {target}, average, repeat; "
        f"at most {universe.iterations} rounds, until the mean moves by less than {universe.tol:g} (relative)"
    ]
    if len(recipe.refs) == 2:
        out.append(
            "  note: with two models there is no third to share a basis with: universe only refines the pairwise "
            "alignment (each model aligned to the other in turn) and re-centres the merge between them"
        )
    if recipe.strategy.name == "vanilla":
        out.append("  note: vanilla aligns nothing, so universe rounds leave the plain average as it is")
    return out


def describe_auto(budget: float | None) -> str:
    """What `alpha: auto` saves, in words (the plan, the card and the README say it alike)."""
    if budget is not None:
        return (
            f"the α with the largest task gain whose support cost is at most {budget:g} nats "
            "(none within it: the α of the smallest support cost, and a note)"
        )
    return (
        "the α with the largest task gain per nat of support cost; an α that gains at no support cost beats "
        "any that costs (the largest gain among them); none gains: the α of the smallest support cost, and a note"
    )


def describe(recipe: Recipe) -> list[str]:
    """The plan a recipe stands for, one line each (``--dry-run`` prints it; nothing is loaded)."""
    out = [f"recipe: {recipe.source}", f"job: {recipe.job}", "models:"]
    transport_labels = {"base": "base A", "finetuned": "fine-tune A + τ", "target": "target B (reference)"}
    for i, (path, ref) in enumerate(recipe.refs):
        label = (
            transport_labels[path.split(".")[0]]
            if recipe.job == "transport"
            else "A (reference)"
            if i == 0
            else chr(ord("A") + i)
            if i < 26
            else f"#{i}"
        )
        if ref.zoo is not None:
            folder = zoo_folder(*ref.zoo)
            where = f"zoo model, cached in {folder}" if is_trained(folder) else "zoo model, trained now (first use)"
        elif ref.source == "local":
            where = "local folder" + ("" if Path(ref.model).is_dir() else ", MISSING")
        else:
            where = "Hub"
        revision = f" @ {ref.revision or 'main'}" if ref.source == "hub" else ""
        out.append(f"  {label}: {ref.model}{revision} ({where})")
    spec = recipe.strategy
    out.append(f"strategy: {spec.name} — {spec.strategy.paper}")
    explicit = spec.model_fields_set
    for key, value in spec.options.model_dump().items():
        out.append(f"  {key}: {_yamlish(value)}{'' if key in explicit else ' (default)'}")
    out.append(f"  needs alignment data: {'yes' if spec.needs_data else 'no'}")
    if not spec.strategy.exact(spec.options):
        out.append("  note: these options do not preserve B's function (reported as such)")
    out.append(f"data: {_data_line(recipe.data)}" if recipe.data else "data: none (data-free)")
    if recipe.job == "merge":
        weights = recipe.merge.weights(len(recipe.refs))
        out.append("merge: weights " + ", ".join(f"{w:g}" for w in weights) + " (reference first)")
        out.extend(_universe_lines(recipe))
    if recipe.job == "transport":
        alphas = ", ".join(f"{a:g}" for a in recipe.alphas)
        auto = recipe.auto_alpha
        if auto is None:
            out.append(f"transport: θ = B + α·π(A_ft − A), α = {alphas} (the first is saved); π aligns A to B")
        else:
            out.append(f"transport: θ = B + α·π(A_ft − A), α chosen automatically from {alphas}; π aligns A to B")
            out.append(f"  saved: {describe_auto(auto.support_budget)}")
    ev = recipe.evaluate
    if ev is None:
        out.append("evaluate: no")
    else:
        if recipe.job == "transport":
            out.append(f"evaluate: {ev.task}, batch size {ev.batch_size}, seed {ev.seed}")
            out.append(f"  data: {_data_line(ev.data)}")
            if ev.support is not None:
                out.append(f"  support: {_data_line(ev.support)}")
            naive = ", naive B + α·τ" if "vanilla" in ev.compare else ""
            out.append(f"  scored: target B, old base A, fine-tune A + τ, transported B + α·π(τ){naive}")
            if ev.support is not None:
                out.append("  trade-off: task gain over B against support cost over B, per α (tradeoff.png)")
        else:
            out.append(
                f"evaluate: {ev.task}, {ev.points} points λ ∈ [0, 1], batch size {ev.batch_size}, seed {ev.seed}"
            )
            out.append(f"  data: {_data_line(ev.data)}")
            out.append(f"  curves: {', '.join(dict.fromkeys([spec.name, *ev.compare]))}")
    out.append(f"output: {recipe.output.dir}" + (" (overwrite)" if recipe.output.overwrite else ""))
    push = recipe.output.push_to_hub
    if push is not None:
        vis = {True: "private", False: "public", None: "account default visibility"}[push.private]
        out.append(f"  push to hub: {push.repo}@{push.revision or 'main'} ({vis})")
    out.append(
        f"device: {recipe.device}; allow_pickle: {str(recipe.allow_pickle).lower()}; "
        f"trust_remote_code: {str(recipe.trust_remote_code).lower()}"
        + ("; allow_different_tokenizers: true" if recipe.allow_different_tokenizers else "")
    )
    return out
