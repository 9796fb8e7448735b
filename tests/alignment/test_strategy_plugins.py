"""A strategy is a plug-in: registered from outside the package, it is run, cached, estimated and
refined by what its entry declares (`Strategy`'s capabilities), never by its name.

The two strategies here live in a package this file writes to a temporary folder (the way a third
party would ship one: `Strategy.module` a dotted name); nothing in hf_rebasin names them. Then every
registered strategy is checked to declare its capabilities consistently.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from pydantic import Field
from transformers import GPT2Config, GPT2LMHeadModel

from hf_rebasin.alignment import cache
from hf_rebasin.alignment.strategies import (
    REGISTRY,
    AlignmentData,
    MemoryProfile,
    Options,
    Pair,
    Strategy,
    StrategyRegistry,
    align,
    get_strategy,
)
from hf_rebasin.core.errors import StrategyOptionError
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.universe import universe_merge
from hf_rebasin.recipe import loads_recipe
from hf_rebasin.run import ResolvedModel, memory
from hf_rebasin.run.alignment_cache import RunCache
from hf_rebasin.symmetry.adapters import graph_for

PACKAGE = "rebasin_test_plugins"  # written to a temporary folder: outside hf_rebasin

SHUFFLE = '''
"""A seeded random permutation of every space: a useless strategy, but a function-preserving one."""

import torch

from hf_rebasin.alignment.strategies import Alignment, Refinement


def run(pair, options, progress):
    transform = pair.graph.random_transform("permutation", torch.Generator().manual_seed(options.seed))
    return Alignment("shuffle", pair.graph, pair.sd_a, pair.sd_b, transform, notes=[f"shuffled (seed {options.seed})"])


def refine_universe(maps, options, progress):
    history = {"measure": "nothing", "models": len(maps.state_dicts), "batches": len(maps.data.batches)}
    return Refinement(list(maps.transforms), ["the shuffle refinement kept every map"], history)
'''

IDENTITY_COPY = '''
"""Aligns nothing: every map the identity."""

from hf_rebasin.alignment.strategies import Alignment


def run(pair, options, progress):
    return Alignment("identity-copy", pair.graph, pair.sd_a, pair.sd_b, pair.graph.identity(), notes=[options.label])
'''


class ShuffleOptions(Options):
    seed: int = Field(0, description="seed of the permutations")
    refine: bool = Field(False, description="in a universe merge of 3+ models, refine every map together (data)")


class IdentityCopyOptions(Options):
    label: str = Field("a copy", description="a note the alignment carries")


def _refines(options: ShuffleOptions) -> bool:
    return options.refine


SHUFFLE_ENTRY = Strategy(
    name="shuffle",
    paper="none (a test plug-in)",
    options=ShuffleOptions,
    module=f"{PACKAGE}.shuffle",
    summary="data-free: a seeded random permutation of every space",
    needs_data=_refines,  # the refinement reads the alignment data…
    memory=MemoryProfile(assignment=False, learned=_refines),  # …and holds the models whole to do it
    universe_refinement=_refines,
)
IDENTITY_COPY_ENTRY = Strategy(
    name="identity-copy",
    paper="none (a test plug-in)",
    options=IdentityCopyOptions,
    module=f"{PACKAGE}.identity_copy",
    identity=True,
    memory=MemoryProfile(assignment=False),
)


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Strategy]]:
    """The plug-in package on ``sys.path`` and its two strategies in the registry, for this module."""
    root = tmp_path_factory.mktemp("plugins")
    (root / PACKAGE).mkdir()
    (root / PACKAGE / "__init__.py").write_text('"""Strategies from outside hf_rebasin."""\n', encoding="utf-8")
    (root / PACKAGE / "shuffle.py").write_text(SHUFFLE, encoding="utf-8")
    (root / PACKAGE / "identity_copy.py").write_text(IDENTITY_COPY, encoding="utf-8")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    entries = [SHUFFLE_ENTRY, IDENTITY_COPY_ENTRY]
    for entry in entries:
        REGISTRY.register(entry)
    yield entries
    for entry in entries:
        REGISTRY.unregister(entry.name)
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
        del sys.modules[name]


def _gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).eval()


def _data(seed: int = 0) -> AlignmentData:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    return AlignmentData([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])


def _pair(a: GPT2LMHeadModel, b: GPT2LMHeadModel, data: AlignmentData | None = None) -> Pair:
    graph = graph_for(a.config, a.state_dict().keys())
    return Pair(graph, a.state_dict(), b.state_dict(), a, b, data)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


# ---------------------------------------------------------------------------------------------
# A strategy from outside the package


def test_a_plugin_strategy_runs_through_the_library_api(plugins: list[Strategy]) -> None:
    a, b = _gpt2(0), _gpt2(1)
    assert get_strategy("shuffle") is SHUFFLE_ENTRY
    alignment = align("shuffle", _pair(a, b), {"seed": 3})
    assert alignment.notes == ["shuffled (seed 3)"]
    assert not all(m.is_identity() for m in alignment.transform.values())
    ids = _data().batches[0]["input_ids"]
    moved = rebuild(b, alignment.aligned_b())
    assert (_logits(moved, ids) - _logits(b, ids)).abs().max() < 1e-4  # a permutation: B's function kept
    assert align("identity-copy", _pair(a, b), {"label": "x"}).notes == ["x"]
    with pytest.raises(StrategyOptionError, match=r"strategy\.colour"):
        align("shuffle", _pair(a, b), {"colour": "red"})  # its own options model, `extra="forbid"`


def test_a_module_is_a_dotted_name_or_one_of_the_package(plugins: list[Strategy]) -> None:
    assert SHUFFLE_ENTRY.module_path == f"{PACKAGE}.shuffle"
    assert get_strategy("vanilla").module_path == "hf_rebasin.alignment.strategies.vanilla"
    registry = StrategyRegistry()
    registry.register(dataclasses.replace(SHUFFLE_ENTRY, name="other"))
    for module in (f"{PACKAGE}.missing", "no_such_package_anywhere.shuffle", f"{PACKAGE}..shuffle", "shuffle"):
        with pytest.raises(ValueError, match="names no module"):
            registry.register(dataclasses.replace(SHUFFLE_ENTRY, name="another", module=module))
    registry.unregister("other")
    assert registry.names == []


def test_identity_drives_the_cache_not_the_name(
    plugins: list[Strategy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setenv("HF_REBASIN_CACHE", str(tmp_path / "cache"))
    a, b = _gpt2(0), _gpt2(1)
    for name, model in (("a", a), ("b", b)):
        model.save_pretrained(tmp_path / name)
    models = [str(tmp_path / "a"), str(tmp_path / "b")]
    body = {"job": "merge", "models": models, "strategy": "weight-matching", "output": {"dir": str(tmp_path / "o")}}
    run = RunCache(loads_recipe(yaml.safe_dump(body)), tmp_path, [])  # a run with the cache on
    pair = _pair(a, b)
    reference = (ResolvedModel(tmp_path / "a"), LoadedModel(a, pair.graph, tmp_path / "a"))
    other = ResolvedModel(tmp_path / "b")
    assert run.use(reference, other, "identity-copy", None, label="B to A", batching=None) is None
    use = run.use(reference, other, "shuffle", {"seed": 2}, label="B to A", batching=None)
    assert use is not None  # not the identity: cached like any strategy
    alignment = align("shuffle", pair, {"seed": 2})
    use.write(alignment, pair)
    back = use.read(pair, "shuffle")
    assert back is not None and use.hit
    expected = alignment.aligned_b()
    assert all(torch.equal(t, expected[k]) for k, t in back.aligned_b().items())


def test_the_memory_estimate_follows_the_profile_not_the_name(
    plugins: list[Strategy], monkeypatch: pytest.MonkeyPatch
) -> None:
    fp = memory.ModelFootprint(
        params=10_000_000, nbytes=20_000_000, dtype="bfloat16", largest=2_000_000, width=2048, hidden=512, layers=8
    )
    monkeypatch.setattr(memory, "footprint", lambda _folder: fp)
    models: list[tuple[str, Path | None]] = [("A", Path("a")), ("B", Path("b"))]
    data = SimpleNamespace(max_tokens=1000)

    def estimate(entry: Strategy, *, streamed: bool, options: Any = None) -> memory.MemoryEstimate:
        REGISTRY.register(entry)
        try:
            spec = SimpleNamespace(name=entry.name, options=entry.parse(options))
            recipe: Any = SimpleNamespace(strategy=spec, data=data, evaluate=None)  # what the estimate reads
            return memory.estimate(recipe, models, streamed=streamed, available=64 * 2**30)
        finally:
            REGISTRY.unregister(entry.name)

    def peaks(entry: Strategy, options: Any = None) -> tuple[int, int]:
        whole, streamed = (estimate(entry, streamed=s, options=options).peak for s in (False, True))
        assert whole is not None and streamed is not None
        return whole, streamed

    f32, lap = 4 * fp.params, memory.LAP_COPIES * 8 * fp.width**2
    nothing = dataclasses.replace(IDENTITY_COPY_ENTRY, name="holds-nothing")
    whole, streamed = peaks(nothing)
    vanilla = dataclasses.replace(get_strategy("vanilla"), name="vanilla-again")  # vanilla's capabilities
    assert peaks(vanilla) == (whole, streamed)
    moved = dataclasses.replace(nothing, identity=False)  # the other model in A's basis
    assert peaks(moved) == (whole + f32, streamed)
    matching = dataclasses.replace(moved, memory=MemoryProfile())  # + the widest assignment problem
    assert peaks(matching) == (whole + f32 + lap, streamed + lap)
    canonical = dataclasses.replace(matching, canonical=True)  # + every model's canonical form
    assert peaks(canonical) == (whole + f32 + lap + 2 * f32, streamed + lap)
    stats = dataclasses.replace(matching, memory=MemoryProfile(statistics=lambda _o, shape: 1000 * shape.hidden))
    hidden_states, layer = 2 * 4 * 1000 * fp.hidden, 2 * 4 * fp.params // fp.layers  # then a layer at a time
    assert peaks(stats) == (whole + f32 + lap, streamed + lap + hidden_states + layer + 1000 * fp.hidden)
    learned = dataclasses.replace(SHUFFLE_ENTRY, name="shuffle-again")  # `refine`: whole models, gradients
    assert peaks(learned) == (whole + f32, streamed)
    refining = estimate(learned, streamed=False, options={"refine": True})
    assert refining.peak == whole + f32 + memory.LEARNED_COPIES * f32 and refining.learned_limit is not None


def test_the_universe_refinement_is_the_strategy_s_own(plugins: list[Strategy]) -> None:
    models = [_gpt2(seed) for seed in range(3)]
    graph = graph_for(models[0].config, models[0].state_dict().keys())
    sds = [m.state_dict() for m in models]

    def merge(options: dict[str, Any]) -> Any:
        return universe_merge("shuffle", options, graph, sds, [1 / 3] * 3, models=models, data=_data(), iterations=1)

    refined = merge({"refine": True})
    assert "universe: the shuffle refinement kept every map" in refined.notes
    assert refined.learned == {"measure": "nothing", "models": 3, "batches": 1}
    plain = merge({"refine": False})
    assert plain.learned is None and not any("refinement" in note for note in plain.notes)


# ---------------------------------------------------------------------------------------------
# Every registered strategy: capabilities declared consistently


def _literal_values(annotation: Any) -> list[Any]:
    if annotation is bool:
        return [True, False]
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return [v for arg in typing.get_args(annotation) for v in _literal_values(arg)]  # `X | None`


def _option_samples(strategy: Strategy) -> list[Any]:
    """The defaults, and every valid value of each boolean or choice option on its own."""
    samples = [strategy.parse(None)]
    for field, info in strategy.options.model_fields.items():
        for value in _literal_values(info.annotation):
            try:
                samples.append(strategy.parse({field: value}))
            except StrategyOptionError:
                pass  # a value that needs another option set too
    return samples


def check_capabilities(strategy: Strategy) -> None:
    """What the capabilities promise each other, for every sampled set of options."""
    shape = SimpleNamespace(params=10_000_000, width=2048, hidden=512, layers=8)
    for options in _option_samples(strategy):
        profile = strategy.memory
        # alignment data is read into activation statistics or learned on: the estimate counts either
        reads = profile.statistics is not None or profile.learned(options)
        assert bool(strategy.needs_data(options)) == reads, (strategy.name, options)
        if profile.statistics is not None:
            assert profile.statistics(options, shape) > 0
        if strategy.universe_refinement(options):  # runs on the data the run loads for it
            assert strategy.needs_data(options), (strategy.name, options)
        if strategy.identity:  # aligns nothing: nothing to hold, learn or refine, and exact
            assert profile == MemoryProfile(assignment=False) and not strategy.canonical
            assert strategy.exact(options) and not strategy.universe_refinement(options)


@pytest.mark.parametrize("name", REGISTRY.names)
def test_every_registered_strategy_declares_its_capabilities_consistently(name: str) -> None:
    check_capabilities(get_strategy(name))


def test_the_plugins_declare_theirs_consistently_too(plugins: list[Strategy]) -> None:
    for entry in plugins:
        check_capabilities(entry)


@pytest.mark.parametrize("name", REGISTRY.names)
def test_a_strategy_does_what_its_capabilities_say(name: str) -> None:
    """``identity``: every map the identity; ``canonical``: the alignment is in canonical form."""
    strategy = get_strategy(name)
    options = strategy.parse(None)
    alignment = strategy.run(_pair(_gpt2(0), _gpt2(1), _data()), options, None)
    assert alignment.canonical == strategy.canonical
    assert all(m.is_identity() for m in alignment.transform.values()) == strategy.identity
    assert alignment.exact == strategy.exact(options)


def _defaults(tree: ast.AST) -> set[int]:
    """ids of the nodes that are defaults, not tests: the value of a ``DEFAULT_*`` constant, a
    ``default=`` argument, or a pydantic ``Field``'s default (its first argument)."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.startswith("DEFAULT") for t in node.targets
        ):
            roots.append(node.value)
        elif isinstance(node, ast.Call):
            roots += [k.value for k in node.keywords if k.arg == "default"]
            if isinstance(node.func, ast.Name) and node.func.id == "Field" and node.args:
                roots.append(node.args[0])
    return {id(n) for root in roots for n in ast.walk(root)}


def test_no_module_outside_strategies_names_a_strategy() -> None:
    """Behaviour follows capabilities: outside strategies/, no code holds a strategy's name as a
    string (a comparison, a set of names, an ``align("vanilla", …)``), so a new strategy needs no
    edit there; defaults (a recipe's or the CLI's) are choices, not tests, and may name one. The plug-ins above are declared in this file alone."""
    package = Path(__file__).resolve().parents[2] / "hf_rebasin"
    names = set(REGISTRY.names)
    control = ast.parse('DEFAULT_S = "vanilla"\nf(default="vanilla")\nif name == "vanilla":\n    pass\n')
    caught = [n for n in ast.walk(control) if isinstance(n, ast.Constant) and id(n) not in _defaults(control)]
    assert [n.lineno for n in caught if n.value in names] == [3]  # the test is caught, the defaults are not
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where.startswith("alignment/strategies/"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defaults = _defaults(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in defaults:
                found.append(f"{where}:{node.lineno}: {node.value!r}")
    assert not found, "strategy names outside strategies/ (ask a capability instead):\n" + "\n".join(found)
