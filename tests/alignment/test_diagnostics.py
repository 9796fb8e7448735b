"""Per-space similarity of matched features (``alignment.png``), against a hand computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiny
from hf_rebasin.alignment.diagnostics import feature_similarity
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.evaluation.report import plot_alignment
from hf_rebasin.symmetry.adapters import graph_for


def _by_space(result: dict) -> dict[str, dict]:
    return {e["space"]: e for e in result["spaces"]}


def test_mlp_similarity_is_the_mean_cosine_of_each_units_weights():
    """Independent computation: unit i of GPT-2's first MLP is column i of c_fc (and its bias) and
    row i of c_proj; the mean cosine of A's and B's unit i over all units is the 'before' value."""
    a, b = tiny.gpt2(0), tiny.gpt2(1)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    graph = graph_for(a.config, sd_a.keys())
    spaces = _by_space(feature_similarity(graph, sd_a, sd_b, graph.identity()))

    def unit(sd: dict, i: int) -> torch.Tensor:
        p = "transformer.h.0.mlp."
        return torch.cat([sd[p + "c_fc.weight"][:, i], sd[p + "c_fc.bias"][i : i + 1], sd[p + "c_proj.weight"][i]])

    n = sd_a["transformer.h.0.mlp.c_fc.bias"].numel()
    by_hand = torch.stack(
        [torch.nn.functional.cosine_similarity(unit(sd_a, i).double(), unit(sd_b, i).double(), dim=0) for i in range(n)]
    ).mean()
    assert spaces["h.0.mlp"]["before"] == pytest.approx(float(by_hand), abs=1e-12)
    assert spaces["h.0.mlp"]["features"] == n and spaces["h.0.mlp"]["kind"] == "mlp"
    assert spaces["h.0.attn"]["kind"] == "heads"


@pytest.mark.parametrize("case", ["gpt2", "llama-gqa", "bert-mlm"])
def test_a_recovered_transform_matches_every_feature_exactly(case):
    """B = A under a random permutation: before alignment features differ, after weight matching
    (which recovers it) every matched feature is its twin, cosine 1."""
    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sd_b = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(2)))
    alignment = align("weight-matching", Pair(graph, sd, sd_b))
    spaces = _by_space(feature_similarity(graph, sd, sd_b, alignment.transform))
    assert set(spaces) == set(graph.spaces)
    for name, entry in spaces.items():
        assert entry["after"] == pytest.approx(1.0, abs=1e-9), name
    assert min(e["before"] for e in spaces.values()) < 0.9


def test_alignment_plot_is_a_png(tmp_path: Path):
    model = tiny.gpt2(0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    result = feature_similarity(graph, sd, tiny.gpt2(1).state_dict(), graph.identity())
    path = plot_alignment(result, tmp_path / "alignment.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no spaces"):
        plot_alignment({"spaces": []}, tmp_path / "none.png")


def _mlp_inputs(model: torch.nn.Module, batches: list[dict]) -> torch.Tensor:
    """GPT-2's first MLP units (c_proj's input) at kept positions, read with a plain torch hook."""
    seen: list[torch.Tensor] = []
    hook = model.transformer.h[0].mlp.c_proj.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    hook.remove()
    return torch.cat(
        [
            t[b["attention_mask"].bool()] if "attention_mask" in b else t.flatten(0, 1)
            for t, b in zip(seen, batches, strict=True)
        ]
    )


@pytest.mark.parametrize("case", ["gpt2", "llama-gqa", "bert-mlm"])
def test_head_perm_reports_activation_correlation_of_matched_features(case):
    """head-perm's alignment.png shows activation correlations (Verma & Elbayad's Fig. 4): B = A
    permuted, so after alignment every matched feature correlates 1 with its twin; on two unrelated
    models "before" is the mean diagonal of the plain correlation matrix."""
    from hf_rebasin.alignment.strategies import AlignmentData
    from hf_rebasin.alignment.verify import example_inputs
    from hf_rebasin.io.rebuild import rebuild
    from hf_rebasin.symmetry.adapters import get_adapter

    model = tiny.FACTORIES[case](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    spec = get_adapter(model.config.model_type)
    data = AlignmentData([example_inputs(spec, model.config, torch.Generator().manual_seed(i)) for i in range(4)])
    sd_b = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(2)))
    alignment = align("head-perm", Pair(graph, sd, sd_b, model, rebuild(model, sd_b), data), {"residual": "last"})
    result = alignment.diagnostics["alignment"]
    assert result["measure"] == "activation correlation of matched features"
    spaces = _by_space(result)
    assert set(spaces) == {n for n in graph.spaces if n in alignment.transform and graph.users(n)} - {"pooler", "head"}
    for name, entry in spaces.items():
        assert entry["after"] == pytest.approx(1.0, abs=1e-6), name
    assert min(e["before"] for e in spaces.values()) < 0.9
    if case == "gpt2":
        other = tiny.gpt2(1)
        moved = align("head-perm", Pair(graph, sd, other.state_dict(), model, other, data), {})
        a, b = _mlp_inputs(model, data.batches), _mlp_inputs(other, data.batches)
        corr = torch.corrcoef(torch.cat([a.T, b.T]).double())[: a.shape[1], a.shape[1] :]
        entry = _by_space(moved.diagnostics["alignment"])["h.0.mlp"]
        assert entry["before"] == pytest.approx(float(corr.diagonal().mean()), abs=1e-6)
        assert entry["after"] > entry["before"]
