"""Reading a recipe: YAML text → the job's recipe model, with every problem at once.

`parse_recipe` reads ``job`` first and validates the rest with that job's own model
(``hf_rebasin.recipe.jobs``); keys that belong to another job are problems of their own. Loading imports no
torch (tests/test_imports.py keeps it so).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hf_rebasin.alignment.strategies import REGISTRY
from hf_rebasin.recipe.jobs import JOBS
from hf_rebasin.recipe.limits import YamlLimitError, load_limited, read_recipe_file
from hf_rebasin.recipe.problems import Lines, Problem, RecipeError, problem_of
from hf_rebasin.recipe.refs import MAX_ZOO_SEED
from hf_rebasin.recipe.sections import AlignedRecipe, RecipeBase
from hf_rebasin.recipe.strategy import StrategySection, StrategySpec

__all__ = ["load_recipe", "loads_recipe", "parse_recipe", "recipe_json_schema", "strategy_spec"]


def parse_recipe(data: Mapping[str, Any], source: str, base_dir: Path, *, lines: Lines | None = None) -> AlignedRecipe:
    """Validate an in-memory recipe with its job's model; relative paths resolve against ``base_dir``.

    ``lines`` maps dotted paths (as tuples of keys) to YAML line numbers, for error messages.
    """
    lines = lines or {}
    if not isinstance(data, Mapping):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise RecipeError(
            source, [Problem("", None, f"a recipe is a mapping of keys (job:, models:, ...); this one is {kind}")]
        )
    job = data.get("job")
    if not isinstance(job, str) or job not in JOBS:
        raise RecipeError(source, [_job_problem(job, lines)])
    model = JOBS[str(job)].recipe
    problems = [Problem(key, lines.get((key,)), why) for key, why in model.misplaced.items() if key in data]
    given = {k: v for k, v in data.items() if k not in model.misplaced}
    try:
        recipe = model.model_validate(given, context={"base_dir": Path(base_dir)})
    except ValidationError as e:
        problems += [problem_of(err, lines, model) for err in e.errors(include_url=False)]
    if problems:
        raise RecipeError(source, problems)
    recipe._source = source
    return recipe


def _job_problem(job: Any, lines: Lines) -> Problem:
    """A recipe without ``job``, or with one no job module declares."""
    allowed = ", ".join(f"'{name}'" for name in JOBS)
    if job is None:
        return Problem("job", None, f"is required but missing (what to do: one of {allowed})")
    message = f"must be one of {allowed}; given {job!r}"
    close = difflib.get_close_matches(str(job), list(JOBS), n=1)
    if close:
        message += f" (did you mean `{close[0]}`?)"
    return Problem("job", lines.get(("job",)), message)


def strategy_spec(name: str, options: Mapping[str, Any], given: Mapping[str, str] | None = None) -> StrategySpec:
    """A strategy and its options from the command line (``--strategy``, ``--set``), checked as a
    recipe's ``strategy:`` section is: a wrong name or option gets the same message (allowed
    values, "did you mean"), naming the option as it was typed (``given``: key -> ``--set`` item)."""
    from pydantic import TypeAdapter

    from hf_rebasin.core.errors import StrategyOptionError

    try:
        return TypeAdapter(StrategySection).validate_python({**options, "name": name})
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            problem = problem_of({**err, "loc": ("strategy", *err["loc"])}, {}, AlignedRecipe)
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


def loads_recipe(text: str, source: str = "<string>", base_dir: Path | None = None) -> AlignedRecipe:
    """Parse and validate recipe YAML text (``load_recipe`` without the file), within the limits
    of `hf_rebasin.recipe.limits` (size, nesting, values): a stranger's recipe costs milliseconds."""
    try:
        node, data = load_limited(text)
    except YamlLimitError as e:
        raise RecipeError(source, [Problem("", e.line, e.message)]) from None
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


def load_recipe(path: str | Path) -> AlignedRecipe:
    """Read a recipe file; relative paths inside it resolve against the file's folder. The file is
    checked before it is opened (a regular file of at most 1 MiB: `read_recipe_file`)."""
    path = Path(path)
    text = read_recipe_file(path)
    return loads_recipe(text, str(path), Path(os.path.realpath(path)).parent)


def recipe_json_schema() -> dict[str, Any]:
    """JSON Schema of recipe files, for editors: one schema per job, chosen by ``job``; strategy
    options are a union tagged by ``name``."""

    def ref(model: str) -> dict[str, Any]:
        """A model field: a string, or the mapping of its own model (``FineTuneRef`` has ``check_base``)."""
        text = f"Hub id[@revision], folder or zoo:KIND-seedN (N from 0 to {MAX_ZOO_SEED})"
        return {"anyOf": [{"type": "string", "description": text}, {"$ref": f"#/$defs/{model}"}]}

    defs: dict[str, Any] = {}
    variants = []
    for name in JOBS:
        job = JOBS[name]
        schema = job.recipe.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(schema.pop("$defs", {}))
        props = schema["properties"]
        required = {"job", *schema.get("required", [])}  # the models and an evaluation a job needs, too:
        if job.recipe.needs_evaluate is not None:  # their defaults (null) only make the error message theirs
            required.add("evaluate")
        for key, field in job.recipe.model_fields.items():
            annotation = str(field.annotation)
            model = "FineTuneRef" if "FineTuneRef" in annotation else "ModelRef" if "ModelRef" in annotation else None
            if model is None:
                continue
            required.add(key)
            if "list" in annotation:
                props[key] = {k: v for k, v in props[key].items() if k not in ("anyOf", "default")}
                props[key].update(type="array", items=ref(model), minItems=getattr(job.recipe, "min_models", 1))
            else:
                props[key] = {k: v for k, v in props[key].items() if k not in ("anyOf", "default", "$ref")} | ref(model)
        if "strategy" in props:
            props["strategy"] = {"anyOf": [{"type": "string", "enum": REGISTRY.names}, props["strategy"]]}
        props["job"] = {"const": name, "type": "string", "description": job.summary}
        for key in job.recipe.misplaced:  # another job's key: refused with its own message
            props.pop(key, None)
        if job.recipe.default_strategy is None:
            props["strategy"].pop("default", None)
            required.add("strategy")
        else:
            props["strategy"]["default"] = {"name": job.recipe.default_strategy}
        shared = [*AlignedRecipe.model_fields, *RecipeBase.model_fields]
        first = ["version", "job", *(k for k in props if k not in shared), "strategy", "data", "evaluate"]
        schema["properties"] = {k: props[k] for k in dict.fromkeys([*first, *props]) if k in props}
        schema["required"] = sorted(required)
        title = schema["title"]
        defs[title] = schema
        variants.append({"$ref": f"#/$defs/{title}"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "hf-rebasin recipe (schema v1)",
        "description": "One schema per job, chosen by `job`.",
        "type": "object",
        "required": ["job"],
        "oneOf": variants,
        "discriminator": {"propertyName": "job"},  # an annotation (OpenAPI's): each variant's `job` is a const
        "$defs": dict(sorted(defs.items())),
    }
