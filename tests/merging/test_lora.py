"""LoRA adapters as task vectors: read, merge, transport factor by factor, write, load with PEFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tiny
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.core.errors import CheckpointError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.lora import apply_adapter, lora_graph, read_adapter, save_adapter, transport_adapter
from hf_rebasin.merging.transport import add_task_vector, task_vector
from hf_rebasin.symmetry.adapters import graph_for

peft = pytest.importorskip("peft")

TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # Conv1D, fused q|k|v output
    "llama-gqa": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"],
    # a mixture of experts: attention, and Qwen2-MoE's shared expert and dense layer (PEFT's LoRA
    # targets Linear modules; a layer's experts are 3-D parameters of one module)
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2-moe": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def _adapter(model: torch.nn.Module, folder: Path, targets: list[str], **extra: object) -> Path:
    """A trained-looking PEFT LoRA adapter on a copy of ``model`` (both factors random, not B = 0)."""
    import copy

    torch.manual_seed(5)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, fan_in_fan_out="c_attn" in targets, **extra
    )
    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)  # an update with an O(1) effect on the logits
    wrapped.save_pretrained(str(folder))
    return folder


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, tiny.V, (2, 10), generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("case", ["gpt2", "llama-gqa", "mixtral", "qwen2-moe"])
def test_transported_adapter_is_the_transformed_finetune(case, tmp_path):
    """B = T(A): the moved adapter on B computes what the adapter computes on A, for a transform
    the strategy recovers (permutations) and for a given one with rotated heads."""
    model = tiny.FACTORIES[case](0)
    base = model.state_dict()
    adapter = read_adapter(_adapter(model, tmp_path / "lora", TARGETS[case]), model)
    assert adapter.modules and all(m.rank == 4 for m in adapter.modules.values())
    graph, demoted = lora_graph(graph_for(model.config, base.keys()))
    assert demoted  # the residual stream: no canonical form for an adapter
    finetuned = apply_adapter(adapter, base)
    ids = _ids()
    want = _logits(rebuild(model, finetuned), ids)
    assert (want - _logits(model, ids)).abs().max() > 0.1  # the adapter does something

    for cls in ("permutation", "orthogonal"):  # orthogonal: inner rotations of the heads
        transform = graph.random_transform(cls, torch.Generator().manual_seed(1))
        target = graph.apply(base, transform)
        if cls == "permutation":
            alignment = align("weight-matching", Pair(graph, target, base))
        else:
            from hf_rebasin.alignment.strategies import Alignment

            alignment = Alignment("given", graph, target, base, transform)
        moved, whole = transport_adapter(adapter, graph, alignment.transform, base, target)
        assert not whole  # a permutation residual: nothing but the factors
        for key, t in moved.items():  # same rank, same file layout
            assert t.shape == _stored(adapter, key).shape
        out = tmp_path / f"moved-{cls}"
        out.mkdir()
        save_adapter(adapter, moved, out, base_model="org/new-base")
        reread = read_adapter(out, rebuild(model, target))
        on_target = apply_adapter(reread, target)
        # the same as adding the dense moved task vector (the full-model path)
        tau = task_vector(alignment, graph, finetuned)
        dense = add_task_vector(target, tau, 1.0)
        assert max((on_target[k] - dense[k]).abs().max().item() for k in dense) < 1e-5
        got = _logits(rebuild(model, on_target), ids)
        assert (got - want).abs().max().item() < 1e-4, cls
        # and PEFT loads it onto the target as it is
        peft_model = peft.PeftModel.from_pretrained(rebuild(model, target), str(out)).eval()
        assert (_logits(peft_model, ids) - want).abs().max().item() < 1e-4
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/new-base"


def _stored(adapter, key):
    for m in adapter.modules.values():
        if key == m.key_a:
            return m.a
        if key == m.key_b:
            return m.b
    return adapter.full[key][1]


def test_alpha_scales_the_update_and_whole_tensors_follow_the_task_vector_rule(tmp_path):
    model = tiny.gpt2_untied(0)
    base = model.state_dict()
    folder = _adapter(model, tmp_path / "lora", ["c_fc"], bias="lora_only")
    adapter = read_adapter(folder, model)
    assert adapter.full  # the trained biases of c_fc are stored whole
    graph, _ = lora_graph(graph_for(model.config, base.keys()))
    transform = graph.random_transform("permutation", torch.Generator().manual_seed(2))
    target = graph.apply(base, transform)
    moved, _ = transport_adapter(adapter, graph, transform, base, target)
    out = tmp_path / "half"
    out.mkdir()
    save_adapter(adapter, moved, out, base_model="b", alpha=0.5, target=target)
    got = apply_adapter(read_adapter(out, rebuild(model, target)), target)
    want = graph.apply(apply_adapter(adapter, base, alpha=0.5), transform)
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5


def test_unsupported_adapters_are_refused_with_the_reason(tmp_path):
    model = tiny.gpt2(0)  # tied head: a LoRA on the embedding would touch one use of the weight only
    with pytest.raises(CheckpointError, match="tied"):
        read_adapter(_adapter(model, tmp_path / "tied", ["wte"]), model)
    dora = _adapter(model, tmp_path / "dora", ["c_fc"])
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        read_adapter(dora, model)
    (dora / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(CheckpointError, match="IA3"):
        read_adapter(dora, model)
    other = tiny.llama(0)
    from hf_rebasin.core.errors import IncompatibleModelsError

    with pytest.raises(IncompatibleModelsError, match=r"does not have|matches no module|another base"):
        read_adapter(_adapter(model, tmp_path / "gpt2", ["c_fc"]), other)


# ---------------------------------------------------------------------------------------------
# job: transport with an adapter, through the CLI


def _transport_folders(tmp_path: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.nn.Module]:
    """base/ (tiny GPT-2 with a tokenizer), lora/ (an adapter on it), target/ (base, permuted)."""
    from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text

    text = shakespeare_text(["hamlet"])[:3000].lower()
    tok = char_tokenizer(text)
    model = tiny.gpt2(0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    target = graph.apply(base, graph.random_transform("permutation", torch.Generator().manual_seed(1)))
    for name, sd in (("base", base), ("target", target)):
        rebuild(model, dict(sd)).save_pretrained(str(tmp_path / name))
        tok.save_pretrained(str(tmp_path / name))
    _adapter(model, tmp_path / "lora", TARGETS["gpt2"])
    (tmp_path / "task.txt").write_text(text[:1500], encoding="utf-8")
    return model, target, rebuild(model, apply_adapter(read_adapter(tmp_path / "lora", model), base))


def _recipe(tmp_path: Path, **extra: object) -> Path:
    import yaml

    recipe = {
        "job": "transport",
        "base": "./base",
        "finetuned": "./lora",
        "target": "./target",
        "strategy": "weight-matching",
        "alpha": [1.0, 0.5],
        "calibrate": False,
        "evaluate": {"task": "causal-lm", "data": {"dataset": "text", "data_files": "task.txt"}},
        "output": {"dir": "moved"},
        **extra,
    }
    path = tmp_path / "transport.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.parametrize("strategy", ["weight-matching", "generalized-orthogonal"])
def test_transport_recipe_writes_an_adapter_for_the_target(strategy, tmp_path):
    from helpers import flat, run_main

    model, target, finetuned = _transport_folders(tmp_path)
    env = {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    proc = run_main(str(_recipe(tmp_path, strategy=strategy)), env=env)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "moved"
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    assert "adapter_model.safetensors" in flat(proc.stdout)
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    moved = record["transport"]
    assert moved["adapter"]["rank"] == 4 and moved["adapter"]["modules"] == 8
    assert moved["loss"]["transported"][0] == pytest.approx(moved["loss"]["finetuned"], abs=1e-4)
    assert abs(moved["loss"]["naive"][0] - moved["loss"]["finetuned"]) > 1e-2
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "target")
    loaded = peft.PeftModel.from_pretrained(rebuild(model, dict(target)), str(out)).eval()
    ids = _ids(3)
    assert (_logits(loaded, ids) - _logits(finetuned, ids)).abs().max().item() < 1e-4
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "library_name: peft" in card and "LoRA" in card
    assert "Stored untied" not in card  # an adapter holds no head, whatever the alignment untied
    canonical = strategy == "generalized-orthogonal"
    assert moved["adapter"]["canonical"] is canonical
    assert bool(moved["adapter"]["whole_biases"]) is canonical  # c_attn and c_fc read a folded β
    assert ("residual stream is rotated" in card) is canonical
    for name in moved["adapter"]["whole_biases"]:
        assert f"`{name}` (stored whole, `bias: lora_only`)" in card


def test_an_adapter_for_another_base_is_refused_unless_allowed(tmp_path):
    from helpers import assert_user_error, run_main

    _transport_folders(tmp_path)
    config_path = tmp_path / "lora" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "someone/other-base"
    config_path.write_text(json.dumps(config))
    proc = run_main(str(_recipe(tmp_path)), "--dry-run")
    assert_user_error(proc, "finetuned.model", "someone/other-base", "check_base: false")
    allowed = _recipe(tmp_path, finetuned={"model": "./lora", "check_base": False})
    env = {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    proc = run_main(str(allowed), env=env)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "moved" / "rebasin.json").read_text(encoding="utf-8"))
    assert any("someone/other-base" in n for n in record["notes"])
    # an adapter is a fine-tune, never a model to merge
    merge = tmp_path / "merge.yaml"
    merge.write_text("job: merge\nmodels: [./base, ./lora]\nstrategy: vanilla\noutput: {dir: m}\n", encoding="utf-8")
    assert_user_error(run_main(str(merge), "--dry-run"), "models.1.model", "PEFT adapter")


def _stored_with_norms(graph, canonical: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A model as stored whose canonical form is ``canonical``: random γ and β put back into every
    LayerNorm whose readers have biases (so the adapter meets γ_B ≠ 1 and β_B ≠ 0)."""
    from hf_rebasin.symmetry.canonical import bias_of

    g = torch.Generator().manual_seed(seed)
    sd = dict(canonical)
    for norm in graph.norms:
        if not norm.readers or norm.bias is None or not all(bias_of(r, sd) for r in norm.readers):
            continue
        gamma = 0.5 + torch.rand(sd[norm.weight].shape, generator=g, dtype=torch.float64)
        beta = 0.3 * torch.randn(sd[norm.bias].shape, generator=g, dtype=torch.float64)
        for reader in norm.readers:
            axis = graph.bindings[reader].axes.index(norm.space)
            shape = [1, 1]
            shape[axis] = -1
            w = sd[reader].double() / gamma.reshape(shape)
            bias = bias_of(reader, sd)
            sd[bias] = (sd[bias].double() - torch.tensordot(w, beta, dims=([axis], [0]))).float()
            sd[reader] = w.float()
        sd[norm.weight], sd[norm.bias] = gamma.float(), beta.float()
    return sd


def test_generalized_orthogonal_moves_an_adapter_through_the_canonical_form(tmp_path):
    """B = a rotated residual stream (canonical form) stored with other norm scales: the moved
    adapter, loaded by PEFT on B as stored, computes what the adapter computes on A."""
    from hf_rebasin.merging.lora import canonical_blocker
    from hf_rebasin.symmetry.canonical import canonicalize

    model = tiny.gpt2_untied(0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    adapter = read_adapter(_adapter(model, tmp_path / "lora", TARGETS["gpt2"]), model)
    assert canonical_blocker(adapter, graph, base) is None
    canon, cgraph, _ = canonicalize(graph, base)
    rotated = cgraph.apply(canon, cgraph.random_transform("orthogonal", torch.Generator().manual_seed(1)))
    target = _stored_with_norms(graph, rotated, seed=2)
    ids = _ids(1)
    assert (_logits(rebuild(model, target), ids) - _logits(model, ids)).abs().max() < 1e-4  # same function
    alignment = align("generalized-orthogonal", Pair(graph, target, base))
    moved, whole = transport_adapter(adapter, graph, alignment.transform, base, target, canonical_graph=alignment.graph)
    assert whole and all(k.endswith(".base_layer.bias") for k in whole)  # c_attn and c_fc read a folded β
    out = tmp_path / "moved"
    out.mkdir()
    save_adapter(adapter, moved, out, base_model="b", target=target, whole=whole)
    want = _logits(rebuild(model, apply_adapter(adapter, base)), ids)
    loaded = peft.PeftModel.from_pretrained(rebuild(model, target), str(out)).eval()
    assert (_logits(loaded, ids) - want).abs().max().item() < 1e-4
    # the runner scores the dense path (B in canonical form + π(τ)): the same function
    dense = add_task_vector(alignment.sd_a, task_vector(alignment, graph, apply_adapter(adapter, base)), 1.0)
    assert (_logits(rebuild(model, dense), ids) - want).abs().max().item() < 1e-4
