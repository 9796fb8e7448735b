"""Unit tests of the graph primitives and solvers (pure tensors, no transformers)."""

from __future__ import annotations

import pytest
import torch

from hf_rebasin.alignment.solvers import lap, plane_rotations, procrustes
from hf_rebasin.core.errors import TransformError
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import Binding, Fused, HeadSpace, Space
from hf_rebasin.symmetry.transforms import AxisMap, HeadMap, random_head_map, random_orthogonal, rotary_plane_rotations


def test_axis_map_rule_is_the_same_for_in_and_out_axes():
    g = torch.Generator().manual_seed(0)
    o = random_orthogonal(5, g)
    m = AxisMap(5, blocks=o[None])
    w = torch.randn(5, 5, dtype=torch.float64, generator=g)
    torch.testing.assert_close(m.apply(w, 0), o @ w)  # output axis: T W
    torch.testing.assert_close(m.apply(w, 1), w @ o.T)  # input axis: W Tᵀ
    perm = torch.randperm(5, generator=g)
    p = AxisMap(5, index=perm)
    torch.testing.assert_close(p.apply(w, 0), p.matrix() @ w)
    torch.testing.assert_close(p.apply(w, 1), w @ p.matrix().T)


def test_random_orthogonal_fixing_ones():
    o = random_orthogonal(7, torch.Generator().manual_seed(1), fix_ones=True)
    torch.testing.assert_close(o @ o.T, torch.eye(7, dtype=torch.float64))
    torch.testing.assert_close(o @ torch.ones(7, dtype=torch.float64), torch.ones(7, dtype=torch.float64))


def test_head_map_keeps_heads_whole_and_groups_together():
    space = HeadSpace("attn", num_heads=4, num_kv_heads=2, head_dim=3)
    hm = HeadMap(
        torch.tensor([1, 0]),
        torch.tensor([[1, 0], [0, 1]]),
        torch.tensor([[2, 0, 1], [0, 1, 2]]),
        torch.tensor([[0, 1, 2], [1, 2, 0]]),
    )
    k = hm.expand(space, "k").index.tolist()
    assert k == [5, 3, 4, 0, 1, 2]  # kv slot 0 ← old kv head 1 with inner perm (2, 0, 1)
    q = hm.expand(space, "q").index.tolist()
    # q slot (0, 0) ← old q head (group 1, member 1) = head 3, with kv slot 0's inner perm
    assert q[:3] == [11, 9, 10] and q[3:6] == [8, 6, 7]
    o = hm.expand(space, "o").index.tolist()
    assert o[:3] == [9, 10, 11]  # V/O inner map of slot 0 is the identity


def test_rotary_rotation_commutes_with_rope():
    # RoPE rotates plane (j, j + d/2) by position × frequency_j; a fixed rotation in the same plane commutes.
    d = 8
    r = rotary_plane_rotations(torch.rand(1, d // 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))[
        0
    ]
    rope = rotary_plane_rotations(torch.linspace(0.1, 2.0, d // 2, dtype=torch.float64)[None])[0]
    torch.testing.assert_close(r @ rope, rope @ r)
    # …while a permutation of two planes does not (different frequencies).
    p = torch.eye(d, dtype=torch.float64)[[1, 0, 2, 3, 5, 4, 6, 7]]
    assert not torch.allclose(p @ rope, rope @ p)


def _toy_graph() -> SymmetryGraph:
    spaces = {
        "res": Space("res", 4, "orthogonal", kind="residual"),
        "mlp": Space("mlp", 6, kind="mlp"),
        "attn": HeadSpace("attn", 2, 2, 2),
    }
    bindings = {
        "emb": Binding("emb", (None, "res")),
        "qkv": Binding("qkv", ("res", Fused(("attn:q", "attn:k", "attn:v")))),
        "o": Binding("o", ("res", "attn:o")),
        "up": Binding("up", ("mlp", "res")),
        "down": Binding("down", ("res", "mlp")),
        "norm.weight": Binding("norm.weight", ("res",), norm_scale=True),
        "head": Binding("head", (None, "res")),
    }
    return SymmetryGraph("toy", spaces, bindings, ties={"head": "emb"})


def test_apply_handles_fused_ties_and_norms():
    graph = _toy_graph()
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(10, 4, generator=g)
    sd = {
        "emb": emb,
        "qkv": torch.randn(4, 12, generator=g),
        "o": torch.randn(4, 4, generator=g),
        "up": torch.randn(6, 4, generator=g),
        "down": torch.randn(4, 6, generator=g),
        "norm.weight": torch.randn(4, generator=g),
        "head": emb,
    }
    graph.check(sd)
    t = graph.random_transform("permutation", g)
    out = graph.apply(sd, t)
    assert out["head"] is out["emb"]  # a tie is transformed once and stays a tie
    res = t["res"].index
    torch.testing.assert_close(out["norm.weight"], sd["norm.weight"][res])
    q_idx = graph.axis_map(t, "attn:q").index
    torch.testing.assert_close(out["qkv"][:, :4], sd["qkv"][res][:, q_idx])
    # orthogonal on a space whose norm scale is not uniform is refused
    with pytest.raises(TransformError, match="canonical form"):
        graph.apply(sd, graph.random_transform("orthogonal", g))
    sd["norm.weight"] = torch.ones(4)
    graph.apply(sd, graph.random_transform("orthogonal", g))


def test_check_names_the_tensor():
    graph = _toy_graph()
    sd = {"emb": torch.zeros(10, 5)}
    with pytest.raises(Exception, match="'emb'"):
        graph.check(sd | {k: torch.zeros(1) for k in graph.bindings if k != "emb"})


def test_orthogonal_refused_on_permutation_space():
    graph = _toy_graph()
    t = graph.identity()
    t["mlp"] = AxisMap(6, blocks=random_orthogonal(6, torch.Generator())[None])
    with pytest.raises(TransformError, match="only permutations"):
        graph.apply({}, t)


def test_solvers_recover_known_maps():
    g = torch.Generator().manual_seed(4)
    perm = torch.randperm(9, generator=g)
    m = torch.eye(9, dtype=torch.float64)[perm] * 3 + 0.1 * torch.rand(9, 9, generator=g, dtype=torch.float64)
    found, _ = lap(m)
    assert torch.equal(found, perm)
    o = random_orthogonal(6, g)
    found_o, value = procrustes(o)
    torch.testing.assert_close(found_o, o)
    assert value == pytest.approx(6.0)
    o1 = random_orthogonal(6, g, fix_ones=True)
    found_o1, _ = procrustes(o1, fix_ones=True)
    torch.testing.assert_close(found_o1, o1)
    r = rotary_plane_rotations(torch.rand(1, 3, generator=g, dtype=torch.float64))[0]
    found_r, _ = plane_rotations(r)
    torch.testing.assert_close(found_r, r)


def test_random_head_map_respects_rotary():
    space = HeadSpace("a", 4, 2, 4, rotary=True)
    hm = random_head_map(space, "permutation", torch.Generator().manual_seed(0))
    assert torch.equal(hm.qk, torch.arange(4).expand(2, 4))  # no Q/K inner permutation under RoPE
    hm = random_head_map(space, "orthogonal", torch.Generator().manual_seed(0))
    i, j = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    other_plane = (i % 2) != (j % 2)  # head_dim 4: planes (0, 2) and (1, 3)
    for block in hm.qk:  # only proper rotations inside rotary planes
        assert torch.all(block[other_plane] == 0)
        assert torch.linalg.det(block).item() == pytest.approx(1.0)
        assert not torch.allclose(block, torch.eye(4, dtype=torch.float64))
