"""The jobs on mixtures of experts, from folders stored one tensor per expert as save_pretrained
writes them, checked against stock transformers: a barrier's ends are the two models' own losses, a
transport onto a permuted copy of the base gives back the fine-tune's function, and `job: align`
writes folders that load with the stock class and compute what their inputs computed."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors import safe_open

import tiny
from helpers import run_main
from hf_rebasin.recipe import load_recipe
from hf_rebasin.run.load import load_workspace
from hf_rebasin.run.pipeline import run_job
from hf_rebasin.run.plan import build_plan
from hf_rebasin.symmetry.adapters import graph_for
from lm_folders import fixed_logits, save_lm, stock_lm, transformers_loss, write_recipe


def _keys(folder: Path) -> set[str]:
    out: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            out |= set(h.keys())
    return out


def test_a_barrier_of_two_mixtrals_scores_its_ends_as_transformers_does(tmp_path: Path) -> None:
    for seed in (0, 1):
        save_lm(tiny.mixtral(seed), tmp_path / f"m{seed}")
    evaluate = {"task": "causal-lm", "data": {"dataset": "shakespeare", "name": "hamlet", "split": "test"}}
    evaluate |= {"max_tokens": 400, "points": 3, "compare": ["vanilla"]}
    body = {"job": "barrier", "models": ["./m0", "./m1"], "strategy": "weight-matching", "evaluate": evaluate}
    workspace = load_workspace(build_plan(load_recipe(write_recipe(tmp_path, {**body, "output": {"dir": "out"}}))))
    done = run_job(workspace)
    a, b = stock_lm(tmp_path / "m0"), stock_lm(tmp_path / "m1")

    assert workspace.eval_batches is not None

    def plain(model: T.PreTrainedModel) -> float:
        return transformers_loss(model, workspace.eval_batches)

    for name in ("weight-matching", "vanilla"):
        curve = done.result.findings.curves[name]
        assert curve["loss"][-1] == pytest.approx(plain(a), rel=1e-5)  # λ = 1: A
        assert curve["loss"][0] == pytest.approx(plain(b), rel=1e-5)  # λ = 0: B (aligned: the same function)
    matched, plain_mid = (
        done.result.findings.curves["weight-matching"]["loss"][1],
        done.result.findings.curves["vanilla"]["loss"][1],
    )
    assert matched != plain_mid  # the alignment moved B


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe"])
def test_a_transport_onto_a_permuted_base_gives_back_the_fine_tune(case: str, tmp_path: Path) -> None:
    """B = the base with experts, units, heads and the residual permuted (and its routers shifted):
    weight matching finds that map exactly, so B + π(τ) is the fine-tune in B's basis and computes
    what the fine-tune computes."""
    base = tiny.FACTORIES[case](0).eval()
    sd = base.state_dict()
    graph = graph_for(base.config, sd.keys())
    g = torch.Generator().manual_seed(4)
    finetuned = type(base)(base.config).eval()
    finetuned.load_state_dict(
        {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in sd.items()}
    )
    target = type(base)(base.config).eval()
    target.load_state_dict(graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(5))))
    for name, model in (("base", base), ("ft", finetuned), ("target", target)):
        save_lm(model, tmp_path / name)
    body = {"job": "transport", "base": "./base", "finetuned": "./ft", "target": "./target", "calibrate": False}
    body |= {"strategy": "weight-matching", "alpha": 1.0, "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    out = stock_lm(tmp_path / "out")
    assert (fixed_logits(out) - fixed_logits(finetuned)).abs().max() <= 1e-4
    assert _keys(tmp_path / "out") == _keys(tmp_path / "target")  # per expert, as its inputs


def test_align_writes_each_mixtral_in_the_first_ones_basis(tmp_path: Path) -> None:
    for seed in (0, 1):
        save_lm(tiny.mixtral(seed), tmp_path / f"m{seed}")
    body = {"job": "align", "models": ["./m0", "./m1"], "strategy": "weight-matching", "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    for seed, sub in ((0, "a"), (1, "b")):
        moved, original = stock_lm(tmp_path / "out" / sub), stock_lm(tmp_path / f"m{seed}")
        assert (fixed_logits(moved) - fixed_logits(original)).abs().max() <= 1e-4
        assert _keys(tmp_path / "out" / sub) == _keys(tmp_path / f"m{seed}")
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text(encoding="utf-8"))
    assert record["recipe"]["job"] == "align"
    a = stock_lm(tmp_path / "m0").state_dict()
    b = stock_lm(tmp_path / "m1").state_dict()
    moved_b = stock_lm(tmp_path / "out" / "b").state_dict()
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert (moved_b[name] - a[name]).norm() < (b[name] - a[name]).norm()  # closer to A once aligned


@pytest.mark.parametrize("residual", ["identity", "all"])
def test_head_perm_on_streamed_mixtrals_writes_what_it_writes_in_memory(
    residual: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Router-weighted expert statistics collected layer by layer from streamed models (``identity``)
    or in whole forward passes of them (``all``) give the merge the in-memory run gives."""

    for seed in (0, 1):
        save_lm(tiny.mixtral(seed), tmp_path / f"m{seed}")
    data = {"dataset": "shakespeare", "name": "hamlet", "split": "train", "max_tokens": 600}
    outputs = {}
    for stream in (False, True):
        name = "streamed" if stream else "memory"
        body = {"job": "merge", "models": ["./m0", "./m1"], "strategy": {"name": "head-perm", "residual": residual}}
        body |= {"data": data, "output": {"dir": name}}
        monkeypatch.setattr(
            importlib.import_module("hf_rebasin.run.plan"), "streamed", lambda _recipe, _models, s=stream: s
        )
        proc = run_main(str(write_recipe(tmp_path, body)))
        assert proc.returncode == 0, proc.stderr
        outputs[name] = stock_lm(tmp_path / name).state_dict()
    assert all(float((outputs["memory"][k] - outputs["streamed"][k]).abs().max()) <= 1e-5 for k in outputs["memory"])
    record = json.loads((tmp_path / "streamed" / "rebasin.json").read_text(encoding="utf-8"))
    assert record["function_preserved"]["max_abs_diff"] < 1e-4
    assert any("weights streamed" in note for note in record["notes"])  # it really streamed
