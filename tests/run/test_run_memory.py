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
from helpers import sparse_bf16_safetensors
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


def _sparse_mistral7b(folder: Path) -> Path:
    """Mistral-7B's config and a safetensors file of its tensors' shapes in bfloat16, sparse: the
    header is real, the 14.5 GB of data are a hole (the estimate reads headers only)."""
    config = T.MistralConfig(architectures=["MistralForCausalLM"])
    folder.mkdir(parents=True)
    config.save_pretrained(str(folder))
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    shapes = {"model.embed_tokens.weight": [v, d], "lm_head.weight": [v, d], "model.norm.weight": [d]}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {f"{p}self_attn.{x}_proj.weight": [d if x in "qo" else kv, d] for x in "qkvo"}
        shapes |= {f"{p}mlp.{x}_proj.weight": [f, d] for x in ("gate", "up")} | {f"{p}mlp.down_proj.weight": [d, f]}
        shapes |= {f"{p}{x}_layernorm.weight": [d] for x in ("input", "post_attention")}
    sparse_bf16_safetensors(folder / "model.safetensors", shapes)
    return folder


def test_a_calibrating_transport_streams_and_holds_teacher_guard_and_student_only(tmp_path: Path) -> None:
    """At Mistral-7B's shape (bf16 files): the transport streams, then calibration holds the
    fine-tune and the target in bf16 and the student in float32, its layers checkpointed:
    under 80 GiB (one H100), where holding every model whole took 349 GiB."""
    a, ft, b = (_sparse_mistral7b(tmp_path / n) for n in ("a", "ft", "b"))
    body = {"job": "transport", "base": str(a), "finetuned": str(ft), "target": str(b), "output": {"dir": "out"}}
    calibrating = loads_recipe(yaml.safe_dump(body))
    unguarded = loads_recipe(yaml.safe_dump({**body, "calibrate": {"guard": 0}}))
    data_free = loads_recipe(yaml.safe_dump({**body, "calibrate": False}))
    models = [("target.model", b), ("base.model", a), ("finetuned.model", ft)]
    assert memory.streams(calibrating)
    fp = memory.footprint(a)
    assert fp is not None and fp.dtype == "bfloat16"
    peaks = [memory.estimate(r, models, streamed=True, available=1 << 45) for r in (calibrating, unguarded, data_free)]
    full, no_guard, free = (p.peak for p in peaks)
    assert full is not None and no_guard is not None and free is not None
    assert full - free >= 2 * fp.nbytes + 4 * fp.params  # fine-tune and target as stored, the student in float32
    assert full - no_guard == fp.nbytes  # without a guard the target is not loaded
    assert full < 80 * 2**30 < memory.estimate(calibrating, models, streamed=False, available=1 << 45).peak
    assert "then calibration" in peaks[0].how


def test_the_calibration_compute_counts_the_budget_it_runs() -> None:
    """Operations scale with the model and the steps; a LoRA adapter's doubled budget doubles the
    fitted part; at 7B shape the default is ~10¹⁷ (six times N per token trained, Kaplan et al.'s
    rule, gives 6 · 7.2e9 · 1.6e6 = 7e16 for the fitting alone)."""
    from hf_rebasin.recipe.calibrate import Calibrate
    from hf_rebasin.run.compute import calibration_flops, matmul_rate

    cal = Calibrate()
    full, adapter = calibration_flops(cal, 7_241_732_096), calibration_flops(cal, 7_241_732_096, adapter=True)
    assert 7e16 < full < 2e17 and 1.8 < adapter / full < 2.0
    assert calibration_flops(cal, 2_000) == 2 * calibration_flops(cal, 1_000)
    rate, where = matmul_rate("cpu")
    assert rate > 1e8 and where == "cpu"
