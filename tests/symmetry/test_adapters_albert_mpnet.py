"""ALBERT and MPNet beyond the proofs every adapter gets (tests/symmetry/test_adapters.py).

ALBERT runs one layer module at every depth: its heads and MLP units are one space per module,
whatever ``num_hidden_layers`` is, the shared layer's reads and writes must take that one map at
every run, and no sublayers are declared (a map per stream would give one tensor a map per run).
Its embedding space is its own (``embedding_hidden_mapping_in`` projects it, even at equal sizes).
MPNet's one relative position bias feeds every layer: its heads keep one order across the depth,
the bias columns with it. Negative controls show each constraint is real; weight matching,
TransFusion and activation matching recover a planted permutation.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.alignment.strategies import AlignmentData, Pair, align
from hf_rebasin.alignment.verify import TOLERANCE, example_inputs, verify_model
from hf_rebasin.core.errors import AdapterError, StrategyOptionError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.sublayers import per_sublayer
from hf_rebasin.symmetry.transforms import AxisMap, Transform, random_orthogonal
from symmetry_checks import output_gap, permuted, planted_by_activations

ALBERT_LAYER = "albert.encoder.albert_layer_groups.0.albert_layers.0"
MPNET_BIAS = "encoder.relative_attention_bias.weight"  # under "mpnet." but in a bare MPNetModel
CASES = ("albert", "albert-mlm", "albert-mlm-equal", "albert-groups", "mpnet-mlm", "mpnet-cls", "mpnet-base")


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {case: tiny.FACTORIES[case](0) for case in CASES}


def _gap(model: torch.nn.Module, sd: dict[str, torch.Tensor], t: Transform | None = None) -> float:
    """max |Δ| of every output of the stock ``model`` rebuilt from ``sd`` (hidden states mapped by
    ``t``; none: no basis changed)."""
    graph = graph_for(model.config, model.state_dict().keys())
    return output_gap(model, graph, sd, t if t is not None else graph.identity())


def _rotate(graph: SymmetryGraph, space: str, seed: int = 0) -> Transform:
    """A rotation that fixes the all-ones vector (what a LayerNorm's centring alone would allow)."""
    t = graph.identity()
    n = graph.spaces[space].size
    t[space] = AxisMap(n, blocks=random_orthogonal(n, torch.Generator().manual_seed(seed), fix_ones=True)[None])
    return t


def _rows(perm: torch.Tensor, dh: int) -> torch.Tensor:
    """The feature index that moves whole heads of ``dh`` features by ``perm``."""
    return (perm[:, None] * dh + torch.arange(dh)).flatten()


def _permute_heads(
    sd: dict[str, torch.Tensor], attn: str, qkv: tuple[str, str, str], o: str, reads: torch.Tensor, writes: torch.Tensor
) -> None:
    """Q/K/V rows (and biases) by ``reads``, the output projection's columns by ``writes``."""
    for r in qkv:
        sd[f"{attn}.{r}.weight"] = sd[f"{attn}.{r}.weight"][reads]
        sd[f"{attn}.{r}.bias"] = sd[f"{attn}.{r}.bias"][reads]
    sd[f"{attn}.{o}.weight"] = sd[f"{attn}.{o}.weight"][:, writes]


# ------------------------------------------------------------------------------------------------
# ALBERT: one layer module at every depth
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [3, 6])
def test_albert_has_one_head_and_mlp_space_per_layer_module_whatever_the_depth(steps):
    model = T.AlbertForMaskedLM(tiny._albert_config(layers=steps))
    graph = graph_for(model.config, model.state_dict().keys())
    assert set(graph.spaces) == {"res", "emb", "group.0.0.attn", "group.0.0.mlp"}
    assert graph.spaces["emb"].size == 16 and graph.spaces["res"].size == 32


def test_albert_groups_have_a_space_per_module(models):
    model = models["albert-groups"]
    graph = graph_for(model.config, model.state_dict().keys())
    modules = [f"group.{g}.{k}" for g in range(2) for k in range(2)]
    assert {s for s in graph.spaces if s.startswith("group.")} == {f"{m}.{x}" for m in modules for x in ("attn", "mlp")}
    t = graph.random_transform("permutation", torch.Generator().manual_seed(3))
    assert _gap(model, graph.apply(model.state_dict(), t), t) <= TOLERANCE


def test_albert_embedding_space_stays_apart_at_equal_sizes(models):
    """``embedding_hidden_mapping_in`` exists even when embedding_size == hidden_size, so the tables
    keep a space of their own."""
    model = models["albert-mlm-equal"]
    graph = graph_for(model.config, model.state_dict().keys())
    assert graph.spaces["emb"].size == graph.spaces["res"].size == 32
    assert graph.bindings["albert.encoder.embedding_hidden_mapping_in.weight"].axes == ("res", "emb")


def test_albert_declares_no_sublayers_so_streams_per_sublayer_are_refused(models):
    model = models["albert"]
    graph = graph_for(model.config, model.state_dict().keys())
    assert graph.sublayers == ()
    with pytest.raises(AdapterError, match="sublayers"):
        per_sublayer(graph)


def test_albert_shared_layer_takes_one_head_and_unit_map_for_all_its_runs(models):
    """The shared layer's output at one run is its input at the next, through the same tensors: one
    head order (and one unit order) on its reads and writes is exact; a different order on its
    writes (what a map per run would ask of them) moves the outputs."""
    model = models["albert-mlm"]
    sd = model.state_dict()
    heads = model.config.num_attention_heads
    dh = model.config.hidden_size // heads
    g = torch.Generator().manual_seed(5)
    sigma, tau = torch.randperm(heads, generator=g), torch.randperm(heads, generator=g)
    assert not torch.equal(sigma, tau)
    attn = f"{ALBERT_LAYER}.attention"
    one = dict(sd)
    _permute_heads(one, attn, ("query", "key", "value"), "dense", _rows(sigma, dh), _rows(sigma, dh))
    assert _gap(model, one) <= TOLERANCE
    two = dict(sd)
    _permute_heads(two, attn, ("query", "key", "value"), "dense", _rows(sigma, dh), _rows(tau, dh))
    assert _gap(model, two) > 1e-3
    units = torch.randperm(model.config.intermediate_size, generator=g)
    mlp = dict(sd)
    mlp[f"{ALBERT_LAYER}.ffn.weight"] = sd[f"{ALBERT_LAYER}.ffn.weight"][units]
    mlp[f"{ALBERT_LAYER}.ffn.bias"] = sd[f"{ALBERT_LAYER}.ffn.bias"][units]
    assert _gap(model, mlp) > 1e-3
    mlp[f"{ALBERT_LAYER}.ffn_output.weight"] = sd[f"{ALBERT_LAYER}.ffn_output.weight"][:, units]
    assert _gap(model, mlp) <= TOLERANCE


@pytest.mark.parametrize("case", ["albert", "albert-mlm", "albert-mlm-equal"])
def test_albert_embedding_permutation_needs_the_mapping_in(models, case):
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = permuted(graph, "emb")
    moved = graph.apply(sd, t)
    assert _gap(model, moved, t) <= TOLERANCE
    mapping = "albert.encoder.embedding_hidden_mapping_in.weight"
    assert _gap(model, {**moved, mapping: sd[mapping]}, t) > 1e-3


def test_albert_mlm_head_writes_the_embedding_space(models):
    """``predictions.dense`` writes ``emb`` (read through its LayerNorm by the tied word embeddings):
    leaving its rows and that LayerNorm unpermuted moves the logits."""
    model = models["albert-mlm"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = permuted(graph, "emb", seed=1)
    moved = graph.apply(sd, t)
    assert _gap(model, moved, t) <= TOLERANCE
    head = [k for k in sd if k.startswith(("predictions.dense.", "predictions.LayerNorm."))]
    assert _gap(model, {**moved, **{k: sd[k] for k in head}}, t) > 1e-3


@pytest.mark.parametrize("space", ["emb", "res"])
def test_albert_rotations_of_the_layernormed_spaces_move_the_outputs(models, space):
    model = models["albert"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = _rotate(graph, space)
    assert _gap(model, graph.apply(sd, t, check=False), t) > 1e-3


def test_albert_orthogonal_falls_back_to_permutation_with_the_reason(models):
    report = verify_model(models["albert"], "orthogonal", seed=0)
    assert report.classes["res"] == report.classes["emb"] == "permutation"
    assert report.max_abs_diff <= TOLERANCE
    (note,) = [n for n in report.fallbacks if "'res'" in n]
    assert "post-norm" in note


# ------------------------------------------------------------------------------------------------
# MPNet: one relative position bias for every layer
# ------------------------------------------------------------------------------------------------


def test_mpnet_has_one_head_space_for_all_layers(models):
    model = models["mpnet-mlm"]
    graph = graph_for(model.config, model.state_dict().keys())
    assert [s for s in graph.spaces if s.endswith("attn")] == ["attn"]
    assert graph.bindings[f"mpnet.{MPNET_BIAS}"].axes == (None, "attn:h")
    assert "num_attention_heads" in get_adapter("mpnet").fixed_widths


def _mpnet_heads(sd: dict[str, torch.Tensor], base: str, layer: int, perm: torch.Tensor, dh: int) -> None:
    rows = _rows(perm, dh)
    _permute_heads(sd, f"{base}encoder.layer.{layer}.attention.attn", ("q", "k", "v"), "o", rows, rows)


@pytest.mark.parametrize("case", ["mpnet-mlm", "mpnet-base"])
def test_mpnet_heads_keep_one_order_because_the_position_bias_is_shared(models, case):
    """One head order in every layer with the bias columns is exact; the bias columns left as they
    are, or each layer its own order (each layer's q/k/v/o moving together), moves the outputs."""
    model = models[case]
    sd = model.state_dict()
    base = "mpnet." if f"mpnet.{MPNET_BIAS}" in sd else ""
    bias = base + MPNET_BIAS
    heads = model.config.num_attention_heads
    dh = model.config.hidden_size // heads
    layers = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(2)
    sigma = torch.randperm(heads, generator=g)
    shared = dict(sd)
    for i in range(layers):
        _mpnet_heads(shared, base, i, sigma, dh)
    assert _gap(model, shared) > 1e-3  # the bias columns not permuted
    shared[bias] = sd[bias][:, sigma]
    assert _gap(model, shared) <= TOLERANCE
    per_layer = dict(sd)
    perms = [sigma] + [torch.roll(sigma, i) for i in range(1, layers)]
    for i, perm in enumerate(perms):
        _mpnet_heads(per_layer, base, i, perm, dh)
    per_layer[bias] = sd[bias][:, sigma]  # the bias can follow one layer's order only
    assert _gap(model, per_layer) > 1e-3


def test_mpnet_stream_rotation_moves_the_outputs(models):
    model = models["mpnet-mlm"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = _rotate(graph, "res")
    assert _gap(model, graph.apply(sd, t, check=False), t) > 1e-3


# ------------------------------------------------------------------------------------------------
# recovery of a planted permutation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["weight-matching", "transfusion"])
@pytest.mark.parametrize("case", ["albert", "albert-groups", "mpnet-mlm", "mpnet-cls"])
def test_a_planted_permutation_is_recovered(models, case, strategy):
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sd_b = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(11)))
    assert max((sd_b[k] - sd[k]).abs().max().item() for k in sd) > 1e-2  # B really moved
    alignment = align(strategy, Pair(graph, sd, sd_b))
    assert alignment.exact
    aligned = alignment.aligned_b()
    assert max((aligned[k] - sd[k]).abs().max().item() for k in sd) < 1e-6


@pytest.mark.parametrize(
    ("case", "residual"),
    [
        ("albert", "last"),
        ("albert", "all"),
        ("albert", "first"),
        ("albert-groups", "last"),
        ("albert-groups", "all"),
        ("mpnet-mlm", "all"),
    ],
)
def test_activation_matching_recovers_a_planted_permutation(models, case, residual):
    """Head-perm pools a shared ALBERT layer's features over its runs (run t of A with run t of B),
    and reads the stream at each run of a shared layer (``all``: one site per step of the depth)."""
    alignment, gap = planted_by_activations(models[case], residual, seed=3)
    assert alignment.exact and not alignment.transform["res"].is_identity() and gap < 1e-6


def test_activation_matching_refuses_a_map_per_run_of_a_shared_layer(models):
    model = models["albert"].eval()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    spec = get_adapter(model.config.model_type)
    batches = [example_inputs(spec, model.config, torch.Generator().manual_seed(i)) for i in range(2)]
    pair = Pair(graph, sd, sd, model, rebuild(model, sd), AlignmentData(batches, frozenset({0})))
    with pytest.raises(StrategyOptionError, match=r"residual: separate .*query.* at 3 steps"):
        align("head-perm", pair, {"residual": "separate"})
