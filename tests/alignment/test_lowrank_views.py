"""Weight views computed from low-rank factors equal the views of the dense matrices those factors
multiply out to, as the dense path (`WeightViews`) computes them, for every space under a random
transform of each class: fused QKV (GPT-2), grouped heads and gated units (Llama), a tied head."""

from __future__ import annotations

import pytest
import torch

import tiny
from hf_rebasin.alignment.features import WeightViews
from hf_rebasin.alignment.features.lowrank import LowRank, LowRankViews, factorable
from hf_rebasin.alignment.features.weights import ExpertBlocks
from hf_rebasin.alignment.strategies.engines.descent import dense
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.canonical import canonicalize


def _low_rank(state: dict[str, torch.Tensor], graph, rank: int, seed: int):
    """Every factorable matrix replaced by a random rank-``rank`` product (its factors kept)."""
    g = torch.Generator().manual_seed(seed)
    factors, dense_state = {}, dict(state)
    for name, t in state.items():
        if t.dim() == 2 and factorable(graph, name):
            f = LowRank(torch.randn(t.shape[0], rank, generator=g), torch.randn(rank, t.shape[1], generator=g))
            factors[name], dense_state[name] = f, f.dense()
    for alias, source in graph.ties.items():
        if source in dense_state:
            dense_state[alias] = dense_state[source]
    return factors, dense_state


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa", "llama-tied-bias", "gemma2", "qwen3-moe"])
@pytest.mark.parametrize("cls", ["permutation", "orthogonal"])
def test_views_from_factors_equal_the_dense_views(family, cls):
    model = tiny.FACTORIES[family](0)
    sd = model.state_dict()
    canonical, graph, _ = canonicalize(graph_for(model.config, sd.keys()), sd)
    canonical = dict(canonical)
    fa, da = _low_rank(canonical, graph, 3, seed=1)
    fb, db = _low_rank(canonical, graph, 3, seed=2)
    assert fa, "no matrix was factored"
    transform = graph.random_transform(cls, torch.Generator().manual_seed(5))
    dense_views = WeightViews(graph, da, db)
    factored = LowRankViews(graph, da, db, fa, fb)
    for space in graph.spaces:
        want, got = dense_views(transform, space), factored(transform, space)
        assert want.keys() == got.keys(), space
        for role in want:
            w, f = want[role], got[role]
            if isinstance(w, ExpertBlocks):  # an expert space's units (stacked experts: never factored)
                assert isinstance(f, ExpertBlocks)
                pairs = [(w.block(a, b), f.block(a, b)) for a in range(w.experts) for b in range(w.experts)]
            else:
                pairs = [(dense(w), dense(f))]
            for wd, fd in pairs:
                scale = float(wd.abs().max())
                torch.testing.assert_close(fd, wd, atol=1e-4 * scale, rtol=1e-4, msg=f"{space} {role}")
