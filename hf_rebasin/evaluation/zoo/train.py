"""A zoo of tiny trained models: GPT-2 (and wider twins), causal LMs of other families (Qwen3, Gemma, Gemma-2,
Gemma-3, Pythia, OLMo-2, Phi-3), BERT and masked LMs of other encoder families (DistilBERT,
XLM-RoBERTa, ModernBERT) on Shakespeare characters; ViT (and a wider twin), DINOv2 and SigLIP on
8×8 digits.

Re-basin needs pairs of models that compute the same kind of function from different seeds.
These are trained by the project's own code (no Hub, no network) in about a minute each on one
CPU thread, cached on disk, and saved exactly as ``save_pretrained`` writes models (safetensors),
so every other part of hf-rebasin reads them like any user's folder. The seed sets both the
initialisation and the data order.

This module holds the entry points: `cached_model` (trained on first use, then reused), the
trainer of every kind, `training_record` and `held_out_batches`, and the models trained on top of
another zoo model (the GPT-2's fine-tune, LoRA adapter and next release, the domain fine-tunes):
those start from `cached_model`'s base and `cached_model` trains them, so they live beside it. How
each family trained from scratch is built and trained lives in `causal`, `masked` and `images`,
their transformers configs in `families`, and the loop every kind shares in `loop`.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import ModelNotFoundError, UnsupportedArchitectureError
from hf_rebasin.core.names import KINDS as KINDS  # `X as X`: re-exported, the runner and scripts read train.X
from hf_rebasin.core.names import Kind
from hf_rebasin.core.resources import cache_root as cache_root
from hf_rebasin.evaluation import data
from hf_rebasin.evaluation.zoo.catalogue import (
    DEFAULT_CONFIGS,
    TRAINING_FILE,
    CausalLMTrainConfig,
    ChatFineTuneConfig,
    ChatLoraConfig,
    DomainFineTuneConfig,
    DomainLoraConfig,
    GPT2FineTuneConfig,
    GPT2LoraConfig,
    GPT2NextConfig,
    GPT2TrainConfig,
    ImageTrainConfig,
    MaskedLMTrainConfig,
    Seq2SeqFineTuneConfig,
    Seq2SeqTrainConfig,
    TrainConfig,
    ViTTrainConfig,
    check_kind,
    is_trained,
    zoo_folder,
)
from hf_rebasin.evaluation.zoo.catalogue import train_steps as train_steps
from hf_rebasin.evaluation.zoo.causal import run_text, train_tiny_causal_lm, train_tiny_gpt2
from hf_rebasin.evaluation.zoo.images import train_tiny_image_classifier, train_tiny_vit
from hf_rebasin.evaluation.zoo.loop import TASKS, Progress, on_zoo_base
from hf_rebasin.evaluation.zoo.masked import masked_lm_batches, train_tiny_bert, train_tiny_masked_lm
from hf_rebasin.evaluation.zoo.seq2seq import seq2seq_held_out, train_seq2seq, train_tiny_seq2seq


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


def _block(folder: Path) -> int:
    """The context length of a zoo model: GPT-2's ``n_positions``, BERT's ``max_position_embeddings``."""
    config = json.loads((folder / "config.json").read_text())
    return int(config["n_positions"] if "n_positions" in config else config["max_position_embeddings"])


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
    return run_text(
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
        import peft  # noqa: F401
    except ImportError:
        raise ModelNotFoundError(
            "the zoo's LoRA adapters are trained with peft: pip install 'hf-rebasin[peft]'"
        ) from None
    from transformers import GPT2LMHeadModel

    cfg = config or GPT2LoraConfig()
    base, tokenizer, train, test = _finetune_data(seed, cfg.plays, cfg.eval_tokens)

    def build() -> Any:
        return _with_lora(GPT2LMHeadModel.from_pretrained(str(base)), cfg)

    folder = run_text(
        "gpt2-lora", seed, cfg, out_dir, build, tokenizer, train, test, progress=progress, threads=threads
    )
    return on_zoo_base(folder, "gpt2", seed)


def _with_lora(model: Any, cfg: GPT2LoraConfig | ChatLoraConfig, **options: Any) -> Any:
    """``model`` with PEFT LoRA on ``cfg``'s layers at its rank (GPT-2's Conv1D stores weights as [in, out])."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=list(cfg.target_modules),
        fan_in_fan_out=True,
        lora_dropout=0.0,
        **options,
    )
    return get_peft_model(model, lora)


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
    return run_text(
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


def _chat_data(cfg: ChatFineTuneConfig | ChatLoraConfig, seed: int) -> tuple[Path, Any, Tensor, Tensor]:
    """(base folder, its tokenizer with ChatML's tokens and chat template, train blocks, held-out
    blocks) of a chat fine-tune of the zoo model ``cfg.base`` of ``seed``."""
    from transformers import PreTrainedTokenizerFast

    base = cached_model(cfg.base, seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(base))
    tokenizer.add_special_tokens({"additional_special_tokens": list(data.CHATML_TOKENS)})
    tokenizer.chat_template = data.CHATML_TEMPLATE
    block = _block(base)
    train = data.text_blocks(tokenizer, data.corpus_text(cfg.corpus, cfg.plays, split="train"), block)
    held_out = data.corpus_text(cfg.corpus, cfg.plays, split="test")
    return base, tokenizer, train, data.text_blocks(tokenizer, held_out, block, max_tokens=cfg.eval_tokens)


def finetune_chat(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: ChatFineTuneConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """`ChatFineTuneConfig`: the zoo GPT-2 ``config.base`` of ``seed`` with ChatML's tokens added
    (embeddings resized), fine-tuned on dialogue-formatted plays; saved with its tokenizer."""
    from transformers import AutoModelForCausalLM

    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, ChatFineTuneConfig):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained by finetune_chat")
    cfg = config or default
    base, tokenizer, train, test = _chat_data(cfg, seed)

    def build() -> Any:
        model = AutoModelForCausalLM.from_pretrained(str(base))
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        return model

    return run_text(kind, seed, cfg, out_dir, build, tokenizer, train, test, progress=progress, threads=threads)


def lora_chat(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: ChatLoraConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """`ChatLoraConfig`: a LoRA adapter with ChatML's tokens as trainable tokens on the zoo GPT-2
    ``config.base`` of ``seed``, resized; saved as an adapter with its tokenizer."""
    from transformers import AutoModelForCausalLM

    cfg = config or ChatLoraConfig()
    base, tokenizer, train, test = _chat_data(cfg, seed)
    new_ids = tokenizer.convert_tokens_to_ids(list(data.CHATML_TOKENS))

    def build() -> Any:
        model = AutoModelForCausalLM.from_pretrained(str(base))
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        return _with_lora(model, cfg, trainable_token_indices={"wte": list(new_ids)})

    folder = run_text(kind, seed, cfg, out_dir, build, tokenizer, train, test, progress=progress, threads=threads)
    return on_zoo_base(folder, cfg.base, seed)


def lora_on_domain(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: DomainLoraConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """`DomainLoraConfig`: a LoRA adapter on the zoo model ``config.base`` of ``seed``, trained on
    ``config.corpus`` with its base's tokenizer; saved as an adapter."""
    from transformers import AutoModelForCausalLM

    cfg = config or DomainLoraConfig()
    base, tokenizer, train, test = _finetune_data(seed, None, cfg.eval_tokens, base_kind=cfg.base, corpus=cfg.corpus)

    def build() -> Any:
        return _with_lora(AutoModelForCausalLM.from_pretrained(str(base)), cfg)

    folder = run_text(kind, seed, cfg, out_dir, build, tokenizer, train, test, progress=progress, threads=threads)
    return on_zoo_base(folder, cfg.base, seed)


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


def finetune_seq2seq(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: Seq2SeqFineTuneConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Fine-tune the zoo encoder-decoder ``config.base`` of ``seed`` (trained first if needed) on
    ``config.corpus``, denoised as it was pretrained; a LoRA adapter where ``config.rank`` > 0."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, Seq2SeqFineTuneConfig):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained by finetune_seq2seq")
    cfg = config or default
    base = cached_model(cfg.base, seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(base))
    start = int(AutoConfig.from_pretrained(str(base)).decoder_start_token_id)

    def make() -> Any:
        model = AutoModelForSeq2SeqLM.from_pretrained(str(base))
        return _with_seq2seq_lora(model, cfg) if cfg.rank else model

    folder = train_seq2seq(kind, seed, cfg, out_dir, (tokenizer, make, start), progress=progress, threads=threads)
    return on_zoo_base(folder, cfg.base, seed) if cfg.rank else folder


def _with_seq2seq_lora(model: Any, cfg: Seq2SeqFineTuneConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=list(cfg.target_modules),
        lora_dropout=0.0,
        task_type="SEQ_2_SEQ_LM",
    )
    return get_peft_model(model, lora)


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
    **{
        kind: functools.partial(train_tiny_seq2seq, kind)
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, Seq2SeqTrainConfig)
    },
    **{
        kind: functools.partial(finetune_seq2seq, kind)
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, Seq2SeqFineTuneConfig)
    },
    "bench-gpt2-chat-lora": functools.partial(lora_chat, "bench-gpt2-chat-lora"),
    "bench-gpt2-ft-lora": functools.partial(lora_on_domain, "bench-gpt2-ft-lora"),
    **{
        kind: functools.partial(finetune_chat, kind)
        for kind, config in DEFAULT_CONFIGS.items()
        if isinstance(config, ChatFineTuneConfig)
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


def _seq2seq_held_out(folder: Path, record: dict[str, Any], tokenizer: Any, batch_size: int) -> list[dict[str, Tensor]]:
    """An encoder-decoder's held-out text noised as it was scored after training (its recorded config;
    a fine-tune's decoder starts as its base's does)."""
    from transformers import AutoConfig

    from hf_rebasin.evaluation.zoo.seq2seq import held_out_blocks

    given = record["config"]
    cfg: Seq2SeqTrainConfig | Seq2SeqFineTuneConfig
    if "corpus" in given:
        cfg = Seq2SeqFineTuneConfig(**{**given, "target_modules": tuple(given["target_modules"])})
        model = cached_model(cfg.base, int(record["seed"]))
    else:
        options = tuple(tuple(o) for o in given["options"])
        cfg, model = Seq2SeqTrainConfig(**{**given, "plays": tuple(given["plays"]), "options": options}), folder
    start = int(AutoConfig.from_pretrained(str(model)).decoder_start_token_id)
    return seq2seq_held_out(tokenizer, held_out_blocks(tokenizer, cfg), start, batch_size)


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
    if TASKS.get(kind) == "image-classification":
        images, labels = data.digits_dataset("test")
        return list(data.image_batches(images, labels, batch_size))
    from transformers import PreTrainedTokenizerFast

    cfg = record["config"]  # every text kind names its plays (or another corpus) and eval_tokens
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    if TASKS.get(kind) == "seq2seq":
        return _seq2seq_held_out(folder, record, tokenizer, batch_size)
    plays = tuple(cfg["plays"]) if "plays" in cfg else None
    text = data.corpus_text(cfg.get("corpus", "shakespeare"), plays, split="test")
    if "block_size" in cfg:  # the blocks it was trained on (XLM-R's positions are 2 more)
        block = int(cfg["block_size"])
    else:  # trained on top of the zoo GPT-2: its context
        on = "gpt2" if kind == "gpt2-lora" else cfg.get("base") if kind.endswith("-lora") else None  # an adapter's base
        block = _block(cached_model(on, int(record["seed"])) if on else Path(folder))
    blocks = data.text_blocks(tokenizer, text, block, max_tokens=cfg["eval_tokens"])
    if TASKS.get(kind) == "masked-lm":
        return masked_lm_batches(blocks, tokenizer, batch_size)
    return list(data.batches(blocks, batch_size, pad_token_id=int(tokenizer.pad_token_id)))
