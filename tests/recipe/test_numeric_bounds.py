"""Every number a recipe holds has a lower and an upper bound and a strict type (issue 64).

The numeric fields come from the recipe's JSON Schema (`recipe_json_schema`, what `hf-rebasin
schema` prints), so a field added later is covered without a line here: first every one must
state both bounds in the schema, then, for each, an otherwise valid recipe with a value past a
bound, with the number as a string (``"64"``) and with ``true`` goes through the real CLI with
``--dry-run``; each must exit 2 with one problem, naming the field, before anything is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import flat, run_main
from hf_rebasin.recipe.jobs.merge import MergeRecipe
from hf_rebasin.recipe.loading import loads_recipe, recipe_json_schema
from hf_rebasin.recipe.problems import RecipeError

SCHEMA = recipe_json_schema()
DEFS: Mapping[str, Any] = SCHEMA["$defs"]
_BOUNDS = (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum"))

_DATA = {"dataset": "shakespeare"}
_EVALUATE = {"task": "causal-lm", "data": _DATA}
_MODELS = {"models": ["./a", "./b"], "data": _DATA}
BASES: dict[str, dict[str, Any]] = {  # an otherwise valid recipe of each job; its models need not exist
    "merge": {**_MODELS, "strategy": "vanilla", "evaluate": _EVALUATE},
    "barrier": {**_MODELS, "strategy": "vanilla", "evaluate": _EVALUATE},
    "align": {**_MODELS, "strategy": "weight-matching"},
    "lineage": _MODELS,
    "transport": {
        "base": "./a",
        "finetuned": "./b",
        "target": "./c",
        "data": _DATA,
        "evaluate": {**_EVALUATE, "support": _DATA},
        "calibrate": False,  # the data-free transport; a `calibrate.*` field under test replaces it with a mapping
    },
}

# keys a mapping needs beside the field under test, so that a value in range parses
COMPANIONS: dict[tuple[str, ...], dict[tuple[str, ...], Any]] = {
    ("alpha",): {("alpha", "auto"): True},  # `support_budget` belongs to `alpha: auto`
    ("evaluate", "support"): {("evaluate", "support", "dataset"): "shakespeare"},
    ("calibrate", "data"): {("calibrate", "data", "dataset"): "shakespeare"},
}
# strategy options that apply only beside another option
STRATEGY_COMPANIONS: dict[str, dict[tuple[str, ...], Any]] = {"generalized-orthogonal": {("strategy", "learned"): True}}


@dataclass(frozen=True)
class NumberField:
    """A numeric value of a recipe: its job, its keys (``[]`` for a list item), its schema, the
    constants (``job``, a strategy's ``name``) of the mappings on the way to it, and the models
    (``$defs``) it is validated by, the job's own first."""

    job: str
    keys: tuple[str, ...]
    node: Mapping[str, Any]
    consts: Mapping[tuple[str, ...], Any]
    via: tuple[str, ...]

    @property
    def path(self) -> str:
        """The field as the recipe's messages name it (a list item by its list)."""
        return ".".join(k for k in self.keys if k != "[]")

    @property
    def section(self) -> tuple[Any, ...]:
        """What validates the field: a section shared by several jobs (`data`, `strategy`) is one model."""
        named = tuple(sorted((k, v) for k, v in self.consts.items() if k != ("job",)))
        return self.keys, named, self.via[1:] or self.via

    def __str__(self) -> str:
        strategy = self.consts.get(("strategy", "name"))
        keys = ".".join(self.keys).replace(".[]", "[]")
        return f"{self.job}:{keys}" + (f" ({strategy})" if strategy else "")


_Found = tuple[tuple[str, ...], Mapping[str, Any], dict[tuple[str, ...], Any], tuple[str, ...]]


def _walk(
    node: Any, keys: tuple[str, ...], consts: dict[tuple[str, ...], Any], via: tuple[str, ...]
) -> Iterator[_Found]:
    """(keys, node, consts, via) of every numeric node under ``node``, through references and unions."""
    if not isinstance(node, Mapping):
        return
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        yield from _walk(DEFS[name], keys, consts, (*via, name))
    if node.get("type") in ("integer", "number"):
        yield keys, node, consts, via
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in node.get(key, []):
            yield from _walk(branch, keys, consts, via)
    if "items" in node:
        yield from _walk(node["items"], (*keys, "[]"), consts, via)
    props = node.get("properties", {})
    here = {
        (*keys, k): v["const"] for k, v in props.items() if isinstance(v, Mapping) and isinstance(v.get("const"), str)
    }
    for key, sub in props.items():
        if (*keys, key) not in here:
            yield from _walk(sub, (*keys, key), {**consts, **here}, via)


def numeric_fields() -> list[NumberField]:
    """Every numeric field of every job's recipe (a strategy's options once per strategy)."""
    found: dict[str, NumberField] = {}
    for variant in SCHEMA["oneOf"]:
        name = variant["$ref"].rsplit("/", 1)[-1]
        job = DEFS[name]["properties"]["job"]["const"]
        for keys, node, consts, via in _walk(DEFS[name], (), {}, (name,)):
            found.setdefault(str(NumberField(job, keys, node, consts, via)), NumberField(job, keys, node, consts, via))
    return list(found.values())


FIELDS = numeric_fields()


def _bound(node: Mapping[str, Any], names: tuple[str, str]) -> tuple[float, bool] | None:
    """(value, inclusive) of the lower or upper bound ``names`` of a schema node; a constant bounds both."""
    if "const" in node:
        return node["const"], True
    for name, inclusive in zip(names, (True, False), strict=True):
        if name in node:
            return node[name], inclusive
    return None


def test_every_numeric_field_has_both_bounds() -> None:
    """Fails for a numeric field added without `ge`/`gt` and `le`/`lt` (nothing would stop 2**40)."""
    assert len(FIELDS) > 100, len(FIELDS)
    unbounded = [str(f) for f in FIELDS if any(_bound(f.node, names) is None for names in _BOUNDS)]
    assert not unbounded, f"numeric recipe fields without a lower and an upper bound: {unbounded}"


def _past(field: NumberField) -> list[float]:
    """A value just past each bound of ``field`` (one it lacks fails the test above)."""
    low, high = (_bound(field.node, names) for names in _BOUNDS)
    step = 1 if field.node.get("type") == "integer" else 0.5
    below = [low[0] - step if low[1] else low[0]] if low is not None else []
    return [*below, *([high[0] + step if high[1] else high[0]] if high is not None else [])]


def _inside(field: NumberField) -> float:
    """A value inside the bounds of ``field`` (the strict types refuse it as a string)."""
    low, high = (_bound(field.node, names) for names in _BOUNDS)
    lo = low[0] if low is not None else high[0] - 2 if high is not None else 0
    hi = high[0] if high is not None else lo + 2
    middle = (lo + hi) / 2
    return int(middle) if field.node.get("type") == "integer" else middle


def _item(field: NumberField, value: Any) -> list[Any]:
    """``value`` as the item of a list (a merge's per-model weights: one per model, summing to 1)."""
    if field.keys[:-1] != ("merge", "weight"):
        return [value]
    return [value, 1 - value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.5]


def _companions(field: NumberField) -> dict[tuple[str, ...], Any]:
    """The constants on the way to ``field`` and the keys it needs beside it."""
    strategy = STRATEGY_COMPANIONS.get(field.consts.get(("strategy", "name"), ""), {})
    return {**field.consts, **COMPANIONS.get(field.keys[:-1], {}), **strategy}


def recipe_with(field: NumberField, value: Any) -> dict[str, Any]:
    """The job's base recipe with ``value`` at ``field`` (and the constants on its way)."""
    body: dict[str, Any] = json.loads(json.dumps({"job": field.job, **BASES[field.job], "output": {"dir": "out"}}))
    for key, const in sorted(_companions(field).items(), key=lambda kv: len(kv[0])):
        _put(body, key, const)
    keys = field.keys
    if keys[-1] == "[]":
        keys, value = keys[:-1], _item(field, value)
    _put(body, keys, value)
    return body


def _put(body: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    """``body[k0][k1]... = value``, a mapping made (or a shorthand such as `strategy: vanilla` replaced) on the way."""
    for key in keys[:-1]:
        if not isinstance(body.get(key), dict):
            body[key] = {}
        body = body[key]
    body[keys[-1]] = value


def _within(field: NumberField) -> list[float]:
    """A value inside the bounds of ``field``, and each bound that is allowed itself."""
    bounds = [_bound(field.node, names) for names in _BOUNDS]
    return [_inside(field), *(b[0] for b in bounds if b is not None and b[1])]


def _parses(field: NumberField, value: Any, base_dir: Path) -> bool:
    try:
        loads_recipe(yaml.safe_dump(recipe_with(field, value)), base_dir=base_dir)
    except RecipeError:
        return False
    return True


def distinct() -> list[NumberField]:
    """Each field once, for the CLI: a section that several jobs share is validated alike in each, so
    it is tried in the first job where a value in range is valid (`evaluate.support` in a transport)."""
    groups: dict[tuple[Any, ...], list[NumberField]] = {}
    for field in FIELDS:
        groups.setdefault(field.section, []).append(field)
    return [next((f for f in group if _parses(f, _inside(f), Path.cwd())), group[0]) for group in groups.values()]


DISTINCT = distinct()


@pytest.mark.parametrize("field", DISTINCT, ids=str)
def test_a_number_within_its_bounds_parses(tmp_path: Path, field: NumberField) -> None:
    """The control: the recipes below are valid but for the value (and the bounds are the schema's)."""
    for value in _within(field):
        loads_recipe(yaml.safe_dump(recipe_with(field, value)), base_dir=tmp_path)  # raises with the problem


def _refused(tmp_path: Path, field: NumberField, value: Any) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_with(field, value), sort_keys=False), encoding="utf-8")
    done = run_main(str(path), "--dry-run")
    err = flat(done.stderr)
    why = f"{field} = {value!r}: exit {done.returncode}\n{done.stderr[-2000:]}"
    assert done.returncode == 2, why
    assert err.startswith("error:") and "Traceback" not in done.stderr, why
    assert "(1 problem)" in err and f"`{field.path}" in err, why


@pytest.mark.parametrize("field", DISTINCT, ids=str)
def test_a_number_past_its_bound_or_of_another_type_is_refused(tmp_path: Path, field: NumberField) -> None:
    """Past either bound, as a string, as a boolean: exit 2, one problem, the field named."""
    for value in [*_past(field), str(_inside(field)), True]:
        _refused(tmp_path, field, value)


def test_exponent_floats_are_numbers_and_no_integers(tmp_path: Path) -> None:
    """`tol: 1e-3`, as the docs write it, is a number (YAML 1.2; PyYAML's 1.1 reads a string), and
    `max_tokens: 1e6` a float that an integer field refuses, saying what it was given."""
    text = "job: merge\nmodels: [./a, ./b]\nstrategy: vanilla\noutput: {dir: out}\n"
    recipe = loads_recipe(text + "merge: {universe: {tol: 1e-3}}\n", base_dir=tmp_path)
    assert isinstance(recipe, MergeRecipe) and recipe.merge.universe is not None
    assert recipe.merge.universe.tol == 0.001
    with pytest.raises(RecipeError) as refused:
        loads_recipe(text + "data: {dataset: shakespeare, max_tokens: 1e6}\n", base_dir=tmp_path)
    assert "`data.max_tokens`: must be a valid integer; given 1000000.0" in str(refused.value)
