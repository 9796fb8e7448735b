"""Mixture-of-experts checkpoints on disk: the per-expert layout `save_pretrained` writes (Mixtral's
``block_sparse_moe.experts.{j}.w1|w2|w3``, Qwen-MoE's ``mlp.experts.{j}.gate_proj|up_proj|down_proj``)
and the fused one (the model's own 3-D ``mlp.experts.gate_up_proj`` / ``down_proj``), loaded in
memory and streamed, written back in the layout they came in, and refused with a typed error
when the experts do not match config.json. The references are stock transformers: its
``state_dict()``, its ``from_pretrained`` and the keys its files hold."""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tiny
from hf_rebasin.cli import main
from hf_rebasin.core.errors import CheckpointError
from hf_rebasin.core.lazy import LazyState
from hf_rebasin.io.export import save_merged_model
from hf_rebasin.io.models import load_model
from hf_rebasin.io.rebuild import running
from hf_rebasin.io.tensors import CheckpointSource

FAMILIES = {"mixtral": tiny.mixtral, "qwen2-moe": tiny.qwen2_moe, "qwen3-moe": tiny.qwen3_moe}
# one expert's key of each family as save_pretrained writes it (layer 0, expert 0): gate, up, down
PER_EXPERT = {
    "mixtral": ("block_sparse_moe.experts.{j}.w1.weight", "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight"),
    "qwen2-moe": ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight", "mlp.experts.{j}.down_proj.weight"),
    "qwen3-moe": ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight", "mlp.experts.{j}.down_proj.weight"),
}  # fmt: skip
FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            keys.update(h.keys())
    return keys


def _layout(keys: set[str]) -> str:
    """What the files hold for layer 0's experts, read from the keys alone."""
    per = any(".experts.0." in k for k in keys)
    fused = any(k.endswith(FUSED[0]) for k in keys)
    assert per != fused, sorted(keys)
    return "per-expert" if per else "fused"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Any]]:
    """Each family saved by stock save_pretrained, per expert (its default) and fused, with the model."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, factory in FAMILIES.items():
        model = factory(0).eval()
        model.save_pretrained(root / name)
        model.save_pretrained(root / f"{name}-fused", save_original_format=False)
        out[name] = (root / name, root / f"{name}-fused", model)
    return out


def _inputs(model: Any) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_files_hold_the_layouts_tested_here(family: str, saved: dict[str, tuple[Path, Path, Any]]) -> None:
    per, fused, model = saved[family]
    keys = _keys(per)
    experts = model.config.num_local_experts if family == "mixtral" else model.config.num_experts
    for j in range(experts):
        assert all(f"model.layers.0.{k.format(j=j)}" in keys for k in PER_EXPERT[family])
    assert _layout(keys) == "per-expert" and _layout(_keys(fused)) == "fused"


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_tensors_are_the_stock_models(
    family: str, layout: str, saved: dict[str, tuple[Path, Path, Any]]
) -> None:
    per, fused, model = saved[family]
    folder = per if layout == "per-expert" else fused
    want = model.state_dict()
    ids = _inputs(model)
    with torch.no_grad():
        logits = model(ids).logits
    for stream in (False, True):
        loaded = load_model(folder, stream=stream)
        assert loaded.expert_layout == layout
        assert (loaded.source is not None) == stream  # streamed, not loaded whole behind the flag
        got = loaded.weights
        assert set(got) == set(want)
        for k, t in want.items():
            assert torch.equal(got[k], t), k
        if stream:
            assert isinstance(loaded.source, CheckpointSource)
            with running(loaded.model, loaded.source) as offloaded:  # the offloaded forward pass
                assert float((offloaded(ids).logits - logits).abs().max()) <= 1e-5


def _transformed(loaded: Any) -> Any:
    transform = loaded.graph.random_transform("permutation", torch.Generator().manual_seed(1))
    return loaded.graph.apply(loaded.weights, transform)


class _Counting(LazyState):
    """A lazy state that counts how often each tensor is computed."""

    def __init__(self, state: LazyState) -> None:
        self.reads: dict[str, int] = {}

        def read(name: str) -> torch.Tensor:
            self.reads[name] = self.reads.get(name, 0) + 1
            return state[name]

        super().__init__({n: tuple(state.shape(n)) for n in state}, {n: state.dtype(n) for n in state}, read)
        self.aliases = dict(state.aliases)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformed_state_is_written_in_the_inputs_layout(
    family: str, layout: str, saved: dict[str, tuple[Path, Path, Any]], tmp_path: Path
) -> None:
    """A permuted state written in memory and from a lazy state: stock from_pretrained gives the
    stock model's logits, and the files use the keys the input used; the streamed writer computes
    each 3-D expert tensor once, not once per expert."""
    per, fused, model = saved[family]
    folder = per if layout == "per-expert" else fused
    ids = _inputs(model)
    with torch.no_grad():
        want = model(ids).logits
    for stream in (False, True):
        loaded = load_model(folder, stream=stream)
        state = _transformed(loaded)
        assert isinstance(state, LazyState) == stream
        if stream:
            state = _Counting(state)
        dest = tmp_path / f"out-{stream}"
        dest.mkdir()  # the run's output folder (`output.output_folder` makes it)
        save_merged_model(loaded.model, state, dest, expert_layout=loaded.expert_layout)
        assert _layout(_keys(dest)) == layout
        assert _keys(dest) == _keys(folder)  # the very names stock save_pretrained wrote
        if stream:
            experts = [n for n in state.reads if ".experts." in n]
            assert experts and all(state.reads[n] == 1 for n in experts), state.reads
        again = T.AutoModelForCausalLM.from_pretrained(str(dest)).eval()
        with torch.no_grad():
            assert float((again(ids).logits - want).abs().max()) <= 1e-4
        changed = {k for k, t in again.state_dict().items() if not torch.equal(t, model.state_dict()[k])}
        assert any(".experts." in k for k in changed)  # the permutation moved the experts


# ---------------------------------------------------------------------------------------------
# Checkpoints that do not match config.json


def _broken(source: Path, dest: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


MIXTRAL = "model.layers.0.block_sparse_moe.experts.{j}.{w}.weight"
QWEN = "model.layers.1.mlp.experts.{j}.{w}.weight"
BAD: dict[str, tuple[str, Callable[[dict[str, torch.Tensor]], None], str]] = {
    "missing-expert": (
        "mixtral",
        lambda sd: sd.pop(MIXTRAL.format(j=2, w="w3")),
        f"{MIXTRAL.format(j=2, w='w3')!r} (expert 2 of the 4 that config.json implies",
    ),
    "fewer-experts": (
        "qwen3-moe",
        lambda sd: [sd.pop(k) for k in list(sd) if ".experts.3." in k],
        "(expert 3 of the 4 that config.json implies for 'model.layers.0.mlp.experts.",
    ),
    "more-experts": (
        "qwen2-moe",
        lambda sd: sd.update({"model.layers.0.mlp.experts.4.down_proj.weight": torch.zeros(32, 16)}),
        "holds tensor 'model.layers.0.mlp.experts.4.down_proj.weight' of expert 4, but config.json implies 4 experts",
    ),
    "wrong-shape": (
        "mixtral",
        lambda sd: sd.update({MIXTRAL.format(j=1, w="w2"): torch.zeros(32, 47)}),
        f"tensor {MIXTRAL.format(j=1, w='w2')!r} in model.safetensors has shape (32, 47), but config.json implies",
    ),
    "integer-expert": (
        "qwen3-moe",
        lambda sd: sd.update({QWEN.format(j=0, w="up_proj"): torch.zeros(16, 32, dtype=torch.int8)}),
        f"tensor {QWEN.format(j=0, w='up_proj')!r} in model.safetensors is stored as int8",
    ),
    "stored-twice": (
        "mixtral",
        lambda sd: sd.update({"model.layers.1.mlp.experts.down_proj": torch.zeros(4, 32, 48)}),
        "holds them one by one as well",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_experts_that_do_not_match_the_config_are_refused(
    case: str, saved: dict[str, tuple[Path, Path, Any]], tmp_path: Path
) -> None:
    family, change, message = BAD[case]
    folder = _broken(saved[family][0], tmp_path / case, change)
    for stream in (False, True):
        with pytest.raises(CheckpointError) as err:
            load_model(folder, stream=stream)
        assert str(folder) in str(err.value) and message in str(err.value), str(err.value)


def test_fused_experts_of_the_wrong_count_are_refused(saved: dict[str, tuple[Path, Path, Any]], tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.gate_up_proj"
    folder = _broken(saved["mixtral"][1], tmp_path / "fused", lambda sd: sd.update({name: sd[name][:3].clone()}))
    with pytest.raises(CheckpointError, match=r"has shape \(3, 96, 32\) in the checkpoint, but config.json implies"):
        load_model(folder, stream=True)


# ---------------------------------------------------------------------------------------------
# The CLI: a merge of two Mixtral folders


def test_cli_merges_two_mixtral_folders_in_memory_and_streamed(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """weight-matching on two seeds, once in memory (evaluated: the barrier's ends are A's and B's
    losses) and once streamed; both outputs load with the stock class, per expert like the inputs."""
    from hf_rebasin.evaluation.data import char_tokenizer

    text = "the quick brown fox jumps over the lazy dog. " * 40
    for seed in (0, 1):
        tiny.mixtral(seed).save_pretrained(tmp_path / f"m{seed}")
        char_tokenizer(text).save_pretrained(str(tmp_path / f"m{seed}"))
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds-cache"))
    models = [str(tmp_path / "m0"), str(tmp_path / "m1")]
    outputs = {}
    for stream in (False, True):
        name = "streamed" if stream else "memory"
        body: dict[str, Any] = {
            "job": "merge",
            "models": models,
            "strategy": "weight-matching",
            "output": {"dir": str(tmp_path / name)},
            "cache": False,
            "device": "cpu",
        }
        if not stream:
            data = {"dataset": "text", "data_files": str(tmp_path / "text.txt")}
            body["evaluate"] = {"task": "causal-lm", "data": data, "points": 3}
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(yaml.safe_dump(body), encoding="utf-8")
        monkeypatch.setattr(
            importlib.import_module("hf_rebasin.run.plan"), "streamed", lambda _recipe, _models, s=stream: s
        )
        capsys.readouterr()
        code = main([str(recipe)])
        assert code == 0, capsys.readouterr().err
        outputs[name] = tmp_path / name
    for name, folder in outputs.items():
        assert _layout(_keys(folder)) == "per-expert", name
        merged = T.AutoModelForCausalLM.from_pretrained(str(folder))
        assert type(merged) is T.MixtralForCausalLM
    memory, streamed = (_tensors(outputs[n]) for n in ("memory", "streamed"))
    assert memory.keys() == streamed.keys()
    assert all(float((memory[k] - streamed[k]).abs().max()) <= 1e-5 for k in memory)
    # the barrier's ends: λ = 0 is A and λ = 1 is B (aligned, the same function), as the plain
    # average's curve, which moves neither model, measures them
    curves = json.loads((outputs["memory"] / "rebasin.json").read_text())["curves"]
    ours, plain = curves["weight-matching"], curves["vanilla"]
    assert ours["lambdas"][0] == 0.0 and ours["lambdas"][-1] == 1.0
    assert abs(ours["loss"][0] - plain["loss"][0]) <= 1e-5
    assert abs(ours["loss"][-1] - plain["loss"][-1]) <= 1e-5
    assert abs(ours["loss"][0] - ours["loss"][-1]) > 1e-3  # two different models


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out
