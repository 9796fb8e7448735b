"""How the zoo's masked LMs are built and trained: the BERT and the other encoder families
(DistilBERT, XLM-RoBERTa, ModernBERT), on the causal LMs' text with masks drawn afresh every step,
scored on held-out blocks masked once from ``EVAL_MASK_SEED``.

`masked_lm_batches` is here too: scoring a zoo masked LM later (`train.held_out_batches`) must draw
the very masks its ``training.json`` loss was computed on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.core.names import Kind
from hf_rebasin.evaluation import data
from hf_rebasin.evaluation.evaldata import mask_tokens
from hf_rebasin.evaluation.zoo.catalogue import (
    DEFAULT_CONFIGS,
    EVAL_MASK_SEED,
    BertTrainConfig,
    MaskedLMTrainConfig,
    check_kind,
)
from hf_rebasin.evaluation.zoo.causal import _text_data
from hf_rebasin.evaluation.zoo.families import masked_lm_config
from hf_rebasin.evaluation.zoo.loop import Progress, _run

_MASK_STREAM = 2**62  # offsets the seed of an epoch's masks from that of its block order


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
