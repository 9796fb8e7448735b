"""The alignment cache (hf_rebasin.alignment.cache): stable keys, exact round trips, misses instead of crashes,
and a recipe run twice that reads its alignments back and writes the same model."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

import tiny
from hf_rebasin.alignment import cache
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from hf_rebasin.recipe import load_recipe
from hf_rebasin.run import ResolvedModel, run_recipe
from hf_rebasin.symmetry.adapters import graph_for


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache on (conftest turns it off everywhere else), rooted in this test's folder."""
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setenv("HF_REBASIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "alignments"


def _pair(case: str, seeds: tuple[int, int] = (0, 1)) -> Pair:
    a, b = (tiny.FACTORIES[case](s) for s in seeds)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    return Pair(graph_for(a.config, sd_a.keys()), sd_a, sd_b, a, b)


def _entries(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []


# ---------------------------------------------------------------------------------------------
# Keys


def test_key_is_stable_and_changes_with_every_input(root: Path, tmp_path: Path, saved_model) -> None:
    a = ResolvedModel(saved_model("gpt2", seed=0))
    b = ResolvedModel(saved_model("gpt2", seed=1))
    c = ResolvedModel(saved_model("gpt2", seed=2))
    key = cache.alignment_key(a, b, "weight-matching")
    assert len(key) == 64 and int(key, 16) >= 0
    assert cache.alignment_key(a, b, "weight-matching", {"seed": 0, "max_iter": 100}) == key  # defaults filled in
    copy = ResolvedModel(Path(shutil.copytree(a.folder, tmp_path / "copy-of-a")))
    assert cache.alignment_key(copy, b, "weight-matching") == key  # content, not path
    different = {
        "roles swapped": cache.alignment_key(b, a, "weight-matching"),
        "other seed": cache.alignment_key(a, b, "weight-matching", {"seed": 1}),
        "other option": cache.alignment_key(a, b, "weight-matching", {"max_iter": 5}),
        "per-sublayer maps": cache.alignment_key(a, b, "weight-matching", {"residual_maps": "per-sublayer"}),
        "other strategy": cache.alignment_key(a, b, "transfusion"),
        "other model": cache.alignment_key(a, c, "weight-matching"),
        "a hub commit": cache.alignment_key(ResolvedModel(a.folder, "0" * 40), b, "weight-matching"),
        "with data": cache.alignment_key(a, b, "weight-matching", data={"spec": {"dataset": "digits"}}),
    }
    model = tiny.gpt2(0)
    graph = graph_for(model.config, model.state_dict().keys())
    on_graph = cache.alignment_key(a, b, "weight-matching", graph=graph)
    assert cache.alignment_key(a, b, "weight-matching", graph=graph_for(model.config, model.state_dict().keys())) == (
        on_graph
    )
    different["a rewritten graph"] = cache.alignment_key(
        a, b, "weight-matching", graph=dataclasses.replace(graph, ties={})
    )
    different["the graph"] = on_graph
    assert key not in different.values() and len(set(different.values())) == len(different), different
    assert cache.key_fields(a, b, "weight-matching")["options"] == {
        "max_iter": 100,
        "seed": 0,
        "residual_maps": "global",
        "glu": "keep",
    }

    # rewriting a weight file in place makes it another model
    tiny.gpt2(3).save_pretrained(str(copy.folder))
    assert cache.alignment_key(copy, b, "weight-matching") != key


def test_data_identity_follows_the_files_content_and_the_spec(root: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be", encoding="utf-8")
    spec = {"dataset": "text", "data_files": str(tmp_path / "*.txt"), "split": "train"}
    first = cache.data_identity(spec, tmp_path, batch_size=8, seed=0)
    assert list(first["files"].values()) == [cache.file_sha256(corpus)]
    assert cache.data_identity(spec, tmp_path, batch_size=8, seed=0) == first
    assert cache.data_identity(spec, tmp_path, batch_size=8, seed=1) != first
    assert cache.data_identity({**spec, "split": "train[:10]"}, tmp_path, batch_size=8, seed=0) != first
    corpus.write_text("that is the question", encoding="utf-8")
    os.utime(corpus, ns=(1, 1))  # another mtime for sure, whatever the clock's resolution
    assert cache.data_identity(spec, tmp_path, batch_size=8, seed=0) != first
    assert cache.data_identity({"dataset": "shakespeare", "split": "train"}, tmp_path)["files"] == {}


def test_file_hashes_are_remembered_by_size_and_mtime(root: Path, tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 1000)
    real = cache.file_sha256(path)
    (memo,) = (root / "hashes").glob("*.json")
    entry = json.loads(memo.read_text(encoding="utf-8"))
    memo.write_text(json.dumps({**entry, "sha256": "remembered"}), encoding="utf-8")
    assert cache.file_sha256(path) == "remembered"  # not read again
    os.utime(path, ns=(entry["mtime_ns"] + 1, entry["mtime_ns"] + 1))
    assert cache.file_sha256(path) == real  # touched: hashed again


# ---------------------------------------------------------------------------------------------
# Entries


@pytest.mark.parametrize(
    ("strategy", "case"),
    [("weight-matching", "gpt2"), ("generalized-orthogonal", "gpt2"), ("generalized-orthogonal", "llama-gqa")],
)
def test_a_hit_rebuilds_the_fresh_alignment_exactly(root: Path, strategy: str, case: str) -> None:
    pair = _pair(case)
    fresh = align(strategy, pair, {"iterations": 2} if strategy == "generalized-orthogonal" else {"max_iter": 3})
    assert cache.save_alignment("k" * 64, fresh, pair) == root / f"{'k' * 64}.safetensors"
    hit = cache.read_alignment("k" * 64, _pair(case), strategy)  # rebuilt on freshly loaded models
    assert (hit.strategy, hit.exact, hit.canonical, hit.untied) == (
        fresh.strategy,
        fresh.exact,
        fresh.canonical,
        fresh.untied,
    )
    assert hit.canonical == (strategy == "generalized-orthogonal")
    assert hit.notes == fresh.notes and hit.timings == pytest.approx(fresh.timings)
    assert hit.graph.ties == fresh.graph.ties
    for which in ("sd_a", "sd_b"):
        mine, theirs = getattr(hit, which), getattr(fresh, which)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    aligned, expected = hit.aligned_b(), fresh.aligned_b()
    assert aligned.keys() == expected.keys()
    assert all(torch.equal(aligned[k], expected[k]) for k in aligned)


def test_entries_are_safetensors_loadable_without_pickle(root: Path) -> None:
    pair = _pair("gpt2")
    path = cache.save_alignment("a" * 64, align("weight-matching", pair, {"max_iter": 2}), pair)
    assert path is not None
    tensors = load_file(str(path))
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert not list(root.glob("*.tmp"))  # written through a temporary file, renamed


def test_broken_or_foreign_entries_are_misses(root: Path) -> None:
    pair = _pair("gpt2")
    fresh = align("weight-matching", pair, {"max_iter": 2})
    path = cache.save_alignment("b" * 64, fresh, pair)
    assert path is not None
    good = path.read_bytes()

    with pytest.raises(cache.CacheMiss) as missing:
        cache.read_alignment("c" * 64, pair)
    assert missing.value.reason == ""  # no entry at all: nothing to report

    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(cache.CacheMiss, match="unreadable"):
        cache.read_alignment("b" * 64, pair)
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))  # one flipped bit of tensor data
    with pytest.raises(cache.CacheMiss, match="checksum"):
        cache.read_alignment("b" * 64, pair)
    path.write_bytes(good)
    with pytest.raises(cache.CacheMiss, match="strategy"):
        cache.read_alignment("b" * 64, pair, "transfusion")
    assert cache.load_alignment("b" * 64, _pair("bert-mlm")) is None  # another graph: spaces differ
    shutil.copy(path, cache.entry_path("d" * 64))
    assert cache.load_alignment("d" * 64, pair) is None  # renamed: not the key it was stored under
    assert cache.load_alignment("b" * 64, pair) is not None


def test_alignments_on_a_graph_rewritten_from_data_are_not_stored(root: Path) -> None:
    pair = _pair("gpt2")
    fresh = align("weight-matching", pair, {"max_iter": 2})
    fresh.graph = graph_for(pair.model_a.config, pair.sd_a.keys())  # equal, but not the pair's own object
    assert cache.save_alignment("e" * 64, fresh, pair) is None
    assert _entries(root) == []


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    assert cache.enabled() and not cache.enabled(False)
    for value, on in (("1", False), ("true", False), ("0", True), ("", True)):
        monkeypatch.setenv(cache.NO_CACHE_ENV, value)
        assert cache.enabled() is on


# ---------------------------------------------------------------------------------------------
# Through the runner


def _gpt2_recipe(tmp_path: Path, out: str, **extra: Any) -> Path:
    """Two tiny GPT-2 with a character tokenizer; generalized-orthogonal merge, weight-matching and
    vanilla curves on built-in data (no files, nothing downloaded)."""
    if not (tmp_path / "a").is_dir():
        tok = char_tokenizer(shakespeare_text(["hamlet"])[:3000].lower())
        for name, seed in (("a", 0), ("b", 1)):
            tiny.gpt2(seed).save_pretrained(str(tmp_path / name))
            tok.save_pretrained(str(tmp_path / name))
    body = {
        "job": "merge",
        "models": ["./a", "./b"],
        "strategy": {"name": "generalized-orthogonal", "iterations": 2},
        "evaluate": {
            "task": "causal-lm",
            "data": {"dataset": "shakespeare", "name": "hamlet", "split": "test", "max_examples": 1},
            "points": 3,
            "max_tokens": 256,
            "compare": ["vanilla", "weight-matching"],
        },
        "output": {"dir": out},
        "device": "cpu",
        **extra,
    }
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    return path


def _run(recipe: Path) -> dict[str, Any]:
    result = run_recipe(load_recipe(recipe))
    record: dict[str, Any] = json.loads((result.output / "rebasin.json").read_text(encoding="utf-8"))
    return record


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_a_rerun_reads_its_alignments_from_the_cache(root: Path, tmp_path: Path) -> None:
    first = _run(_gpt2_recipe(tmp_path, "first"))
    assert first["cache"] == {"enabled": True, "hits": 0, "misses": 2}  # vanilla is never cached
    assert len(_entries(root)) == 2
    assert not any("from the cache" in n for n in first["notes"])

    second = _run(_gpt2_recipe(tmp_path, "second"))
    assert second["cache"] == {"enabled": True, "hits": 2, "misses": 0}
    hits = [n for n in second["notes"] if "read from the cache" in n]
    assert len(hits) == 2 and any(n.startswith("generalized-orthogonal alignment of B to A") for n in hits)
    assert second["timings"]["align"] < first["timings"]["align"]
    assert second["curves"] == first["curves"] and second["barrier"] == first["barrier"]
    assert second["function_preserved"] == first["function_preserved"] and second["untied"] == first["untied"]
    one, two = _weights(tmp_path / "first"), _weights(tmp_path / "second")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)

    # a damaged entry is recomputed and written again, never an error
    for entry in _entries(root):
        entry.write_bytes(entry.read_bytes()[:100])
    third = _run(_gpt2_recipe(tmp_path, "third"))
    assert third["cache"] == {"enabled": True, "hits": 0, "misses": 2}
    assert sum("not used: unreadable entry" in n for n in third["notes"]) == 2
    three = _weights(tmp_path / "third")
    assert all(torch.equal(one[k], three[k]) for k in one)
    fourth = _run(_gpt2_recipe(tmp_path, "fourth"))
    assert fourth["cache"]["hits"] == 2


def test_cache_false_and_the_environment_bypass_the_cache(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    off = _run(_gpt2_recipe(tmp_path, "off", cache=False))
    assert off["cache"] == {"enabled": False, "hits": 0, "misses": 0} and off["recipe"]["cache"] is False
    assert _entries(root) == []
    monkeypatch.setenv(cache.NO_CACHE_ENV, "1")
    assert _run(_gpt2_recipe(tmp_path, "env"))["cache"]["enabled"] is False
    assert _entries(root) == []


def test_alignment_data_are_part_of_the_key(root: Path, tmp_path: Path) -> None:
    def recipe(out: str, examples: int) -> Path:
        data = {"dataset": "shakespeare", "name": "hamlet", "split": "test", "max_tokens": 128 * examples}
        path = _gpt2_recipe(tmp_path, out, strategy={"name": "head-perm"}, data=data)
        body = yaml.safe_load(path.read_text(encoding="utf-8"))
        del body["evaluate"]  # alignment only: no curves
        path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
        return path

    assert _run(recipe("one", 1))["cache"]["misses"] == 1
    assert _run(recipe("two", 2))["cache"]["misses"] == 1  # more data: another alignment
    assert _run(recipe("three", 1))["cache"]["hits"] == 1
    assert len(_entries(root)) == 2
