"""Work in progress (issue 32): a narrower model written into a wider shape of its family
(`hf_rebasin.embed`), checked against the stock classes: the wide model computes the narrow one's
logits (the wide config's norm ε scaled by d/d′)."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny
from hf_rebasin.adapters import graph_for
from hf_rebasin.canonical import canonicalize
from hf_rebasin.embed import embed_state, residual_ratio
from hf_rebasin.errors import IncompatibleModelsError
from hf_rebasin.offload import empty_model

EPS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps")
WIDER = {  # hidden 32 → 48, units → 64, heads 4 → 6 (KV groups 2 → 3), head_dim kept
    "llama-gqa": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
    "qwen3-untied": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3),
    "phi3": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
    "mixtral": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
    "gpt-neox": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6),
    "gpt2": dict(n_embd=48, n_inner=160, n_head=6),
}
CANONICAL = {"gpt2", "gpt-neox"}  # LayerNorm streams: embedded from the canonical form (mean 0 over d)


def _widened(case: str, sizes: dict) -> float:
    model = tiny.FACTORIES[case](0).eval()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    narrow_config = copy.deepcopy(model.config)
    if case in CANONICAL:
        sd, graph, untied = canonicalize(graph, sd)
        narrow_config.tie_word_embeddings = not untied and narrow_config.tie_word_embeddings
    config = copy.deepcopy(narrow_config)
    for k, v in sizes.items():
        setattr(config, k, v)
    shapes = {k: tuple(t.shape) for k, t in empty_model(type(model), config).state_dict().items()}
    wide_graph = graph_for(config, shapes.keys())
    for ratio in residual_ratio(graph, wide_graph).values():
        for name in EPS:
            if isinstance(getattr(config, name, None), float):
                setattr(config, name, getattr(config, name) * ratio)
    small = type(model)(narrow_config).eval()
    small.load_state_dict(sd)
    wide = type(model)(config).eval()
    wide.load_state_dict(embed_state(graph, sd, wide_graph, shapes))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((small(ids).logits - wide(ids).logits).abs().max())


@pytest.mark.parametrize("case", sorted(WIDER))
def test_a_wider_stock_model_computes_the_narrow_ones_logits(case: str) -> None:
    assert _widened(case, WIDER[case]) <= 1e-4


@pytest.mark.parametrize(
    "sizes", [dict(intermediate_size=64), dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8)]
)
def test_units_and_heads_alone_embed_bit_exactly(sizes: dict) -> None:
    assert _widened("llama-gqa", sizes) == 0.0


@pytest.mark.parametrize(
    ("case", "sizes", "why"),
    [
        ("llama-gqa", dict(head_dim=12, num_attention_heads=4, num_key_value_heads=2), "rotary"),
        ("mixtral", dict(num_local_experts=6), "routing weight"),
        ("llama-gqa", dict(intermediate_size=16), "narrower"),
    ],
)
def test_what_cannot_be_embedded_is_refused_with_the_reason(case: str, sizes: dict, why: str) -> None:
    with pytest.raises(IncompatibleModelsError, match=why):
        _widened(case, sizes)
