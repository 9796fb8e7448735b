"""The YAML recipe, schema v1: its sections, reading it, and problems that teach.

- the pydantic models every job's recipe is built from: `refs` (models), `data`, `weights` (merge
  weights, transport's α), `evaluate`, `output`, `strategy` (the section made from the strategy
  registry), what they share (`common`), and in `sections` the bases of the jobs' recipe models
  (`RecipeBase`, `ModelsRecipe`, `AlignedRecipe`);
- `problems`: `RecipeError` and how a pydantic error becomes a message (path, line, what is allowed);
- `loading`: YAML → the recipe model of its ``job`` (declared in `jobs`), and the JSON
  Schema of every job's recipe.

Importing this package imports no torch (nor transformers, datasets, scipy): validating a recipe
or printing its schema takes a fraction of a second (tests/test_imports.py keeps it so).
Imports the torch-free parts of the stages below it (names, the strategy registry, the zoo's
catalogue, the file gate); never the run or the CLI.
"""

from __future__ import annotations

from hf_rebasin.recipe.data import DataSpec
from hf_rebasin.recipe.evaluate import Evaluate
from hf_rebasin.recipe.loading import load_recipe, loads_recipe, parse_recipe, recipe_json_schema, strategy_spec
from hf_rebasin.recipe.output import Output, PushToHub
from hf_rebasin.recipe.problems import Problem, RecipeError
from hf_rebasin.recipe.refs import MAX_ZOO_SEED, ZOO_PATTERN, FineTuneRef, ModelRef
from hf_rebasin.recipe.sections import AlignedRecipe, ModelsRecipe, RecipeBase
from hf_rebasin.recipe.strategy import StrategySpec
from hf_rebasin.recipe.weights import AUTO_ALPHAS, DEFAULT_WEIGHT, AutoAlpha, Merge, Universe

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
