"""The memory plan (hf_rebasin.run.memory): sizes from the safetensors headers, the estimated peak in
the dry run, and a run that would not fit stopped before a weight is loaded."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml
from safetensors import safe_open

import tiny
from hf_rebasin.cli import main
from hf_rebasin.core.errors import CheckpointError
from hf_rebasin.core.memory import InsufficientMemoryError
from hf_rebasin.recipe import loads_recipe
from hf_rebasin.run import load as run_load
from hf_rebasin.run import memory
from hf_rebasin.run.plan import build_plan


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("memory")
    for seed in (0, 1):
        tiny.llama(seed).to(torch.bfloat16).save_pretrained(str(root / f"m{seed}"), max_shard_size=20_000)
    return root / "m0", root / "m1"


def _recipe(root: Path, models: tuple[Path, Path], **extra: Any) -> Path:
    body = {"job": "merge", "models": [str(m) for m in models], "output": {"dir": str(root / "out")}, **extra}
    body.setdefault("strategy", "weight-matching")
    path = root / "r.yaml"
    path.write_text(yaml.safe_dump(body), encoding="utf-8")
    return path


def test_footprint_counts_what_the_files_hold(pair: tuple[Path, Path]) -> None:
    found = memory.footprint(pair[0])
    assert found is not None
    model = T.AutoModelForCausalLM.from_pretrained(str(pair[0]))
    assert found.params == sum(p.numel() for p in model.parameters())  # untied: every parameter stored once
    stored = 0
    largest = mixed = 0
    for f in pair[0].glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                stored += t.numel() * t.element_size()
                largest = max(largest, t.numel())
                if "embed_tokens" not in k and "lm_head" not in k:
                    mixed = max(mixed, t.numel())
    assert found.nbytes == stored and found.largest == largest and found.dtype == "bfloat16"
    assert found.largest_mixed == mixed < largest  # vocabulary rows are streamed in blocks
    assert found.width == model.config.intermediate_size
    assert memory.footprint(pair[0].parent) is None  # no checkpoint there


def test_a_streamed_run_is_estimated_far_below_one_that_loads_its_models(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    streamed = build_plan(loads_recipe(_recipe(tmp_path, pair).read_text())).memory
    evaluated = {"evaluate": {"task": "causal-lm", "data": {"dataset": "shakespeare"}}}
    whole = build_plan(loads_recipe(_recipe(tmp_path, pair, **evaluated).read_text())).memory
    assert streamed is not None and whole is not None and streamed.streamed and not whole.streamed
    assert streamed.peak is not None and whole.peak is not None
    fp = memory.footprint(pair[0])
    assert fp is not None
    assert streamed.peak - memory.OVERHEAD < whole.peak - memory.OVERHEAD
    lap = memory.LAP_COPIES * 8 * fp.width**2
    held = max(memory.FORWARD_COPIES * 4 * fp.largest, memory.STREAM_COPIES * 4 * fp.largest_mixed)
    assert streamed.peak == memory.OVERHEAD + held + lap
    assert whole.peak - memory.OVERHEAD >= 2 * 4 * fp.params  # both models in float32 at least
    learned = {"strategy": {"name": "generalized-orthogonal", "learned": True}, "data": {"dataset": "shakespeare"}}
    plan = build_plan(loads_recipe(_recipe(tmp_path, pair, **learned).read_text()))
    assert plan.memory is not None and plan.memory.learned_limit is not None
    assert any(line.startswith("learned matching: models of up to") for line in plan.lines())


def test_the_dry_run_prints_each_model_and_the_estimate(pair: tuple[Path, Path], tmp_path: Path, capsys: Any) -> None:
    assert main([str(_recipe(tmp_path, pair)), "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    fp = memory.footprint(pair[0])
    assert fp is not None
    assert f"model models.0.model: {fp.params / 1e6:,.1f}M parameters, bfloat16" in out
    assert "memory: streamed tensor by tensor; estimated peak" in out and "available" in out


def test_a_run_that_would_not_fit_stops_before_loading(
    pair: tuple[Path, Path], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(tmp_path, pair)
    monkeypatch.setattr(memory, "available_memory", lambda: 1024**2)  # 1 MiB free besides this process
    loaded: list[Path] = []
    real = run_load.load_model
    monkeypatch.setattr(run_load, "load_model", lambda path, **kw: loaded.append(path) or real(path, **kw))

    assert main([str(recipe), "--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(r"this run needs about [0-9.]+ GiB of memory .* but [0-9.]+ GiB is available", err), err
    assert "--no-memory-check" in err
    assert main([str(recipe)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "stopped before loading anything" in err and "Traceback" not in err
    assert not loaded and not (tmp_path / "out").exists()

    assert main([str(recipe), "--no-memory-check"]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file() or (
        tmp_path / "out" / "model.safetensors"
    ).is_file()


def test_a_damaged_checkpoint_is_refused_as_the_file_it_is(tmp_path: Path) -> None:
    """A header length larger than the file (here the bytes of a text) is the file's error, named,
    never a size nor a memory estimate."""
    tiny.llama(0).save_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*header claims"):
        memory.footprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*header claims 1,099,511,627,776 bytes"):
        memory.footprint(tmp_path)


def test_a_calibrating_transport_counts_its_student_and_its_refusal_says_calibrate_false(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = pair
    body = {"job": "transport", "base": str(a), "finetuned": str(b), "target": str(a), "output": {"dir": "out"}}
    calibrating = loads_recipe(yaml.safe_dump(body))
    data_free = loads_recipe(yaml.safe_dump({**body, "calibrate": False}))
    models = [("target.model", a), ("base.model", a), ("finetuned.model", b)]
    fp = memory.footprint(a)
    assert fp is not None
    with_student = memory.estimate(calibrating, models, streamed=False, available=1 << 40)
    without = memory.estimate(data_free, models, streamed=False, available=1 << 40)
    assert with_student.peak is not None and without.peak is not None
    assert with_student.peak - without.peak >= 4 * fp.params  # the student in float32, at least
    assert "calibration" in with_student.how and "calibration" not in without.how
    small = memory.estimate(calibrating, models, streamed=False, available=without.peak // 4)
    with pytest.raises(InsufficientMemoryError, match="calibrate: false"):
        small.check()
