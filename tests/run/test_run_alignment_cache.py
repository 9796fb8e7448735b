"""The alignment cache as a run uses it (hf_rebasin.run.alignment_cache): keyed by the batching
the run actually used, so other batches never reuse an alignment computed on other data."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import tiny
from hf_rebasin.alignment import cache
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.recipe import loads_recipe
from hf_rebasin.run import ResolvedModel
from hf_rebasin.run.alignment_cache import RunCache
from hf_rebasin.run.data import BatchSpec
from hf_rebasin.symmetry.adapters import graph_for


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RunCache, LoadedModel, Path, BatchSpec]:
    """Two tiny GPT-2 folders, a head-perm recipe with alignment data, and the cache on."""
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setenv("HF_REBASIN_CACHE", str(tmp_path / "cache"))
    folders = []
    for seed in (0, 1):
        model = tiny.gpt2(seed)
        model.save_pretrained(tmp_path / f"m{seed}")
        folders.append(tmp_path / f"m{seed}")
    text = {
        "job": "merge",
        "models": [str(f) for f in folders],
        "strategy": {"name": "head-perm"},
        "data": {"dataset": "shakespeare", "name": "hamlet", "split": "test"},
        "evaluate": {"task": "causal-lm", "data": {"dataset": "shakespeare", "split": "test"}, "batch_size": 4},
        "output": {"dir": str(tmp_path / "out")},
    }
    recipe = loads_recipe(yaml.safe_dump(text))
    spec = BatchSpec.for_alignment(recipe, "causal-lm")
    assert spec is not None
    reference = LoadedModel(model, graph_for(model.config, model.state_dict().keys()), folders[0])
    return RunCache(recipe, tmp_path, []), reference, folders[1], spec


def test_the_alignment_batches_follow_evaluate() -> None:
    text = "job: merge\nmodels: [zoo:gpt2-seed0, zoo:gpt2-seed1]\nstrategy: weight-matching\noutput: {dir: out}\n"
    data = "data: {dataset: shakespeare, split: test, max_tokens: 256}\n"
    alone = BatchSpec.for_alignment(loads_recipe(text + data), "causal-lm")
    assert alone == BatchSpec("causal-lm", 8, 256, None, 0)  # no `evaluate`: its defaults
    assert BatchSpec.for_alignment(loads_recipe(text), "causal-lm") is None


def test_the_key_changes_with_the_batching(setup: tuple[RunCache, LoadedModel, Path, BatchSpec]) -> None:
    run, reference, other, spec = setup
    options = run.recipe.strategy.options

    def key(batching: BatchSpec) -> str:
        use = run.use((ResolvedModel(reference.path), reference), ResolvedModel(other), "head-perm", options,
                      label="B to A", batching=batching)  # fmt: skip
        assert use is not None
        return use.key

    first = key(spec)
    assert key(dataclasses.replace(spec)) == first
    assert key(dataclasses.replace(spec, batch_size=spec.batch_size * 2)) != first
    assert key(dataclasses.replace(spec, seed=1)) != first
    assert key(dataclasses.replace(spec, task="masked-lm")) != first


def test_off_and_data_free_identity_are_not_cached(
    setup: tuple[RunCache, LoadedModel, Path, BatchSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, reference, other, spec = setup
    args = ((ResolvedModel(reference.path), reference), ResolvedModel(other))
    assert run.use(*args, "vanilla", None, label="B to A", batching=spec) is None  # cheaper to rebuild
    monkeypatch.setenv(cache.NO_CACHE_ENV, "1")
    assert RunCache(run.recipe, run.base_dir, []).use(*args, "head-perm", None, label="B to A", batching=spec) is None
