"""A zoo of tiny trained models: GPT-2 (and wider twins), causal LMs of other families (Qwen3, Gemma, Gemma-2,
Gemma-3, Pythia, OLMo-2, Phi-3), BERT and masked LMs of other encoder families (DistilBERT,
XLM-RoBERTa, ModernBERT) on Shakespeare characters; ViT (and a wider twin), DINOv2 and SigLIP on
8×8 digits.

Re-basin needs pairs of models that compute the same kind of function from different seeds.
These are trained by the project's own code (no Hub, no network) in about a minute each on one
CPU thread, cached on disk, and saved exactly as ``save_pretrained`` writes models (safetensors),
so every other part of hf-rebasin reads them like any user's folder. The seed sets both the
initialisation and the data order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from . import data
from .errors import ModelNotFoundError, UnsupportedArchitectureError
from .evaldata import mask_tokens
from .evaluate import evaluate_loss
from .names import KINDS as KINDS  # `X as X`: re-exported, the runner and scripts read train.X
from .names import Kind, Task
from .resources import cache_root as cache_root
from .zoo import (
    DEFAULT_CONFIGS,
    EVAL_MASK_SEED,
    RECIPE_VERSION,
    TRAINING_FILE,
    BertTrainConfig,
    CausalLMTrainConfig,
    DomainFineTuneConfig,
    GPT2FineTuneConfig,
    GPT2LoraConfig,
    GPT2NextConfig,
    GPT2TrainConfig,
    ImageTrainConfig,
    MaskedLMTrainConfig,
    SubwordLMTrainConfig,
    SubwordMaskedLMTrainConfig,
    TrainConfig,
    ViTTrainConfig,
    check_kind,
    config_hash,
    is_trained,
    zoo_folder,
)
from .zoo import train_steps as train_steps

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Progress = Callable[[int, float], None]
_C = TypeVar("_C", GPT2TrainConfig, ViTTrainConfig)

# the loss a zoo kind is trained and scored with (every kind not named here is a causal LM)
_TASKS: dict[Kind, Task] = {
    **{kind: "image-classification" for kind, config in DEFAULT_CONFIGS.items() if isinstance(config, ViTTrainConfig)},
    "bert": "masked-lm",
    **{kind: "masked-lm" for kind, config in DEFAULT_CONFIGS.items() if isinstance(config, MaskedLMTrainConfig)},
    **{
        kind: "image-classification" for kind, config in DEFAULT_CONFIGS.items() if isinstance(config, ImageTrainConfig)
    },
}
_MASK_STREAM = 2**62  # offsets the seed of an epoch's masks from that of its block order


@contextlib.contextmanager
def _training_context(seed: int, threads: int | None) -> Iterator[None]:
    """Seed torch's RNG and pin the intra-op thread count, restoring both afterwards.

    One thread by default: these models are too small to gain much from more, and on a shared
    machine spinning OpenMP threads slow a step down ten-fold or worse. A fixed count also keeps
    the floating-point summation order, hence the weights, the same from run to run.
    """
    previous = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No transformers warnings or progress bars while the zoo trains and saves its own models.

    Library code does not print: progress goes to the caller's callback instead.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(level)


def _schedule(step: int, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak rate."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))


def _endless(make: Callable[[int], Iterator[dict[str, Tensor]]], seed: int) -> Iterator[dict[str, Tensor]]:
    """Epoch after epoch, each in a fresh order drawn from (seed, epoch)."""
    epoch = 0
    while True:
        yield from make(seed * 100_003 + epoch)
        epoch += 1


def _fit(
    model: torch.nn.Module,
    stream: Iterator[dict[str, Tensor]],
    *,
    steps: int,
    lr: float,
    warmup: int,
    weight_decay: float,
    progress: Progress | None,
) -> float:
    """AdamW on the model's own loss; returns the mean loss of the last 50 steps."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; not biases, norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, warmup, steps))
    model.train()
    recent: list[float] = []
    for step in range(steps):
        loss = model(**next(stream)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = float(loss.detach())
        recent = [*recent[-49:], value]
        if progress is not None:
            progress(step, value)
    model.eval()
    return sum(recent) / max(1, len(recent))


def _save(model: PreTrainedModel, out_dir: Path, record: dict[str, Any], processor: Any = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))  # safetensors by default
    if processor is not None:
        processor.save_pretrained(str(out_dir))
    (out_dir / TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out_dir


def _record(
    kind: Kind, seed: int, config: TrainConfig, seconds: float, train_loss: float, **held_out: Any
) -> dict[str, Any]:
    return {
        "kind": kind,
        "seed": seed,
        "config": dataclasses.asdict(config),
        "config_hash": config_hash(kind, config),
        "recipe_version": RECIPE_VERSION,
        "train_seconds": round(seconds, 2),
        "train_loss": train_loss,
        "held_out": held_out,
    }


def gpt2_data(config: GPT2TrainConfig) -> tuple[Any, Tensor, Tensor]:
    """(tokenizer, train blocks, held-out blocks) of a GPT-2 zoo config.

    The tokenizer covers the characters of all the plays (both splits), so held-out text has no
    unknown characters.
    """
    return _char_blocks(config.plays, config.block_size, config.eval_tokens, mask=False)


def _text_data(
    cfg: CausalLMTrainConfig | MaskedLMTrainConfig | BertTrainConfig, *, mask: bool
) -> tuple[Any, Tensor, Tensor]:
    """(tokenizer, train blocks, held-out blocks) of a text kind trained from scratch: characters
    for the tiny zoo, a BPE vocabulary learned on the training split for the benchmark zoo."""
    if not isinstance(cfg, SubwordLMTrainConfig | SubwordMaskedLMTrainConfig):
        return _char_blocks(cfg.plays, cfg.block_size, cfg.eval_tokens, mask=mask)
    text = data.shakespeare_text(cfg.plays, split="train")
    tokenizer = data.bpe_tokenizer(text, cfg.vocab_size, mask=mask)
    train = data.text_blocks(tokenizer, text, cfg.block_size)
    held_out = data.shakespeare_text(cfg.plays, split="test")
    test = data.text_blocks(tokenizer, held_out, cfg.block_size, max_tokens=cfg.eval_tokens)
    return tokenizer, train, test


def _char_blocks(
    plays: tuple[str, ...], block_size: int, eval_tokens: int, *, mask: bool
) -> tuple[Any, Tensor, Tensor]:
    """(character tokenizer of all the plays, train blocks, held-out blocks)."""
    tokenizer = data.char_tokenizer(data.shakespeare_text(plays), mask=mask)
    train = data.text_blocks(tokenizer, data.shakespeare_text(plays, split="train"), block_size)
    test = data.text_blocks(tokenizer, data.shakespeare_text(plays, split="test"), block_size, max_tokens=eval_tokens)
    return tokenizer, train, test


def _run(
    kind: Kind,
    seed: int,
    cfg: TrainConfig,
    out_dir: Path,
    build: Callable[[], PreTrainedModel],
    epoch: Callable[[int], Iterator[dict[str, Tensor]]],
    held_out: Iterable[dict[str, Tensor]],
    *,
    progress: Progress | None,
    threads: int | None,
    processor: Any = None,
) -> Path:
    """Build (seeded), train, score on held-out data, save with a ``training.json`` record.

    ``processor`` (tokenizer or image processor) is saved beside the model, so a recipe can read
    data for it like for any user's folder.
    """
    losses: list[float] = []

    def track(step: int, loss: float) -> None:
        losses.append(loss)
        if progress is not None:
            progress(step, loss)

    with _quiet_transformers(), _training_context(seed, threads):
        model = build()
        start = time.perf_counter()
        train_loss = _fit(
            model,
            _endless(epoch, seed),
            steps=cfg.steps,
            lr=cfg.lr,
            warmup=cfg.warmup,
            weight_decay=cfg.weight_decay,
            progress=track,
        )
        seconds = time.perf_counter() - start
        task = _TASKS.get(kind, "causal-lm")
        result = evaluate_loss(model, held_out, task)
        count = {"examples" if task == "image-classification" else "tokens": result.count}
        record = _record(kind, seed, cfg, seconds, train_loss, loss=result.loss, **count, **result.metric)
        record["train_curve"] = _tenths(losses)
        return _save(model, Path(out_dir), record, processor)


def _tenths(losses: list[float]) -> list[float]:
    """Mean training loss over each tenth of the steps: whether the loss had flattened by the end."""
    n = len(losses)
    cuts = [round(i * n / 10) for i in range(11)]
    return [round(sum(losses[a:b]) / (b - a), 4) for a, b in itertools.pairwise(cuts) if b > a]


def _run_text(
    kind: Kind,
    seed: int,
    cfg: GPT2TrainConfig
    | GPT2FineTuneConfig
    | GPT2LoraConfig
    | GPT2NextConfig
    | CausalLMTrainConfig
    | DomainFineTuneConfig,
    out_dir: Path,
    build: Callable[[], Any],
    tokenizer: Any,
    train: Tensor,
    test: Tensor,
    *,
    progress: Progress | None,
    threads: int | None,
) -> Path:
    """`_run` for the causal-LM kinds: batches of token blocks padded with the tokenizer's pad id, held-out
    blocks scored 64 at a time, the tokenizer saved beside the result."""
    pad = int(tokenizer.pad_token_id)
    return _run(
        kind,
        seed,
        cfg,
        out_dir,
        build,
        lambda s: data.batches(train, cfg.batch_size, pad_token_id=pad, seed=s, drop_last=True),
        list(data.batches(test, 64, pad_token_id=pad)),
        progress=progress,
        threads=threads,
        processor=tokenizer,
    )


def train_tiny_gpt2(
    seed: int,
    out_dir: Path,
    config: GPT2TrainConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
    kind: Kind = "gpt2",
) -> Path:
    """Train a small character-level GPT2LMHeadModel on Shakespeare; save it with its tokenizer.

    ``seed`` sets the initialisation and the order of the training blocks. Deterministic given
    ``seed``, ``config`` and ``threads`` on one machine; ``progress(step, loss)`` after each step.
    ``kind`` (a zoo kind whose config is a `GPT2TrainConfig`: gpt2 or a wider twin) is what
    ``training.json`` records and, without ``config``, whose default config is trained.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = config or _default_config(kind, GPT2TrainConfig)
    tokenizer, train, test = gpt2_data(cfg)
    pad = int(tokenizer.pad_token_id)
    model_config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    return _run_text(
        kind,
        seed,
        cfg,
        out_dir,
        lambda: GPT2LMHeadModel(model_config),
        tokenizer,
        train,
        test,
        progress=progress,
        threads=threads,
    )


def _default_config(kind: Kind, cls: type[_C]) -> _C:
    """Zoo kind ``kind``'s default config, checked to be a ``cls``: a trainer called with a kind it
    does not train fails here rather than building the wrong model."""
    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, cls):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained from a {cls.__name__}")
    return default


def causal_lm_config(config: CausalLMTrainConfig, tokenizer: Any) -> Any:
    """The transformers config of a `CausalLMTrainConfig`'s model for ``tokenizer``: the family's
    config class with the zoo's sizes and the tokenizer's special ids, then ``options``; everything
    else is the family's default, but every dropout is 0 (GPT-2's default is 0.1)."""
    from transformers import AutoConfig

    sizes: dict[str, Any] = {
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
    }
    return AutoConfig.for_model(
        config.family,
        **_no_dropout(config.family),
        vocab_size=len(tokenizer),
        max_position_embeddings=config.block_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=int(tokenizer.pad_token_id),
        **{k: v for k, v in sizes.items() if v is not None},
        **{k: list(v) if isinstance(v, tuple) else v for k, v in config.options},  # tuples: hashable in the key
    )


# sizes a family names otherwise than the zoo's shared names (and its config's attribute_map does not alias)
_RENAMED: dict[str, dict[str, str]] = {"distilbert": {"intermediate_size": "hidden_dim"}}
# families whose learned positions start after padding_idx (RoBERTa's rule): two more rows than a
# block, as the released checkpoints have (514 for 512 tokens) and as a run reads them (`run.data`)
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")


def _no_dropout(family: str) -> dict[str, float]:
    """Every dropout rate of ``family``'s config at 0 (``hidden_dropout_prob``, GPT-2's ``resid_pdrop``, …)."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(family).to_dict()
    return {
        k: 0.0
        for k, v in defaults.items()
        if any(part in k for part in ("dropout", "drop_path", "pdrop")) and isinstance(v, float)
    }


def _family_config(family: str, sizes: dict[str, Any], options: tuple[tuple[str, Any], ...], **fixed: Any) -> Any:
    """``AutoConfig.for_model(family)`` with the zoo's ``sizes`` under the family's own names, every
    dropout of the family at 0, ``fixed`` (special ids, labels), then ``options``.

    Dropout off everywhere: the zoo's models are compared weight by weight and scored as trained,
    and the families' defaults differ (DistilBERT's and XLM-R's 0.1, ModernBERT's and DINOv2's 0).
    """
    from transformers import AutoConfig

    no_dropout = _no_dropout(family)
    named = {_RENAMED.get(family, {}).get(k, k): v for k, v in sizes.items()}
    if family == "dinov2" and "intermediate_size" in named:  # DINOv2 sizes its MLP as a multiple of the width
        ratio = named.pop("intermediate_size") / named["hidden_size"]
        named["mlp_ratio"] = int(ratio) if ratio.is_integer() else ratio
    return AutoConfig.for_model(
        family,
        **no_dropout,
        **named,
        **fixed,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in options},  # tuples: hashable in the key
    )


def masked_lm_config(config: MaskedLMTrainConfig, tokenizer: Any) -> Any:
    """The transformers config of a `MaskedLMTrainConfig`'s model for ``tokenizer``: the family's
    config class with the zoo's sizes, no dropout, the tokenizer's special ids for every special-id
    field the family has (ModernBERT's ``cls_token_id`` too), then ``options``."""
    from transformers import AutoConfig

    fields = AutoConfig.for_model(config.family).to_dict()
    special = {
        f"{name}_token_id": getattr(tokenizer, f"{name}_token_id", None)
        for name in ("pad", "bos", "eos", "cls", "sep")
        if f"{name}_token_id" in fields
    }
    offset = 2 if config.family in _OFFSET_POSITIONS else 0
    sizes = {
        "vocab_size": len(tokenizer),
        "max_position_embeddings": config.block_size + offset,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
    }
    return _family_config(config.family, sizes, config.options, **special)


# families whose image classifier is one tower of a two-tower config: the tower's config key and
# model type (the zoo's sizes, no dropout and ``options`` go there), and the other tower's minimal
# config. SiglipForImageClassification builds the vision tower only: no text weight exists, but
# SiglipConfig keeps a text config (projection_size: the vision width, as a SiglipModel needs it).
_TOWERS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "siglip": (
        "vision_config",
        "siglip_vision_model",
        "text_config",
        {
            "vocab_size": 16,
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "intermediate_size": 16,
            "max_position_embeddings": 8,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
        },
    ),
}


def image_config(config: ImageTrainConfig) -> Any:
    """The transformers config of an `ImageTrainConfig`'s model: the family's config class for the
    8×8 grayscale digits and their 10 labels, the zoo's sizes, no dropout, then ``options``; for a
    two-tower family (SigLIP) the sizes and ``options`` go to the vision tower's config, the other
    tower gets a minimal one."""
    sizes = {
        "image_size": 8,
        "patch_size": config.patch_size,
        "num_channels": 1,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
    }
    labels = {"id2label": {i: str(i) for i in range(10)}, "label2id": {str(i): i for i in range(10)}}
    if config.family in _TOWERS:
        key, tower, other, minimal = _TOWERS[config.family]
        vision = _family_config(tower, sizes, config.options).to_dict()
        text = {**minimal, "projection_size": config.hidden_size}
        from transformers import AutoConfig

        return AutoConfig.for_model(config.family, **{key: vision, other: text}, **labels)
    return _family_config(config.family, sizes, config.options, **labels)


def train_tiny_causal_lm(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: CausalLMTrainConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Train a small character-level causal LM of ``config.family`` on Shakespeare, as
    `train_tiny_gpt2` trains its GPT-2 (same data, blocks, batches, schedule); save it with its tokenizer."""
    from transformers import AutoModelForCausalLM

    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, CausalLMTrainConfig):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained by train_tiny_causal_lm")
    cfg = config or default
    tokenizer, train, test = _text_data(cfg, mask=False)
    model_config = causal_lm_config(cfg, tokenizer)
    return _run_text(
        kind,
        seed,
        cfg,
        out_dir,
        lambda: AutoModelForCausalLM.from_config(model_config),
        tokenizer,
        train,
        test,
        progress=progress,
        threads=threads,
    )


def train_tiny_vit(
    seed: int,
    out_dir: Path,
    config: ViTTrainConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
    kind: Kind = "vit",
) -> Path:
    """Train a small ViTForImageClassification on the 8×8 digits and save it.

    ``seed`` sets the initialisation and the order of the training images; the train/test split
    itself is fixed (``digits_dataset`` default), so every seed is tested on the same images.
    ``kind`` (vit or a wider twin) as in `train_tiny_gpt2`.
    """
    from transformers import ViTConfig, ViTForImageClassification

    cfg = config or _default_config(kind, ViTTrainConfig)
    model_config = ViTConfig(
        image_size=8,
        patch_size=cfg.patch_size,
        num_channels=1,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        id2label={i: str(i) for i in range(10)},
        label2id={str(i): i for i in range(10)},
    )
    return _run_digits(
        kind, seed, cfg, out_dir, lambda: ViTForImageClassification(model_config), progress=progress, threads=threads
    )


def _run_digits(
    kind: Kind,
    seed: int,
    cfg: ViTTrainConfig | ImageTrainConfig,
    out_dir: Path,
    build: Callable[[], Any],
    *,
    progress: Progress | None,
    threads: int | None,
) -> Path:
    """`_run` for the image kinds: the digits' training split in batches drawn per epoch, the test
    split scored 256 at a time, the digits' image processor saved beside the result."""
    images, labels = data.digits_dataset("train")
    test_images, test_labels = data.digits_dataset("test")
    return _run(
        kind,
        seed,
        cfg,
        out_dir,
        build,
        lambda s: data.image_batches(images, labels, cfg.batch_size, seed=s, drop_last=True),
        list(data.image_batches(test_images, test_labels, 256)),
        progress=progress,
        threads=threads,
        processor=digits_processor(),
    )


def train_tiny_image_classifier(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: ImageTrainConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Train a small image classifier of ``config.family`` on the 8×8 digits, as `train_tiny_vit`
    trains its ViT (same images, batches, schedule); save it with the digits' image processor."""
    from transformers import AutoModelForImageClassification

    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, ImageTrainConfig):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained by train_tiny_image_classifier")
    cfg = config or default
    model_config = image_config(cfg)
    return _run_digits(
        kind,
        seed,
        cfg,
        out_dir,
        lambda: AutoModelForImageClassification.from_config(model_config),
        progress=progress,
        threads=threads,
    )


def digits_processor() -> Any:
    """The image processor of the zoo ViT: 8×8 grayscale, scaled to [0, 1], normalised by 0.5 / 0.5.

    It maps the ``digits`` data set's PIL images (see `evaldata`) to the pixels the model was
    trained on (`data.digits_dataset`), up to the rounding of the pixels to 8 bits.
    """
    from transformers import ViTImageProcessor

    return ViTImageProcessor(
        do_resize=True,
        size={"height": 8, "width": 8},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5],
        image_std=[0.5],
    )


def _finetune_data(
    seed: int, plays: tuple[str, ...] | None, eval_tokens: int, *, base_kind: str = "gpt2", corpus: str = "shakespeare"
) -> tuple[Path, Any, Tensor, Tensor]:
    """(base folder, its tokenizer, train blocks, held-out blocks) for training on top of the zoo
    model ``base_kind`` of ``seed``, on ``corpus`` (`data.corpus_text`). The tokenizer is the
    base's (characters it never saw become ``<unk>``), so the result shares every tensor shape
    with its base, as a task vector needs."""
    from transformers import PreTrainedTokenizerFast

    base = cached_model(base_kind, seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(base))
    block = _block(base)
    train = data.text_blocks(tokenizer, data.corpus_text(corpus, plays, split="train"), block)
    held_out = data.corpus_text(corpus, plays, split="test")
    test = data.text_blocks(tokenizer, held_out, block, max_tokens=eval_tokens)
    return base, tokenizer, train, test


def bert_data(config: BertTrainConfig | MaskedLMTrainConfig) -> tuple[Any, Tensor, Tensor]:
    """(tokenizer with a ``<mask>`` token, train blocks, held-out blocks) of a masked-LM zoo config:
    `gpt2_data`'s text and blocks (the benchmark zoo's: BPE), unmasked (masks are drawn per batch)."""
    return _text_data(config, mask=True)


def _mask(ids: Tensor, tokenizer: Any, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(masked ids, attention mask, labels) of token blocks: `mask_tokens` (15 %; 80 % ``<mask>``,
    10 % random, 10 % kept) over every position that is neither padding nor a special token."""
    attention = (ids != int(tokenizer.pad_token_id)).long()
    candidates = (attention == 1) & ~torch.isin(ids, torch.tensor(tokenizer.all_special_ids, dtype=torch.long))
    inputs, labels = mask_tokens(
        ids, candidates, mask_token_id=int(tokenizer.mask_token_id), vocab_size=len(tokenizer), seed=seed
    )
    return inputs, attention, labels


def masked_lm_batches(
    blocks: Tensor, tokenizer: Any, batch_size: int, seed: int = EVAL_MASK_SEED
) -> list[dict[str, Tensor]]:
    """Masked-LM batches ``{"input_ids", "attention_mask", "labels"}`` over ``blocks`` in order, the masks
    drawn once for all of them from ``seed``: the same masks whatever ``batch_size``, at every call."""
    inputs, attention, labels = _mask(blocks, tokenizer, seed)
    return [
        {
            "input_ids": inputs[i : i + batch_size],
            "attention_mask": attention[i : i + batch_size],
            "labels": labels[i : i + batch_size],
        }
        for i in range(0, blocks.shape[0], batch_size)
    ]


def _masked_epoch(blocks: Tensor, tokenizer: Any, batch_size: int, seed: int) -> Iterator[dict[str, Tensor]]:
    """One training epoch of masked-LM batches: blocks in an order drawn from ``seed``, every batch
    masked afresh from its own seed (drawn from ``seed`` too), so no two steps share masks."""
    seeds = torch.Generator().manual_seed(seed + _MASK_STREAM)
    pad = int(tokenizer.pad_token_id)
    for batch in data.batches(blocks, batch_size, pad_token_id=pad, seed=seed, drop_last=True):
        mask_seed = int(torch.randint(2**62, (), generator=seeds))
        inputs, attention, labels = _mask(batch["input_ids"], tokenizer, mask_seed)
        yield {"input_ids": inputs, "attention_mask": attention, "labels": labels}


def train_tiny_bert(
    seed: int,
    out_dir: Path,
    config: BertTrainConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Train a small character-level BertForMaskedLM on Shakespeare (masked LM); save it with its tokenizer.

    ``seed`` sets the initialisation, the order of the training blocks and their masks (drawn
    afresh every step). The held-out blocks are masked once, from ``EVAL_MASK_SEED``
    (`held_out_batches` gives the same batches). Deterministic given ``seed``, ``config`` and ``threads``.
    """
    from transformers import BertConfig, BertForMaskedLM

    cfg = config or BertTrainConfig()
    tokenizer, train, test = bert_data(cfg)
    model_config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.block_size,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=int(tokenizer.pad_token_id),
    )
    return _run_masked(
        "bert",
        seed,
        cfg,
        out_dir,
        lambda: BertForMaskedLM(model_config),
        tokenizer,
        train,
        test,
        progress=progress,
        threads=threads,
    )


def _run_masked(
    kind: Kind,
    seed: int,
    cfg: BertTrainConfig | MaskedLMTrainConfig,
    out_dir: Path,
    build: Callable[[], Any],
    tokenizer: Any,
    train: Tensor,
    test: Tensor,
    *,
    progress: Progress | None,
    threads: int | None,
) -> Path:
    """`_run` for the masked-LM kinds: fresh masks every step, the held-out blocks masked once from
    ``EVAL_MASK_SEED`` and scored 64 at a time, the tokenizer saved beside the result."""
    return _run(
        kind,
        seed,
        cfg,
        out_dir,
        build,
        lambda s: _masked_epoch(train, tokenizer, cfg.batch_size, s),
        masked_lm_batches(test, tokenizer, 64),
        progress=progress,
        threads=threads,
        processor=tokenizer,
    )


def train_tiny_masked_lm(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: MaskedLMTrainConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Train a small character-level masked LM of ``config.family`` on Shakespeare, as
    `train_tiny_bert` trains its BERT (same data, blocks, masks, schedule); save it with its tokenizer."""
    from transformers import AutoModelForMaskedLM

    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, MaskedLMTrainConfig):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained by train_tiny_masked_lm")
    cfg = config or default
    tokenizer, train, test = bert_data(cfg)
    model_config = masked_lm_config(cfg, tokenizer)
    return _run_masked(
        kind,
        seed,
        cfg,
        out_dir,
        lambda: AutoModelForMaskedLM.from_config(model_config),
        tokenizer,
        train,
        test,
        progress=progress,
        threads=threads,
    )


def _train_further(
    kind: Kind,
    seed: int,
    cfg: GPT2FineTuneConfig | GPT2NextConfig,
    out_dir: Path,
    *,
    reorder: int | None,
    progress: Progress | None,
    threads: int | None,
) -> Path:
    """Train the zoo GPT-2 of ``seed`` further on ``cfg.plays`` (a fine-tune, or a re-release);
    ``reorder`` seeds a shuffle of the blocks first, so they come in another order than before."""
    from transformers import GPT2LMHeadModel

    base, tokenizer, train, test = _finetune_data(seed, cfg.plays, cfg.eval_tokens)
    if reorder is not None:
        train = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(reorder))]
    return _run_text(
        kind,
        seed,
        cfg,
        out_dir,
        lambda: GPT2LMHeadModel.from_pretrained(str(base)),
        tokenizer,
        train,
        test,
        progress=progress,
        threads=threads,
    )


def finetune_tiny_gpt2(
    seed: int,
    out_dir: Path,
    config: GPT2FineTuneConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Fine-tune the zoo GPT-2 of ``seed`` (trained first if needed) on other plays; save it."""
    cfg = config or GPT2FineTuneConfig()
    return _train_further("gpt2-ft", seed, cfg, out_dir, reorder=None, progress=progress, threads=threads)


def lora_tiny_gpt2(
    seed: int,
    out_dir: Path,
    config: GPT2LoraConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Train a PEFT LoRA adapter on the zoo GPT-2 of ``seed`` (trained first if needed); save it.

    The folder is a standard adapter (``adapter_config.json``, ``adapter_model.safetensors``) whose
    ``base_model_name_or_path`` is ``zoo:gpt2-seed<seed>``, the way a recipe names its base.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ModelNotFoundError(
            "the zoo's LoRA adapters are trained with peft: pip install 'hf-rebasin[peft]'"
        ) from None
    from transformers import GPT2LMHeadModel

    cfg = config or GPT2LoraConfig()
    base, tokenizer, train, test = _finetune_data(seed, cfg.plays, cfg.eval_tokens)

    def build() -> Any:
        lora = LoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.lora_alpha,
            target_modules=list(cfg.target_modules),
            fan_in_fan_out=True,  # GPT-2's Conv1D stores weights as [in, out]
            lora_dropout=0.0,
        )
        return get_peft_model(GPT2LMHeadModel.from_pretrained(str(base)), lora)

    folder = _run_text(
        "gpt2-lora", seed, cfg, out_dir, build, tokenizer, train, test, progress=progress, threads=threads
    )
    adapter_config = folder / "adapter_config.json"
    written = json.loads(adapter_config.read_text())
    written["base_model_name_or_path"] = f"zoo:gpt2-seed{seed}"
    adapter_config.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return folder


def finetune_on_domain(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: DomainFineTuneConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Fine-tune the zoo model ``config.base`` of ``seed`` (trained first if needed) on the text of
    ``config.corpus``, with the base's tokenizer and context; save it."""
    from transformers import AutoModelForCausalLM

    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, DomainFineTuneConfig):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained by finetune_on_domain")
    cfg = config or default
    base, tokenizer, train, test = _finetune_data(seed, None, cfg.eval_tokens, base_kind=cfg.base, corpus=cfg.corpus)
    return _run_text(
        kind,
        seed,
        cfg,
        out_dir,
        lambda: AutoModelForCausalLM.from_pretrained(str(base)),
        tokenizer,
        train,
        test,
        progress=progress,
        threads=threads,
    )


def next_tiny_gpt2(
    seed: int,
    out_dir: Path,
    config: GPT2NextConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Continue the pretraining of the zoo GPT-2 of ``seed`` (trained first if needed); save it."""
    cfg = config or GPT2NextConfig()
    reorder = seed + cfg.data_seed
    return _train_further("gpt2-next", seed, cfg, out_dir, reorder=reorder, progress=progress, threads=threads)


def _block(folder: Path) -> int:
    """The context length of a zoo model: GPT-2's ``n_positions``, BERT's ``max_position_embeddings``."""
    config = json.loads((folder / "config.json").read_text())
    return int(config["n_positions"] if "n_positions" in config else config["max_position_embeddings"])


_TRAINERS: dict[Kind, Callable[..., Path]] = {
    **{
        kind: functools.partial(train_tiny_gpt2, kind=kind)
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, GPT2TrainConfig)
    },
    **{
        kind: functools.partial(train_tiny_vit, kind=kind)
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, ViTTrainConfig)
    },
    "gpt2-ft": finetune_tiny_gpt2,
    "gpt2-lora": lora_tiny_gpt2,
    "gpt2-next": next_tiny_gpt2,
    "bert": train_tiny_bert,
    **{
        kind: functools.partial(train_tiny_causal_lm, kind)
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, CausalLMTrainConfig)
    },
    **{
        kind: functools.partial(train_tiny_masked_lm, kind)
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, MaskedLMTrainConfig)
    },
    **{
        kind: functools.partial(train_tiny_image_classifier, kind)
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, ImageTrainConfig)
    },
    **{
        kind: functools.partial(finetune_on_domain, kind)
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, DomainFineTuneConfig)
    },
}


def cached_model(
    kind: str,
    seed: int,
    cache_dir: Path | None = None,
    *,
    config: TrainConfig | None = None,
    progress: Progress | None = None,
) -> Path:
    """The folder of zoo model ``kind`` trained from ``seed``: trained on first use, reused after.

    Lives in ``<cache_dir>/<kind>-seed<seed>-<config hash>``; ``cache_dir`` defaults to
    ``cache_root() / "zoo"``. Training writes to a temporary sibling folder that is renamed into
    place when complete, so an interrupted run leaves no half-written model behind and two
    processes racing for the same model both end with one complete folder.
    """
    final = zoo_folder(kind, seed, cache_dir, config=config)
    if is_trained(final):
        return final
    cfg = config if config is not None else DEFAULT_CONFIGS[check_kind(kind)]
    zoo = final.parent
    zoo.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=zoo))
    try:
        _TRAINERS[check_kind(kind)](seed, tmp, cfg, progress=progress)
        try:
            tmp.rename(final)
        except OSError:
            if not is_trained(final):  # not a finished twin from another process
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def training_record(folder: Path) -> dict[str, Any]:
    """What ``training.json`` in a zoo folder says: kind, seed, config, time, held-out loss."""
    path = Path(folder) / TRAINING_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{str(path)!r} not found: {str(folder)!r} is not a zoo model folder")
    record: dict[str, Any] = json.loads(path.read_text())
    return record


def held_out_batches(folder: Path, batch_size: int = 64) -> list[dict[str, Tensor]]:
    """The held-out evaluation batches of a zoo model (text or digits it was not trained on).

    A masked LM's are masked-LM batches whose masks come from ``EVAL_MASK_SEED``: the batches its
    ``training.json`` loss was computed on, the same at every call.
    """
    record = training_record(folder)
    kind = check_kind(record["kind"])
    if _TASKS.get(kind) == "image-classification":
        images, labels = data.digits_dataset("test")
        return list(data.image_batches(images, labels, batch_size))
    from transformers import PreTrainedTokenizerFast

    cfg = record["config"]  # every text kind names its plays (or another corpus) and eval_tokens
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    plays = tuple(cfg["plays"]) if "plays" in cfg else None
    text = data.corpus_text(cfg.get("corpus", "shakespeare"), plays, split="test")
    if "block_size" in cfg:  # the blocks it was trained on (XLM-R's positions are 2 more)
        block = int(cfg["block_size"])
    else:  # trained on top of the zoo GPT-2: its context
        block = _block(cached_model("gpt2", int(record["seed"])) if kind == "gpt2-lora" else Path(folder))
    blocks = data.text_blocks(tokenizer, text, block, max_tokens=cfg["eval_tokens"])
    if _TASKS.get(kind) == "masked-lm":
        return masked_lm_batches(blocks, tokenizer, batch_size)
    return list(data.batches(blocks, batch_size, pad_token_id=int(tokenizer.pad_token_id)))
