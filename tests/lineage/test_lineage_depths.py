"""Lineage across depths: pruned, up-scaled and two-parent stacked descendants are mapped layer by
layer, each matched layer with its p-value; models trained apart are not called related at any
depth; merge refuses other depths and says what to do."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from test_lineage import _fine_tuned

import tiny
from helpers import assert_user_error, run_main
from hf_rebasin.io.models import load_model
from hf_rebasin.lineage.compare import ALPHA
from hf_rebasin.lineage.pairs import lineage_of
from hf_rebasin.lineage.record import LineageRecord
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.canonical import canonicalize

LAYERS = {
    "gpt2": "n_layer",
    "llama-gqa": "num_hidden_layers",
    "dinov2-cls": "num_hidden_layers",
    "t5-encoder": "num_layers",
}
KEYS = {
    "gpt2": "transformer.h",
    "llama-gqa": "model.layers",
    "dinov2-cls": "dinov2.encoder.layer",
    "t5-encoder": "encoder.block",
}


def _deep(family: str, seed: int, layers: int = 4) -> torch.nn.Module:
    """A random model of ``family`` with ``layers`` layers (the tiny zoo's widths)."""
    config = copy.deepcopy(tiny.FACTORIES[family](seed).config)
    setattr(config, LAYERS[family], layers)
    torch.manual_seed(seed)
    return type(tiny.FACTORIES[family](seed))(config).eval()


def _stacked(
    family: str, parents: list[torch.nn.Module], sources: list[tuple[int, int]], noise: float = 0.05, seed: int = 1
) -> torch.nn.Module:
    """A model whose layer j is ``parents[p]``'s layer i for ``(p, i) = sources[j]`` (embeddings and
    head from the first parent), then fine-tuned (noise)."""
    key = re.escape(KEYS[family])
    pattern = re.compile(rf"^{key}\.(\d+)\.(.*)$")
    config = copy.deepcopy(parents[0].config)
    setattr(config, LAYERS[family], len(sources))
    child = type(parents[0])(config).eval()
    states = [p.state_dict() for p in parents]
    out = {}
    for name in child.state_dict():
        found = pattern.match(name)
        if found is None:
            out[name] = states[0][name]
        else:
            p, i = sources[int(found.group(1))]
            out[name] = states[p][f"{KEYS[family]}.{i}.{found.group(2)}"]
    child.load_state_dict(_fine_tuned(out, noise, seed), strict=False)
    return child


def _lineage(models: list[torch.nn.Module], tmp_path: Path) -> LineageRecord:
    folders = []
    for k, m in enumerate(models):
        m.save_pretrained(str(tmp_path / f"m{k}"))
        folders.append(str(tmp_path / f"m{k}"))
    return lineage_of([load_model(f) for f in folders], folders)


def _sources(record: LineageRecord, pair: int = 0) -> list[int | None]:
    lmap = record.pairs[pair].layer_map
    assert lmap is not None
    return [m.source for m in lmap.layers]


# DINOv2 and a T5 encoder name their spaces apart from their tensors (``enc.*``, ``layer.{i}``): one case each
@pytest.mark.parametrize(
    ("family", "kept", "kind"),
    [
        *(
            (family, kept, kind)
            for family in ("gpt2", "llama-gqa")
            for kept, kind in (
                ([0, 2, 4], "depth-pruned"),
                ([0, 1, 2, 3], "depth-pruned"),
                ([0, 1, 2, 3, 2, 3, 4, 5], "depth up-scaled"),
            )
        ),
        ("dinov2-cls", [0, 2, 4], "depth-pruned"),
        ("t5-encoder", [0, 1, 2, 3, 2, 3, 4, 5], "depth up-scaled"),
    ],
)
def test_a_pruned_or_up_scaled_fine_tune_is_mapped_layer_by_layer(family: str, kept: list[int], kind: str, tmp_path):
    parent = _deep(family, 0, 6)
    child = _stacked(family, [parent], [(0, i) for i in kept])
    record = _lineage([parent, child], tmp_path)
    pair = record.pairs[0]
    assert pair.verdict == "same basis", [(e.space, e.z, e.in_place) for e in pair.spaces]
    lmap = pair.layer_map
    assert lmap is not None and lmap.model == 1 and lmap.parents == [0] and lmap.kind == kind
    assert _sources(record) == kept
    assert all(m.log10_p < math.log10(ALPHA) for m in lmap.layers)
    assert "mergekit" in pair.next_step and "refuse" in pair.next_step
    slices = yaml.safe_load(lmap.mergekit)["slices"]
    built = [i for s in slices for i in range(*s["sources"][0]["layer_range"])]
    assert built == kept  # the passthrough config builds the parent's layers at the child's depth


def test_the_map_does_not_depend_on_which_model_is_given_first(tmp_path: Path) -> None:
    parent = _deep("gpt2", 0, 6)
    child = _stacked("gpt2", [parent], [(0, i) for i in (0, 2, 4)])
    record = _lineage([child, parent], tmp_path)
    lmap = record.pairs[0].layer_map
    assert lmap is not None and lmap.model == 0 and lmap.parents == [1]
    assert _sources(record) == [0, 2, 4]


def test_an_up_scaled_copy_in_another_basis_is_related_with_its_map(tmp_path: Path) -> None:
    parent = _deep("llama-gqa", 0, 4)
    child = _stacked("llama-gqa", [parent], [(0, i) for i in (0, 1, 2, 1, 2, 3)])
    sd, graph, _ = canonicalize(graph_for(child.config, child.state_dict().keys()), child.state_dict())
    moved = graph.apply(sd, graph.random_transform("orthogonal", torch.Generator().manual_seed(3)))
    child.load_state_dict(moved)
    record = _lineage([parent, child], tmp_path)
    assert record.pairs[0].verdict == "related up to symmetry"
    assert _sources(record) == [0, 1, 2, 1, 2, 3]
    assert "align first" in record.pairs[0].next_step


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa"])
def test_models_trained_apart_are_independent_at_other_depths(family: str, tmp_path: Path) -> None:
    parent, other = _deep(family, 0, 6), _deep(family, 1, 6)
    pruned = _stacked(family, [other], [(0, i) for i in (0, 2, 4)])
    stacked = _stacked(family, [other], [(0, i) for i in (0, 1, 2, 3, 2, 3, 4, 5)])
    record = _lineage([parent, pruned, stacked], tmp_path)
    verdicts = {(p.a, p.b): p.verdict for p in record.pairs}
    assert verdicts[(0, 1)] == verdicts[(0, 2)] == "independent"
    for pair in record.pairs[:2]:
        assert pair.layer_map is not None and all(m.source is None for m in pair.layer_map.layers)
        assert "mergekit" not in pair.next_step
    assert verdicts[(1, 2)] != "independent"  # the two descendants of seed 1 are kin


def _check_stack(record: LineageRecord, sources: list[tuple[int, int]]) -> None:
    assert len(record.layer_maps) == 1, [(p.a, p.b, p.verdict) for p in record.pairs]
    stack = record.layer_maps[0]
    assert stack.model == 2 and stack.parents == [0, 1] and stack.kind == "stacked from several parents"
    assert [(m.parent, m.source) for m in stack.layers] == sources
    assert all(m.log10_p < math.log10(ALPHA) for m in stack.layers)
    built = [
        (s["sources"][0]["model"], r)
        for s in yaml.safe_load(stack.mergekit)["slices"]
        for r in range(*s["sources"][0]["layer_range"])
    ]
    assert built == [(record.models[p].given, i) for p, i in sources]


# each family and each depth once in the fast suite (the same-depth Llama, the deeper GPT-2); the
# other two with the slow tests
_SAME, _DEEPER = [(0, 0), (0, 1), (1, 2), (1, 3)], [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
PASSTHROUGHS = [
    pytest.param("llama-gqa", _SAME, id="same-llama-gqa"),
    pytest.param("gpt2", _DEEPER, id="deeper-gpt2"),
    pytest.param("gpt2", _SAME, id="same-gpt2", marks=pytest.mark.slow),
    pytest.param("llama-gqa", _DEEPER, id="deeper-llama-gqa", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "sources"), PASSTHROUGHS)
def test_a_passthrough_stack_of_two_models_trained_apart_is_mapped_to_both(family, sources, tmp_path: Path) -> None:
    p1, p2 = _deep(family, 0, 4), _deep(family, 1, 4)
    record = _lineage([p1, p2, _stacked(family, [p1, p2], sources)], tmp_path)
    _check_stack(record, sources)
    verdicts = {(p.a, p.b): p.verdict for p in record.pairs}
    assert verdicts[(0, 1)] == "independent" and verdicts[(0, 2)] != "independent" != verdicts[(1, 2)]


def test_a_deeper_passthrough_of_two_fine_tunes_of_one_base_is_mapped_to_both(tmp_path: Path) -> None:
    base = _deep("gpt2", 0, 4)
    p1, p2 = (_stacked("gpt2", [base], [(0, i) for i in range(4)], 0.3, seed) for seed in (1, 2))
    sources = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
    record = _lineage([p1, p2, _stacked("gpt2", [p1, p2], sources, 0.05, 3)], tmp_path)
    _check_stack(record, sources)


def test_siblings_are_not_called_a_stack(tmp_path: Path) -> None:
    base = _deep("gpt2", 0, 4)
    kids = [_stacked("gpt2", [base], [(0, i) for i in range(4)], 0.3, seed) for seed in (1, 2, 3)]
    assert _lineage(kids, tmp_path).layer_maps == []


def test_lineage_prints_the_map_and_merge_refuses_other_depths_with_the_way_forward(saved_model, tmp_path: Path):
    parent = _deep("gpt2", 0, 4)
    child = _stacked("gpt2", [parent], [(0, 0), (0, 2)])
    a, b = str(saved_model(parent, name="deep")), str(saved_model(child, name="pruned"))
    proc = run_main("lineage", a, b, "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert re.search(r"comparing 2 models: 1 pair, about \d+ s on this machine", text), text
    assert "depth-pruned" in text and "layers 0–1 ←" not in text and "layer 1 ← 2" in text, text
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {"job": "merge", "strategy": "vanilla", "models": [a, b], "output": {"dir": str(tmp_path / "m")}}
        )
    )
    assert_user_error(run_main(str(recipe)), "layers", "hf-rebasin lineage", "passthrough")
    assert not (tmp_path / "m").exists()


def test_models_of_other_depths_that_differ_in_more_than_depth_are_refused_naming_a_tensor(tmp_path: Path) -> None:
    from hf_rebasin.core.errors import IncompatibleModelsError

    plain = _deep("llama-gqa", 0, 2)
    config = copy.deepcopy(plain.config)
    config.num_hidden_layers, config.attention_bias = 3, True
    biased = type(plain)(config)
    with pytest.raises(
        IncompatibleModelsError, match=r"differ in more than depth \(tensor 'model\.layers\.0\.self_attn"
    ):
        _lineage([plain, biased], tmp_path)


def test_job_lineage_maps_other_depths_from_a_recipe(saved_model, tmp_path: Path) -> None:
    parent = _deep("gpt2", 0, 4)
    child = _stacked("gpt2", [parent], [(0, 0), (0, 1), (0, 2), (0, 1), (0, 2), (0, 3)])
    a, b = str(saved_model(parent, name="base")), str(saved_model(child, name="upscaled"))
    recipe = tmp_path / "lineage.yaml"
    recipe.write_text(yaml.safe_dump({"job": "lineage", "models": [a, b], "output": {"dir": str(tmp_path / "out")}}))
    proc = run_main(str(recipe))
    assert proc.returncode == 0, proc.stderr
    record = LineageRecord.model_validate_json((tmp_path / "out" / "lineage.json").read_text())
    assert record.pairs[0].layer_map is not None and record.pairs[0].layer_map.kind == "depth up-scaled"
    assert "depth up-scaled" in (tmp_path / "out" / "README.md").read_text()


def test_best_map_keeps_order_where_it_scores_as_well_and_repeats_where_it_must() -> None:
    from hf_rebasin.lineage.depth import best_map
    from hf_rebasin.lineage.estimate import duration

    pruned = torch.tensor([[0.9, 0.1], [0.2, 0.1], [0.1, 0.95], [0.1, 0.2]], dtype=torch.float64)
    assert best_map(pruned) == ([0, 2], True)
    upscaled = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.9, 0.88]], dtype=torch.float64)
    assert best_map(upscaled) == ([0, 1, 1], False)
    assert [duration(x) for x in (4.2, 600, 9000)] == ["4 s", "10 min", "2.5 h"]


def test_layer_maps_are_refused_for_models_with_two_streams(tmp_path: Path) -> None:
    from hf_rebasin.core.errors import IncompatibleModelsError

    clip = tiny.FACTORIES["clip"](0)
    config = copy.deepcopy(clip.config)
    config.text_config.num_hidden_layers += 1
    with pytest.raises(IncompatibleModelsError, match="one residual stream"):
        _lineage([clip, type(clip)(config)], tmp_path)
