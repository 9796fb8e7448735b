"""Streamed activation statistics: exact moments, sites derived from the graph, masking, lockstep
of two models, the collector's state machine, memory that does not grow with the data, and the same
numbers under accelerate with two processes as with one."""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from hf_rebasin.alignment.features import (
    Collector,
    CollectorStateError,
    CrossMoments,
    HookPlan,
    Phase,
    activation_sites,
    activation_stats,
)
from hf_rebasin.core.errors import IncompatibleModelsError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import HeadSpace
from hf_rebasin.symmetry.transforms import AxisMap, HeadMap

TESTS = Path(__file__).resolve().parents[1]
FIELDS = ("count", "sum_a", "sum_b", "sq_a", "sq_b", "cross")


def _graph(model: torch.nn.Module) -> SymmetryGraph:
    return graph_for(model.config, model.state_dict().keys())


def _tokens(n: int, batch: int = 4, length: int = 10, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Token batches (ids ≥ 2, so 0 and 1 can play special tokens); row 1 is right-padded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, tiny.V, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1, length - 3 :] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _images(n: int, batch: int = 3, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"pixel_values": torch.randn(batch, 1, 8, 8, generator=g)} for _ in range(n)]


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |Δ| / max |x|: the tolerance measure for sums of very different sizes."""
    return ((x - y).abs().max() / x.abs().max().clamp_min(1e-300)).item()


def _assert_same_moments(a: CrossMoments, b: CrossMoments, rel: float) -> None:
    for f in FIELDS:
        assert _rel(getattr(a, f), getattr(b, f)) <= rel, f


# --------------------------------------------------------------------------------------------
# CrossMoments
# --------------------------------------------------------------------------------------------


def _correlated(n: int, dtype: torch.dtype, mean: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = x[:, :4] @ torch.randn(4, 4, generator=g, dtype=torch.float64) + 0.5 * torch.randn(n, 4, generator=g)
    return (x + mean).to(dtype), (y - mean).to(dtype)


def test_moments_equal_corrcoef_of_all_data():
    x, y = _correlated(257, torch.float64, mean=3.0)
    m = CrossMoments.zeros(5, 4)
    for lo, hi in ((0, 100), (100, 100), (100, 101), (101, 257)):  # includes an empty update
        m.update(x[lo:hi], y[lo:hi])
    expected = np.corrcoef(np.hstack([x.numpy(), y.numpy()]), rowvar=False)[:5, 5:]
    corr = m.correlation()
    assert corr.dtype == torch.float64 and corr.shape == (5, 4)
    np.testing.assert_allclose(corr.numpy(), expected, atol=1e-12)
    assert m.count.item() == 257
    torch.testing.assert_close(m.sum_a, x.sum(0))
    torch.testing.assert_close(m.sq_b, (y * y).sum(0))
    torch.testing.assert_close(m.cross, x.T @ y)


def test_float32_batches_keep_precision_under_large_means():
    """Products run in float32 on batch-centred data: a mean of 1e3 (1e6 × the variance) must not
    eat the correlation, as raw float32 second moments would."""
    x, y = _correlated(3000, torch.float32, mean=1e3)
    m = CrossMoments.zeros(5, 4)
    for chunk in range(3):
        m.update(x[chunk * 1000 : (chunk + 1) * 1000], y[chunk * 1000 : (chunk + 1) * 1000])
    expected = np.corrcoef(np.hstack([x.double().numpy(), y.double().numpy()]), rowvar=False)[:5, 5:]
    np.testing.assert_allclose(m.correlation().numpy(), expected, atol=1e-5)


def test_constant_features_correlate_zero():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 3, generator=g)
    x[:, 1] = 3.7  # constant, nonzero
    y = torch.randn(50, 2, generator=g)
    y[:, 0] = 0.0  # constant zero
    m = CrossMoments.zeros(3, 2)
    m.update(x[:20], y[:20])
    m.update(x[20:], y[20:])
    corr = m.correlation()
    assert corr.dtype == torch.float64 and torch.isfinite(corr).all()
    assert (corr[1] == 0).all() and (corr[:, 0] == 0).all()
    assert corr[0, 1] != 0
    assert (CrossMoments.zeros(3, 2).correlation() == 0).all()  # nothing seen yet: no NaN either


def test_update_rejects_mismatched_rows():
    with pytest.raises(ValueError, match=r"x \[n, 3\]"):
        CrossMoments.zeros(3, 2).update(torch.zeros(4, 3), torch.zeros(5, 2))


def test_all_reduce_is_a_no_op_in_one_process():
    m = CrossMoments.zeros(2, 2)
    m.update(torch.ones(3, 2), torch.ones(3, 2))
    m.all_reduce()
    assert m.count.item() == 3 and (m.cross == 3).all()


# --------------------------------------------------------------------------------------------
# Sites
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["gpt2", "bert-mlm", "llama-gqa", "vit"])
def test_every_space_gets_a_site_of_its_size(case):
    model = tiny.FACTORIES[case](0)
    graph = _graph(model)
    sites = activation_sites(graph, model)
    by_key: dict[str, list] = {}
    for s in sites:
        by_key.setdefault(s.key, []).append(s)
    for name, space in graph.spaces.items():
        if isinstance(space, HeadSpace):
            for role in "qko":
                (site,) = by_key[f"{name}:{role}"]
                assert site.size == space.role_size(role)
                assert site.where == ("input" if role == "o" else "output")
            assert f"{name}:v" not in by_key  # v shares the inner map with o
        elif space.kind == "mlp":
            (site,) = by_key[name]
            assert site.where == "input" and site.size == space.size  # post-activation units
        elif space.kind == "residual":
            assert len(by_key[name]) >= 3
            assert all(s.where == "input" and s.size == space.size for s in by_key[name])
    for s in sites:  # every site is a real module whose features have that many columns
        assert isinstance(model.get_submodule(s.module), torch.nn.Module)


def test_fused_and_grouped_query_sites():
    gpt2 = tiny.gpt2(0)
    sites = {s.key: s for s in activation_sites(_graph(gpt2), gpt2) if s.key != "res"}
    assert sites["h.1.attn:q"].module == "transformer.h.1.attn.c_attn" and sites["h.1.attn:q"].offset == 0
    assert sites["h.1.attn:k"].module == "transformer.h.1.attn.c_attn" and sites["h.1.attn:k"].offset == 32
    assert sites["h.1.attn:o"].module == "transformer.h.1.attn.c_proj"
    assert sites["h.0.mlp"].module == "transformer.h.0.mlp.c_proj"
    llama = tiny.llama(0)
    sites = {s.key: s for s in activation_sites(_graph(llama), llama) if s.key != "res"}
    assert sites["layers.0.attn:k"].size == 16 and sites["layers.0.attn:q"].size == 32  # 2 KV heads, 4 Q heads
    assert sites["layers.0.mlp"].module == "model.layers.0.mlp.down_proj"


def test_space_filter():
    model = tiny.gpt2(0)
    graph = _graph(model)
    assert {s.key for s in activation_sites(graph, model, ["h.0.mlp", "h.1.attn"])} == {
        "h.0.mlp",
        "h.1.attn:q",
        "h.1.attn:k",
        "h.1.attn:o",
    }
    with pytest.raises(ValueError, match="no space"):
        activation_sites(graph, model, ["h.9.mlp"])


# --------------------------------------------------------------------------------------------
# Collection
# --------------------------------------------------------------------------------------------


def test_residual_groups_and_modes():
    model = tiny.llama(0)
    graph = _graph(model)
    data = _tokens(2)
    runs = {mode: activation_stats(model, tiny.llama(1), graph, data, residual=mode) for mode in ("all", "separate")}
    stats = runs["all"]
    layer = "model.layers.{}."
    groups = []
    for i in range(2):
        groups.append([layer.format(i) + f"self_attn.{p}_proj" for p in "qkv"])
        groups.append([layer.format(i) + f"mlp.{p}_proj" for p in ("gate", "up")])
    assert stats.residual_groups == [*groups, ["lm_head"]]
    assert stats.residual_spaces == ["res"] * 5
    assert stats.module_order[:4] == [layer.format(0) + f"self_attn.{p}_proj" for p in "qkvo"]
    assert len(stats.module_order) == 16  # the linears, and the final norm (the `last` state)
    assert stats.module_order[-2:] == ["model.norm", "lm_head"]
    assert stats.tokens == 2 * (4 * 10 - 3)
    assert stats.moments["res"].count.item() == 5 * stats.tokens  # 4 readers' inputs and the final state
    separate = runs["separate"].moments
    assert [k for k in separate if k.startswith("res")] == [f"res@{i}" for i in range(5)]
    # lm_head reads the final norm's output: the 5 sites of `all` are the 5 groups, each centred alone
    within = CrossMoments.within([separate[f"res@{i}"] for i in range(5)])
    _assert_same_moments(stats.moments["res"], within, 1e-12)
    for mode, index in (("first", 0), ("last", 4)):
        one = activation_stats(model, tiny.llama(1), graph, data, residual=mode)
        _assert_same_moments(one.moments["res"], separate[f"res@{index}"], 1e-12)
    none = activation_stats(model, tiny.llama(1), graph, data, residual="none")
    assert not any(k.startswith("res") for k in none.moments)
    assert set(none.moments) == {k for k in stats.moments if k != "res"}


def _corr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of the columns of a [n, d] with those of b [n, d], in float64."""
    a, b = a.double() - a.double().mean(0), b.double() - b.double().mean(0)
    return (a.T @ b) / torch.outer(a.norm(dim=0), b.norm(dim=0))


def _bert_stream(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """BERT's residual stream at every LayerNorm output (embeddings, then per layer after attention
    and after the MLP), kept positions only: read with plain transformers, no hf-rebasin code."""
    sites: list[list[torch.Tensor]] = []
    for batch in batches:
        after_attn: list[torch.Tensor] = []

        def keep_output(_m: torch.nn.Module, _i: object, out: torch.Tensor, into: list = after_attn) -> None:
            into.append(out)

        hooks = [layer.attention.output.register_forward_hook(keep_output) for layer in model.bert.encoder.layer]
        with torch.no_grad():
            hidden = model(**batch, output_hidden_states=True).hidden_states
        for h in hooks:
            h.remove()
        keep = batch["attention_mask"].bool()
        order = [hidden[0]] + [t for i in range(len(after_attn)) for t in (after_attn[i], hidden[i + 1])]
        sites.append([t[keep] for t in order])
    return [torch.cat(column) for column in zip(*sites, strict=True)]


def test_bert_last_and_all_read_the_encoder_stream():
    """`last` is the final encoder LayerNorm at every position (not the MLM head's transform, which
    the decoder reads); `all` averages the covariances of the encoder's LayerNorm outputs, each
    centred at its own mean (Verma & Elbayad's code), checked against hidden states of plain
    transformers."""
    model_a, model_b = tiny.bert_mlm(0), tiny.bert_mlm(1)
    data = _tokens(2)
    graph = _graph(model_a)
    a, b = _bert_stream(model_a, data), _bert_stream(model_b, data)
    assert len(a) == 1 + 2 * model_a.config.num_hidden_layers
    last = activation_stats(model_a, model_b, graph, data, residual="last").moments["res"].correlation()
    torch.testing.assert_close(last, _corr(a[-1], b[-1]), atol=1e-6, rtol=0)
    first = activation_stats(model_a, model_b, graph, data, residual="first").moments["res"].correlation()
    torch.testing.assert_close(first, _corr(a[0], b[0]), atol=1e-6, rtol=0)
    cov = sum((x - x.mean(0)).double().T @ (y - y.mean(0)).double() for x, y in zip(a, b, strict=True))
    var_a = sum(((x - x.mean(0)).double() ** 2).sum(0) for x in a)
    var_b = sum(((y - y.mean(0)).double() ** 2).sum(0) for y in b)
    expected = cov / torch.outer(var_a.sqrt(), var_b.sqrt())
    pooled = activation_stats(model_a, model_b, graph, data, residual="all").moments["res"]
    assert pooled.count.item() == len(a) * a[0].shape[0]
    torch.testing.assert_close(pooled.correlation(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("same_object", [False, True])
def test_model_against_itself_has_unit_diagonal(same_object):
    model = tiny.gpt2(0)
    other = model if same_object else copy.deepcopy(model)
    stats = activation_stats(model, other, _graph(model), _tokens(3))
    assert len(stats.moments) == 9
    for key, m in stats.moments.items():
        # the products run in float32 (on centred data): the diagonal is 1 to float32 rounding, whose last
        # bits depend on the BLAS kernel the processor gets
        ones = torch.ones(m.cross.shape[0], dtype=torch.float64)
        torch.testing.assert_close(m.correlation().diagonal(), ones, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m.sum_a, m.sum_b, msg=key)


def test_permuted_copy_is_recovered_by_argmax():
    """B = A with a random permutation of every space: corr(A_i, B_j) = 1 where B_j is A_i, so the
    argmax over A of each B column is the permutation's index (new[j] = old[index[j]])."""
    model = tiny.gpt2(0)
    graph = _graph(model)
    transform = graph.random_transform("permutation", torch.Generator().manual_seed(3))
    permuted = rebuild(model, graph.apply(model.state_dict(), transform))
    stats = activation_stats(model, permuted, graph, _tokens(4))
    for key in ("h.0.mlp", "h.1.mlp", "h.1.attn:o", "res"):
        name, _, role = key.partition(":")
        m = transform[name]
        if isinstance(m, HeadMap):
            space = graph.spaces[name]
            assert isinstance(space, HeadSpace)
            m = m.expand(space, role)
        assert isinstance(m, AxisMap) and m.index is not None
        corr = stats.moments[key].correlation()
        assert torch.equal(corr.argmax(dim=0), m.index), key
        assert torch.equal(corr.argmax(dim=1), torch.argsort(m.index)), key
        assert corr.max(dim=0).values.min() > 1 - 1e-6


def test_padding_changes_nothing():
    """A padded batch gives the statistics of its rows without the padding."""
    model_a, model_b = tiny.bert_mlm(0), tiny.bert_mlm(1)
    graph = _graph(model_a)
    (padded,) = _tokens(1, batch=2)
    rows = [
        {"input_ids": padded["input_ids"][:1], "attention_mask": padded["attention_mask"][:1]},
        {"input_ids": padded["input_ids"][1:, :7], "attention_mask": padded["attention_mask"][1:, :7]},
    ]
    one = activation_stats(model_a, model_b, graph, [padded])
    two = activation_stats(model_a, model_b, graph, rows)
    assert one.tokens == two.tokens == 17
    assert one.moments.keys() == two.moments.keys()
    for key in one.moments:
        _assert_same_moments(one.moments[key], two.moments[key], 1e-5)


def test_special_ids_are_dropped():
    model_a, model_b = tiny.bert_mlm(0), tiny.bert_mlm(1)
    data = _tokens(2)
    for batch in data:
        batch["input_ids"][:, 0] = 0  # [CLS]
        batch["input_ids"][0, -1] = 1  # [SEP] of the unpadded first row
    stats = activation_stats(model_a, model_b, _graph(model_a), data, special_ids=[0, 1])
    assert stats.tokens == 2 * (4 * 10 - 3 - 4 - 1)
    assert stats.moments["layer.0.mlp"].count.item() == stats.tokens
    assert stats.moments["res"].count.item() == 5 * stats.tokens  # 5 encoder sites (the decoder reads the head)


def test_two_residual_spaces_are_numbered_apart():
    model = tiny.clip(0)
    g = torch.Generator().manual_seed(0)
    data = [{**batch, "pixel_values": torch.randn(4, 3, 8, 8, generator=g)} for batch in _tokens(1)]
    stats = activation_stats(model, tiny.clip(1), _graph(model), data, residual="separate")
    assert stats.residual_spaces == ["vision.res"] * 5 + ["text.res"] * 5  # the vision tower runs first
    assert {k for k in stats.moments if "res@" in k} == {f"{t}.res@{j}" for t in ("text", "vision") for j in range(5)}
    assert stats.moments["text.res@0"].count.item() == stats.tokens == 37  # the text mask
    assert stats.moments["vision.res@0"].count.item() == 4 * 5  # no mask on patches


def test_image_batches_use_every_patch():
    model_a, model_b = tiny.vit(0), tiny.vit(1)
    stats = activation_stats(model_a, model_b, _graph(model_a), _images(2), residual="separate")
    assert stats.tokens == 2 * 3 * 5  # 4 patches + [CLS]
    assert stats.moments["layers.1.mlp"].count.item() == 30
    assert stats.moments["res@4"].count.item() == 6  # the classifier reads [CLS] only


def test_memory_does_not_grow_with_batches():
    model_a, model_b = tiny.gpt2(0), tiny.gpt2(1)
    graph = _graph(model_a)
    few = activation_stats(model_a, model_b, graph, _tokens(2))
    many = activation_stats(model_a, model_b, graph, _tokens(6))
    assert few.moments.keys() == many.moments.keys()
    for key in few.moments:
        for f in FIELDS:
            assert getattr(few.moments[key], f).shape == getattr(many.moments[key], f).shape
    assert many.tokens == 3 * few.tokens
    assert many.moments["res"].count.item() == 3 * few.moments["res"].count.item()


def test_hooks_removed_and_modes_restored_even_on_error():
    model_a, model_b = tiny.gpt2(0), tiny.gpt2(1)
    model_a.train()
    graph = _graph(model_a)
    seen: list[int] = []
    activation_stats(model_a, model_b, graph, _tokens(3), progress=seen.append)
    assert seen == [37, 74, 111]
    with pytest.raises(IndexError):  # a token id past the vocabulary fails inside model A's forward
        activation_stats(model_a, model_b, graph, [{"input_ids": torch.full((1, 4), 10**6)}])

    def interrupt(tokens: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        activation_stats(model_a, model_b, graph, _tokens(2), progress=interrupt)
    assert model_a.training and not model_b.training
    for model in (model_a, model_b):
        assert not any(m._forward_hooks for m in model.modules())


# --------------------------------------------------------------------------------------------
# The collector's state machine
# --------------------------------------------------------------------------------------------


def _collector(model_a: torch.nn.Module, model_b: torch.nn.Module) -> Collector:
    return Collector(model_a, model_b, HookPlan.of(_graph(model_a), model_a, None), "all", None)


def _hooked(model: torch.nn.Module) -> bool:
    return any(m._forward_hooks for m in model.modules())


@torch.no_grad()
def test_illegal_transitions_raise():
    model_a, model_b = tiny.gpt2(0), tiny.gpt2(1)
    (batch,) = _tokens(1)
    col = _collector(model_a, model_b)
    with pytest.raises(CollectorStateError, match="'idle' to 'forward A'"):
        col.begin(batch, Phase.FORWARD_A)  # no hooks yet
    with col:
        assert col.phase is Phase.READY and _hooked(model_a) and _hooked(model_b)
        with pytest.raises(CollectorStateError, match="opened once"), col:
            pass
        assert col.phase is Phase.READY and _hooked(model_a)  # the live collection is left alone
        with pytest.raises(CollectorStateError, match="'ready' to 'forward B'"):
            col.to_b()
        with pytest.raises(CollectorStateError, match="'ready' to 'ready'"):
            col.end_batch()
        with pytest.raises(CollectorStateError, match="FORWARD_AB needs one model"):
            col.begin(batch, Phase.FORWARD_AB)  # two models
        with pytest.raises(CollectorStateError, match=r"model A ran .* while the collector was 'ready'"):
            model_a(**batch)  # a forward outside a batch
        col.begin(batch, Phase.FORWARD_A)
        with pytest.raises(CollectorStateError, match=r"model B ran .* while the collector was 'forward A'"):
            model_b(**batch)
        with pytest.raises(CollectorStateError, match="'forward A' to 'ready'"):
            col.end_batch()  # B has not run
        model_a(**batch)
        col.to_b()
        with pytest.raises(CollectorStateError, match="model A ran"):
            model_a(**batch)
        model_b(**batch)
        col.end_batch()
        assert col.phase is Phase.READY and col.tokens == 37
        with pytest.raises(CollectorStateError, match="knows already"):
            col.begin(batch, Phase.PROBE)  # the first forward of A showed the structure
        with pytest.raises(CollectorStateError, match="after a clean close"):
            col.result()
    assert col.phase is Phase.CLOSED and not _hooked(model_a) and not _hooked(model_b)
    assert col.result().tokens == 37
    with pytest.raises(CollectorStateError, match="'closed' to 'forward A'"):
        col.begin(batch, Phase.FORWARD_A)
    with pytest.raises(CollectorStateError, match="opened once"), col:
        pass
    with _collector(model_a, model_a) as same:
        with pytest.raises(CollectorStateError, match="run each batch once"):
            same.begin(batch, Phase.FORWARD_A)
        with pytest.raises(CollectorStateError, match="after a probe"):
            same.begin(batch, Phase.FORWARD_AB)  # the keys are not known before a probe


@torch.no_grad()
def test_hooks_removed_after_an_error_inside_the_context():
    model_a, model_b = tiny.gpt2(0), tiny.gpt2(1)
    model_a.train()
    (batch,) = _tokens(1)
    col = _collector(model_a, model_b)
    with pytest.raises(ZeroDivisionError), col:
        col.begin(batch, Phase.FORWARD_A)
        model_a(**batch)
        assert not model_a.training
        _ = 1 / 0
    assert col.phase is Phase.ABORTED
    assert model_a.training and not model_b.training
    assert not _hooked(model_a) and not _hooked(model_b)
    with pytest.raises(CollectorStateError, match="'aborted'"):
        col.result()
    # features that find no partner are a model mismatch, and the batch is never closed
    for runs_of_b in (0, 2):
        col = _collector(model_a, model_b)
        with pytest.raises(IncompatibleModelsError, match="never did" if runs_of_b == 0 else "more often"), col:
            col.begin(batch, Phase.FORWARD_A)
            model_a(**batch)
            col.to_b()
            for _ in range(runs_of_b):
                model_b(**batch)
            col.end_batch()
        assert col.phase is Phase.ABORTED and not _hooked(model_a) and not _hooked(model_b)
    # hooks half registered when registering fails (a module B lacks): the ones on are removed
    plan = HookPlan.of(_graph(model_a), model_a, None)
    broken = Collector(model_a, model_b, dataclasses.replace(plan, modules=(*plan.modules, "no.such")), "all", None)
    with pytest.raises(AttributeError), broken:
        pass
    assert broken.phase is Phase.CLOSED and model_a.training
    assert not _hooked(model_a) and not _hooked(model_b)


def test_two_half_batches_give_the_statistics_of_one_batch():
    model_a, model_b = tiny.gpt2(0), tiny.gpt2(1)
    graph = _graph(model_a)
    (whole,) = _tokens(1)
    halves = [{k: v[rows] for k, v in whole.items()} for rows in (slice(0, 2), slice(2, 4))]
    one = activation_stats(model_a, model_b, graph, [whole], residual="separate")
    two = activation_stats(model_a, model_b, graph, halves, residual="separate")
    assert one.tokens == two.tokens == 37
    assert one.residual_groups == two.residual_groups and one.module_order == two.module_order
    assert one.moments.keys() == two.moments.keys()
    for key in one.moments:
        assert torch.equal(one.moments[key].count, two.moments[key].count), key
        _assert_same_moments(one.moments[key], two.moments[key], 1e-6)


# --------------------------------------------------------------------------------------------
# accelerate: two processes give the statistics of one
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # two distributed processes (15 s)
def test_two_processes_match_one(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts one process in accelerate 1.x (more need
    MPI); the torchrun launcher (--multi_gpu) with ACCELERATE_USE_CPU=1 gives two gloo processes."""
    script = str(TESTS / "accelerate_stats.py")
    port = _free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")])),
        "HF_HOME": str(tmp_path / "hf"),  # no user accelerate config
        "MASTER_PORT": str(port),
    }
    single, double = tmp_path / "one.pt", tmp_path / "two.pt"
    subprocess.run([sys.executable, script, str(single)], env=env, check=True, timeout=300, cwd=TESTS.parent)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(port), script, str(double)]
    done = subprocess.run(
        launch, env={**env, "ACCELERATE_USE_CPU": "1"}, timeout=300, cwd=TESTS.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    one, two = torch.load(single), torch.load(double)
    assert one["num_processes"] == 1 and two["num_processes"] == 2
    worst = 0.0
    for run in ("six", "one", "lockstep"):
        a, b = one["runs"][run], two["runs"][run]
        assert a["tokens"] == b["tokens"] and a["residual_groups"] == b["residual_groups"]
        assert a["moments"].keys() == b["moments"].keys()
        for key, fields in a["moments"].items():
            for f, x in fields.items():
                worst = max(worst, _rel(x, b["moments"][key][f]))
    assert worst <= 1e-6


def _seq2seq_batches(source: int, target: int) -> list[dict[str, torch.Tensor]]:
    """Two batches of an encoder-decoder: row 1's source and row 2's target right-padded."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        ids, dec = (
            torch.randint(2, tiny.V, (3, source), generator=g),
            torch.randint(2, tiny.V, (3, target), generator=g),
        )
        mask, dmask = torch.ones(3, source, dtype=torch.long), torch.ones(3, target, dtype=torch.long)
        mask[1, source - 2 :], dmask[2, target - 3 :] = 0, 0
        out.append(
            {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec, "decoder_attention_mask": dmask}
        )
    return out


def _plain_sums(model: torch.nn.Module, batches, modules: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Σ of each module's input (or output) features over the positions it should read, with plain
    hooks: ``modules`` maps a module to (``input``/``output``, ``source``/``target``)."""
    sums: dict[str, torch.Tensor] = {}
    current: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def fn(_m, args, out):
            where, positions = modules[name]
            t = args[0] if where == "input" else out
            mask = current["attention_mask" if positions == "source" else "decoder_attention_mask"].bool()
            sums[name] = sums.get(name, 0) + t[mask].double().sum(0)

        return fn

    handles = [model.get_submodule(m).register_forward_hook(hook(m)) for m in modules]
    with torch.no_grad():
        for b in batches:
            current.update(b)
            model(**b)
    for h in handles:
        h.remove()
    return sums


@pytest.mark.parametrize(("source", "target"), [(9, 6), (7, 7)])
def test_an_encoder_decoders_sites_read_the_sources_or_the_targets_positions(source: int, target: int) -> None:
    """Encoder sites and cross-attention's keys read the sources' positions, the decoder's other
    sites the targets' (also when both have one length, where shapes cannot tell); T5's one
    self-attention head order per stack is read in every layer."""
    model_a, model_b = tiny.t5(0), tiny.t5(1)
    batches = _seq2seq_batches(source, target)
    stats = activation_stats(model_a, model_b, _graph(model_a), batches, residual="none")
    layers = (model_a.config.num_layers, model_a.config.num_decoder_layers)
    enc_o = [f"encoder.block.{i}.layer.0.SelfAttention.o" for i in range(layers[0])]
    dec_o = [f"decoder.block.{i}.layer.0.SelfAttention.o" for i in range(layers[1])]
    cross_k, cross_o = "decoder.block.0.layer.1.EncDecAttention.k", "decoder.block.0.layer.1.EncDecAttention.o"
    modules = {**{m: ("input", "source") for m in enc_o}, **{m: ("input", "target") for m in dec_o}}
    modules |= {cross_k: ("output", "source"), cross_o: ("input", "target")}
    sums = _plain_sums(model_a, batches, modules)
    sources = sum(int(b["attention_mask"].sum()) for b in batches)
    targets = sum(int(b["decoder_attention_mask"].sum()) for b in batches)
    expected = {
        "enc.self:o": (layers[0] * sources, sum(sums[m] for m in enc_o)),
        "dec.self:o": (layers[1] * targets, sum(sums[m] for m in dec_o)),
        "dec.0.cross:k": (sources, sums[cross_k]),
        "dec.0.cross:o": (targets, sums[cross_o]),
    }
    for key, (count, total) in expected.items():
        m = stats.moments[key]
        assert int(m.count) == count, key
        assert torch.allclose(m.sum_a, total, rtol=1e-5, atol=1e-5), key
