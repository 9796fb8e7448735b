"""Lineage: a descendant is found under every transform of its family's symmetry catalogue, a model
trained apart is not, and bad input exits 2 with nothing written."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from scipy.stats import norm
from test_glu import random_scales

import tiny
import warm_cli
from helpers import assert_user_error, flat, run_main
from hf_rebasin.alignment.widths import embed_model
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.lineage import compare
from hf_rebasin.lineage.compare import NULL_SIMILARITY
from hf_rebasin.lineage.pairs import lineage_of
from hf_rebasin.lineage.record import LineageRecord
from hf_rebasin.lineage.stats import signal_of, signal_rank
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hub_server import client_env

FAMILIES = ["gpt2", "llama-gqa", "gemma2", "qwen3-moe", "bert-mlm", "vit"]


def _fine_tuned(sd: dict[str, torch.Tensor], scale: float = 0.05, seed: int = 1) -> dict[str, torch.Tensor]:
    """A stand-in for training on top: every float tensor moved by noise of ``scale`` of its RMS."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        if v.is_floating_point() and v.numel() > 1:
            rms = v.double().pow(2).mean().sqrt().float()
            v = v + scale * rms * torch.randn(v.shape, generator=g, dtype=v.dtype)
        out[k] = v
    return out


def _transformed(model: torch.nn.Module, sd: dict[str, torch.Tensor], cls: str, seed: int = 7):
    """``sd`` moved by a random transform of class ``cls`` (in canonical form: a rotation needs it)."""
    graph = graph_for(model.config, sd.keys())
    canonical, cgraph, _ = canonicalize(graph, sd)
    return cgraph.apply(canonical, cgraph.random_transform(cls, torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_descendant_is_found_under_every_transform_and_a_model_trained_apart_is_not(family):
    a = tiny.FACTORIES[family](0).eval()
    sd_a = a.state_dict()
    graph = graph_for(a.config, sd_a.keys())
    child = _fine_tuned(sd_a)
    same = compare(graph, sd_a, child)
    assert same.verdict == "same basis" and same.statistic > 0.8
    for cls in ("permutation", "orthogonal"):
        moved = compare(graph, sd_a, _transformed(a, child, cls))
        assert moved.verdict == "related up to symmetry", (cls, moved.statistic, moved.raw_statistic)
        # random-init weights have no spectral gap between signal and bulk: trained ones align better
        assert moved.statistic > 0.5 > 0.2 > abs(moved.raw_statistic)
    apart = compare(graph, sd_a, tiny.FACTORIES[family](1).state_dict())
    assert apart.verdict == "independent" and abs(apart.statistic) < 0.2
    assert apart.p_value > 0.5 and moved.log10_p < -100


def test_rescaled_gated_units_do_not_hide_a_parent():
    """Gated units scaled by any s ≠ 0 (sign included), the residual rotated: still related."""
    a = tiny.FACTORIES["llama-gqa"](0).eval()
    sd = _fine_tuned(a.state_dict())
    graph = graph_for(a.config, sd.keys())
    rescaled = glu.apply_unit_scales(graph, sd, random_scales(graph, 3))
    found = compare(graph, a.state_dict(), _transformed(a, rescaled, "orthogonal"))
    assert found.verdict == "related up to symmetry" and found.statistic > 0.9


def test_a_widened_descendant_is_related_to_its_narrow_parent(tmp_path):
    narrow = tiny.FACTORIES["gpt2"](0).eval()
    like = copy.deepcopy(narrow.config)
    like.n_embd, like.n_head = 48, 6
    wide, _ = embed_model(narrow, like)
    wide.load_state_dict(_fine_tuned(wide.state_dict(), scale=0.05))
    models = [_loaded(narrow, tmp_path / "narrow"), _loaded(wide, tmp_path / "wide")]
    record = lineage_of(models, ["narrow", "wide"])
    assert record.pairs[0].verdict in ("same basis", "related up to symmetry")
    assert record.models[0].embedded is not None


def _loaded(model: torch.nn.Module, folder: Path) -> LoadedModel:
    sd = model.state_dict()
    return LoadedModel(model=model, graph=graph_for(model.config, sd.keys()), path=folder)


def test_the_split_commutes_with_the_symmetries_and_the_p_value_is_the_normal_tail():
    """Checked against numpy's SVD and scipy's normal tail, not the package's own arithmetic."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g, dtype=torch.float64)
    r = signal_rank(tuple(w.shape), share=0.25)
    signal = signal_of(w, r).dense().double()
    u, s, vh = np.linalg.svd(w.numpy(), full_matrices=False)
    np.testing.assert_allclose(signal.numpy(), (u[:, :r] * s[:r]) @ vh[:r], atol=1e-5)  # float32 factors
    p, _ = torch.linalg.qr(torch.randn(24, 24, generator=g, dtype=torch.float64))
    q, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    moved = signal_of(p @ w @ q, r).dense().double()
    torch.testing.assert_close(w - signal, p.T @ (p @ w @ q - moved) @ q.T, atol=1e-5, rtol=0)  # the bulk moves along
    big = torch.randn(1100, 1000, generator=g) @ torch.diag(torch.logspace(1, -1, 1000))  # past EXACT_SVD: randomized
    top = np.linalg.svd(big.double().numpy(), compute_uv=False)[:64]
    found = torch.linalg.svdvals(signal_of(big, 64).dense().double()).numpy()[:64]
    np.testing.assert_allclose(found, top, rtol=1e-2)
    a = tiny.FACTORIES["gpt2"](0)
    found = compare(graph_for(a.config, a.state_dict().keys()), a.state_dict(), tiny.FACTORIES["gpt2"](1).state_dict())
    counted = [e for e in found.spaces if e.counted]
    for e in counted:
        assert e.z == pytest.approx((e.similarity - NULL_SIMILARITY) * math.sqrt(e.entries))
    z = sum(e.z for e in counted) / math.sqrt(len(counted))
    assert found.p_value == pytest.approx(norm.sf(z), rel=1e-6, abs=1e-300)


def test_lineage_writes_a_typed_record_a_plot_and_prints_each_verdict(saved_model, tmp_path):
    a = saved_model("gpt2")
    child = tiny.FACTORIES["gpt2"](0)
    child.load_state_dict(_fine_tuned(child.state_dict()))
    b, c = saved_model(child), saved_model("gpt2", seed=1)
    out = tmp_path / "lineage"
    proc = run_main("lineage", str(a), str(b), str(c), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    record = LineageRecord.model_validate_json((out / "lineage.json").read_text())
    verdicts = {(p.a, p.b): p.verdict for p in record.pairs}
    assert verdicts == {(0, 1): "same basis", (0, 2): "independent", (1, 2): "independent"}
    assert (out / "lineage.png").read_bytes()[:4] == b"\x89PNG"
    printed_steps = flat(proc.stdout)
    assert "next: no alignment needed" in printed_steps and "next: trained apart" in printed_steps
    printed = run_main("lineage", str(a), str(b), "--json")
    assert json.loads(printed.stdout)["pairs"][0]["verdict"] == "same basis"


def test_bad_input_exits_2_and_writes_nothing(saved_model, tmp_path):
    out = tmp_path / "never"
    gpt2 = str(saved_model("gpt2"))
    deeper = tiny.FACTORIES["gpt2"](0)
    config = copy.deepcopy(deeper.config)
    config.n_layer, config.n_embd = 3, 2 * config.n_embd  # other widths are embedded, other depths mapped: not both
    cases = [
        ((gpt2,), ("two models or more",)),
        ((gpt2, str(saved_model("llama-gqa"))), ("llama", "gpt2", "one family")),
        ((gpt2, str(saved_model(type(deeper)(config)))), ("n_layer", "depth", "cannot be embedded")),
        ((gpt2, str(tmp_path / "missing")), ("MODEL 2",)),
    ]
    for models, needles in cases:
        assert_user_error(run_main("lineage", *models, "--output", str(out)), *needles)
        assert not out.exists()


def test_a_hub_id_that_does_not_exist_exits_2(hub, saved_model, tmp_path):
    """A subprocess (the client reads HF_ENDPOINT at import), forked from the warm helper that the
    other CLI subprocesses share (the same PYTHONPATH: the repository first)."""
    env = {**client_env(hub, None, tmp_path), "PYTHONPATH": warm_cli.PYTHONPATH}
    argv = ["lineage", str(saved_model("gpt2")), "alice/no-such-model"]
    proc = warm_cli.run_module(argv, env=env, cwd=Path.cwd(), timeout=300)
    assert_user_error(proc, "alice/no-such-model")


def test_job_lineage_runs_from_a_recipe_and_refuses_what_it_does_not_use(saved_model, tmp_path):
    child = tiny.FACTORIES["gpt2"](0)
    child.load_state_dict(_fine_tuned(child.state_dict()))
    body = {"job": "lineage", "models": [str(saved_model("gpt2")), str(saved_model(child))]}
    out = tmp_path / "out"
    recipe = tmp_path / "lineage.yaml"
    recipe.write_text(yaml.safe_dump({**body, "output": {"dir": str(out)}}))
    proc = run_main(str(recipe))
    assert proc.returncode == 0, proc.stderr
    record = LineageRecord.model_validate_json((out / "lineage.json").read_text())
    assert [p.verdict for p in record.pairs] == ["same basis"]
    assert json.loads((out / "rebasin.json").read_text())["diagnostics"]["lineage"] == {"A-B": "same basis"}
    assert "# Lineage:" in (out / "README.md").read_text()
    data = {"dataset": "shakespeare", "split": "train"}
    for extra, needle in (
        ({"evaluate": {"task": "causal-lm", "data": data}}, "evaluate"),
        ({"strategy": "weight-matching"}, "strategy"),
        ({"merge": {"weight": 0.5}}, "merge"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump({**body, **extra, "output": {"dir": str(tmp_path / "never")}}))
        assert_user_error(run_main(str(bad)), needle)
        assert not (tmp_path / "never").exists()


def test_a_pair_too_large_for_memory_exits_2_before_comparing(saved_model, tmp_path, monkeypatch):
    """The comparison holds several copies of each model: refused up front, not killed by the kernel."""
    import hf_rebasin.lineage.pairs as pairs

    monkeypatch.setattr(pairs, "available_memory", lambda: 1 << 20)
    out = tmp_path / "never"
    proc = run_main("lineage", str(saved_model("gpt2")), str(saved_model("gpt2", seed=1)), "--output", str(out))
    assert_user_error(proc, "needs about", "available", "read from their files tensor by tensor")
    assert not out.exists()
