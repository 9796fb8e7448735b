"""DeBERTa-v2/v3 beyond the proofs every adapter gets (tests/symmetry/test_adapters.py).

Negative controls: the constraints the adapter declares are real. The relative-position table and its
LayerNorm are on the residual stream's map (every layer's projections read them); without
``share_att_key`` the position projections carry the query and key roles, and the Q/K inner maps
are free (an invertible map on Q with its inverse transpose on K keeps all three score terms), but
only when the position projections take them too. The embedding space is read by ``embed_proj`` and
written by the legacy MLM head. Weight matching recovers a planted permutation; a ConvLayer is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.alignment.verify import TOLERANCE, verify_model
from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import HeadSpace
from hf_rebasin.symmetry.transforms import AxisMap, HeadMap, Transform, random_orthogonal
from symmetry_checks import output_gap, permuted

CASES = ("deberta-v2-mlm", "deberta-v2-mlm-head", "deberta-v2-mlm-emb", "deberta-v2-cls", "deberta-v2-token")
ALL = (*CASES, "deberta-v2-base")
SELF = "deberta.encoder.layer.0.attention.self"


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {case: tiny.FACTORIES[case](0) for case in ALL}


def _qk_map(graph: SymmetryGraph, layer: int = 0, seed: int = 0) -> tuple[str, Transform]:
    """Layer ``layer``'s heads kept in place, a dense invertible (not orthogonal) Q/K inner map per head."""
    name = f"layer.{layer}.attn"
    space = graph.spaces[name]
    assert isinstance(space, HeadSpace)
    ident = graph.identity()[name]
    assert isinstance(ident, HeadMap)
    g = torch.Generator().manual_seed(seed)
    m = random_orthogonal(space.head_dim, g, batch=space.num_kv_heads) * torch.linspace(0.5, 2.0, space.head_dim)
    t = graph.identity()
    t[name] = HeadMap(ident.kv_perm, ident.q_perm, m @ random_orthogonal(space.head_dim, g), ident.vo, invertible=True)
    return name, t


# ------------------------------------------------------------------------------------------------
# the relative-position table: on the stream's map
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_stream_permutation_needs_the_relative_position_table(models, case):
    """Permuting the stream is exact with ``encoder.rel_embeddings``' columns permuted too, and moves
    the outputs when the table is left as it was (every layer's projections read it)."""
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    assert graph.bindings["deberta.encoder.rel_embeddings.weight"].axes == (None, "res")
    t = permuted(graph, "res")
    moved = graph.apply(sd, t)
    assert output_gap(model, graph, moved, t) <= TOLERANCE
    table = "deberta.encoder.rel_embeddings.weight"
    assert output_gap(model, graph, {**moved, table: sd[table]}, t) > 1e-3


@pytest.mark.parametrize("case", ["deberta-v2-mlm", "deberta-v2-cls"])
def test_the_table_layernorm_is_on_the_stream(models, case):
    """``norm_rel_ebd: layer_norm``: ``encoder.LayerNorm`` normalizes the table, so it takes the
    stream's permutation; left unpermuted, the outputs move."""
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = permuted(graph, "res", seed=2)
    moved = graph.apply(sd, t)
    assert output_gap(model, graph, moved, t) <= TOLERANCE
    norm = {k: sd[k] for k in ("deberta.encoder.LayerNorm.weight", "deberta.encoder.LayerNorm.bias")}
    assert output_gap(model, graph, {**moved, **norm}, t) > 1e-3


def test_a_layers_heads_are_its_own(models):
    """Each layer projects the shared table with its own weights: permuting layer 0's heads alone
    (q, k, v, o) is exact, though layer 1 reads the same table with its heads in place."""
    model = models["deberta-v2-mlm"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = graph.identity()
    ident = t["layer.0.attn"]
    assert isinstance(ident, HeadMap)
    kv = torch.tensor([2, 0, 3, 1])
    t["layer.0.attn"] = HeadMap(kv, ident.q_perm, ident.qk, ident.vo)
    assert output_gap(model, graph, graph.apply(sd, t), t) <= TOLERANCE
    # the same head order on q/k but not on v/o mixes heads: a real constraint
    mixed = {**graph.apply(sd, t), **{k: sd[k] for k in sd if ".value_proj." in k and "layer.0" in k}}
    assert output_gap(model, graph, mixed, t) > 1e-3


# ------------------------------------------------------------------------------------------------
# Q/K inner maps: free, with the position projections on the query and key roles
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["deberta-v2-mlm", "deberta-v2-cls", "deberta-v2-token"])
def test_qk_inner_maps_are_free_and_exact(models, case):
    """A dense invertible Q/K map M (K by M⁻ᵀ) keeps q·k, q·K_r (K_r moves as k) and k·Q_r (Q_r as q)."""
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    name, t = _qk_map(graph)
    assert graph.spaces[name].qk == "free"
    assert output_gap(model, graph, graph.apply(sd, t), t) <= TOLERANCE


def test_without_share_att_key_the_position_projections_take_the_qk_map(models):
    """``share_att_key: false``: ``pos_key_proj`` rows are on the key role and ``pos_query_proj``
    rows on the query role. Leaving either unmapped, or giving each the other's map, moves the outputs."""
    model = models["deberta-v2-cls"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    assert graph.bindings[f"{SELF}.pos_key_proj.weight"].axes == ("layer.0.attn:k", "res")
    assert graph.bindings[f"{SELF}.pos_query_proj.weight"].axes == ("layer.0.attn:q", "res")
    _name, t = _qk_map(graph, seed=3)
    moved = graph.apply(sd, t)
    assert output_gap(model, graph, moved, t) <= TOLERANCE
    for proj in ("pos_key_proj", "pos_query_proj"):  # c2p and p2c each need theirs
        kept = {k: sd[k] for k in sd if k.startswith(f"{SELF}.{proj}.")}
        assert output_gap(model, graph, {**moved, **kept}, t) > 1e-3, proj
    swapped = {**moved}
    for p in ("weight", "bias"):  # the query's map M on pos_key, the key's M⁻ᵀ on pos_query
        swapped[f"{SELF}.pos_key_proj.{p}"] = _as(graph, sd, t, f"{SELF}.pos_key_proj.{p}", "q")
        swapped[f"{SELF}.pos_query_proj.{p}"] = _as(graph, sd, t, f"{SELF}.pos_query_proj.{p}", "k")
    assert output_gap(model, graph, swapped, t) > 1e-3


def _as(graph: SymmetryGraph, sd: dict[str, torch.Tensor], t: Transform, tensor: str, role: str) -> torch.Tensor:
    """``tensor`` moved as if its rows were on ``role`` of layer 0's heads."""
    m = t["layer.0.attn"]
    assert isinstance(m, HeadMap)
    return m.expand(graph.spaces["layer.0.attn"], role).apply(sd[tensor], 0)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# the embedding space
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ALL)
def test_embedding_space_exists_only_where_projected(models, case):
    model = models[case]
    graph = graph_for(model.config, model.state_dict().keys())
    projected = getattr(model.config, "embedding_size", 32) != model.config.hidden_size
    assert ("emb" in graph.spaces) == projected
    if projected:
        assert graph.spaces["emb"].size == 16 and graph.spaces["emb"].max_class == "permutation"


@pytest.mark.parametrize("case", ["deberta-v2-mlm-emb", "deberta-v2-base"])
def test_embedding_permutation_needs_embed_proj(models, case):
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = permuted(graph, "emb")
    moved = graph.apply(sd, t)
    assert output_gap(model, graph, moved, t) <= TOLERANCE
    (proj,) = [k for k in sd if k.endswith("embeddings.embed_proj.weight")]  # the bare model has no prefix
    assert output_gap(model, graph, {**moved, proj: sd[proj]}, t) > 1e-3


def test_legacy_head_writes_the_embedding_space(models):
    """The legacy head's transform (dense → GELU → LayerNorm) writes ``emb`` for the tied decoder:
    unpermuted, the logits move; rotated (fixing the all-ones vector), they move too."""
    model = models["deberta-v2-mlm-emb"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = permuted(graph, "emb", seed=1)
    moved = graph.apply(sd, t)
    head = [k for k in sd if k.startswith("cls.predictions.transform.")]
    assert output_gap(model, graph, {**moved, **{k: sd[k] for k in head}}, t) > 1e-3
    r = graph.identity()
    r["emb"] = AxisMap(16, blocks=random_orthogonal(16, torch.Generator().manual_seed(0), fix_ones=True)[None])
    assert output_gap(model, graph, graph.apply(sd, r, check=False), r) > 1e-3


# ------------------------------------------------------------------------------------------------
# alignment, fallbacks, refusals
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["deberta-v2-mlm", "deberta-v2-cls", "deberta-v2-mlm-emb"])
def test_weight_matching_recovers_a_planted_permutation(models, case):
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    planted = graph.random_transform("permutation", torch.Generator().manual_seed(4))
    assert any(not planted[n].is_identity() for n in ("res", "layer.0.attn", "layer.1.attn"))
    sd_b = graph.apply(sd, planted)
    assert max(float((sd_b[k] - sd[k]).abs().max()) for k in sd) > 1e-2
    alignment = align("weight-matching", Pair(graph, sd, sd_b))
    assert alignment.exact
    aligned = alignment.aligned_b()
    assert max(float((aligned[k] - sd[k]).abs().max()) for k in sd) < 1e-5


def test_orthogonal_falls_back_to_permutation_with_the_reason(models):
    report = verify_model(models["deberta-v2-mlm-emb"], "orthogonal", seed=0)
    assert report.classes["res"] == report.classes["emb"] == "permutation"
    assert report.max_abs_diff <= TOLERANCE
    (note,) = [n for n in report.fallbacks if "'res'" in n]
    assert "post-norm" in note


def test_without_relative_attention_the_encoder_is_bert_like():
    """DeBERTa-v2 with ``relative_attention: false`` has no table and no position projections:
    absolute positions only, and the same adapter holds (every tensor described, outputs kept)."""
    config = tiny._deberta_config(relative_attention=False, position_biased_input=True, num_labels=3)
    torch.manual_seed(0)
    model = tiny._randomize_norms(T.DebertaV2ForSequenceClassification(config), 0)
    sd = model.state_dict()
    assert not any("rel_embeddings" in k or "pos_key_proj" in k for k in sd)
    graph_for(model.config, sd.keys()).check(sd, source="deberta-v2 without relative attention")
    for cls in ("permutation", "orthogonal"):
        report = verify_model(model, cls, seed=1)
        assert report.compared and report.max_abs_diff <= TOLERANCE, report


def test_conv_layer_is_refused_by_name():
    config = tiny._deberta_config(conv_kernel_size=3)
    keys = T.DebertaV2Model(config).state_dict().keys()
    assert "encoder.conv.conv.weight" in keys  # transformers builds it: a real tensor we would have to place
    with pytest.raises(UnsupportedArchitectureError, match="conv_kernel_size"):
        graph_for(config, keys)


def test_a_config_without_token_types_is_read():
    """DeBERTa-v3 states ``type_vocab_size: 0`` (no token-type table): a count, not a width, so the
    config check lets 0 through and still refuses a negative one."""
    from hf_rebasin.core.errors import ConfigError
    from hf_rebasin.io.configs import _check_dimensions

    _check_dimensions({"type_vocab_size": 0, "hidden_size": 32, "num_attention_heads": 4}, Path("config.json"))
    with pytest.raises(ConfigError, match="type_vocab_size"):
        _check_dimensions({"type_vocab_size": -1}, Path("config.json"))
