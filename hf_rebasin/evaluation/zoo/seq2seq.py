"""How the zoo's encoder-decoders are built and pretrained: BART by text infilling, T5 by span
corruption, on Shakespeare (characters, or a BPE vocabulary learned on the training split), with
fresh noise every epoch and held-out text noised once with a fixed seed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.core.names import Kind
from hf_rebasin.evaluation import data
from hf_rebasin.evaluation.seq2seq import block_room, collate, noised_pairs, objective_of
from hf_rebasin.evaluation.zoo.catalogue import DEFAULT_CONFIGS, EVAL_MASK_SEED, check_kind
from hf_rebasin.evaluation.zoo.loop import Progress, _run
from hf_rebasin.evaluation.zoo.seq2seq_config import BART_FAMILIES, SENTINELS, Seq2SeqFineTuneConfig, Seq2SeqTrainConfig

__all__ = [
    "held_out_blocks",
    "model_config",
    "seq2seq_data",
    "seq2seq_held_out",
    "train_seq2seq",
    "train_tiny_seq2seq",
    "training_batches",
]


def _tokenizer(cfg: Seq2SeqTrainConfig) -> Any:
    """The kind's tokenizer, ending every text in ``<eos>`` (as BART's and T5's do): BART's with a
    mask token, T5's with sentinels ``<extra_id_0>`` … appended after the BPE vocabulary."""
    from tokenizers import processors

    mask = cfg.family in BART_FAMILIES
    if cfg.vocab_size:
        tokenizer = data.bpe_tokenizer(data.shakespeare_text(cfg.plays, split="train"), cfg.vocab_size, mask=mask)
    else:
        tokenizer = data.char_tokenizer(data.shakespeare_text(cfg.plays), mask=mask)
    if cfg.family == "t5":
        tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_id_{i}>" for i in range(SENTINELS)]})
    eos = int(tokenizer.eos_token_id)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {data.EOS}", special_tokens=[(data.EOS, eos)]
    )
    return tokenizer


def _blocks(tokenizer: Any, text: str, block_size: int, max_tokens: int | None) -> list[list[int]]:
    """``text`` as consecutive blocks of content ids that fit ``block_size`` once noised and framed."""
    objective = objective_of(tokenizer, paired=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[:max_tokens] if max_tokens is not None else ids
    size = block_room(tokenizer, objective, block_size)
    return [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]


def _text(cfg: Seq2SeqTrainConfig | Seq2SeqFineTuneConfig, split: Literal["train", "test"]) -> str:
    if isinstance(cfg, Seq2SeqFineTuneConfig):
        return data.corpus_text(cfg.corpus, split=split)
    return data.shakespeare_text(cfg.plays, split=split)


def held_out_blocks(tokenizer: Any, cfg: Seq2SeqTrainConfig | Seq2SeqFineTuneConfig) -> list[list[int]]:
    """The held-out blocks a zoo encoder-decoder (or its fine-tune) is scored on."""
    return _blocks(tokenizer, _text(cfg, "test"), cfg.block_size, cfg.eval_tokens)


def training_batches(
    tokenizer: Any,
    cfg: Seq2SeqTrainConfig | Seq2SeqFineTuneConfig,
    start: int,
    max_tokens: int,
    batch_size: int = 16,
    seed: int = 0,
) -> list[dict[str, Tensor]]:
    """The first ``max_tokens`` of the training text noised once with ``seed``, in order: alignment
    data for the benchmarks (never the held-out text)."""
    blocks = _blocks(tokenizer, _text(cfg, "train"), cfg.block_size, max_tokens)
    pairs = list(noised_pairs(tokenizer, objective_of(tokenizer, paired=False), blocks, seed))
    pad = int(tokenizer.pad_token_id)
    return [collate(pairs[i : i + batch_size], pad, start) for i in range(0, len(pairs), batch_size)]


def seq2seq_data(cfg: Seq2SeqTrainConfig) -> tuple[Any, list[list[int]], list[list[int]]]:
    """(tokenizer, training blocks, held-out blocks) of a zoo encoder-decoder."""
    tokenizer = _tokenizer(cfg)
    return tokenizer, _blocks(tokenizer, _text(cfg, "train"), cfg.block_size, None), held_out_blocks(tokenizer, cfg)


def _batches(
    tokenizer: Any, blocks: list[list[int]], batch_size: int, seed: int, start: int
) -> list[dict[str, Tensor]]:
    """The blocks noised with ``seed`` and batched in an order drawn from it (the last partial batch kept)."""
    pairs = list(noised_pairs(tokenizer, objective_of(tokenizer, paired=False), blocks, seed))
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    pad = int(tokenizer.pad_token_id)
    return [
        collate([pairs[j] for j in order[i : i + batch_size]], pad, start) for i in range(0, len(pairs), batch_size)
    ]


def seq2seq_held_out(
    tokenizer: Any, blocks: list[list[int]], start: int, batch_size: int = 64
) -> list[dict[str, Tensor]]:
    """Held-out batches: noised once with `EVAL_MASK_SEED`, the same at every evaluation."""
    return _batches(tokenizer, blocks, batch_size, EVAL_MASK_SEED, start)


def model_config(cfg: Seq2SeqTrainConfig, tokenizer: Any) -> Any:
    """The transformers config of a zoo encoder-decoder: no dropout, the tokenizer's special ids. T5's
    head is apart from its embeddings (v1.1's layout: ``tie_word_embeddings`` false, no rescale)."""
    from transformers import AutoConfig

    ids = {"pad_token_id": int(tokenizer.pad_token_id), "eos_token_id": int(tokenizer.eos_token_id)}
    sizes: dict[str, Any]
    if cfg.family in BART_FAMILIES:
        sizes = {
            "d_model": cfg.hidden_size,
            **{f"{s}_layers": cfg.num_layers for s in ("encoder", "decoder")},
            **{f"{s}_attention_heads": cfg.num_heads for s in ("encoder", "decoder")},
            **{f"{s}_ffn_dim": cfg.intermediate_size for s in ("encoder", "decoder")},
            "max_position_embeddings": cfg.block_size,
            **{k: 0.0 for k in ("dropout", "attention_dropout", "activation_dropout")},
            "bos_token_id": int(tokenizer.bos_token_id),
            "decoder_start_token_id": ids["eos_token_id"],  # BART's decoder starts from its end of sentence
            "forced_eos_token_id": None,
        }
    elif cfg.family == "t5":
        sizes = {
            "d_model": cfg.hidden_size,
            "d_kv": cfg.head_dim or cfg.hidden_size // cfg.num_heads,
            "d_ff": cfg.intermediate_size,
            "num_layers": cfg.num_layers,
            "num_decoder_layers": cfg.num_layers,
            "num_heads": cfg.num_heads,
            "feed_forward_proj": "gated-gelu",
            "tie_word_embeddings": False,
            "dropout_rate": 0.0,
            "decoder_start_token_id": ids["pad_token_id"],  # T5's decoder starts from padding
        }
    else:
        raise UnsupportedArchitectureError(
            f"the zoo trains encoder-decoders of families bart and t5, not {cfg.family!r}"
        )
    options = {k: v for k, v in cfg.options if k != "embedding_std"}
    return AutoConfig.for_model(cfg.family, vocab_size=len(tokenizer), **sizes, **ids, **options)


def build(config: Any, embedding_std: float | None = None) -> Any:
    """A fresh model of ``config``, its embeddings drawn at ``embedding_std`` where given; T5's head
    given its own weights (transformers 5 ties it to the embeddings, and a v1.1 checkpoint stores it
    apart, which loading reads untied), started at the embeddings times d_model^-½: what the tied,
    rescaled head of the original T5 computes at initialisation (T5's own embeddings alone give
    logits of about 50 nats' loss, and most of a short run is spent shrinking them)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_config(config)
    if embedding_std is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, embedding_std)
    if config.model_type == "t5":
        scale = config.d_model**-0.5
        model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone() * scale)
        model.all_tied_weights_keys = {k: v for k, v in model.all_tied_weights_keys.items() if k != "lm_head.weight"}
    return model


def train_seq2seq(
    kind: Kind,
    seed: int,
    cfg: Seq2SeqTrainConfig | Seq2SeqFineTuneConfig,
    out_dir: Path,
    parts: tuple[Any, Callable[[], Any], int],
    *,
    progress: Progress | None,
    threads: int | None,
) -> Path:
    """`_run` for an encoder-decoder: ``parts`` = (tokenizer, model builder, decoder start id); every
    epoch's training text noised afresh, full batches only; the tokenizer saved beside the result."""
    tokenizer, make, start = parts
    train = _blocks(tokenizer, _text(cfg, "train"), cfg.block_size, None)

    def epoch(s: int) -> Iterator[dict[str, Tensor]]:
        made = _batches(tokenizer, train, cfg.batch_size, s, start)
        return iter([b for b in made if len(b["labels"]) == cfg.batch_size])

    held_out = seq2seq_held_out(tokenizer, held_out_blocks(tokenizer, cfg), start)
    return _run(
        kind, seed, cfg, out_dir, make, epoch, held_out, progress=progress, threads=threads, processor=tokenizer
    )


def train_tiny_seq2seq(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: Seq2SeqTrainConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Pretrain a zoo encoder-decoder by denoising; save it with its tokenizer."""
    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, Seq2SeqTrainConfig):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained by train_tiny_seq2seq")
    cfg = config or default
    tokenizer = _tokenizer(cfg)
    model_cfg = model_config(cfg, tokenizer)
    std = dict(cfg.options).get("embedding_std")
    parts = (tokenizer, lambda: build(model_cfg, std), int(model_cfg.decoder_start_token_id))
    return train_seq2seq(kind, seed, cfg, out_dir, parts, progress=progress, threads=threads)
