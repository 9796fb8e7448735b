"""Recipe problems that teach: every problem at once, each with the file, the dotted path
(``strategy.residual``), the line, what was given and what is allowed."""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from hf_rebasin.alignment.strategies import REGISTRY
from hf_rebasin.core.errors import RebasinUserError
from hf_rebasin.recipe.common import quoted, shown
from hf_rebasin.recipe.strategy import SECTIONS

__all__ = ["Lines", "Problem", "RecipeError", "problem_of"]

# error types raised by the sections' own checks: their message says it all
_OWN_ERRORS = frozenset({"model_ref", "data_files", "weight", "compare", "repo", "dir", "device", "size"})
# a number of the wrong type (strict: "64" and `true` are refused where a number belongs)
_NUMBER_TYPES = {"int_type": "a valid integer", "float_type": "a valid number", "int_from_float": "a valid integer"}


def _not_a_number(kind: str, value: Any) -> str:
    """Why ``value`` is not the number a field of type ``kind`` takes: a string (quotes, or a word) or a boolean."""
    why = (
        ", not a boolean"
        if isinstance(value, bool)
        else " (a number, without quotes)"
        if isinstance(value, str)
        else ""
    )
    return f"must be {_NUMBER_TYPES[kind]}{why}; given {shown(value)}"


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


# Errors


def _model_at(loc: tuple[str, ...], strategy: str | None, root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class that validates the mapping at ``loc`` of a recipe of model ``root`` (for
    listing its allowed keys)."""
    model: type[BaseModel] = root
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if model is root and part == "strategy":
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


def problem_of(err: Mapping[str, Any], lines: Lines, root: type[BaseModel]) -> Problem:
    """One pydantic error of a recipe of model ``root`` as a `Problem`: its path, line and a message that says what is allowed."""
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
    model = _model_at(loc[:-1], strategy, root) if loc else None
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
        message = f"must be one of {expected}; given {quoted(value)}"
    elif kind == "union_tag_invalid":
        path, line = f"{path}.name", lines.get((*loc, "name"), line)
        message = f"unknown strategy {quoted(ctx.get('tag'))}; allowed: {ctx.get('expected_tags', '')}"
        close = difflib.get_close_matches(str(ctx.get("tag")), REGISTRY.names, n=1)
        if close:
            message += f" (did you mean `{close[0]}`?)"
    elif kind == "union_tag_not_found":
        message = f"needs a `name`: one of {', '.join(REGISTRY.names)}"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        message = f"must be a mapping of keys{about}; given {quoted(value)}"
    elif kind in _NUMBER_TYPES:
        message = f"{_not_a_number(kind, value)}{about}"
    elif kind == "recipe":
        message = err["msg"]
    elif kind in _OWN_ERRORS:
        message = f"{err['msg']}; given {quoted(value)}"
    else:
        msg = str(err["msg"]).removeprefix("Value error, ")
        given = (
            "" if isinstance(value, Mapping) else f"; given {quoted(value)}"
        )  # a whole section: the message names the key
        message = f"{msg[:1].lower()}{msg[1:]}{given}{about}"
    return Problem(path, line, message)
