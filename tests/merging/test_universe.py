"""Universe merging (``merge.universe``): every model aligned to an evolving mean, averaged, repeated.

Exactness: three noisy copies of one model under random allowed transforms merge back into that
model, and every model's map into the merge's basis keeps its function. Trained models: the universe
merge of three tiny GPT-2 trained from different seeds beats their plain average. Then the recipe
section, its plan, and a whole run through the CLI.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml
from test_strategies import _text_data

import tiny
from helpers import flat, run_main
from hf_rebasin.alignment.verify import example_inputs
from hf_rebasin.core.errors import MissingDataError, StrategyOptionError
from hf_rebasin.evaluation import data as builtin_data
from hf_rebasin.evaluation.evaluate import evaluate_loss
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.io.models import load_model
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.interpolate import merge_state_dicts
from hf_rebasin.merging.universe import UniverseResult, universe_merge
from hf_rebasin.recipe import RecipeError, Universe, load_recipe, loads_recipe, parse_recipe, recipe_json_schema
from hf_rebasin.recipe.describe import describe
from hf_rebasin.run import plan
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.canonical import canonicalize, is_canonical

TOL = 1e-4  # max |Δ logits| of a function-preserving map, float32
THIRDS = [1 / 3, 1 / 3, 1 / 3]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the zoo trains: the many small SVDs and LAPs of a universe merge run
    ten times slower or worse when OpenMP threads spin on a shared CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------
# Exactness on tiny random models


def _noisy(sd: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.numel() > 1 else v
        for k, v in sd.items()
    }


def _copies(case: str, transform_class: str, n: int = 3, noise: float = 1e-3) -> tuple[Any, list[Any]]:
    """(the original model, n live models that are noisy random allowed transforms of it).

    Permutations act on the model as it is (a tied head stays tied); orthogonal maps on its canonical
    form, so those copies are canonical models (γ = 1, untied).
    """
    base = tiny.FACTORIES[case](0)
    sd = base.state_dict()
    graph = graph_for(base.config, sd.keys())
    untied: list[str] = []
    if transform_class == "orthogonal":
        sd, graph, untied = canonicalize(graph, sd)
    models = []
    for k in range(n):
        moved = graph.apply(sd, graph.random_transform(transform_class, torch.Generator().manual_seed(10 + k)))
        noisy = _noisy(moved, noise, seed=100 + k)
        for alias, source in graph.ties.items():  # noise must not break a tie
            noisy[alias] = noisy[source]
        models.append(rebuild(base, noisy, untie=bool(untied)))
    return base, models


def _logits(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**inputs).logits.float()


def _check_maps_preserve_function(models: list[Any], result: UniverseResult, inputs: dict[str, torch.Tensor]) -> None:
    """Every model's map into the merge's basis leaves its outputs unchanged, and refers to the merge."""
    assert len(result.alignments) == len(models)
    for model, al in zip(models, result.alignments, strict=True):
        assert al.exact and al.sd_a is result.merged
        rebuilt = rebuild(model, al.aligned_b(), untie=bool(al.untied))
        gap = (_logits(rebuilt, inputs) - _logits(model, inputs)).abs().max().item()
        assert gap <= TOL, gap


def _check_rounds(result: UniverseResult, iterations: int, tol: float) -> None:
    assert 1 <= result.rounds <= iterations and len(result.change) == result.rounds
    assert len(result.spread) == result.rounds + 1 and len(result.kept) == result.rounds
    assert result.converged == (result.change[-1] < tol)
    for before, after in zip(result.spread, result.spread[1:], strict=False):  # the spread never grows
        assert after <= before * (1 + 1e-9), result.spread


CASES = [  # (tiny model, transform class of the copies, strategy, options, rounds)
    ("gpt2", "permutation", "weight-matching", None, 4),
    ("gpt2", "permutation", "generalized-orthogonal", None, 4),
    ("llama-gqa", "orthogonal", "generalized-orthogonal", None, 4),
    ("gpt2", "permutation", "head-perm", {"residual": "all"}, 4),
    ("gpt2", "permutation", "generalized-orthogonal", {"learned": True, "steps": 3, "lr": 1e-3}, 1),
]


@pytest.mark.parametrize(
    ("case", "transform_class", "strategy", "options", "rounds"),
    CASES,
    ids=[f"{c[2]}{'-learned' if c[3] and 'learned' in c[3] else ''}-{c[0]}-{c[1]}" for c in CASES],
)
def test_universe_of_transformed_copies_recovers_the_model(case, transform_class, strategy, options, rounds):
    base, models = _copies(case, transform_class)
    graph = graph_for(models[0].config, models[0].state_dict().keys())
    stages: list[str] = []
    result = universe_merge(
        strategy,
        options,
        graph,
        [m.state_dict() for m in models],
        THIRDS,
        models=models,
        data=_text_data(),
        iterations=rounds,
        tol=1e-4,
        progress=lambda stage, _done, _total: stages.append(stage),
    )
    _check_rounds(result, rounds, 1e-4)
    # the copies differ by noise of 1e-3 only: the transforms were found (learned maps chase the loss
    # of the line between two models, not their distance, and may wander a little from it)
    assert result.spread[-1] < (1e-2 if options and options.get("learned") else 3e-3), result.spread
    inputs = example_inputs(get_adapter(base.config.model_type), base.config, torch.Generator().manual_seed(0))
    _check_maps_preserve_function(models, result, inputs)
    merged = rebuild(base, result.merged, untie=bool(result.untied))
    expected = _logits(base, inputs)
    assert (_logits(merged, inputs) - expected).abs().max().item() < 0.02 * expected.abs().max().item()
    assert "universe: reference alignment" in stages and "universe: round 1" in stages
    if options and options.get("learned"):  # then every map is refined together on Dirichlet weightings
        assert result.learned is not None and "Dirichlet" in result.learned["measure"]
        assert any(n.startswith("universe: learned matching") for n in result.notes)
    canonical = strategy == "generalized-orthogonal"
    assert result.canonical == canonical
    assert result.untied == (["lm_head.weight"] if canonical and case == "gpt2" else [])


def test_mean_of_canonical_models_is_canonical_and_canonicalize_leaves_it_alone():
    """The target of every round after the first is a mean of canonical forms: the strategy's own
    canonicalization of it must be a no-op (up to rounding), with the tied head reported untied."""
    _base, models = _copies("gpt2", "permutation")
    sd0 = models[0].state_dict()
    graph = graph_for(models[0].config, sd0.keys())
    result = universe_merge("generalized-orthogonal", None, graph, [m.state_dict() for m in models], THIRDS)
    mean = result.merged
    assert is_canonical(graph, mean)
    assert mean["lm_head.weight"].data_ptr() != mean["transformer.wte.weight"].data_ptr()  # untied
    again, cgraph, untied = canonicalize(graph, mean)
    assert untied == ["lm_head.weight"] and "lm_head.weight" not in cgraph.ties
    assert max((again[k].double() - mean[k].double()).abs().max().item() for k in mean) < 1e-6
    twice, _, _ = canonicalize(cgraph, again)
    assert max((twice[k].double() - again[k].double()).abs().max().item() for k in again) < 1e-6


def test_reference_merge_is_round_zero_and_initial_alignments_are_reused():
    _base, models = _copies("gpt2", "permutation")
    sds = [m.state_dict() for m in models]
    graph = graph_for(models[0].config, sds[0].keys())
    first = universe_merge("weight-matching", None, graph, sds, [0.5, 0.25, 0.25], iterations=0)
    assert first.rounds == 0 and first.change == [] and first.merged is first.reference
    assert any("no rounds" in n for n in first.notes)
    from hf_rebasin.alignment.strategies import Pair, align

    initial = [align("weight-matching", Pair(graph, sds[0], sd)) for sd in sds[1:]]
    reference = merge_state_dicts([sds[0], *(al.aligned_b() for al in initial)], [0.5, 0.25, 0.25])
    again = universe_merge("weight-matching", None, graph, sds, [0.5, 0.25, 0.25], initial=initial, iterations=2)
    assert all(torch.equal(again.reference[k], reference[k]) for k in reference)


def test_vanilla_universe_is_the_plain_average_and_converges_at_once():
    models = [tiny.gpt2(seed) for seed in range(3)]
    sds = [m.state_dict() for m in models]
    graph = graph_for(models[0].config, sds[0].keys())
    result = universe_merge("vanilla", None, graph, sds, THIRDS)
    plain = merge_state_dicts(sds, THIRDS)
    assert result.rounds == 1 and result.change == [0.0] and result.converged
    assert all(torch.equal(result.merged[k], plain[k]) for k in plain)


def test_bad_calls_are_refused():
    models = [tiny.gpt2(seed) for seed in range(3)]
    sds = [m.state_dict() for m in models]
    graph = graph_for(models[0].config, sds[0].keys())
    with pytest.raises(ValueError, match="2 weights for 3 models"):
        universe_merge("weight-matching", None, graph, sds, [0.5, 0.5])
    with pytest.raises(ValueError, match="at least two models"):
        universe_merge("weight-matching", None, graph, sds[:1], [1.0])
    with pytest.raises(StrategyOptionError, match=r"strategy\.iterations"):
        universe_merge("generalized-orthogonal", {"iterations": 0}, graph, sds, THIRDS)
    with pytest.raises(MissingDataError, match="data:"):  # activation-based strategies need data and models
        universe_merge("head-perm", None, graph, sds, THIRDS, models=models)


# ---------------------------------------------------------------------------------------------
# Trained models: the universe merge beats the plain three-way average


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three tiny GPT-2 (1 layer, d = 32) trained 200 steps on Hamlet from seeds 0, 1, 2 (~6 s)."""
    cfg = train.GPT2TrainConfig(
        steps=200,
        n_embd=32,
        n_layer=1,
        n_head=2,
        block_size=32,
        lr=1e-2,
        warmup=10,
        plays=("hamlet",),
        eval_tokens=4096,
    )
    root = tmp_path_factory.mktemp("universe-trained")
    return [train.train_tiny_gpt2(seed, root / f"seed{seed}", cfg) for seed in range(3)]


@pytest.mark.slow  # trains its models: with the other trained-model tests
def test_universe_of_three_trained_models_beats_their_plain_average(trained: list[Path]) -> None:
    loaded = [load_model(f) for f in trained]
    sds = [lm.model.state_dict() for lm in loaded]
    models = [lm.model for lm in loaded]
    template = models[0]
    batches = train.held_out_batches(trained[0])

    def loss(sd: dict[str, torch.Tensor], untie: bool = False) -> float:
        return evaluate_loss(rebuild(template, sd, untie=untie), batches, "causal-lm").loss

    vanilla = loss(merge_state_dicts(sds, THIRDS))
    rows = [f"vanilla three-way average: {vanilla:.4f} nats"]
    for strategy, rounds in (("weight-matching", 5), ("generalized-orthogonal", 3)):
        result = universe_merge(strategy, None, loaded[0].graph, sds, THIRDS, models=models, iterations=rounds)
        _check_rounds(result, rounds, 1e-4)
        untie = bool(result.untied)
        universe, reference = loss(result.merged, untie), loss(result.reference, untie)
        rows.append(
            f"{strategy}: reference {reference:.4f}, universe {universe:.4f} nats after {result.rounds} rounds "
            f"(spread {result.spread[0]:.4f} → {result.spread[-1]:.4f})"
        )
        assert universe < vanilla, rows
        assert result.spread[-1] < result.spread[0]  # the rounds brought the models closer together
    print("\n" + "\n".join(rows))


@pytest.mark.slow  # trains its models: with the other trained-model tests
def test_leave_one_out_escapes_the_pull_of_the_full_mean(trained: list[Path]) -> None:
    """Aligned to the mean of all, a model's own share pulls weight matching back to the map it has:
    the first round changes almost nothing (0 or a few units: 0.023 against 0.30 with transformers
    5.23). Aligned to the mean of the others it moves, and the spread drops."""
    loaded = [load_model(f) for f in trained]
    sds = [lm.model.state_dict() for lm in loaded]
    graph = loaded[0].graph
    full = universe_merge("weight-matching", None, graph, sds, THIRDS, leave_one_out=False)
    others = universe_merge("weight-matching", None, graph, sds, THIRDS, leave_one_out=True)
    assert full.change[-1] == 0.0 and full.spread[-1] == pytest.approx(full.spread[0], rel=0.01)
    assert full.change[0] < 0.2 * others.change[0]
    assert others.spread[-1] < others.spread[0] and others.spread[-1] < full.spread[-1]


# ---------------------------------------------------------------------------------------------
# The recipe section and its plan

RECIPE = """\
job: merge
models: [org/a, org/b, org/c]
strategy: weight-matching
merge:
  weight: [0.4, 0.3, 0.3]
  universe: {iterations: 3, tol: 0.001}
output: {dir: out}
"""


def _problems(text: str) -> list[tuple[str, str]]:
    with pytest.raises(RecipeError) as info:
        loads_recipe(text, "recipe.yaml")
    return [(p.path, p.message) for p in info.value.problems]


def test_universe_section_parses_with_defaults_and_shorthands(tmp_path: Path) -> None:
    recipe = loads_recipe(RECIPE, "recipe.yaml", tmp_path)
    assert recipe.merge.universe == Universe(iterations=3, tol=0.001, leave_one_out=True)
    assert recipe.merge.weights(3) == [0.4, 0.3, 0.3]
    on = loads_recipe(RECIPE.replace("{iterations: 3, tol: 0.001}", "true"), "recipe.yaml", tmp_path)
    assert on.merge.universe == Universe()
    assert (on.merge.universe.iterations, on.merge.universe.tol, on.merge.universe.leave_one_out) == (5, 1e-4, True)
    for off in ("false", "null"):
        assert loads_recipe(RECIPE.replace("{iterations: 3, tol: 0.001}", off), "r", tmp_path).merge.universe is None
    assert loads_recipe(RECIPE.replace("  universe: {iterations: 3, tol: 0.001}\n", ""), "r").merge.universe is None
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(recipe_json_schema())
    for value in (True, {"iterations": 3}):
        validator.validate({**yaml.safe_load(RECIPE), "merge": {"universe": value}})
    assert not validator.is_valid({**yaml.safe_load(RECIPE), "merge": {"universe": {"rounds": 3}}})


@pytest.mark.parametrize(
    ("value", "path", "needle"),
    [
        ("{iterations: 0}", "merge.universe.iterations", "greater than or equal to 1"),
        ("{iters: 3}", "merge.universe.iters", "allowed: iterations, leave_one_out, tol (did you mean `iterations`?)"),
        ("{tol: -1}", "merge.universe.tol", "greater than or equal to 0"),
        ("{tol: .nan}", "merge.universe.tol", "finite"),
        ("{leave_one_out: maybe}", "merge.universe.leave_one_out", "bool"),
        ("3", "merge.universe", "must be true, false, or a mapping"),
        ("[3]", "merge.universe", "given [3]"),
    ],
)
def test_bad_universe_settings_name_the_field(value: str, path: str, needle: str) -> None:
    problems = _problems(RECIPE.replace("{iterations: 3, tol: 0.001}", value))
    assert [p for p, _ in problems] == [path], problems
    assert needle in problems[0][1], problems


def test_universe_belongs_to_job_merge() -> None:
    barrier = RECIPE.replace("job: merge", "job: barrier").replace("[org/a, org/b, org/c]", "[org/a, org/b]")
    barrier = barrier.replace("[0.4, 0.3, 0.3]", "0.5") + "evaluate: {task: causal-lm, data: {dataset: shakespeare}}\n"
    problems = _problems(barrier)
    assert [p for p, _ in problems] == ["merge.universe"]
    assert "belongs to job: merge" in problems[0][1]


def test_plan_describes_the_universe_and_the_two_model_case(tmp_path: Path) -> None:
    lines = describe(loads_recipe(RECIPE, "recipe.yaml", tmp_path))
    at = lines.index("merge: weights 0.4, 0.3, 0.3 (reference first)")
    assert lines[at + 1].startswith(
        "  universe: from the reference merge, realign every model to the mean of the others"
    )
    assert "at most 3 rounds" in lines[at + 1] and "less than 0.001" in lines[at + 1]
    assert not any("two models" in line for line in lines)
    data = yaml.safe_load(RECIPE)
    data.update(models=["org/a", "org/b"], merge={"weight": 0.5, "universe": {"leave_one_out": False}})
    two = describe(parse_recipe(data, "inline", tmp_path))
    assert any("realign every model to the mean of all, average, repeat" in line for line in two)
    assert any("with two models there is no third" in line for line in two)
    data.update(strategy="vanilla")
    assert any("vanilla aligns nothing" in line for line in describe(parse_recipe(data, "inline", tmp_path)))


# ---------------------------------------------------------------------------------------------
# A whole run through the CLI


def test_cli_runs_a_three_model_universe_merge(tmp_path: Path) -> None:
    text = builtin_data.shakespeare_text(["hamlet"])[:3000].lower()
    tok = builtin_data.char_tokenizer(text)
    assert len(tok) <= tiny.V
    for seed in range(3):
        tiny.gpt2(seed).save_pretrained(str(tmp_path / f"gpt2-{seed}"))
        tok.save_pretrained(str(tmp_path / f"gpt2-{seed}"))
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    body = {
        "job": "merge",
        "models": [f"./gpt2-{seed}" for seed in range(3)],
        "strategy": {"name": "generalized-orthogonal", "iterations": 2},
        "merge": {"universe": {"iterations": 2}},
        "evaluate": {
            "task": "causal-lm",
            "data": {"dataset": "text", "data_files": "corpus.txt"},
            "points": 3,
            "max_tokens": 400,
        },
        "output": {"dir": "merged"},
    }
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds-cache"), "OMP_NUM_THREADS": "1"}

    lines = plan(load_recipe(recipe))
    assert any(line.startswith("  universe: from the reference merge") for line in lines)
    assert not (tmp_path / "merged").exists()

    proc = run_main(str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "merged"
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    universe = record["universe"]
    assert 1 <= universe["rounds"] <= 2 and len(universe["change"]) == universe["rounds"]
    assert len(universe["spread"]) == universe["rounds"] + 1 and isinstance(universe["converged"], bool)
    assert set(record["merged"]) == {"generalized-orthogonal", "vanilla"}
    assert set(universe["reference"]) == {"loss", "metric", "count"}
    assert record["merge_weights"] == [0.5, 0.25, 0.25]  # λ = 0.5 on A by default, the rest shared
    assert record["function_preserved"]["max_abs_diff"] < TOL  # models 1, 2 to A and all three to the mean
    assert set(record["curves"]) == {"generalized-orthogonal", "vanilla"}  # curves stay between A and B
    assert any(n.startswith("universe: loss") for n in record["notes"])
    stdout = flat(proc.stdout)
    assert "universe: loss" in stdout and "the reference merge" in stdout
    assert "universe: loss" in (out / "README.md").read_text(encoding="utf-8")

    # the saved model is the universe merge (canonical, untied), not the reference merge
    merged = T.GPT2LMHeadModel.from_pretrained(str(out))
    assert merged.config.tie_word_embeddings is False and record["untied"] == ["lm_head.weight"]
    loaded = [load_model(tmp_path / f"gpt2-{seed}") for seed in range(3)]
    expected = universe_merge(
        "generalized-orthogonal",
        {"iterations": 2},
        loaded[0].graph,
        [lm.model.state_dict() for lm in loaded],
        [0.5, 0.25, 0.25],
        iterations=2,
    )
    saved = merged.state_dict()
    assert max((saved[k] - v).abs().max().item() for k, v in expected.merged.items()) < 1e-6
    assert max((saved[k] - v).abs().max().item() for k, v in expected.reference.items()) > 1e-3
