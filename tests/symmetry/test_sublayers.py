"""Per-sublayer residual streams (TransFusion's residual maps for transport): every tensor's stream
follows the order in which the model runs its modules, matching recovers a different map per
stream, and a transport with them is exact when the new base is a transform of the old one."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from test_transport import _finetune, _max_diff, permuted_transport_folders

import tiny
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.alignment.verify import accepted_inputs, example_inputs
from hf_rebasin.core.errors import AdapterError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.transport import add_task_vector, task_vector
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.adapters.base import as_choices
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.spaces import HeadSpace, Space
from hf_rebasin.symmetry.sublayers import is_per_sublayer, per_sublayer, stream_of

PER_SUBLAYER = {"residual_maps": "per-sublayer"}


def _residuals(graph):
    return [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.kind == "residual"]


def _run_order(model, inputs) -> dict[str, int]:
    """The order in which the model's modules with parameters first run (forward pre-hooks)."""
    order: dict[str, int] = {}

    def note(name: str):
        def hook(_module, _args) -> None:
            order.setdefault(name, len(order))

        return hook

    handles = [
        mod.register_forward_pre_hook(note(name))
        for name, mod in model.named_modules()
        if any(True for _ in mod.parameters(recurse=False))
    ]
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    return order


PARALLEL_ONLY = ("phi", "cohere", "cohere2")  # a parallel residual with no option to turn it off


def _parallel(config: object) -> bool:
    """Attention and MLP read one stream: GPT-NeoX's and StableLM's option, Falcon's (its new
    architecture always), Phi and Cohere always."""
    options = ("use_parallel_residual", "parallel_attn", "new_decoder_architecture")
    return any(getattr(config, o, False) for o in options) or getattr(config, "model_type", None) in PARALLEL_ONLY


@pytest.mark.parametrize("case", sorted(tiny.FACTORIES))
def test_streams_follow_the_order_the_model_runs_its_modules(case):
    """Independent of the adapters' sublayer lists: in the order the model runs its modules, a
    tensor's stream never goes back, and it steps up by one exactly at each sublayer's output
    projection (a module that reads a head or MLP space and writes the stream)."""
    model = tiny.FACTORIES[case](0).eval()
    if _parallel(model.config):
        pytest.skip(
            "parallel residual: the MLP runs after the attention writes but reads the stream before it "
            "(test_adapters_decoders.py::test_streams_follow_the_data_flow)"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        pytest.skip(
            "encoder-decoder: the decoder's embeddings start a second stream after the encoder has run, and "
            "cross-attention reads the encoder's last one; per-sublayer streams are not defined there yet"
        )
    if getattr(model.config, "shared_expert_intermediate_size", 0):
        pytest.skip(
            "a shared expert runs after the routed experts have written: two branches of one sublayer, "
            "both reading the stream before it (test_moe.py checks the split keeps the model)"
        )
    graph = graph_for(model.config, model.state_dict().keys())
    if not graph.sublayers:
        pytest.skip(
            "no sublayers declared: ALBERT runs one layer's weights at every depth, so a stream per sublayer "
            "would give a shared tensor another map at each run (test_adapters_albert_mpnet.py checks the refusal)"
        )
    inputs = example_inputs(get_adapter(model.config.model_type), model.config, torch.Generator().manual_seed(0))
    # SiglipForImageClassification: pixels only; a multiple-choice head: the rows as one question's choices
    order = _run_order(model, as_choices(model, accepted_inputs(model, inputs)))
    for res in _residuals(graph):
        streams = stream_of(graph, res)
        tower = res[: -len("res")]  # CLIP: "text." / "vision."; one tower otherwise
        # one output projection per attention layer (T5's layers share one head space); SigLIP's
        # pooling attention reads the finished stream and writes a space of its own: no layer
        layers = [
            t
            for t, b in graph.bindings.items()
            if any(
                isinstance(a, str)
                and a.endswith(":o")
                and a.startswith(tower)
                and ".pool." not in a
                and isinstance(graph.spaces[a.split(":")[0]], HeadSpace)
                for a in b.axes
            )
        ]
        # one module may both read and write the stream (a MoE layer's experts: gate_up_proj reads,
        # down_proj writes): inside it, what it reads comes first
        ran = sorted(
            (order[t.rsplit(".", 1)[0]], streams[t], t)
            for t in streams
            if t not in graph.ties and t.rsplit(".", 1)[0] in order
        )
        seen = [streams[t] for *_, t in ran]
        assert seen == sorted(seen), f"{res}: a stream goes back in run order"
        assert seen[0] == 0 and seen[-1] == 2 * len(layers), res
        for (*_, before), (*_, t) in itertools.pairwise(ran):
            if streams[t] != streams[before]:
                # the module's weight (a MoE layer's experts: the stacked tensor itself)
                weight = graph.bindings.get(t.rsplit(".", 1)[0] + ".weight") or graph.bindings[t]
                others = {a.parts[0] if hasattr(a, "parts") else a for a in weight.axes} - {res, None}
                assert streams[t] == streams[before] + 1 and any(
                    ":o" in o or "mlp" in o or ":units" in o for o in others if isinstance(o, str)
                ), f"{t} starts stream {streams[t]}"
    split = per_sublayer(graph)
    split.check(model.state_dict())
    assert per_sublayer(split) is split and is_per_sublayer(split) and not is_per_sublayer(graph)


def test_gpt2_streams_by_hand():
    model = tiny.gpt2(0)
    streams = stream_of(graph_for(model.config, model.state_dict().keys()), "res")
    want = {
        "transformer.wte.weight": 0,
        "transformer.h.0.ln_1.weight": 0,
        "transformer.h.0.attn.c_attn.weight": 0,
        "transformer.h.0.attn.c_proj.weight": 1,
        "transformer.h.0.attn.c_proj.bias": 1,
        "transformer.h.0.ln_2.bias": 1,
        "transformer.h.0.mlp.c_fc.weight": 1,
        "transformer.h.0.mlp.c_proj.weight": 2,
        "transformer.h.1.ln_1.weight": 2,
        "transformer.ln_f.weight": 4,
        "lm_head.weight": 4,  # tied to wte, but read after ln_f: canonical form unties it there
    }
    assert {k: streams[k] for k in want} == want


def test_an_adapter_without_sublayers_is_refused():
    import dataclasses

    model = tiny.gpt2(0)
    graph = dataclasses.replace(graph_for(model.config, model.state_dict().keys()), sublayers=())
    with pytest.raises(AdapterError, match="sublayers"):
        per_sublayer(graph)


@pytest.mark.parametrize("case", ["gpt2", "bert-mlm", "llama-gqa", "vit"])
@pytest.mark.parametrize("strategy", ["weight-matching", "transfusion"])
def test_matching_recovers_a_different_permutation_per_stream(case, strategy):
    model = tiny.FACTORIES[case](0)
    base = model.state_dict()
    split = per_sublayer(graph_for(model.config, base.keys()))
    transform = split.random_transform("permutation", torch.Generator().manual_seed(1))
    streams = [transform[n].index for n in split.spaces if "#" in n]
    assert len({tuple(p.tolist()) for p in streams}) == len(streams)  # really one map per stream
    target = split.apply(base, transform)
    alignment = align(strategy, Pair(graph_for(model.config, base.keys()), target, base), PER_SUBLAYER)
    assert is_per_sublayer(alignment.graph) and not alignment.exact
    assert _max_diff(alignment.aligned_b(), target) < 1e-6


@pytest.mark.parametrize("case", ["gpt2", "llama-gqa", "vit"])
def test_generalized_orthogonal_recovers_a_rotation_per_stream(case):
    model = tiny.FACTORIES[case](0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    canon, cgraph, _ = canonicalize(per_sublayer(graph), base)
    transform = cgraph.random_transform("orthogonal", torch.Generator().manual_seed(1))
    target = cgraph.apply(canon, transform)
    alignment = align("generalized-orthogonal", Pair(graph, target, base), PER_SUBLAYER)
    assert alignment.canonical and is_per_sublayer(alignment.graph)
    assert _max_diff(alignment.aligned_b(), target) < 1e-4


# deberta-v2-mlm: its relative-position table rides stream 0 yet every layer reads it
@pytest.mark.parametrize("case", ["gpt2", "bert-mlm", "llama-gqa", "deberta-v2-mlm"])
@pytest.mark.parametrize("strategy", ["weight-matching", "transfusion", "generalized-orthogonal"])
def test_a_transport_on_a_transformed_base_carries_the_finetune_exactly(case, strategy):
    """B is A in another basis (one residual map): every stream's map is that map, so B + π(τ)
    computes what the fine-tune computes, with the stock class."""
    model = tiny.FACTORIES[case](0).eval()
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    if strategy == "generalized-orthogonal" and case != "bert-mlm":
        canon, cgraph, _ = canonicalize(graph, base)
        target = cgraph.apply(canon, cgraph.random_transform("orthogonal", torch.Generator().manual_seed(1)))
    else:
        target = graph.apply(base, graph.random_transform("permutation", torch.Generator().manual_seed(1)))
    ft = _finetune(base)
    alignment = align(strategy, Pair(graph, target, base), PER_SUBLAYER)
    moved = add_task_vector(alignment.sd_a, task_vector(alignment, graph, ft), 1.0)  # the unsplit graph: split for it
    inputs = example_inputs(get_adapter(model.config.model_type), model.config, torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = rebuild(model, dict(ft))(**inputs).logits
        got = rebuild(model, dict(moved), untie=bool(alignment.untied))(**inputs).logits
    assert (got - want).abs().max().item() < 1e-4


def test_learned_matching_and_per_sublayer_maps_are_refused_together():
    from hf_rebasin.alignment.strategies import get_strategy
    from hf_rebasin.core.errors import StrategyOptionError

    with pytest.raises(StrategyOptionError, match="per-sublayer"):
        get_strategy("generalized-orthogonal").parse({"learned": True, "residual_maps": "per-sublayer"})


def test_transfusion_in_a_transport_defaults_to_per_sublayer_maps(tmp_path):
    """`strategy: transfusion` in a transport runs with per-sublayer maps (the paper's Step 3); B is
    A permuted, so the transported model is the fine-tune; the record says why no aligned model was
    checked."""
    import transformers as T
    import yaml

    from helpers import run_main

    model, ft = permuted_transport_folders(tmp_path)
    recipe = {"job": "transport", "base": "./base", "finetuned": "./ft", "target": "./target"}
    recipe |= {"strategy": "transfusion", "calibrate": False, "output": {"dir": "out"}}
    path = tmp_path / "transport.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    proc = run_main(str(path))
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text(encoding="utf-8"))
    assert record["strategy"] == "transfusion" and record["strategy_options"]["residual_maps"] == "per-sublayer"
    assert record["function_preserved"]["max_abs_diff"] is None
    assert "per sublayer" in record["function_preserved"]["reason"]
    out = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    ids = torch.randint(0, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (out(ids).logits - rebuild(model, dict(ft))(ids).logits).abs().max().item() < 1e-4
