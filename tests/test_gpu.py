"""The CUDA path against the CPU (tests marked ``gpu`` skip without CUDA), and the GPU check's own
plan, which runs everywhere: ``benchmarks/scale/gpu_check.py`` must skip cleanly where there is no GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import tiny
from hf_rebasin.evaluation.data import char_tokenizer
from hf_rebasin.recipe import loads_recipe
from hf_rebasin.run import run_recipe

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda"  # what the gpu tests compare with the CPU
TEXT = "to be, or not to be, that is the question:\nwhether 'tis nobler in the mind to suffer\n" * 8


def test_gpu_check_says_what_it_would_run() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale" / "gpu_check.py"), "--plan", "--bench"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for check in ("merge", "barrier", "transport", "align", "learned", "learned-bench-gpt2"):
        assert f"  {check}: job " in done.stdout


def _pair(tmp_path: Path) -> list[str]:
    tok = char_tokenizer(TEXT)
    folders = []
    for seed in (0, 1):
        folder = tmp_path / f"m{seed}"
        tiny.gpt2(seed).save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
        folders.append(str(folder))
    (tmp_path / "text.txt").write_text(TEXT)
    return folders


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["weight-matching", "generalized-orthogonal", "head-perm"])
def test_a_merge_on_cuda_is_the_merge_on_the_cpu(tmp_path: Path, strategy: str) -> None:
    """The same recipe on both devices: the merged weights and the barrier agree (float32 math on
    the device; the LAP on the CPU)."""
    body = {
        "job": "barrier",
        "models": _pair(tmp_path),
        "strategy": strategy,
        "data": {"dataset": "text", "data_files": str(tmp_path / "text.txt")},
        "evaluate": {"task": "causal-lm", "data": {"dataset": "text", "data_files": str(tmp_path / "text.txt")}},
    }
    out = {}
    for name, device in (("reference", "cpu"), ("device", DEVICE)):
        recipe = loads_recipe(yaml.safe_dump({**body, "output": {"dir": str(tmp_path / name)}}), base_dir=tmp_path)
        run_recipe(recipe, device=device)
        out[name] = json.loads((tmp_path / name / "rebasin.json").read_text())
    assert out["reference"]["barrier"], "no barrier measured"
    for curve, numbers in out["reference"]["barrier"].items():
        for key, value in numbers.items():
            assert out["device"]["barrier"][curve][key] == pytest.approx(value, rel=1e-3, abs=1e-4), (curve, key)
    saved = [tmp_path / name / "model.safetensors" for name in ("reference", "device")]
    if all(p.is_file() for p in saved):
        a, b = (load_file(str(p)) for p in saved)
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


# Where CUDA is absent, tensors on the `meta` device stand in for the GPU's: what a stage builds to
# sit beside its inputs must land on their device. On an H100 these stages once mixed cuda and cpu
# (a missing head role's zeros, the similarity sums, the gated units' accumulators).


def _meta_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to("meta") for k, v in model.state_dict().items()}


def test_the_similarity_sums_sit_on_the_weights_device() -> None:
    from hf_rebasin.alignment.diagnostics import _accumulate
    from hf_rebasin.symmetry.adapters import graph_for

    sd = _meta_state(tiny.gpt2(0))
    sums = _accumulate(graph_for(tiny.gpt2(0).config, sd.keys()), sd, sd, None)
    assert sums and {t.device.type for acc in sums.values() for t in acc} == {"meta"}


def test_a_missing_head_roles_zeros_sit_beside_the_other_views() -> None:
    from hf_rebasin.alignment.strategies.engines.descent import HeadPairs
    from hf_rebasin.symmetry.spaces import HeadSpace

    space = HeadSpace("h.0.attn", num_heads=4, num_kv_heads=2, head_dim=8)
    views = {"q": torch.zeros(32, 32, device="meta"), "o": torch.zeros(32, 32, device="meta")}
    pairs = HeadPairs.from_views(space, views)
    assert [t.device.type for t in (pairs.q, pairs.k, pairs.v, pairs.o)] == ["meta"] * 4
    assert pairs.k.shape == (2, 2, 8, 8) and pairs.q.shape == (2, 2, 2, 2, 8, 8)


def test_gated_units_scales_and_agreement_sit_on_the_weights_device() -> None:
    from hf_rebasin.symmetry.adapters import graph_for
    from hf_rebasin.symmetry.glu import _agreement, unit_scales

    model = tiny.llama(0)
    sd = _meta_state(model)
    graph = graph_for(model.config, sd.keys())
    assert graph.glus
    assert {s.device.type for s in unit_scales(graph, sd).values()} == {"meta"}
    assert _agreement(graph, graph.glus[0], sd, sd, graph.identity()).device.type == "meta"
