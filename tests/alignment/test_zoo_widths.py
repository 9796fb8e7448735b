"""The zoo's wider twins (kinds gpt2-d96, gpt2-d128: `GPT2TrainConfig`; vit-d128: `ViTTrainConfig`):
the narrow kind's depth, data, vocabulary, schedule and head width, more features, MLP units and
heads, so that a narrow zoo model embeds exactly into a wide one's config (pairs of two widths).

Fast: every model is the kind's full size but trained for two steps on little data.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import transformers as T

from hf_rebasin.alignment.widths import embed_model
from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.core.names import Kind
from hf_rebasin.evaluation import evaluate
from hf_rebasin.evaluation.zoo import catalogue as zoo
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.recipe import ZOO_PATTERN

# wide kind -> (narrow kind, hidden size, heads, MLP units)
WIDE: dict[Kind, tuple[Kind, int, int, int]] = {
    "gpt2-d96": ("gpt2", 96, 6, 384),
    "gpt2-d128": ("gpt2", 128, 8, 512),
    "vit-d128": ("vit", 128, 8, 256),
    "gpt2-d96-h4": ("gpt2", 96, 4, 384),  # the same heads, each wider: head_dim 16 → 24
}
PLAYS = ("macbeth",)


def _short(kind: Kind) -> zoo.GPT2TrainConfig | zoo.ViTTrainConfig:
    """The kind's default config, sizes kept, trained for two steps on one play."""
    default = zoo.DEFAULT_CONFIGS[kind]
    if isinstance(default, zoo.GPT2TrainConfig):
        return dataclasses.replace(default, steps=2, batch_size=4, warmup=1, plays=PLAYS, eval_tokens=512)
    assert isinstance(default, zoo.ViTTrainConfig)
    return dataclasses.replace(default, steps=2, batch_size=8, warmup=1)


def _sizes(config: Any) -> tuple[int, int, int, int]:
    """(hidden size, layers, heads, head width) of a GPT-2 or ViT config."""
    if config.model_type == "gpt2":
        return config.n_embd, config.n_layer, config.n_head, config.n_embd // config.n_head
    return (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.hidden_size // config.num_attention_heads,
    )


@pytest.mark.parametrize("kind", WIDE)
def test_the_default_config_is_the_narrow_kinds_but_wider(kind: Kind) -> None:
    narrow_kind, hidden, heads, _ = WIDE[kind]
    wide, narrow = zoo.DEFAULT_CONFIGS[kind], zoo.DEFAULT_CONFIGS[narrow_kind]
    assert type(wide) is type(narrow) and kind in train.KINDS
    changed = {f.name for f in dataclasses.fields(wide) if getattr(wide, f.name) != getattr(narrow, f.name)}
    if isinstance(wide, zoo.GPT2TrainConfig):
        assert changed == {"n_embd", "n_head"} - ({"n_head"} if heads == narrow.n_head else set())  # the rest kept
        assert (wide.n_embd, wide.n_head) == (hidden, heads)
    else:
        assert changed == {"hidden_size", "num_attention_heads", "intermediate_size"}
    match = ZOO_PATTERN.fullmatch(f"zoo:{kind}-seed3")
    assert match is not None and match.groups() == (kind, "3")
    assert zoo.config_hash(kind, wide) != zoo.config_hash(narrow_kind, narrow)
    assert zoo.zoo_folder(kind, 2).name == f"{kind}-seed2-{zoo.config_hash(kind, wide)}"


def test_the_zoo_keeps_its_cache_keys() -> None:
    """Models cached before the wide kinds stay valid, and so do the wide ones trained since: a
    changed key retrains them (bump RECIPE_VERSION on purpose if the training code changes)."""
    keys: dict[Kind, str] = {
        "gpt2": "1ca44fec87a1",
        "vit": "9c0438e5a363",
        "gpt2-d96": "6a7e0b6b4e86",
        "gpt2-d128": "a4109e15c104",
        "vit-d128": "bef4ff4303cb",
    }
    assert {kind: zoo.config_hash(kind, zoo.DEFAULT_CONFIGS[kind]) for kind in keys} == keys


@pytest.mark.parametrize("kind", WIDE)
def test_a_wide_kind_trains_saves_and_embeds_the_narrow_one(kind: Kind, tmp_path: Path) -> None:
    narrow_kind, hidden, heads, units = WIDE[kind]
    steps: list[int] = []
    cfg = _short(kind)
    folder = train.cached_model(kind, 0, tmp_path, config=cfg, progress=lambda s, loss: steps.append(s))
    narrow_folder = train.cached_model(narrow_kind, 0, tmp_path, config=_short(narrow_kind))
    assert folder.name == f"{kind}-seed0-{zoo.config_hash(kind, cfg)}" and steps == [0, 1]
    record = train.training_record(folder)
    assert record["kind"] == kind and record["config_hash"] == zoo.config_hash(kind, cfg)

    auto = T.AutoModelForCausalLM if narrow_kind == "gpt2" else T.AutoModelForImageClassification
    wide, narrow = auto.from_pretrained(str(folder)), auto.from_pretrained(str(narrow_folder))
    assert type(wide) is type(narrow)
    w, n = _sizes(wide.config), _sizes(narrow.config)
    assert w == (hidden, n[1], heads, hidden // heads) and n[3] == 16  # wider; same depth
    assert w[3] == n[3] or w[2] == n[2]  # the same head width (more heads), or the same heads (wider ones)
    mlp_in = [t for k, t in wide.state_dict().items() if k.endswith(("mlp.c_fc.bias", "mlp.fc1.bias"))]
    assert len(mlp_in) == n[1] and all(t.shape == (units,) for t in mlp_in)  # MLP units in every layer
    task = evaluate.task_of(wide)
    if narrow_kind == "gpt2":  # the same characters and context
        w_cfg, n_cfg = wide.config, narrow.config
        assert (w_cfg.vocab_size, w_cfg.n_positions) == (n_cfg.vocab_size, n_cfg.n_positions)
        assert (folder / "tokenizer.json").read_text() == (narrow_folder / "tokenizer.json").read_text()
        assert record["held_out"]["tokens"] == train.training_record(narrow_folder)["held_out"]["tokens"] > 0
    else:  # the same images and labels
        assert wide.config.id2label == narrow.config.id2label and wide.config.patch_size == narrow.config.patch_size
        assert record["held_out"]["examples"] == 359 and "accuracy" in record["held_out"]
    batches = train.held_out_batches(folder)
    result = evaluate.evaluate_loss(wide, batches, task)
    assert result.loss == pytest.approx(record["held_out"]["loss"], rel=1e-5)

    embedded, _ = embed_model(narrow, wide.config)  # the narrow model, unchanged, in the wide shape
    shapes = {k: t.shape for k, t in wide.state_dict().items()}
    assert {k: t.shape for k, t in embedded.state_dict().items()} == shapes
    before = evaluate.evaluate_loss(narrow, batches, task).loss
    assert evaluate.evaluate_loss(embedded, batches, task).loss == pytest.approx(before, rel=1e-4)


def test_a_trainer_refuses_a_kind_it_does_not_train(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitectureError, match="GPT2TrainConfig"):
        train.train_tiny_gpt2(0, tmp_path / "a", kind="vit-d128")
    with pytest.raises(UnsupportedArchitectureError, match="ViTTrainConfig"):
        train.train_tiny_vit(0, tmp_path / "b", kind="gpt2-d96")
    with pytest.raises(UnsupportedArchitectureError, match="GPT2TrainConfig"):
        zoo.zoo_folder("gpt2-d128", 0, tmp_path, config=zoo.DEFAULT_CONFIGS["vit-d128"])
    assert not any(tmp_path.iterdir())
