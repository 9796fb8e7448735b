"""head-perm's `residual` when a recipe leaves it unset: `all` (the best choice on the benchmark
zoo), except for streamed models whose every-site statistics would be large; then `identity`."""

from __future__ import annotations

import pytest
import torch

import tiny
from hf_rebasin.alignment.strategies import AlignmentData, Pair, align, get_strategy
from hf_rebasin.alignment.strategies.head_perm import default_residual
from hf_rebasin.alignment.strategies.options import RESIDUAL_MOMENTS_FLOOR, residual_moment_bytes
from hf_rebasin.symmetry.adapters import graph_for


def _data() -> AlignmentData:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, tiny.V, (4, 12), generator=g) for _ in range(3)]
    return AlignmentData([{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids])


def test_unset_residual_runs_all_in_memory_and_says_so():
    a, b = tiny.gpt2(0), tiny.gpt2(1)
    graph = graph_for(a.config, a.state_dict().keys())
    pair = Pair(graph, a.state_dict(), b.state_dict(), a, b, _data())
    unset = align("head-perm", pair, {})
    explicit = align("head-perm", pair, {"residual": "all"})
    identity = align("head-perm", pair, {"residual": "identity"})
    assert get_strategy("head-perm").parse({}).residual is None  # type: ignore[attr-defined]
    assert unset.resolved == {"residual": "all"} and explicit.resolved == {}
    assert any(n.startswith("residual: all (unset in the recipe; the models are in memory") for n in unset.notes)
    res = [n for n in graph.spaces if n.startswith("res")]
    assert res and all(torch.equal(unset.transform[n].index, explicit.transform[n].index) for n in res)
    # `identity` leaves the stream alone; `all` permutes it
    assert all(identity.transform.get(n) is None or identity.transform[n].is_identity() for n in res)
    assert not all(unset.transform[n].is_identity() for n in res)


def _skeleton(config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("name", "config", "params", "streamed_choice"),
    [
        # GPT-2 small: 25 sites × (2·768)² × 8 B = 472 MB of statistics: under 1 GiB, so `all`
        ("gpt2-small", {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12}, 124.4e6, "all"),
        # Qwen3-0.6B: 57 sites × (2·1024)² × 8 B = 1.91 GB > 1 GiB and > 2 B × 0.6B params
        (
            "qwen3-0.6b",
            {
                "model_type": "qwen3",
                "hidden_size": 1024,
                "intermediate_size": 3072,
                "num_hidden_layers": 28,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
            },
            596.0e6,
            "identity",
        ),
    ],
)
def test_streamed_models_with_large_statistics_take_identity(name, config, params, streamed_choice):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**config)
    model = _skeleton(cfg)
    graph = graph_for(cfg, model.state_dict().keys())
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - params) / params < 0.01, count  # the published sizes
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    assert residual_moment_bytes(layers, d) == (2 * layers + 1) * 8 * (2 * d) ** 2
    assert default_residual(graph, model, streamed=False) == "all"
    assert default_residual(graph, model, streamed=True) == streamed_choice
    big = residual_moment_bytes(layers, d) > max(2 * count, RESIDUAL_MOMENTS_FLOOR)
    assert (streamed_choice == "identity") == big


def test_a_tiny_streamed_model_takes_all():
    model = tiny.llama(0)
    graph = graph_for(model.config, model.state_dict().keys())
    config = model.config
    assert residual_moment_bytes(config.num_hidden_layers, config.hidden_size) < RESIDUAL_MOMENTS_FLOOR
    assert default_residual(graph, model, streamed=True) == "all"
