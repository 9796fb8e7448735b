"""Transport of a task vector onto a new base: exact when the new base is a transform of the old one."""

from __future__ import annotations

import json

import pytest
import torch

import tiny
from hf_rebasin.alignment.strategies import Pair, align
from hf_rebasin.alignment.verify import example_inputs
from hf_rebasin.core.errors import IncompatibleModelsError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.transport import add_task_vector, task_vector
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.canonical import canonicalize


def _finetune(sd: dict[str, torch.Tensor], scale: float = 0.05, seed: int = 3) -> dict[str, torch.Tensor]:
    """A stand-in fine-tune: every floating tensor moved (norm scales included), ties kept."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for k, v in sd.items():
        if not v.is_floating_point():
            out[k] = v
        elif v.data_ptr() in seen:
            out[k] = seen[v.data_ptr()]
        else:
            out[k] = seen[v.data_ptr()] = v + scale * (v.std() if v.numel() > 1 else 1.0) * torch.randn(
                v.shape, generator=g
            )
    return out


def _max_diff(a, b) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b if b[k].is_floating_point())


def _logits(model, sd, untie, inputs):
    with torch.no_grad():
        return rebuild(model, dict(sd), untie=untie)(**inputs).logits


@pytest.mark.parametrize("case", ["gpt2", "bert-mlm", "llama-gqa", "vit"])
@pytest.mark.parametrize("strategy", ["weight-matching", "transfusion"])
def test_permutation_transport_is_exact_for_every_alpha(case, strategy):
    model = tiny.FACTORIES[case](0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    ft = _finetune(base)
    transform = graph.random_transform("permutation", torch.Generator().manual_seed(1))
    target = graph.apply(base, transform)  # the "new release": the old base in another basis
    alignment = align(strategy, Pair(graph, target, base))  # brings the old base into the target's basis
    tau = task_vector(alignment, graph, ft)
    for alpha in (0.5, 1.0):
        want = graph.apply(
            {k: v + alpha * (ft[k] - v) if v.is_floating_point() else v for k, v in base.items()}, transform
        )
        assert _max_diff(add_task_vector(alignment.sd_a, tau, alpha), want) < 1e-5, alpha


@pytest.mark.parametrize("case", ["gpt2", "llama-gqa", "vit"])
def test_orthogonal_transport_carries_the_finetune_exactly(case):
    model = tiny.FACTORIES[case](0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    ft = _finetune(base)
    canon, cgraph, untied = canonicalize(graph, base)
    transform = cgraph.random_transform("orthogonal", torch.Generator().manual_seed(1))
    target = cgraph.apply(canon, transform)
    alignment = align("generalized-orthogonal", Pair(graph, target, base))
    assert alignment.canonical
    tau = task_vector(alignment, graph, ft)
    inputs = example_inputs(get_adapter(model.config.model_type), model.config, torch.Generator().manual_seed(0))
    # α = 1: the target plus the moved task vector computes what the fine-tune computes
    moved = add_task_vector(alignment.sd_a, tau, 1.0)
    want = _logits(model, ft, False, inputs)
    got = _logits(model, moved, bool(untied), inputs)
    assert (got - want).abs().max().item() < 1e-4
    # any α: the same transform of the canonical-coordinate interpolation
    ft_canon = canonicalize(graph, ft)[0]
    half = {k: v + 0.5 * (ft_canon[k] - v) if v.is_floating_point() else v for k, v in canon.items()}
    assert _max_diff(add_task_vector(alignment.sd_a, tau, 0.5), cgraph.apply(half, transform)) < 1e-4


def test_tied_tensors_stay_tied_and_shapes_are_checked():
    model = tiny.FACTORIES["gpt2"](0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    alignment = align("weight-matching", Pair(graph, base, base))
    tau = task_vector(alignment, graph, _finetune(base))
    out = add_task_vector(alignment.sd_a, tau, 1.0)
    assert out["lm_head.weight"].data_ptr() == out["transformer.wte.weight"].data_ptr()
    with pytest.raises(IncompatibleModelsError, match="only in the base"):
        task_vector(alignment, graph, {k: v for k, v in base.items() if k != "transformer.h.0.mlp.c_fc.bias"})
    bad = dict(tau, **{"transformer.h.0.mlp.c_fc.bias": torch.zeros(3)})
    with pytest.raises(IncompatibleModelsError, match=r"c_fc\.bias"):
        add_task_vector(alignment.sd_a, bad, 1.0)


# ---------------------------------------------------------------------------------------------
# job: transport through the CLI


def permuted_transport_folders(tmp_path, tokenizer=None):
    """``base``, ``ft`` (the base moved a little) and ``target`` (the base permuted) saved under
    ``tmp_path`` from a tiny GPT-2; returns the model and the fine-tune's state dict."""
    model = tiny.gpt2(0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    ft = _finetune(base, scale=0.2)
    target = graph.apply(base, graph.random_transform("permutation", torch.Generator().manual_seed(1)))
    for name, sd in (("base", base), ("ft", ft), ("target", target)):
        rebuild(model, dict(sd)).save_pretrained(str(tmp_path / name))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp_path / name))
    return model, ft


def test_a_transport_recipe_without_strategy_rotates_one_residual_stream(tmp_path):
    """No `strategy`: generalized-orthogonal with one residual map. B is A rotated (canonical form),
    which no permutation can undo, so only a rotation found exactly gives back the fine-tune's
    logits, here read with the stock class from the output folder."""
    import transformers as T
    import yaml

    from helpers import run_main

    model = tiny.gpt2(0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    ft = _finetune(base, scale=0.2)
    canon, cgraph, untied = canonicalize(graph, base)
    target = cgraph.apply(canon, cgraph.random_transform("orthogonal", torch.Generator().manual_seed(1)))
    assert untied  # canonical form folds ln_f's scale into lm_head: all three are saved untied
    for name, sd in (("base", base), ("ft", ft), ("target", target)):
        rebuild(model, dict(sd), untie=True).save_pretrained(str(tmp_path / name))
    recipe = {"job": "transport", "base": "./base", "finetuned": "./ft", "target": "./target", "calibrate": False}
    recipe |= {"output": {"dir": "out"}}
    path = tmp_path / "transport.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    proc = run_main(str(path))
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text(encoding="utf-8"))
    assert record["strategy"] == "generalized-orthogonal"
    assert record["strategy_options"]["residual_maps"] == "global"
    out = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.randint(0, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = rebuild(model, dict(ft))(ids).logits
        assert (out(ids).logits - want).abs().max().item() < 1e-4


@pytest.mark.slow  # ~25 s: runs in CI's slow pass, keeping the default run under 10 minutes
def test_transport_recipe_moves_a_finetune_onto_a_transformed_base(tmp_path):
    import json

    import transformers as T
    import yaml

    from helpers import assert_user_error, flat, run_main
    from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text

    text = shakespeare_text(["hamlet"])[:3000].lower()
    tok = char_tokenizer(text)
    model, ft = permuted_transport_folders(tmp_path, tok)
    (tmp_path / "task.txt").write_text(text[:1500], encoding="utf-8")
    (tmp_path / "support.txt").write_text(text[1500:], encoding="utf-8")
    recipe = {
        "job": "transport",
        "base": "./base",
        "finetuned": "./ft",
        "target": "./target",
        "strategy": "weight-matching",
        "alpha": [1.0, 0.5],
        "calibrate": False,
        "evaluate": {
            "task": "causal-lm",
            "data": {"dataset": "text", "data_files": "task.txt"},
            "support": {"dataset": "text", "data_files": "support.txt"},
        },
        "output": {"dir": "moved"},
    }
    path = tmp_path / "transport.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    proc = run_main(str(path), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "transported B + 1·π(τ)" in flat(proc.stdout) and "naive B + 0.5·τ" in flat(proc.stdout)
    record = json.loads((tmp_path / "moved" / "rebasin.json").read_text(encoding="utf-8"))
    moved = record["transport"]
    assert moved["alphas"] == [1.0, 0.5]
    for scores in (moved, moved["support"]):
        loss = scores["loss"]
        assert loss["transported"][0] == pytest.approx(loss["finetuned"], abs=1e-4)  # the target is A, permuted
        assert abs(loss["naive"][0] - loss["finetuned"]) > 1e-2  # adding τ in the wrong basis is not the fine-tune
    assert [m["role"] for m in record["models"]] == ["target", "base", "finetuned"]
    assert [d["role"] for d in record["datasets"]] == ["evaluation", "support"]
    assert record["function_preserved"]["max_abs_diff"] < 1e-4
    out = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "moved"))
    ids = torch.randint(0, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = rebuild(model, dict(ft))(ids).logits
        assert (out(ids).logits - want).abs().max().item() < 1e-4
    card = (tmp_path / "moved" / "README.md").read_text(encoding="utf-8")
    assert "# Transported: ft moved onto target" in card and "## Transport" in card
    assert "this model: B + 1·π(τ)" in card and "On the support data" in card and "| fine-tune A + τ |" in card

    # a target narrower than the base (a wide task vector has no exact image there), and a fine-tune
    # that is not of the base's shape: exit 2
    T.GPT2LMHeadModel(T.GPT2Config(vocab_size=tiny.V, n_embd=24, n_layer=1, n_head=2)).save_pretrained(
        str(tmp_path / "other")
    )
    tok.save_pretrained(str(tmp_path / "other"))
    for key, needle in (("target", "narrower than the base"), ("finetuned", "shape")):
        bad = dict(recipe, **{key: "./other"}, output={"dir": "bad"})
        path.write_text(yaml.safe_dump(bad, sort_keys=False), encoding="utf-8")
        assert_user_error(run_main(str(path), env=env), needle)
        assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------
# a head only the fine-tune has (a classifier trained on A's features)


def _classifier_finetune(model):
    """A GPT2ForSequenceClassification from ``model``'s body, moved a little, with a new head."""
    import transformers as T

    config = T.GPT2Config(**{**model.config.to_dict(), "num_labels": 3, "pad_token_id": 0})
    torch.manual_seed(7)
    cls = T.GPT2ForSequenceClassification(config).eval()
    body = {k: v for k, v in _finetune(model.state_dict()).items() if k.startswith("transformer.")}
    missing = cls.load_state_dict(body, strict=False).missing_keys
    assert missing == ["score.weight"]
    with torch.no_grad():
        cls.score.weight.normal_(0, 0.5)
    return cls


@pytest.mark.parametrize("strategy", ["weight-matching", "generalized-orthogonal"])
def test_a_head_only_in_the_finetune_is_carried_into_the_targets_basis(strategy):
    from hf_rebasin.merging.transport import move_finetune

    model = tiny.gpt2(0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    ft_model = _classifier_finetune(model)
    ft = ft_model.state_dict()
    ft_graph = graph_for(ft_model.config, ft.keys())
    if strategy == "weight-matching":
        target = graph.apply(base, graph.random_transform("permutation", torch.Generator().manual_seed(1)))
    else:
        canon, cgraph, _ = canonicalize(graph, base)
        target = cgraph.apply(canon, cgraph.random_transform("orthogonal", torch.Generator().manual_seed(1)))
    alignment = align(strategy, Pair(graph, target, base))
    tau, carried = move_finetune(alignment, graph, ft, ft_graph)
    assert sorted(carried) == ["score.weight"] and "lm_head.weight" not in tau
    body = add_task_vector(alignment.sd_a, tau, 1.0)
    moved = {k: carried[k] if k in carried else body[k] for k in ft}
    ids = torch.randint(1, tiny.V, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ft_model(ids).logits
        got = rebuild(ft_model, moved)(ids).logits
    assert (got - want).abs().max().item() < 1e-4


def test_transport_recipe_carries_a_new_head_and_refuses_another_architecture(tmp_path):
    import transformers as T
    import yaml

    from helpers import assert_user_error, run_main

    model = tiny.gpt2(0)
    base = model.state_dict()
    graph = graph_for(model.config, base.keys())
    target = graph.apply(base, graph.random_transform("permutation", torch.Generator().manual_seed(1)))
    rebuild(model, dict(base)).save_pretrained(str(tmp_path / "base"))
    rebuild(model, dict(target)).save_pretrained(str(tmp_path / "target"))
    ft_model = _classifier_finetune(model)
    ft_model.save_pretrained(str(tmp_path / "ft"))
    tiny.llama(0).save_pretrained(str(tmp_path / "llama"))

    def recipe(finetuned: str) -> str:
        path = tmp_path / f"{finetuned}.yaml"
        body = {"job": "transport", "base": "./base", "finetuned": f"./{finetuned}", "target": "./target"}
        body |= {"strategy": "weight-matching", "calibrate": False, "output": {"dir": f"out-{finetuned}"}}
        path.write_text(yaml.safe_dump(body), encoding="utf-8")
        return str(path)

    proc = run_main(recipe("ft"))
    assert proc.returncode == 0, proc.stderr
    out = T.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "out-ft")).eval()
    assert type(out).__name__ == "GPT2ForSequenceClassification"
    ids = torch.randint(1, tiny.V, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (out(ids).logits - ft_model(ids).logits).abs().max().item() < 1e-4
    record = json.loads((tmp_path / "out-ft" / "rebasin.json").read_text(encoding="utf-8"))
    assert record["transport"]["carried"] == ["score.weight"]
    assert any("score.weight" in n for n in record["notes"])
    assert_user_error(run_main(recipe("llama")), "finetuned.model", "architecture of the base")
