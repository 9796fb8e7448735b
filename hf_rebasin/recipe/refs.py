"""Model references: a Hub id (``org/name@revision``), a local folder beside the recipe, or a zoo model
(``zoo:gpt2-seed0``); checked when the recipe is read, not deep inside a download.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.core.names import KINDS
from hf_rebasin.io.hub.resolve import repo_id_problem, split_ref
from hf_rebasin.recipe.common import Section, local_path, recipe_dir

# a model of the zoo (`hf_rebasin.evaluation.zoo.catalogue`, trained by `hf_rebasin.evaluation.zoo.train` on first use, then cached)
ZOO_PATTERN = re.compile(rf"zoo:({'|'.join(KINDS)})-seed(\d+)")
# the largest zoo seed: training derives further seeds from it (seed × 100003 + epoch) for
# torch.Generator, which takes at most 2**64 - 1, and numpy takes at most 2**32 - 1
MAX_ZOO_SEED = 2**32 - 1


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


class ModelRef(Section):
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
        resolved = local_path(value, recipe_dir(info))
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
