"""The zoo's encoders and vision models of other families (kinds distilbert, xlm-roberta, modernbert:
`MaskedLMTrainConfig`, trained like the zoo BERT; dinov2, siglip: `ImageTrainConfig`, trained like the
zoo ViT), each built through ``AutoConfig.for_model``.

Fast: the default configs are only built (never trained); training runs on a tiny variant of each,
and each kind's recipe runs end to end on stand-ins (tiny random models where the zoo keeps its
trained ones).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers as T
import yaml

from helpers import ROOT
from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.core.names import Task
from hf_rebasin.evaluation import data, evaluate
from hf_rebasin.evaluation.zoo import catalogue as zoo
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.evaluation.zoo.families import image_config, masked_lm_config
from hf_rebasin.evaluation.zoo.images import digits_processor
from hf_rebasin.evaluation.zoo.masked import bert_data
from hf_rebasin.recipe import ZOO_PATTERN, load_recipe
from hf_rebasin.run import run_recipe
from hf_rebasin.symmetry.adapters import get_adapter

# kind -> (model_type, class, task)
KINDS: dict[str, tuple[str, type, Task]] = {
    "distilbert": ("distilbert", T.DistilBertForMaskedLM, "masked-lm"),
    "xlm-roberta": ("xlm-roberta", T.XLMRobertaForMaskedLM, "masked-lm"),
    "modernbert": ("modernbert", T.ModernBertForMaskedLM, "masked-lm"),
    "dinov2": ("dinov2", T.Dinov2ForImageClassification, "image-classification"),
    "siglip": ("siglip", T.SiglipForImageClassification, "image-classification"),
}
MASKED = [kind for kind, (_, _, task) in KINDS.items() if task == "masked-lm"]
RECIPES = ["merge-distilbert", "merge-xlm-roberta", "barrier-modernbert", "merge-dinov2", "merge-siglip"]
PLAYS = ("macbeth",)


def _auto(kind: str) -> Any:
    return T.AutoModelForMaskedLM if KINDS[kind][2] == "masked-lm" else T.AutoModelForImageClassification


def _tiny(kind: str) -> zoo.MaskedLMTrainConfig | zoo.ImageTrainConfig:
    """The kind's default config at toy size: the same family and options, trains in well under a second."""
    default = zoo.DEFAULT_CONFIGS[kind]
    if isinstance(default, zoo.ImageTrainConfig):
        return dataclasses.replace(
            default, steps=3, batch_size=8, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warmup=1
        )
    assert isinstance(default, zoo.MaskedLMTrainConfig)
    layer_types = dict(default.options).get("layer_types")
    return dataclasses.replace(
        default,
        steps=3,
        batch_size=4,
        block_size=16,
        hidden_size=16,
        num_layers=len(layer_types) if layer_types else 1,  # one per layer type, as the options list them
        num_heads=2,
        intermediate_size=32,
        warmup=1,
        plays=PLAYS,
        eval_tokens=512,
    )


def _model_config(kind: str, cfg: zoo.MaskedLMTrainConfig | zoo.ImageTrainConfig, tokenizer: Any = None) -> Any:
    if isinstance(cfg, zoo.ImageTrainConfig):
        return image_config(cfg)
    return masked_lm_config(cfg, tokenizer)


def test_the_bert_and_vit_kinds_keep_their_cache_keys() -> None:
    """Models cached before the new kinds stay valid: changing these hashes retrains every zoo BERT
    and ViT (bump RECIPE_VERSION on purpose if the training code changes what a config produces)."""
    assert zoo.RECIPE_VERSION == 2
    assert zoo.config_hash("bert", zoo.DEFAULT_CONFIGS["bert"]) == "79420622ada9"
    assert zoo.config_hash("vit", zoo.DEFAULT_CONFIGS["vit"]) == "9c0438e5a363"


@pytest.mark.parametrize("kind", MASKED)
def test_a_default_masked_lm_config_builds_a_model_like_the_zoo_bert(kind: str) -> None:
    model_type, cls, _ = KINDS[kind]
    cfg = zoo.DEFAULT_CONFIGS[kind]
    bert = zoo.DEFAULT_CONFIGS["bert"]
    assert isinstance(cfg, zoo.MaskedLMTrainConfig) and isinstance(bert, zoo.BertTrainConfig)
    assert cfg.family == model_type
    schedule = ("steps", "batch_size", "block_size", "lr", "warmup", "weight_decay", "plays", "eval_tokens")
    assert [getattr(cfg, f) for f in schedule] == [getattr(bert, f) for f in schedule]
    tokenizer, _, _ = bert_data(cfg)
    config = masked_lm_config(cfg, tokenizer)
    assert config.model_type == model_type
    torch.manual_seed(0)
    model = T.AutoModelForMaskedLM.from_config(config)
    assert type(model) is cls
    c = model.config
    # shared names: DistilBERT's dim / n_layers / n_heads answer to them through its attribute_map
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (64, 4, 4)
    assert c.vocab_size == len(tokenizer) and c.pad_token_id == tokenizer.pad_token_id == 0
    dropouts = {k: v for k, v in c.to_dict().items() if "dropout" in k and v is not None}
    assert dropouts and set(dropouts.values()) == {0.0}, dropouts  # the families' 0.1 defaults are off
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embeddings  # the MLM decoder tied, as released
    params = sum(p.numel() for p in model.parameters())
    assert 200_000 < params < 215_000, params  # the zoo BERT has 211,013
    if kind == "distilbert":
        assert c.hidden_dim == 256 and c.max_position_embeddings == 32  # DistilBERT's name for the MLP width
    if kind == "xlm-roberta":
        assert c.intermediate_size == 256 and c.type_vocab_size == 1 and c.layer_norm_eps == 1e-5
        assert c.max_position_embeddings == 32 + 2  # positions start after padding_idx
    if kind == "modernbert":
        assert c.intermediate_size == 176 and c.max_position_embeddings == 32  # GeGLU: ⅔ of 4 · 64, to 16
        assert c.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
        assert c.local_attention == 16 and c.cls_token_id is None and c.sep_token_id is None
    get_adapter(model_type).graph(config, model.state_dict().keys())  # hf-rebasin can align it


def test_the_default_dinov2_config_builds_a_model_like_the_zoo_vit() -> None:
    cfg = zoo.DEFAULT_CONFIGS["dinov2"]
    vit = zoo.DEFAULT_CONFIGS["vit"]
    assert isinstance(cfg, zoo.ImageTrainConfig) and isinstance(vit, zoo.ViTTrainConfig)
    schedule = ("steps", "batch_size", "patch_size", "hidden_size", "intermediate_size", "lr", "warmup")
    assert [getattr(cfg, f) for f in schedule] == [getattr(vit, f) for f in schedule]
    assert (cfg.num_layers, cfg.num_heads) == (vit.num_hidden_layers, vit.num_attention_heads)
    config = image_config(cfg)
    torch.manual_seed(0)
    model = T.AutoModelForImageClassification.from_config(config)
    assert type(model) is T.Dinov2ForImageClassification
    c = model.config
    assert (c.image_size, c.patch_size, c.num_channels, c.hidden_size, c.num_hidden_layers) == (8, 2, 1, 64, 2)
    assert c.mlp_ratio == 2 and model.dinov2.encoder.layer[0].mlp.fc1.out_features == 128  # the ViT's MLP
    assert c.id2label == {i: str(i) for i in range(10)} and c.hidden_dropout_prob == c.drop_path_rate == 0.0
    assert model.dinov2.embeddings.position_embeddings.shape == (1, 16 + 1, 64)  # 4 × 4 patches and [CLS]
    assert model.classifier.in_features == 2 * 64  # [CLS, mean of the patches]
    assert model(pixel_values=torch.zeros(3, 1, 8, 8)).logits.shape == (3, 10)
    params = sum(p.numel() for p in model.parameters())
    assert 65_000 < params < 75_000, params  # the zoo ViT has 69,194
    get_adapter("dinov2").graph(config, model.state_dict().keys())


def test_the_default_siglip_config_builds_a_classifier_like_the_zoo_vit() -> None:
    """SiglipForImageClassification: the zoo sizes on the vision tower, a minimal text config (no
    text weight is built), the digits' 10 labels; the classifier reads the mean of all 16 patches."""
    cfg = zoo.DEFAULT_CONFIGS["siglip"]
    vit = zoo.DEFAULT_CONFIGS["vit"]
    assert isinstance(cfg, zoo.ImageTrainConfig) and isinstance(vit, zoo.ViTTrainConfig)
    schedule = ("steps", "batch_size", "patch_size", "hidden_size", "intermediate_size", "lr", "warmup")
    assert [getattr(cfg, f) for f in schedule] == [getattr(vit, f) for f in schedule]
    assert (cfg.num_layers, cfg.num_heads) == (vit.num_hidden_layers, vit.num_attention_heads)
    config = image_config(cfg)
    assert type(config) is T.SiglipConfig and config.model_type == "siglip"
    v, t = config.vision_config, config.text_config
    assert (v.image_size, v.patch_size, v.num_channels, v.hidden_size, v.num_hidden_layers) == (8, 2, 1, 64, 2)
    assert (v.num_attention_heads, v.intermediate_size, v.attention_dropout) == (4, 128, 0.0)
    assert v.vision_use_head and t.projection_size == 64 and t.num_hidden_layers == 1
    assert config.id2label == {i: str(i) for i in range(10)} and config.num_labels == 10
    torch.manual_seed(0)
    model = T.AutoModelForImageClassification.from_config(config)
    assert type(model) is T.SiglipForImageClassification
    sd = model.state_dict()
    assert not any(k.startswith("text_model.") for k in sd) and "vision_model.head.probe" in sd
    assert sd["vision_model.embeddings.position_embedding.weight"].shape == (16, 64)  # 4 × 4 patches, no [CLS]
    assert model.classifier.in_features == 64
    assert model(pixel_values=torch.zeros(3, 1, 8, 8)).logits.shape == (3, 10)
    params = sum(p.numel() for p in model.parameters())
    head = sum(p.numel() for n, p in model.named_parameters() if n.startswith("vision_model.head."))
    assert 65_000 < params - head < 75_000, params  # the zoo ViT has 69,194; the pooling head is unused
    graph = get_adapter("siglip").graph(config, sd.keys())
    assert graph.spaces["vision.res"].max_class == "orthogonal" and "text.res" not in graph.spaces


@pytest.mark.parametrize("kind", KINDS)
def test_a_tiny_variant_trains_saves_and_scores_like_the_zoo_model(kind: str, tmp_path: Path) -> None:
    model_type, cls, task = KINDS[kind]
    tiny = _tiny(kind)
    steps: list[int] = []
    folder = train.cached_model(kind, 0, tmp_path, config=tiny, progress=lambda s, loss: steps.append(s))
    assert folder.name == f"{kind}-seed0-{zoo.config_hash(kind, tiny)}"
    assert [p.name for p in tmp_path.iterdir()] == [folder.name] and steps == [0, 1, 2]
    model = _auto(kind).from_pretrained(str(folder))
    assert type(model) is cls and model.config.model_type == model_type
    record = train.training_record(folder)
    assert record["kind"] == kind and record["config"]["family"] == model_type
    batches = train.held_out_batches(folder)
    result = evaluate.evaluate_loss(model, batches, task)
    assert result.loss == pytest.approx(record["held_out"]["loss"], rel=1e-5)
    if task == "masked-lm":
        assert (folder / "tokenizer.json").is_file()
        assert T.PreTrainedTokenizerFast.from_pretrained(str(folder)).mask_token == "<mask>"
        assert batches[0]["input_ids"].shape[1] == 16  # the training blocks, not XLM-R's 18 positions
        assert result.count == record["held_out"]["tokens"] > 0
        # the loss is the masked tokens' cross-entropy, computed here from the logits
        with torch.no_grad():
            total = sum(
                float(F.cross_entropy(model(**b).logits.flatten(0, 1).double(), b["labels"].flatten(), reduction="sum"))
                for b in batches
            )
        assert total / result.count == pytest.approx(record["held_out"]["loss"], rel=1e-5)
    else:
        assert (folder / "preprocessor_config.json").is_file()
        assert result.count == record["held_out"]["examples"] == 359  # the digits' test split
        assert 0.0 <= record["held_out"]["accuracy"] <= 1.0


def test_each_kind_has_its_own_cache_key_and_config_class(tmp_path: Path) -> None:
    hashes = {zoo.config_hash(kind, zoo.DEFAULT_CONFIGS[kind]) for kind in train.KINDS}
    assert len(hashes) == len(train.KINDS)
    for kind in KINDS:
        assert kind in train.KINDS and zoo.train_steps(kind) == zoo.DEFAULT_CONFIGS[kind].steps
        match = ZOO_PATTERN.fullmatch(f"zoo:{kind}-seed3")
        assert match is not None and match.groups() == (kind, "3")
        expected = type(zoo.DEFAULT_CONFIGS[kind]).__name__
        with pytest.raises(UnsupportedArchitectureError, match=expected):
            zoo.zoo_folder(kind, 0, tmp_path, config=zoo.DEFAULT_CONFIGS["bert"])
    with pytest.raises(UnsupportedArchitectureError, match="BertTrainConfig"):
        zoo.zoo_folder("bert", 0, tmp_path, config=zoo.DEFAULT_CONFIGS["distilbert"])
    with pytest.raises(UnsupportedArchitectureError, match="not trained by train_tiny_masked_lm"):
        train.train_tiny_masked_lm("dinov2", 0, tmp_path / "x")
    with pytest.raises(UnsupportedArchitectureError, match="not trained by train_tiny_image_classifier"):
        train.train_tiny_image_classifier("distilbert", 0, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def _stand_in(kind: str, cache: Path) -> None:
    """Tiny random models of the kind's family where the zoo keeps seeds 0 and 1."""
    cfg = _tiny(kind)
    if isinstance(cfg, zoo.MaskedLMTrainConfig):  # the zoo's tokenizer: all the default plays
        processor: Any = data.char_tokenizer(data.shakespeare_text(), mask=True)
        config = masked_lm_config(cfg, processor)
    else:
        processor, config = digits_processor(), image_config(cfg)
    for seed in (0, 1):
        folder = train.zoo_folder(kind, seed, cache / "zoo")
        torch.manual_seed(seed)
        _auto(kind).from_config(config).save_pretrained(str(folder))
        processor.save_pretrained(str(folder))
        (folder / train.TRAINING_FILE).write_text(json.dumps({"kind": kind, "seed": seed}))


@pytest.mark.parametrize("name", RECIPES)
def test_the_recipe_of_a_new_kind_runs_end_to_end_on_stand_ins(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text(encoding="utf-8"))
    kind = ZOO_PATTERN.fullmatch(spec["models"][0]).group(1)  # type: ignore[union-attr]
    _stand_in(kind, tmp_path)
    monkeypatch.setenv("HF_REBASIN_CACHE", str(tmp_path))
    image = KINDS[kind][2] == "image-classification"
    assert spec["evaluate"]["task"] == KINDS[kind][2]
    spec["evaluate"].update(points=3, **({"max_examples": 64} if image else {"max_tokens": 1024}))
    if "data" in spec:  # alignment data: a small sample
        spec["data"].update({"max_examples": 64} if image else {"max_tokens": 1024})
    if isinstance(spec["strategy"], dict) and spec["strategy"].get("learned"):
        spec["strategy"]["steps"] = 3  # the refinement runs; its length is the recipe's business
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
        merged = _auto(kind).from_pretrained(str(tmp_path / "out"))
        assert type(merged) is KINDS[kind][1] and merged.config.model_type == KINDS[kind][0]
