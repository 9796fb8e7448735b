"""Runs on models of one family but different widths, checked against stock transformers: the
narrower model is embedded into the wider shape, the alignment recovers a planted map across the
padding, the barrier's ends are the models' own losses, the merged model loads with the stock class
in the wide shape, a narrow base's fine-tune is transported onto a wider target, and what cannot be
embedded exits 2 with its reason."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml

import tiny
from helpers import run_main
from hf_rebasin.alignment.widths import embed_model
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from hf_rebasin.recipe import load_recipe
from hf_rebasin.run.load import load_workspace
from hf_rebasin.run.pipeline import run_job, run_recipe
from hf_rebasin.run.plan import build_plan, plan
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from lm_folders import fixed_logits, save_lm, stock_lm, transformers_loss, write_recipe

WIDE = {  # hidden 32 → 48, heads 4 → 6 (head_dim 8 kept; Llama: KV groups 2 → 3), units grown
    "gpt2": dict(n_embd=48, n_head=6),
    "llama-gqa": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
    # the same 4 heads, each wider (head_dim 8 → 12): the queries scaled by √(12/8), the scores kept
    "gpt2-wider-heads": dict(n_embd=48, n_head=4),
}
FACTORY = {"gpt2-wider-heads": "gpt2"}  # the tiny model each case widens (default: the case's name)
HEADS = {"gpt2": 6, "llama-gqa": 6, "gpt2-wider-heads": 4}
EVALUATE = {"task": "causal-lm", "data": {"dataset": "shakespeare", "name": "hamlet", "split": "test"}}
EVALUATE |= {"max_tokens": 400}
DATA = {"dataset": "shakespeare", "name": "hamlet", "split": "train", "max_tokens": 2000, "block_size": 32}


def _like(model: T.PreTrainedModel, case: str) -> Any:
    config = copy.deepcopy(model.config)
    for k, v in WIDE[case].items():
        setattr(config, k, v)
    return config


def _planted(case: str, cls: str = "permutation", seed: int = 5) -> tuple[T.PreTrainedModel, T.PreTrainedModel]:
    """A narrow tiny model and a wide one that is its exact embedding moved by a random map of ``cls``."""
    narrow = tiny.FACTORIES[FACTORY.get(case, case)](0).eval()
    embedded, _ = embed_model(narrow, _like(narrow, case))
    sd = embedded.state_dict()
    graph = graph_for(embedded.config, sd.keys())
    if cls == "orthogonal":  # a rotation is exact once every norm's scale is folded into its readers
        sd, graph, untied = canonicalize(graph, sd)
        assert not untied
    wide = type(embedded)(embedded.config).eval()
    wide.load_state_dict(graph.apply(sd, graph.random_transform(cls, torch.Generator().manual_seed(seed))))
    return narrow, wide


def test_a_barrier_across_widths_scores_its_ends_as_transformers_does(tmp_path: Path) -> None:
    narrow = tiny.gpt2(0)
    torch.manual_seed(1)
    wide = T.GPT2LMHeadModel(_like(tiny.gpt2(1), "gpt2")).eval()
    save_lm(narrow, tmp_path / "n")
    save_lm(wide, tmp_path / "w")
    body = {"job": "barrier", "models": ["./n", "./w"], "strategy": "weight-matching", "output": {"dir": "out"}}
    body["evaluate"] = {**EVALUATE, "points": 3, "compare": ["vanilla"]}
    ws = load_workspace(build_plan(load_recipe(write_recipe(tmp_path, body))))
    assert ws.models.reference.embedded and "res (residual features): 32 → 48" in ws.models.reference.embedded
    assert ws.models.others[0].embedded is None
    done = run_job(ws)
    assert ws.eval_batches is not None
    a, b = (
        transformers_loss(stock_lm(tmp_path / "n"), ws.eval_batches),
        transformers_loss(stock_lm(tmp_path / "w"), ws.eval_batches),
    )
    for name in ("weight-matching", "vanilla"):
        curve = done.result.findings.curves[name]["loss"]
        assert curve[-1] == pytest.approx(a, rel=1e-4)  # λ = 1: the narrow model, embedded (the wide config's ε)
        assert curve[0] == pytest.approx(b, rel=1e-5)  # λ = 0: the wide model
    assert any("embedded into the shape of" in n for n in ws.notes)


@pytest.mark.parametrize("case", sorted(WIDE))
@pytest.mark.parametrize("narrow_first", [True, False])
def test_weight_matching_recovers_a_map_planted_in_the_wider_shape(
    case: str, narrow_first: bool, tmp_path: Path
) -> None:
    """B = the narrow model's exact embedding, its heads, units and stream permuted: aligned across
    the padding, the midpoint of the two is that embedding, so the merged model (wide shape, stock
    class) computes the narrow model's logits, whichever of the two is the reference."""
    narrow, wide = _planted(case)
    save_lm(narrow, tmp_path / "n")
    save_lm(wide, tmp_path / "w")
    models = ["./n", "./w"] if narrow_first else ["./w", "./n"]
    body = {"job": "merge", "models": models, "strategy": "weight-matching", "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    merged = stock_lm(tmp_path / "out")
    assert merged.config.hidden_size == 48 and merged.config.num_attention_heads == HEADS[case]
    assert (fixed_logits(merged) - fixed_logits(narrow)).abs().max() <= 1e-4
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text(encoding="utf-8"))
    grown = [m.get("embedded") for m in record["models"]]
    assert (grown[0] is not None, grown[1] is not None) == (narrow_first, not narrow_first)
    assert "embedded into the shape of" in (tmp_path / "out" / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("strategy", "cls"),
    [
        ("transfusion", "permutation"),
        ({"name": "generalized-orthogonal"}, "orthogonal"),
        ({"name": "head-perm", "residual": "all"}, "permutation"),
    ],
)
def test_every_strategy_recovers_a_map_across_widths(strategy: Any, cls: str, tmp_path: Path) -> None:
    """The same with the other strategies; the residual stream of B rotated for generalized-orthogonal
    (the padding is free coordinates of the rotation), and head-perm's statistics on real text, where
    the narrow model's added units and heads have zero variance."""
    narrow, wide = _planted("llama-gqa", cls)
    save_lm(narrow, tmp_path / "n")
    save_lm(wide, tmp_path / "w")
    body = {"job": "merge", "models": ["./n", "./w"], "strategy": strategy, "output": {"dir": "out"}}
    if isinstance(strategy, dict) and strategy["name"] == "head-perm":
        body["data"] = DATA
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    assert (fixed_logits(stock_lm(tmp_path / "out")) - fixed_logits(narrow)).abs().max() <= 1e-4


def test_a_universe_of_three_widths_has_the_widest_shape(tmp_path: Path) -> None:
    for seed, (d, heads) in enumerate(((32, 4), (40, 5), (48, 6))):
        config = copy.deepcopy(tiny.gpt2(0).config)
        config.n_embd, config.n_head = d, heads
        torch.manual_seed(seed)
        save_lm(T.GPT2LMHeadModel(config), tmp_path / f"m{seed}")
    body = {"job": "merge", "models": ["./m0", "./m1", "./m2"], "strategy": "weight-matching"}
    body |= {"merge": {"universe": True}, "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    assert stock_lm(tmp_path / "out").config.n_embd == 48
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text(encoding="utf-8"))
    assert [m.get("embedded") is not None for m in record["models"]] == [True, True, False]


@pytest.mark.parametrize("case", sorted(WIDE))
def test_a_narrow_bases_fine_tune_moves_onto_a_wider_target(case: str, tmp_path: Path) -> None:
    """The target is the base's exact embedding, permuted: weight matching finds the map across the
    padding, and target + π(τ) computes what the narrow fine-tune computes."""
    base, target = _planted(case)
    g = torch.Generator().manual_seed(4)
    finetuned = type(base)(base.config).eval()
    finetuned.load_state_dict(
        {
            k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in base.state_dict().items()
        }
    )
    for name, model in (("base", base), ("ft", finetuned), ("target", target)):
        save_lm(model, tmp_path / name)
    body = {"job": "transport", "base": "./base", "finetuned": "./ft", "target": "./target", "calibrate": False}
    body |= {"strategy": "weight-matching", "alpha": 1.0, "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    out = stock_lm(tmp_path / "out")
    assert out.config.hidden_size == 48
    assert (fixed_logits(out) - fixed_logits(finetuned)).abs().max() <= 1e-4


def _refused(tmp_path: Path, body: dict[str, Any]) -> str:
    proc = run_main(str(write_recipe(tmp_path, {**body, "output": {"dir": "out"}})))
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "out").exists()
    return proc.stderr


def test_a_transport_onto_a_narrower_target_is_refused(tmp_path: Path) -> None:
    narrow, wide = _planted("llama-gqa")
    for name, model in (("base", wide), ("ft", wide), ("target", narrow)):
        save_lm(model, tmp_path / name)
    body = {"job": "transport", "base": "./base", "finetuned": "./ft", "target": "./target", "calibrate": False}
    err = _refused(tmp_path, {**body, "strategy": "weight-matching"})
    assert "narrower than the base" in err and "no\nexact image" in err.replace(" exact image", "\nexact image")


@pytest.mark.parametrize(
    ("case", "sizes", "reason"),
    [
        ("llama-gqa", dict(num_hidden_layers=3, intermediate_size=64), "depth"),
        ("mixtral", dict(num_local_experts=6, intermediate_size=64), "number of experts"),
        ("llama-gqa", dict(head_dim=12), "rotary"),
        ("bert-mlm", dict(hidden_size=48, num_attention_heads=6), "post-norm"),
    ],
)
def test_what_cannot_be_embedded_exits_2_with_its_reason(
    case: str, sizes: dict[str, int], reason: str, tmp_path: Path
) -> None:
    narrow = tiny.FACTORIES[case](0).eval()
    config = copy.deepcopy(narrow.config)
    for k, v in sizes.items():
        setattr(config, k, v)
    torch.manual_seed(1)
    save_lm(narrow, tmp_path / "n")
    save_lm(type(narrow)(config), tmp_path / "w")
    err = _refused(tmp_path, {"job": "merge", "models": ["./n", "./w"], "strategy": "weight-matching"})
    assert reason in err, err


def test_the_wide_sampler_needs_models_of_different_widths(tmp_path: Path) -> None:
    for seed in (0, 1):
        save_lm(tiny.gpt2(seed), tmp_path / f"m{seed}")
    strategy = {"name": "generalized-orthogonal", "learned": True, "steps": 2, "sampler": "wide(0.5, 0.9)"}
    body = {"job": "merge", "models": ["./m0", "./m1"], "strategy": strategy, "data": DATA}
    assert "both models have one width" in _refused(tmp_path, body)


def test_learned_matching_across_widths_draws_lambda_on_the_narrow_side(tmp_path: Path) -> None:
    narrow, wide = _planted("gpt2")
    save_lm(narrow, tmp_path / "n")
    save_lm(wide, tmp_path / "w")
    strategy = {"name": "generalized-orthogonal", "learned": True, "steps": 2, "eval_every": 1}
    body = {"job": "merge", "models": ["./n", "./w"], "strategy": strategy, "data": DATA, "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text(encoding="utf-8"))
    assert any("wide(0.1, 0.5)" in n and "A's weight uniform(0.5, 0.9)" in n for n in record["notes"])


def test_embed_writes_a_folder_the_stock_class_loads_with_the_same_logits(tmp_path: Path) -> None:
    narrow = tiny.gpt2(0)
    save_lm(narrow, tmp_path / "n")
    save_lm(T.GPT2LMHeadModel(_like(narrow, "gpt2")), tmp_path / "w")
    proc = run_main("embed", str(tmp_path / "n"), "--like", str(tmp_path / "w"), "--output", str(tmp_path / "e"))
    assert proc.returncode == 0, proc.stderr
    embedded = stock_lm(tmp_path / "e")
    assert embedded.config.n_embd == 48
    assert (fixed_logits(embedded) - fixed_logits(narrow.eval())).abs().max() <= 1e-4
    record = json.loads((tmp_path / "e" / "embedding.json").read_text(encoding="utf-8"))
    assert record["canonical_form"] and record["untied"] == ["lm_head.weight"]
    assert "32 → 48" in (tmp_path / "e" / "README.md").read_text(encoding="utf-8")
    # the other way round: nothing is written
    proc = run_main("embed", str(tmp_path / "w"), "--like", str(tmp_path / "n"), "--output", str(tmp_path / "x"))
    assert proc.returncode == 2 and "narrower" in proc.stderr and not (tmp_path / "x").exists()


def test_the_shipped_recipe_runs_end_to_end_on_stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recipes/barrier-widths.yaml with untrained stand-ins where the zoo keeps its two models."""
    from hf_rebasin.evaluation.zoo import train

    spec = yaml.safe_load((Path(__file__).parents[2] / "recipes" / "barrier-widths.yaml").read_text(encoding="utf-8"))
    tok = char_tokenizer(shakespeare_text())
    for ref, (d, heads) in zip(spec["models"], ((16, 2), (32, 4)), strict=True):
        kind, seed = ref.removeprefix("zoo:").rsplit("-seed", 1)
        folder = train.zoo_folder(kind, int(seed), tmp_path / "zoo")
        torch.manual_seed(int(seed))
        config = T.GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=d, n_layer=1, n_head=heads, pad_token_id=0)
        T.GPT2LMHeadModel(config).save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
        (folder / train.TRAINING_FILE).write_text(json.dumps({"kind": kind, "seed": int(seed)}))
    monkeypatch.setenv("HF_REBASIN_CACHE", str(tmp_path))
    spec["evaluate"].update(points=3, max_tokens=1024)
    spec["output"] = {"dir": "out"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    dry = plan(load_recipe(path))  # --dry-run: said before any weight is loaded
    assert dry[dry.index(next(x for x in dry if x.startswith("widths differ"))) + 1 :][:2] == [
        "  A: n_embd 16, n_head 2",
        "  B: n_embd 32, n_head 4",
    ]
    run_recipe(load_recipe(path))
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text(encoding="utf-8"))
    assert (
        "res (residual features): 16 → 32" in record["models"][0]["embedded"] and "embedded" not in record["models"][1]
    )
    assert set(record["curves"]) == {spec["strategy"], *spec["evaluate"]["compare"]}
    assert record["function_preserved"]["max_abs_diff"] < 1e-4


def test_a_lora_adapter_on_a_narrow_base_moves_onto_a_wider_target_as_a_full_model(tmp_path: Path) -> None:
    """Its factors have the narrow base's widths: merged into that base, embedded and moved as a full
    fine-tune; the output is a full model of the target's shape computing what base + adapter does."""
    peft = pytest.importorskip("peft")
    base, target = _planted("llama-gqa")
    save_lm(base, tmp_path / "base")
    save_lm(target, tmp_path / "target")
    torch.manual_seed(5)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(copy.deepcopy(base), config).eval()
    wrapped.save_pretrained(str(tmp_path / "lora"))
    body = {"job": "transport", "base": "./base", "finetuned": "./lora", "target": "./target", "calibrate": False}
    body |= {"strategy": "weight-matching", "alpha": 1.0, "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    assert (fixed_logits(stock_lm(out)) - fixed_logits(wrapped)).abs().max() <= 1e-4
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert any("moved as a full fine-tune" in n for n in record["notes"])
    assert not any("trained with new tokens" in n for n in record["notes"])  # a plain adapter


def test_job_align_writes_both_models_in_the_wide_shape(tmp_path: Path) -> None:
    narrow, wide = _planted("llama-gqa")
    save_lm(narrow, tmp_path / "n")
    save_lm(wide, tmp_path / "w")
    body = {"job": "align", "models": ["./n", "./w"], "strategy": "weight-matching", "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    a, b = stock_lm(tmp_path / "out" / "a"), stock_lm(tmp_path / "out" / "b")
    assert a.config.hidden_size == b.config.hidden_size == 48
    assert (
        fixed_logits(a) - fixed_logits(narrow)
    ).abs().max() <= 1e-4  # A embedded (the wide config's ε is its own here)
    assert (fixed_logits(b) - fixed_logits(wide)).abs().max() <= 1e-4  # B in A's basis
    assert (
        stock_lm(tmp_path / "out" / "b").state_dict()["model.embed_tokens.weight"]
        - a.state_dict()["model.embed_tokens.weight"]
    ).abs().max() <= 1e-5  # the planted map undone: B's weights are A's
