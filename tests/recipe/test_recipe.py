"""Recipe schema v1: valid recipes parse with defaults, every bad input is a RecipeError that teaches."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_rebasin.alignment.strategies import REGISTRY
from hf_rebasin.alignment.strategies.generalized_orthogonal import GeneralizedOrthogonalOptions
from hf_rebasin.alignment.strategies.head_perm import HeadPermOptions
from hf_rebasin.core.errors import RebasinUserError
from hf_rebasin.recipe import Recipe, RecipeError, load_recipe, loads_recipe, parse_recipe, recipe_json_schema
from hf_rebasin.recipe.describe import describe
from hf_rebasin.recipe.jobs import JOBS

MERGE = """\
job: merge
models:
  - model: org/bert-seed1
    revision: main
  - ./local/bert-seed2
strategy:
  name: head-perm
  residual: first
data:
  dataset: text
  data_files: books.txt
  column: text
  max_tokens: 1000
merge:
  weight: 0.25
output:
  dir: out/bert-merge
"""

BARRIER = """\
job: barrier
models: [org/a, org/b]
strategy:
  name: weight-matching
  max_iter: 5
evaluate:
  task: masked-lm
  data: {dataset: text, data_files: wiki.txt, split: train, column: text}
  points: 5
  compare: [vanilla, transfusion]
output:
  dir: /abs/out
  overwrite: true
  push_to_hub: {repo: user/bert-merge, private: true}
device: cuda:1
"""


def write(folder: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def problems(text: str, tmp_path: Path) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text))
    err = info.value
    assert isinstance(err, RebasinUserError) and isinstance(err, ValueError)
    assert str(tmp_path / "recipe.yaml") in str(err)
    assert "errors.pydantic.dev" not in str(err) and "Traceback" not in str(err)
    return err


def paths(err: RecipeError) -> list[str]:
    return [p.path for p in err.problems]


# ---------------------------------------------------------------------------------------------
# Valid recipes


def test_merge_recipe_parses_with_defaults_and_resolved_paths(tmp_path: Path) -> None:
    (tmp_path / "org").mkdir()  # a folder "org" beside the recipe must not turn org/bert-seed1 local
    recipe = load_recipe(write(tmp_path, MERGE))
    assert recipe.version == 1 and recipe.job == "merge"
    assert recipe.models[0].model == "org/bert-seed1" and recipe.models[0].revision == "main"
    assert not recipe.models[0].is_local
    assert recipe.models[1].model == str(tmp_path / "local" / "bert-seed2") and recipe.models[1].revision is None
    assert recipe.models[1].is_local
    assert recipe.strategy.name == "head-perm"
    opts = recipe.strategy.options
    assert isinstance(opts, HeadPermOptions)
    assert opts == HeadPermOptions(residual="first")  # the rest are the strategy's defaults
    assert recipe.strategy.needs_data
    assert recipe.data is not None
    assert recipe.data.data_files == str(tmp_path / "books.txt") and recipe.data.split == "train"
    assert recipe.data.load_kwargs() == {"path": "text", "split": "train", "data_files": str(tmp_path / "books.txt")}
    assert recipe.merge.weight == 0.25 and recipe.merge.weights(2) == [0.25, 0.75]
    assert recipe.evaluate is None
    assert recipe.output.dir == tmp_path / "out" / "bert-merge"
    assert recipe.output.overwrite is False and recipe.output.push_to_hub is None
    assert (recipe.allow_pickle, recipe.trust_remote_code, recipe.device) == (False, False, "auto")
    assert recipe.source == str(tmp_path / "recipe.yaml")


def test_hub_id_with_a_local_folder_of_that_name_is_local(tmp_path: Path) -> None:
    (tmp_path / "org" / "bert-seed1").mkdir(parents=True)
    recipe = load_recipe(write(tmp_path, MERGE))
    assert recipe.models[0].model == str(tmp_path / "org" / "bert-seed1")


def test_barrier_recipe_parses(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, BARRIER))
    assert recipe.job == "barrier" and [m.model for m in recipe.models] == ["org/a", "org/b"]
    assert recipe.strategy.options.model_dump() == {"max_iter": 5, "seed": 0, "residual_maps": "global", "glu": "keep"}
    assert not recipe.strategy.needs_data and recipe.data is None
    ev = recipe.evaluate
    assert ev is not None and ev.task == "masked-lm" and ev.points == 5
    assert ev.compare == ["vanilla", "transfusion"] and ev.batch_size == 8 and ev.seed == 0
    assert ev.data.data_files == str(tmp_path / "wiki.txt") and ev.data.column == "text"
    assert recipe.output.dir == Path("/abs/out") and recipe.output.overwrite
    push = recipe.output.push_to_hub
    assert push is not None and push.repo == "user/bert-merge" and push.private is True and push.revision is None
    assert recipe.device == "cuda:1"


def test_shorthands_and_multi_model_weights(tmp_path: Path) -> None:
    data = {
        "version": 1,
        "job": "merge",
        "models": ["org/a", {"model": "org/b", "revision": "v2"}, "org/c"],
        "strategy": "vanilla",
        "merge": {"weight": [0.5, 0.25, 0.25]},
        "output": {"dir": "out"},
    }
    recipe = parse_recipe(data, "inline", tmp_path)
    assert recipe.strategy.name == "vanilla" and str(recipe.models[1]) == "org/b@v2"
    assert recipe.merge.weights(3) == [0.5, 0.25, 0.25]
    assert parse_recipe({**data, "merge": {"weight": 0.4}}, "inline", tmp_path).merge.weights(3) == pytest.approx(
        [0.4, 0.3, 0.3]
    )


def test_seq2seq_pairs_name_both_columns_or_neither(tmp_path: Path) -> None:
    data = yaml.safe_load(BARRIER)
    pairs = {"dataset": "json", "data_files": "pairs.jsonl", "source_column": "en", "target_column": "fr"}
    data["evaluate"] = {"task": "seq2seq", "data": pairs}
    ev = parse_recipe(data, "inline", tmp_path).evaluate
    assert ev is not None and (ev.data.source_column, ev.data.target_column) == ("en", "fr")
    del pairs["target_column"]
    with pytest.raises(RecipeError, match="`source_column` pairs with `target_column`") as info:
        parse_recipe(data, "inline", tmp_path)
    assert paths(info.value) == ["evaluate.data.target_column"]


def test_speech_pairs_read_audio_in_place_of_a_source_column(tmp_path: Path) -> None:
    data = yaml.safe_load(BARRIER)
    speech = {"dataset": "json", "data_files": "speech.jsonl", "audio_column": "wav", "target_column": "text"}
    data["evaluate"] = {"task": "seq2seq", "data": speech}
    ev = parse_recipe(data, "inline", tmp_path).evaluate
    assert ev is not None and (ev.data.audio_column, ev.data.target_column) == ("wav", "text")
    speech["source_column"] = "en"
    with pytest.raises(RecipeError, match="`audio_column` is the source of speech pairs") as info:
        parse_recipe(data, "inline", tmp_path)
    assert paths(info.value) == ["evaluate.data.source_column"]


def test_image_data_and_evaluation_budget(tmp_path: Path) -> None:
    data = yaml.safe_load(BARRIER)
    data["evaluate"] = {
        "task": "image-classification",
        "data": {"dataset": "imagefolder", "data_dir": "digits", "image_column": "img", "max_examples": 64},
    }
    ev = parse_recipe(data, "inline", tmp_path).evaluate
    assert ev is not None and ev.data.data_dir == str(tmp_path / "digits") and ev.data.image_column == "img"
    assert ev.max_examples == 64 and ev.points == 21 and ev.compare == ["vanilla"]
    data["evaluate"]["max_examples"] = 32
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, "inline", tmp_path)
    assert paths(info.value) == ["evaluate.max_examples"]


def test_hub_dataset_keeps_its_files_relative_to_the_repo(tmp_path: Path) -> None:
    data = yaml.safe_load(MERGE)
    data["data"] = {"dataset": "Salesforce/wikitext", "name": "wikitext-2-raw-v1", "data_files": "train/*.parquet"}
    recipe = parse_recipe(data, "inline", tmp_path)
    assert recipe.data is not None and recipe.data.dataset == "Salesforce/wikitext"
    assert recipe.data.data_files == "train/*.parquet"


def test_describe_lists_the_plan(tmp_path: Path) -> None:
    lines = describe(load_recipe(write(tmp_path, MERGE)))
    text = "\n".join(lines)
    assert "job: merge" in lines
    assert "  A (reference): org/bert-seed1 @ main (Hub)" in lines
    assert f"  B: {tmp_path / 'local' / 'bert-seed2'} (local folder, MISSING)" in lines
    assert "  components: [ff, attn, residual] (default)" in lines and "  special_tokens: true (default)" in lines
    assert "strategy: head-perm" in text and "  residual: first" in lines and "  heads: head-perm (default)" in lines
    assert "  needs alignment data: yes" in lines
    assert f"data_files={tmp_path / 'books.txt'}" in text and "MISSING" in text
    assert "merge: weights 0.25, 0.75 (reference first)" in lines
    assert "evaluate: no" in lines and f"output: {tmp_path / 'out' / 'bert-merge'}" in lines
    barrier = describe(load_recipe(write(tmp_path, BARRIER)))
    assert "  curves: weight-matching, vanilla, transfusion" in barrier
    assert "  push to hub: user/bert-merge@main (private)" in barrier
    assert not any(line.startswith("merge:") for line in barrier)


# ---------------------------------------------------------------------------------------------
# Errors


def test_unknown_top_level_key(tmp_path: Path) -> None:
    err = problems(MERGE + "strategyy: vanilla\n", tmp_path)
    assert paths(err) == ["strategyy"]
    assert err.problems[0].line == 18
    assert (
        "line 18" in str(err)
        and "did you mean `strategy`" in str(err)
        and "allowed: allow_different_tokenizers, allow_pickle" in str(err)
    )


def test_unknown_strategy_option_names_the_allowed_options(tmp_path: Path) -> None:
    err = problems(MERGE.replace("  residual: first\n", "  residual: first\n  max_iter: 3\n"), tmp_path)
    assert paths(err) == ["strategy.max_iter"] and err.problems[0].line == 9
    assert "not an option of strategy 'head-perm'" in str(err)
    assert "allowed: components, form, heads, name, qk, residual, special_tokens" in str(err)


def test_nested_options_key_is_explained(tmp_path: Path) -> None:
    err = problems(MERGE.replace("  residual: first\n", "  options: {residual: first}\n"), tmp_path)
    assert paths(err) == ["strategy.options"] and "directly under `strategy`" in str(err)


def test_bad_strategy_value_lists_allowed_values(tmp_path: Path) -> None:
    err = problems(MERGE.replace("residual: first", "residual: middle"), tmp_path)
    assert paths(err) == ["strategy.residual"] and err.problems[0].line == 8
    assert "'identity', 'first', 'last', 'all', 'separate'" in str(err) and "given 'middle'" in str(err)


def test_unknown_strategy_name(tmp_path: Path) -> None:
    err = problems(MERGE.replace("name: head-perm", "name: git-rebasin"), tmp_path)
    assert paths(err) == ["strategy.name"] and err.problems[0].line == 7
    assert all(name in str(err) for name in REGISTRY.names)


def test_wrong_types(tmp_path: Path) -> None:
    text = MERGE.replace("max_tokens: 1000", "max_tokens: lots").replace("revision: main", "revision: [main]")
    err = problems(text, tmp_path)
    assert sorted(paths(err)) == ["data.max_tokens", "models.0.revision"]
    lines = {p.path: p.line for p in err.problems}
    assert lines == {"models.0.revision": 4, "data.max_tokens": 13}
    assert "given 'lots'" in str(err) and "valid integer" in str(err)


def test_bad_enum_values(tmp_path: Path) -> None:
    err = problems(BARRIER.replace("task: masked-lm", "task: mlm").replace("device: cuda:1", "device: gpu"), tmp_path)
    assert sorted(paths(err)) == ["device", "evaluate.task"]
    assert "'causal-lm', 'masked-lm', 'sequence-classification', 'image-classification'" in str(err)
    assert "auto, cpu, cuda, cuda:N" in str(err)


def test_bad_compare_entry_lists_strategies(tmp_path: Path) -> None:
    err = problems(BARRIER.replace("[vanilla, transfusion]", "[vanilla, averaging]"), tmp_path)
    assert paths(err) == ["evaluate.compare.1"] and err.problems[0].line == 10
    assert "'weight-matching'" in str(err) and "given 'averaging'" in str(err)


def test_barrier_needs_evaluate(tmp_path: Path) -> None:
    err = problems(MERGE.replace("job: merge", "job: barrier"), tmp_path)
    assert paths(err) == ["evaluate"] and "job: barrier needs an `evaluate:` section" in str(err)


def test_head_perm_needs_data(tmp_path: Path) -> None:
    text = MERGE.split("data:")[0] + "output:\n  dir: out\n"
    err = problems(text, tmp_path)
    assert paths(err) == ["data"] and "strategy 'head-perm' with residual: first needs alignment data" in str(err)


def test_learned_needs_data_but_plain_generalized_orthogonal_does_not(tmp_path: Path) -> None:
    base = "job: merge\nmodels: [org/a, org/b]\nstrategy:\n  name: generalized-orthogonal\n{extra}output: {{dir: o}}\n"
    recipe = load_recipe(write(tmp_path, base.format(extra="")))
    assert isinstance(recipe.strategy.options, GeneralizedOrthogonalOptions) and not recipe.strategy.needs_data
    err = problems(base.format(extra="  learned: true\n"), tmp_path)
    assert paths(err) == ["data"] and "with learned: true needs" in str(err)


def test_compare_curve_that_needs_data(tmp_path: Path) -> None:
    err = problems(BARRIER.replace("[vanilla, transfusion]", "[head-perm]"), tmp_path)
    assert paths(err) == ["evaluate.compare.0"] and "strategy 'head-perm' needs alignment data" in str(err)


def test_weight_list_length_and_sum(tmp_path: Path) -> None:
    err = problems(MERGE.replace("weight: 0.25", "weight: [0.5, 0.25, 0.25]"), tmp_path)
    assert paths(err) == ["merge.weight"] and err.problems[0].line == 15 and "3 weights for 2 models" in str(err)
    err = problems(MERGE.replace("weight: 0.25", "weight: [0.5, 0.6]"), tmp_path)
    assert paths(err) == ["merge.weight"] and "sum to 1" in str(err)
    err = problems(MERGE.replace("weight: 0.25", "weight: 1.5"), tmp_path)
    assert paths(err) == ["merge.weight"] and "[0, 1]" in str(err)


def test_missing_keys_and_the_text_builder_without_files(tmp_path: Path) -> None:
    text = MERGE.replace("  dir: out/bert-merge\n", "  overwrite: true\n").replace("  data_files: books.txt\n", "")
    err = problems(text, tmp_path)
    assert sorted(paths(err)) == ["data.data_files", "output.dir"]
    by_path = {p.path: p for p in err.problems}
    assert by_path["output.dir"].line == 15 and "is required but missing" in by_path["output.dir"].message
    assert "`text` builder reads local files" in by_path["data.data_files"].message


def test_too_few_models_and_bad_entries(tmp_path: Path) -> None:
    err = problems(MERGE.replace("  - ./local/bert-seed2\n", ""), tmp_path)
    assert paths(err) == ["models"] and "at least two" in str(err)
    err = problems(MERGE.replace("  - ./local/bert-seed2\n", "  - 42\n"), tmp_path)
    assert paths(err) == ["models.1"] and err.problems[0].line == 5 and "Hub id or folder" in str(err)


TRANSPORT = """\
job: transport
base: org/a
finetuned: {model: org/a-ft, revision: v2}
target: org/b@main
alpha: [1.0, 0.5]
calibrate: false
evaluate:
  task: causal-lm
  data: {dataset: shakespeare, name: macbeth, split: test}
  support: {dataset: shakespeare, split: test}
output: {dir: o}
"""


def test_transport_recipe_defaults_to_generalized_orthogonal_and_lists_its_models(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, TRANSPORT))
    assert recipe.strategy.name == "generalized-orthogonal" and recipe.strategy.residual_maps == "global"
    assert recipe.alphas == [1.0, 0.5] and "models" not in type(recipe).model_fields
    assert [(where, str(ref)) for where, ref in recipe.refs] == [
        ("target.model", "org/b@main"),
        ("base.model", "org/a"),
        ("finetuned.model", "org/a-ft@v2"),
    ]
    assert recipe.evaluate is not None and recipe.evaluate.support is not None
    plan = "\n".join(describe(recipe))
    assert "target B (reference): org/b @ main" in plan and "α = 1, 0.5" in plan and "support: shakespeare" in plan
    assert load_recipe(write(tmp_path, TRANSPORT.replace("alpha: [1.0, 0.5]\n", ""))).alphas == [1.0]


def test_transport_recipe_errors_name_the_field(tmp_path: Path) -> None:
    err = problems(TRANSPORT.replace("base: org/a\n", ""), tmp_path)
    assert paths(err) == ["base"] and "job: transport needs `base`" in str(err)
    err = problems(TRANSPORT.replace("base: org/a\n", "models: [org/a, org/b]\n"), tmp_path)
    assert sorted(paths(err)) == ["base", "models"] and "instead of `models`" in str(err)
    err = problems(TRANSPORT + "merge: {weight: 0.5}\n", tmp_path)
    assert paths(err) == ["merge"] and "`alpha`, not `merge.weight`" in str(err)
    err = problems(TRANSPORT.replace("alpha: [1.0, 0.5]", "alpha: lots"), tmp_path)
    assert paths(err) == ["alpha"]
    err = problems(MERGE + "alpha: 1.0\ntarget: org/b\n", tmp_path)
    assert sorted(paths(err)) == ["alpha", "target"] and "belongs to job: transport" in str(err)
    err = problems(MERGE.replace("job: merge", "job: distill"), tmp_path)
    assert paths(err) == ["job"] and ", ".join(f"'{job}'" for job in JOBS) in str(err)  # every job, by name
    assert {"merge", "barrier", "transport"} <= set(JOBS)


def test_wrong_version(tmp_path: Path) -> None:
    err = problems("version: 2\n" + MERGE, tmp_path)
    assert paths(err) == ["version"] and "must be one of 1" in str(err)


def test_missing_file_folder_and_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="does not exist") as info:
        load_recipe(tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in str(info.value)
    with pytest.raises(RecipeError, match="is a folder"):
        load_recipe(tmp_path)
    assert "this one is a list" in str(problems("- job: merge\n", tmp_path))
    assert "this one is empty" in str(problems("# nothing\n", tmp_path))


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    err = problems(MERGE.replace("  residual: first", "  residual: [first"), tmp_path)
    assert "YAML syntax error" in str(err) and err.problems[0].line is not None
    assert f"line {err.problems[0].line}" in str(err) and err.problems[0].line >= 8


def test_duplicate_keys_are_refused(tmp_path: Path) -> None:
    err = problems(MERGE + "job: barrier\n", tmp_path)
    assert paths(err) == ["job"] and err.problems[0].line == 18 and "first on line 1" in str(err)


# ---------------------------------------------------------------------------------------------
# JSON schema


def test_json_schema_lists_strategies_and_their_options(tmp_path: Path) -> None:
    schema = recipe_json_schema()
    text = yaml.safe_dump(schema)
    for name in REGISTRY.names:
        assert name in text
    assert schema["required"] == ["job"] and [v["$ref"] for v in schema["oneOf"]] == [
        f"#/$defs/{job.recipe.__name__}" for job in JOBS.values()
    ]
    head_perm = schema["$defs"]["HeadPermStrategy"]
    residual = head_perm["properties"]["residual"]  # unset (null): chosen from the models' size
    assert [c.get("enum") for c in residual["anyOf"]] == [["identity", "first", "last", "all", "separate"], None]
    assert residual["anyOf"][1] == {"type": "null"} and residual["default"] is None
    assert schema["$defs"]["TransportRecipe"]["properties"]["job"]["const"] == "transport"
    assert "models" not in schema["$defs"]["TransportRecipe"]["properties"]
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for text in (MERGE, BARRIER, TRANSPORT):
        validator.validate(yaml.safe_load(text))
    bad = yaml.safe_load(MERGE)
    bad["strategy"]["residual"] = "middle"
    assert not validator.is_valid(bad)
    bad["strategy"] = {"name": "weight-matching", "residual": "first"}  # residual is head-perm's option
    assert not validator.is_valid(bad)
    assert not validator.is_valid({**yaml.safe_load(TRANSPORT), "models": ["org/a", "org/b"]})  # not a transport's key
    assert not validator.is_valid({**yaml.safe_load(MERGE), "job": "distill"})


# ---------------------------------------------------------------------------------------------
# Fuzzing: mutations give a RecipeError or a valid Recipe, never another exception

WRONG = st.sampled_from(
    [None, 0, -1, 1.5, float("nan"), "", "x", "org/x", "../up", True, [], [1, "a"], {}, {"k": "v"}]
).map(copy.deepcopy)  # fresh containers: a shared {} would end up inside itself


def _locations(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            found += _locations(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _locations(v, (*path, i))
    return found


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    data = copy.deepcopy(yaml.safe_load(draw(st.sampled_from([MERGE, BARRIER]))))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(_locations(data)[1:]))
        parent = data
        for part in where[:-1]:
            parent = parent[part]
        action = draw(st.sampled_from(["drop", "wrong", "add"]))
        if action == "drop":
            del parent[where[-1]]
        elif action == "wrong":
            parent[where[-1]] = draw(WRONG)
        elif isinstance(parent[where[-1]], dict):
            parent[where[-1]][draw(st.sampled_from(["extra", "name", "options", "1"]))] = draw(WRONG)
        else:
            parent[where[-1]] = draw(WRONG)
    return data


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated())
def test_mutations_give_recipe_error_or_recipe(data: dict[str, Any], tmp_path: Path) -> None:
    for attempt in (lambda: parse_recipe(data, "fuzz", tmp_path), lambda: loads_recipe(yaml.safe_dump(data))):
        try:
            result = attempt()
        except RecipeError as e:
            assert e.problems and all(p.message for p in e.problems)
        else:
            assert isinstance(result, Recipe)
            describe(result)


# ---------------------------------------------------------------------------------------------
# Zoo models, built-in data, job shape


ZOO = """\
job: barrier
models: [zoo:gpt2-seed0, zoo:gpt2-seed1]
strategy: generalized-orthogonal
evaluate:
  task: causal-lm
  data: {dataset: shakespeare, split: test}
output: {dir: out}
"""


def test_zoo_models_and_builtin_data_parse(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, ZOO))
    assert [m.zoo for m in recipe.models] == [("gpt2", 0), ("gpt2", 1)]
    assert [m.source for m in recipe.models] == ["zoo", "zoo"]
    assert recipe.evaluate is not None and recipe.evaluate.data.dataset == "shakespeare"
    assert recipe.text == ZOO  # kept verbatim for the model card
    plan = "\n".join(describe(recipe))
    assert "zoo:gpt2-seed0 (zoo model" in plan and "shakespeare (built in)" in plan


def test_bad_zoo_reference_and_revision(tmp_path: Path) -> None:
    err = problems(ZOO.replace("zoo:gpt2-seed1", "zoo:roberta-seed1"), tmp_path)
    assert paths(err) == ["models.1.model"] and "zoo:KIND-seedN" in str(err) and "gpt2, vit" in str(err)
    err = problems(
        ZOO.replace("[zoo:gpt2-seed0, zoo:gpt2-seed1]", "[{model: zoo:gpt2-seed0, revision: v1}, zoo:vit-seed1]"),
        tmp_path,
    )
    assert paths(err) == ["models.0"] and "no revisions" in str(err)


def test_builtin_data_reads_no_files(tmp_path: Path) -> None:
    err = problems(ZOO.replace("split: test}", "split: test, data_files: x.txt}"), tmp_path)
    assert paths(err) == ["evaluate.data.data_files"] and "built-in data set" in str(err)


def test_barrier_with_three_models_names_the_line(tmp_path: Path) -> None:
    err = problems(ZOO.replace("zoo:gpt2-seed1]", "zoo:gpt2-seed1, zoo:gpt2-seed2]"), tmp_path)
    assert paths(err) == ["models"] and err.problems[0].line == 2 and "lists 3" in str(err)
