"""The ``output:`` section: the local result folder (relative to the recipe), its shards and dtype, and
the optional push to the Hub (its repo id checked when the recipe is read).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.core.names import DEFAULT_SHARD_SIZE
from hf_rebasin.io.hub.resolve import is_repo_id, repo_id_problem
from hf_rebasin.recipe.common import Section, local_path, recipe_dir

_SIZE = re.compile(r"\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", re.IGNORECASE)


class PushToHub(Section):
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


class Output(Section):
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
            return local_path(value, recipe_dir(info), force=True)
        if isinstance(value, str):
            raise PydanticCustomError("dir", "must be a folder path, not empty")
        return value
