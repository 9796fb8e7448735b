"""The YAML recipe, schema v1: its sections, reading it, and problems that teach.

- `sections`: the pydantic models every job's recipe is built from (models, data, evaluation,
  output, the strategy section made from the strategy registry) and the bases of the jobs'
  recipe models (`RecipeBase`, `AlignedRecipe`);
- `problems`: `RecipeError` and how a pydantic error becomes a message (path, line, what is allowed);
- `loading`: YAML → the recipe model of its ``job`` (declared in `jobs`), and the JSON
  Schema of every job's recipe.

Importing this package imports no torch (nor transformers, datasets, scipy): validating a recipe
or printing its schema takes a fraction of a second (tests/test_imports.py keeps it so).
"""

from __future__ import annotations

from .loading import load_recipe, loads_recipe, parse_recipe, recipe_json_schema, strategy_spec
from .problems import Problem, RecipeError
from .sections import (
    AUTO_ALPHAS,
    DEFAULT_WEIGHT,
    MAX_ZOO_SEED,
    ZOO_PATTERN,
    AlignedRecipe,
    AutoAlpha,
    DataSpec,
    Evaluate,
    FineTuneRef,
    Merge,
    ModelRef,
    ModelsRecipe,
    Output,
    PushToHub,
    RecipeBase,
    StrategySpec,
    Universe,
)

# the recipe every run takes: each job's model is one (`jobs`)
Recipe = AlignedRecipe

__all__ = [
    "AUTO_ALPHAS",
    "DEFAULT_WEIGHT",
    "MAX_ZOO_SEED",
    "ZOO_PATTERN",
    "AlignedRecipe",
    "AutoAlpha",
    "DataSpec",
    "Evaluate",
    "FineTuneRef",
    "Merge",
    "ModelRef",
    "ModelsRecipe",
    "Output",
    "Problem",
    "PushToHub",
    "Recipe",
    "RecipeBase",
    "RecipeError",
    "StrategySpec",
    "Universe",
    "load_recipe",
    "loads_recipe",
    "parse_recipe",
    "recipe_json_schema",
    "strategy_spec",
]
