"""The data sections (``data:``, ``evaluate.data``, ``evaluate.support``): what ``datasets.load_dataset``
reads, its local files resolved against the recipe's folder, and how much of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hf_rebasin.core.names import BUILTIN_DATASETS, LOCAL_BUILDERS, SampleBy
from hf_rebasin.recipe.common import Section, local_path, recipe_dir

# how much data a section may ask for: a trillion tokens or examples is a pretraining corpus (a
# few zeros too many are refused when the recipe is read); a block of 16M tokens is past any context
MAX_DATA = 10**12
MAX_BLOCK_SIZE = 1 << 24

DataFiles = Union[str, list[str], dict[str, Union[str, list[str]]]]  # noqa: UP007 (pydantic needs a runtime union)


class DataSpec(Section):
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
    source_column: str | None = Field(
        None,
        description="source text column (seq2seq pairs, with `target_column`); default: `source` where the data "
        "have both `source` and `target`, else `column`'s plain text is noised",
    )
    target_column: str | None = Field(
        None, description="target text column (seq2seq pairs, or the transcripts of `audio_column`); default: `target`"
    )
    audio_column: str | None = Field(
        None,
        description="column of WAV file paths, relative to the recipe's folder (speech-to-text models such as "
        "Whisper: the sources of seq2seq pairs whose targets are `target_column`'s transcripts)",
    )
    max_tokens: int | None = Field(None, ge=1, le=MAX_DATA, strict=True, description="read at most this many tokens")
    max_examples: int | None = Field(
        None, ge=1, le=MAX_DATA, strict=True, description="read at most this many examples"
    )
    block_size: int | None = Field(
        None,
        ge=2,
        le=MAX_BLOCK_SIZE,
        strict=True,
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
        base = recipe_dir(info)
        if self.audio_column is not None and self.source_column is not None:
            raise PydanticCustomError(
                "recipe",
                "`audio_column` is the source of speech pairs: remove `source_column` (keep `target_column`)",
                {"at": "source_column"},
            )
        if self.audio_column is None and (self.source_column is None) != (self.target_column is None):
            one, other = ("source_column", "target_column")[:: 1 if self.target_column is None else -1]
            raise PydanticCustomError(
                "recipe",
                "`{one}` pairs with `{other}`: give both (seq2seq sources and targets) or neither",
                {"one": one, "other": other, "at": other},
            )
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
            self.dataset = local_path(self.dataset, base)
            return self
        if self.data_files is None and self.data_dir is None:
            raise PydanticCustomError(
                "recipe",
                "the `{builder}` builder reads local files: give `data_files` (a file, a glob, a list, "
                "or {split: files}) or `data_dir`",
                {"builder": self.dataset, "at": "data_files"},
            )
        if self.data_dir is not None:
            self.data_dir = local_path(self.data_dir, base, force=True)
        if isinstance(self.data_files, str):
            self.data_files = local_path(self.data_files, base, force=True)
        elif isinstance(self.data_files, list):
            self.data_files = [local_path(f, base, force=True) for f in self.data_files]
        elif isinstance(self.data_files, dict):
            self.data_files = {
                k: local_path(v, base, force=True)
                if isinstance(v, str)
                else [local_path(f, base, force=True) for f in v]
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
