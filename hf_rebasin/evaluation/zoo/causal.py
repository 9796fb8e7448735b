"""How the zoo's causal LMs trained from scratch are built and trained: the GPT-2 (and its wider
twins) and the other decoder families, on Shakespeare characters (or, for the benchmark zoo, a BPE
vocabulary learned on the training split).

Also the text data the masked LMs share (`_text_data`) and the causal-LM run (`run_text`) the
fine-tunes reuse: one source of token blocks and batches for every text kind.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.core.names import Kind
from hf_rebasin.evaluation import data
from hf_rebasin.evaluation.zoo.catalogue import (
    DEFAULT_CONFIGS,
    BertTrainConfig,
    CausalLMTrainConfig,
    ChatFineTuneConfig,
    ChatLoraConfig,
    DomainFineTuneConfig,
    GPT2FineTuneConfig,
    GPT2LoraConfig,
    GPT2NextConfig,
    GPT2TrainConfig,
    MaskedLMTrainConfig,
    SubwordLMTrainConfig,
    SubwordMaskedLMTrainConfig,
    check_kind,
)
from hf_rebasin.evaluation.zoo.families import causal_lm_config
from hf_rebasin.evaluation.zoo.loop import Progress, _run, default_config


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


def run_text(
    kind: Kind,
    seed: int,
    cfg: GPT2TrainConfig
    | GPT2FineTuneConfig
    | GPT2LoraConfig
    | GPT2NextConfig
    | CausalLMTrainConfig
    | DomainFineTuneConfig
    | ChatFineTuneConfig
    | ChatLoraConfig,
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

    cfg = config or default_config(kind, GPT2TrainConfig)
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
    return run_text(
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
    return run_text(
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
