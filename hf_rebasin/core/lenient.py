"""`Part`: a pydantic model for JSON that one version writes and any version reads back.

The base of every part of ``rebasin.json`` (`record`, `scores`). A part is built by keyword or,
like the dataclasses the record used to be, positionally in field order, and validated as usual.
`Part.to_json` is its JSON form (aliases applied; a key named in ``_omit_none`` only when set).
`Part.from_json` reads one back leniently, whatever version wrote it: a field that is missing,
null or does not validate takes its default, and keys the part does not declare are ignored
(kept, where its config allows extras). A required field that does not validate leaves the part
holding it unreadable: that part takes its own default in turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
)
from typing_extensions import Self

__all__ = ["Num", "Part", "reading"]

Num = float | None  # a number, written as null where it was not finite (NaN, ±inf)

_READING = ContextVar("_READING", default=False)


def reading() -> bool:
    """Whether a `Part.from_json` is under way (for validators that are lenient on read only)."""
    return _READING.get()


class Part(BaseModel):
    """A part of a JSON file; see the module docstring."""

    model_config = ConfigDict(populate_by_name=True, coerce_numbers_to_str=True)
    _omit_none: ClassVar[frozenset[str]] = frozenset()  # keys written only when not None

    def __init__(self, *args: Any, **data: Any) -> None:
        names = list(type(self).model_fields)
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
        super().__init__(**dict(zip(names, args, strict=False)), **data)

    @field_validator("*", mode="wrap")
    @classmethod
    def _lenient(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        field = cls.model_fields[str(info.field_name)]
        if not reading() or field.is_required():
            return handler(value)
        default = field.get_default(call_default_factory=True)
        if value is None:
            return default
        try:
            return handler(value)
        except ValidationError:  # a damaged file still reads
            return default

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None or k not in self._omit_none}

    def to_json(self) -> dict[str, Any]:
        """As written (before the writer turns NaN into null and sorts the keys)."""
        return self.model_dump(by_alias=True)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Self:
        """Read back, leniently."""
        token = _READING.set(True)
        try:
            return cls.model_validate(data or {})
        finally:
            _READING.reset(token)
