"""XLM-RoBERTa, DistilBERT and ModernBERT beyond the proofs every adapter gets (tests/symmetry/test_adapters.py).

Negative controls: what the adapters leave out of the symmetry group really changes the outputs
(an orthogonal map of the residual, whose reason is a norm on the residual path; ModernBERT's GeGLU
halves or heads mixed; DistilBERT's residual permutation without the MLM head's LayerNorm).
Weight matching recovers a known permutation; the CLI verifies a saved model, merges two saved
models on the streamed path and evaluates masked-LM models end to end.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml

import tiny
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.alignment.verify import TOLERANCE, compare, example_inputs, outputs_of, verify_model
from hf_rebasin.cli import main
from hf_rebasin.core.errors import TransformError
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import Space
from hf_rebasin.symmetry.transforms import AxisMap, HeadMap, Transform, random_orthogonal

FAMILIES: dict[str, tuple[str, ...]] = {
    "xlm-roberta": ("xlm-roberta-mlm", "xlm-roberta-cls"),
    "distilbert": ("distilbert-mlm", "distilbert-cls", "distilbert-base"),
    "modernbert": ("modernbert-mlm", "modernbert-cls", "modernbert-base", "modernbert-bias"),
}
CASES = [case for cases in FAMILIES.values() for case in cases]
# heads that read the residual through a linear map of their own (no activation bound to it)
CLASSIFIERS = ["xlm-roberta-cls", "distilbert-cls", "modernbert-cls", "modernbert-bias"]
MLM_CLASSES = {
    "xlm-roberta-mlm": T.XLMRobertaForMaskedLM,
    "distilbert-mlm": T.DistilBertForMaskedLM,
    "modernbert-mlm": T.ModernBertForMaskedLM,
}


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {case: tiny.FACTORIES[case](0) for case in CASES}


def _gap(
    model: torch.nn.Module,
    graph: SymmetryGraph,
    sd: dict[str, torch.Tensor],
    transform: Transform | None = None,
    untie: bool = False,
) -> float:
    """max |Δ| of every output of ``model`` rebuilt from ``sd`` (hidden states mapped by ``transform``)."""
    spec = get_adapter(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before = outputs_of(model.eval(), spec, inputs)
    after = outputs_of(rebuild(model, sd, untie=untie), spec, inputs)
    return compare(spec, graph, transform if transform is not None else graph.identity(), before, after)


def _rotation(graph: SymmetryGraph, seed: int = 0) -> Transform:
    """Identity everywhere but a random orthogonal map of the residual that fixes the all-ones
    vector (so LayerNorm's mean subtraction is not what breaks)."""
    t = graph.identity()
    size = graph.spaces["res"].size
    t["res"] = AxisMap(size, blocks=random_orthogonal(size, torch.Generator().manual_seed(seed), fix_ones=True)[None])
    return t


# ------------------------------------------------------------------------------------------------
# the residual stream: permutations only, and why
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_residual_is_permutation_only_with_the_reason(models, case):
    report = verify_model(models[case], "orthogonal", seed=0)
    assert report.classes["res"] == "permutation" and report.max_abs_diff <= TOLERANCE
    (note,) = [n for n in report.fallbacks if "'res'" in n]
    assert ("embeddings.norm" if case.startswith("modernbert") else "post-norm") in note


@pytest.mark.parametrize("case", CASES)
def test_orthogonal_residual_is_refused_and_moves_the_outputs(models, case):
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = _rotation(graph)
    with pytest.raises(TransformError, match="only permutations"):
        graph.apply(sd, t)
    assert _gap(model, graph, graph.apply(sd, t, check=False), t) > 1e-3


def _path_norms(graph: SymmetryGraph) -> list[str]:
    """γ of the norms on the residual path: their output *is* the stream (no linear reader)."""
    return [n.weight for n in graph.norms if n.space == "res" and not n.readers]


@pytest.mark.parametrize("case", CLASSIFIERS)
def test_the_norm_on_the_residual_path_is_the_reason(models, case):
    """Declare the residual orthogonal anyway and bring the model to canonical form: a rotation
    still moves the outputs, and stops moving them once every γ on the residual path is 1, so those
    norms (post-norm LayerNorms; ModernBERT's embedding LayerNorm) are the only obstacle."""
    model = models[case]
    gaps = []
    for flatten in (False, True):
        sd = dict(model.state_dict())
        graph = graph_for(model.config, sd.keys())
        if flatten:
            for name in _path_norms(graph):
                sd[name] = torch.ones_like(sd[name])
                bias = name[: -len("weight")] + "bias"
                if bias in sd:
                    sd[bias] = torch.zeros_like(sd[bias])  # a β off 1⊥ would meet centered readers
            model = rebuild(model, sd)
        space = graph.spaces["res"]
        assert isinstance(space, Space)
        graph.spaces["res"] = dataclasses.replace(space, max_class="orthogonal", centered=True)
        canon, cgraph, untied = canonicalize(graph, sd)
        t = _rotation(cgraph, seed=3)
        gaps.append(_gap(model, cgraph, cgraph.apply(canon, t, check=False), t, untie=bool(untied)))
    assert gaps[0] > 1e-3 and gaps[1] <= TOLERANCE, gaps


# ------------------------------------------------------------------------------------------------
# ModernBERT: GeGLU halves, heads, rotary
# ------------------------------------------------------------------------------------------------

WI = "model.layers.0.mlp.Wi"
WQKV = "model.layers.0.attn.Wqkv"


def _rows(sd: dict[str, torch.Tensor], name: str, index: torch.Tensor) -> None:
    for suffix in (".weight", ".bias"):
        if name + suffix in sd:
            sd[name + suffix] = sd[name + suffix].index_select(0, index)


@pytest.mark.parametrize("case", ["modernbert-mlm", "modernbert-bias"])
def test_modernbert_glu_halves_in_the_wrong_order_move_the_outputs(models, case):
    model = models[case]
    sd = dict(model.state_dict())
    graph = graph_for(model.config, sd.keys())
    ff = model.config.intermediate_size
    swapped = dict(sd)
    _rows(swapped, WI, torch.cat([torch.arange(ff, 2 * ff), torch.arange(ff)]))  # [gate | input]
    assert _gap(model, graph, swapped) > 1e-3
    # one unit permutation on the input half only (as if the halves were two spaces)…
    perm = torch.randperm(ff, generator=torch.Generator().manual_seed(0))
    half = dict(sd)
    _rows(half, WI, torch.cat([perm, torch.arange(ff, 2 * ff)]))
    half["model.layers.0.mlp.Wo.weight"] = sd["model.layers.0.mlp.Wo.weight"][:, perm]
    assert _gap(model, graph, half) > 1e-3
    # …while the same permutation of both halves is exact
    both = dict(half)
    _rows(both, WI, torch.cat([torch.arange(ff), perm + ff]))
    assert _gap(model, graph, both) <= TOLERANCE


@pytest.mark.parametrize("case", ["modernbert-mlm", "modernbert-bias"])
def test_modernbert_mixing_heads_moves_the_outputs(models, case):
    """The same permutation of Q and K features across two heads (rows of the fused Wqkv)."""
    model = models[case]
    sd = dict(model.state_dict())
    graph = graph_for(model.config, sd.keys())
    d, dh = model.config.hidden_size, model.config.hidden_size // model.config.num_attention_heads
    idx = torch.arange(3 * d)
    for start in (0, d):  # q, then k
        idx[[start, start + dh]] = idx[[start + dh, start]]  # feature 0 of head 0 <-> of head 1
    _rows(sd, WQKV, idx)
    assert _gap(model, graph, sd) > 1e-2


def test_modernbert_qk_inner_permutation_under_rope_moves_the_outputs(models):
    """Rotary Q/K: moving whole rotary planes inside a head changes the scores (RoPE rotates each
    plane at its own frequency); the same permutation on the V/O side is exact."""
    model = models["modernbert-mlm"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    space = graph.spaces["layers.0.attn"]
    assert getattr(space, "rotary", False)
    t = graph.identity()
    ident = t["layers.0.attn"]
    assert isinstance(ident, HeadMap)
    g, dh = ident.qk.shape
    planes = torch.arange(dh)
    planes[[0, 1, dh // 2, dh // 2 + 1]] = planes[[1, 0, dh // 2 + 1, dh // 2]]
    t["layers.0.attn"] = HeadMap(ident.kv_perm, ident.q_perm, planes.expand(g, dh).clone(), ident.vo)
    assert _gap(model, graph, graph.apply(sd, t, check=False), t) > 1e-3
    with pytest.raises(TransformError, match="Q/K inner permutation"):  # the class check refuses it too
        graph.apply(sd, t)
    t["layers.0.attn"] = HeadMap(ident.kv_perm, ident.q_perm, ident.qk, planes.expand(g, dh).clone())
    assert _gap(model, graph, graph.apply(sd, t), t) <= TOLERANCE


# ------------------------------------------------------------------------------------------------
# DistilBERT: the MLM head's transform output is the residual space
# ------------------------------------------------------------------------------------------------


def test_distilbert_residual_permutation_needs_the_mlm_head_layernorm(models):
    model = models["distilbert-mlm"]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    t = graph.identity()
    t["res"] = AxisMap(graph.spaces["res"].size, index=torch.randperm(32, generator=torch.Generator().manual_seed(0)))
    moved = graph.apply(sd, t)
    assert _gap(model, graph, moved, t) <= TOLERANCE
    partial = {**moved, "vocab_layer_norm.weight": sd["vocab_layer_norm.weight"]}
    partial["vocab_layer_norm.bias"] = sd["vocab_layer_norm.bias"]
    assert _gap(model, graph, partial, t) > 1e-3


# ------------------------------------------------------------------------------------------------
# weight matching
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_weight_matching_recovers_a_known_permutation(models, case):
    """B is A under a random permutation of every space; A aligned to B is A again."""
    model = models[case]
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sd_b = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(4)))
    assert max(float((sd_b[k] - sd[k]).abs().max()) for k in sd) > 1e-2
    alignment = align("weight-matching", Pair(graph, sd, sd_b))
    assert alignment.exact
    assert _gap(model, graph, alignment.aligned_b()) <= TOLERANCE


# ------------------------------------------------------------------------------------------------
# the CLI: verify, a streamed merge, masked-LM evaluation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "xlm-roberta-mlm",
        "distilbert-mlm",
        "modernbert-mlm",
        "electra",
        "electra-mlm-equal",
        "electra-cls",
        "deberta-v2-mlm",
        "deberta-v2-mlm-emb",
        "deberta-v2-cls",
        "albert",
        "albert-groups",
        "mpnet-mlm",
        "mpnet-base",
    ],
)
def test_cli_verify_a_saved_model(tmp_path: Path, case: str, capsys: Any) -> None:
    folder = tmp_path / case
    tiny.FACTORIES[case](0).save_pretrained(str(folder))
    for cls in ("permutation", "orthogonal"):
        capsys.readouterr()
        assert main(["verify", str(folder), "--class", cls]) == 0
        printed = " ".join(capsys.readouterr().out.split())
        assert float(printed.split("max |Δ| = ")[1].split()[0]) <= TOLERANCE
        assert "OK" in printed


def _permuted_copy(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    return rebuild(model, graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(seed))))


def _run(root: Path, name: str, body: dict[str, Any], capsys: Any) -> Path:
    out = root / "out" / name
    recipe = root / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump({**body, "output": {"dir": str(out)}, "cache": False}), encoding="utf-8")
    capsys.readouterr()
    code = main([str(recipe)])
    assert code == 0, capsys.readouterr().err
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    spec = get_adapter(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.eval()(**inputs).logits


@pytest.mark.parametrize("case", list(MLM_CLASSES))
def test_streamed_weight_matching_merge_with_a_permuted_copy(tmp_path: Path, case: str, capsys: Any) -> None:
    """A merge (no evaluation, no cache: the streamed path) of A and a permuted copy of A is A, as
    the stock class loads it."""
    a = tiny.FACTORIES[case](0)
    a.save_pretrained(str(tmp_path / "a"))
    _permuted_copy(a, seed=1).save_pretrained(str(tmp_path / "b"))
    body = {"job": "merge", "models": [str(tmp_path / "a"), str(tmp_path / "b")], "strategy": "weight-matching"}
    out = _run(tmp_path, case, body, capsys)
    merged = MLM_CLASSES[case].from_pretrained(str(out))
    assert type(merged) is type(a)
    assert float((_logits(merged) - _logits(a)).abs().max()) <= TOLERANCE
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert record["function_preserved"]["max_abs_diff"] <= TOLERANCE


@pytest.fixture(scope="module")
def text() -> str:
    return shakespeare_text(["hamlet"])[:3000].lower()


@pytest.mark.parametrize("case", list(MLM_CLASSES))
def test_masked_lm_merge_is_evaluated(tmp_path: Path, case: str, text: str, capsys: Any) -> None:
    """A merge of two independent models, scored by masked-LM pseudo-perplexity along the curve."""
    tok = char_tokenizer(text, mask=True)
    assert len(tok) <= tiny.V
    for name, seed in (("a", 0), ("b", 1)):
        tiny.FACTORIES[case](seed).save_pretrained(str(tmp_path / name))
        tok.save_pretrained(str(tmp_path / name))
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    body = {
        "job": "merge",
        "models": [str(tmp_path / "a"), str(tmp_path / "b")],
        "strategy": "weight-matching",
        "evaluate": {
            "task": "masked-lm",
            "data": {"dataset": "text", "data_files": str(tmp_path / "corpus.txt")},
            "points": 3,
            "max_tokens": 400,
        },
    }
    out = _run(tmp_path, case, body, capsys)
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert record["task"] == "masked-lm"
    curve = record["curves"]["weight-matching"]
    assert len(curve["loss"]) == 3 and set(curve["metric"]) == {"pseudo_perplexity"}
    assert record["function_preserved"]["max_abs_diff"] <= TOLERANCE
    assert type(MLM_CLASSES[case].from_pretrained(str(out))) is MLM_CLASSES[case]
