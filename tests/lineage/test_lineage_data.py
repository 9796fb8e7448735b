"""Lineage with alignment data: the maps fitted on activations are the transform that moved B (every
family's symmetry classes), they start an alignment that finds what the weights alone miss, and the
recipe job takes `data`."""

from __future__ import annotations

import pytest
import torch
import yaml
from test_lineage import _fine_tuned, _transformed

import tiny
from helpers import assert_user_error, run_main
from hf_rebasin.lineage import compare
from hf_rebasin.lineage.compare import prepared
from hf_rebasin.lineage.datamaps import LineageData, data_maps
from hf_rebasin.lineage.record import LineageRecord
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from lm_folders import save_lm

FAMILIES = ["gpt2", "llama-gqa", "gemma2", "qwen3-moe", "bert-mlm", "vit"]


def _batches(model: torch.nn.Module, n: int = 6) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    config = model.config
    if getattr(config, "model_type", "") == "vit":
        size, ch = config.image_size, config.num_channels
        return [{"pixel_values": torch.randn(16, ch, size, size, generator=g)} for _ in range(n)]
    ids = torch.randint(0, config.vocab_size, (8, 32), generator=g)
    return [{"input_ids": ids.roll(i, 0) if i else ids, "attention_mask": torch.ones_like(ids)} for i in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_maps_fitted_on_activations_undo_the_transform_that_moved_b(family):
    """B is A under a random transform of its family's richest class: the maps found from the two
    models' activations alone bring B's weights back onto A's, tensor by tensor."""
    model = tiny.FACTORIES[family](0).eval()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    a, cgraph, untie, _ = prepared(graph, sd)
    b, _, _, _ = prepared(graph, _transformed(model, sd, "orthogonal", seed=3))
    fitted, tokens = data_maps(cgraph, a, b, untie, LineageData(_batches(model), model))
    assert tokens > 0 and set(fitted) == set(cgraph.spaces)
    back = cgraph.apply(b, {**cgraph.identity(), **fitted})
    moved = [k for k in a if a[k].is_floating_point() and not torch.allclose(a[k], b[k], atol=1e-5)]
    assert moved, "the transform moved nothing"
    for k in a:
        scale = a[k].abs().max().item() + 1e-12
        assert (back[k] - a[k]).abs().max().item() <= 1e-3 * scale, k


def test_data_finds_a_heavily_noised_moved_copy_that_the_weights_alone_miss():
    """A random model moved and then noised by 45 % of each weight's RMS: its top directions are
    reshuffled, so the data-free alignment calls it independent; started from the activations'
    maps, the alignment finds it. Another seed stays independent with data."""
    model = tiny.FACTORIES["llama-gqa"](0).eval()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    moved = _transformed(model, _fine_tuned(sd, scale=0.45), "orthogonal", seed=5)
    data = LineageData(_batches(model, 8), model)
    free = compare(graph, sd, moved)
    found = compare(graph, sd, moved, data=data)
    apart = compare(graph, sd, tiny.FACTORIES["llama-gqa"](1).state_dict(), data=data)
    assert found.verdict == "related up to symmetry", (free.statistic, found.statistic)
    assert found.statistic > free.statistic + 0.1
    assert apart.verdict == "independent" and abs(apart.statistic) < 0.1
    assert found.tokens == apart.tokens > 0 and found.passes["permutations"] == 0
    assert "activations" in found.seconds and "activations" not in free.seconds


def test_job_lineage_takes_data(tmp_path):
    """`data:` in a lineage recipe: the dry run says so, the record names the data and counts its
    tokens, the verdicts are those of the data-free run."""
    child = tiny.FACTORIES["gpt2"](0)
    child.load_state_dict(_fine_tuned(child.state_dict()))
    made = (tiny.gpt2(0), child, tiny.gpt2(1))
    models = [str(save_lm(m, tmp_path / f"m{i}")) for i, m in enumerate(made)]
    out = tmp_path / "out"
    recipe = tmp_path / "lineage.yaml"
    data = {"dataset": "shakespeare", "split": "train", "max_tokens": 2048}
    recipe.write_text(yaml.safe_dump({"job": "lineage", "models": models, "data": data, "output": {"dir": str(out)}}))
    dry = run_main(str(recipe), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "alignments started from activations on shakespeare" in dry.stdout
    proc = run_main(str(recipe))
    assert proc.returncode == 0, proc.stderr
    record = LineageRecord.model_validate_json((out / "lineage.json").read_text())
    assert [p.verdict for p in record.pairs] == ["same basis", "independent", "independent"]
    assert record.settings["data"] == "shakespeare (train)" and int(record.settings["data_tokens"]) > 1000
    assert all(p.passes["permutations"] == 0 and "activations" in p.seconds for p in record.pairs)
    assert "started from maps fitted on both models' activations" in (out / "README.md").read_text()


def test_data_too_large_for_memory_is_refused_naming_it(tmp_path, monkeypatch):
    """Activation statistics are d² per space: when they are what does not fit, the error says so."""
    import hf_rebasin.lineage.pairs as pairs

    models = [str(save_lm(tiny.gpt2(s), tmp_path / f"m{s}")) for s in (0, 1)]
    out = tmp_path / "never"
    recipe = tmp_path / "lineage.yaml"
    body = {"job": "lineage", "models": models, "data": {"dataset": "shakespeare", "split": "train"}}
    recipe.write_text(yaml.safe_dump({**body, "output": {"dir": str(out)}}))
    monkeypatch.setattr(pairs, "data_bytes", lambda lm, tokens: 1 << 40)  # the data-free part stays far below 16 GiB
    monkeypatch.setattr(pairs, "available_memory", lambda: 1 << 34)
    assert_user_error(run_main(str(recipe)), "reading the activations of `data`", "without `data` it fits")
    assert not out.exists()


def test_canonical_forms_run_as_stock_models():
    """What the activations are read from: the canonical form (γ folded, a tied head apart) computes
    the stock model's logits."""
    from hf_rebasin.io.rebuild import running

    model = tiny.FACTORIES["gpt2"](0).eval()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    canonical, _, untied = canonicalize(graph, sd)
    batch = _batches(model, 1)[0]
    with running(model, canonical, untie=bool(untied)) as form, torch.no_grad():
        assert (form(**batch).logits - model(**batch).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-moe", "vit"])
def test_models_read_from_files_run_layer_by_layer_and_find_the_same_maps(family, tmp_path, monkeypatch):
    """Streamed models never run whole: A and B go layer by layer in lockstep (one layer's
    statistics at a time, the stream's from the hidden states between layers), and the maps still
    undo the transform."""
    import hf_rebasin.lineage.datamaps as datamaps
    from hf_rebasin.io.models import load_model
    from hf_rebasin.io.rebuild import rebuild

    model = tiny.FACTORIES[family](0).eval()
    sd = model.state_dict()
    model.save_pretrained(str(tmp_path / "a"))
    rebuild(model, dict(_transformed(model, sd, "orthogonal", seed=3))).save_pretrained(str(tmp_path / "b"))
    la, lb = (load_model(tmp_path / x, stream=True) for x in "ab")
    assert la.source is not None and not isinstance(datamaps.layer_plan(la.graph, la.model), str)

    def whole(*_args, **_kwargs):
        raise AssertionError("streamed models ran whole forward passes")

    monkeypatch.setattr(datamaps, "activation_stats", whole)
    a, cgraph, untie, _ = prepared(la.graph, la.weights)
    b, _, _, _ = prepared(lb.graph, lb.weights)
    fitted, tokens = data_maps(cgraph, a, b, untie, LineageData(_batches(model), la.model))
    assert tokens > 0 and set(fitted) == set(cgraph.spaces)
    a_mem, b_mem = {k: a[k] for k in a}, {k: b[k] for k in b}
    back = cgraph.apply(b_mem, {**cgraph.identity(), **fitted})
    for k in a_mem:
        scale = a_mem[k].abs().max().item() + 1e-12
        assert (back[k] - a_mem[k]).abs().max().item() <= 1e-3 * scale, k
