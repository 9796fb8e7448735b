"""The ``output:`` section: the local result folder (relative to the recipe), its shards and dtype, and
the optional push to the Hub (its repo id checked when the recipe is read).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.core.names import DEFAULT_SHARD_SIZE
from hf_rebasin.io.hub.resolve import is_repo_id, repo_id_problem
from hf_rebasin.recipe.common import Section, local_path, recipe_dir

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update(kib=2**10, mib=2**20, gib=2**30, tib=2**40)
# a shard past the whole model is one file: 1 PiB is past any model, so a larger size is a typo
MAX_SHARD_BYTES = 2**50


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
    max_shard_size: str | Annotated[int, Field(ge=1, le=MAX_SHARD_BYTES, strict=True)] = Field(
        DEFAULT_SHARD_SIZE,
        description="split model.safetensors into shards past this size: bytes, or a string such as 2GB or 500MB "
        "(1 byte to 1 PiB)",
    )
    push_to_hub: PushToHub | None = Field(None, description="also publish the folder to the Hub")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="dtype of the written weights; default: the reference model's stored dtype "
        "(merge: model A, transport: the target B or the adapter's own); the work is done in float32",
    )

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _shard_size(cls, value: Any) -> Any:
        """A size of 1 byte to 1 PiB, in bytes or with a unit; checked before the union's types so that
        `true` or a number past the bound gets this message, not one per member of the union."""
        size: float | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            size = value
        elif isinstance(value, str) and (m := _SIZE.fullmatch(value.strip())):
            size = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if size is None or not 1 <= size <= MAX_SHARD_BYTES:
            raise PydanticCustomError("size", "a size of 1 byte to 1 PiB, in bytes or with a unit: 500MB, 2GB, 10GiB")
        return value

    @field_validator("dir", mode="before")
    @classmethod
    def _dir(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and value:
            return local_path(value, recipe_dir(info), force=True)
        if isinstance(value, str):
            raise PydanticCustomError("dir", "must be a folder path, not empty")
        return value
