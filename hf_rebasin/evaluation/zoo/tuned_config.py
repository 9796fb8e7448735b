"""The zoo's models trained on top of another zoo model: fine-tunes, LoRA adapters and the next
release of a base (torch-free, like the rest of the catalogue, which re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_rebasin.core.names import DEFAULT_PLAYS

__all__ = [
    "ChatFineTuneConfig",
    "ChatLoraConfig",
    "DomainFineTuneConfig",
    "DomainLoraConfig",
    "GPT2FineTuneConfig",
    "GPT2LoraConfig",
    "GPT2NextConfig",
]


@dataclass(frozen=True)
class GPT2FineTuneConfig:
    """A fine-tune of the zoo GPT-2 of the same seed on other plays: the task vector of transport demos.

    Small on purpose (a few hundred steps at a low rate): a task vector that stays near its base,
    as fine-tunes of large models do.
    """

    steps: int = 300  # ≈ 7 s on one CPU thread; held-out loss on the new plays ≈ 1.72 (base ≈ 2.20)
    batch_size: int = 16
    lr: float = 5e-4
    warmup: int = 20
    weight_decay: float = 0.0
    plays: tuple[str, ...] = ("the-merry-wives-of-windsor",)
    eval_tokens: int = 65536


@dataclass(frozen=True)
class ChatFineTuneConfig:
    """A chat fine-tune of a zoo causal LM (``base``, the same seed): ChatML's ``<|im_start|>`` and
    ``<|im_end|>`` added to its tokenizer as special tokens and the embeddings resized (new rows at
    the mean of the old, as transformers' ``resize_token_embeddings`` does), then trained on the
    speeches of ``plays`` as ChatML turns (`data.chatml_dialogue`), the way the PEFT guide "LoRA
    with additional tokens" trains a chat model. The base and the fine-tune have vocabularies that
    differ by those two tokens."""

    base: str = "gpt2"
    corpus: str = "shakespeare-chatml"
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    plays: tuple[str, ...] = ("the-merry-wives-of-windsor", "twelfth-night", "much-ado-about-nothing")
    eval_tokens: int = 65536


@dataclass(frozen=True)
class ChatLoraConfig:
    """The chat fine-tune as a PEFT LoRA adapter, the PEFT guide's "LoRA with additional tokens":
    ChatML's two tokens added and the base resized, LoRA on attention and MLP projections, the new
    tokens' rows trained as PEFT trainable tokens (``trainable_token_indices``; GPT-2's LM head is
    tied, so they are its rows too). The adapter is saved with its tokenizer."""

    base: str = "bench-gpt2"
    corpus: str = "kjv-chatml"
    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    rank: int = 16
    lora_alpha: int = 32
    target_modules: tuple[str, ...] = ("c_attn", "c_proj", "c_fc")
    plays: tuple[str, ...] = ()
    eval_tokens: int = 65536


@dataclass(frozen=True)
class DomainLoraConfig(ChatLoraConfig):
    """`DomainFineTuneConfig`'s fine-tune as a PEFT LoRA adapter (``ChatLoraConfig``'s layers, rank and
    rate), no token added: a task adapter that shares its base's vocabulary."""

    corpus: str = "kjv"
    eval_tokens: int = 131072


@dataclass(frozen=True)
class GPT2LoraConfig:
    """A PEFT LoRA adapter on the zoo GPT-2 of the same seed, trained on the fine-tune's plays.

    Attention and MLP projections at rank 16, at the full fine-tune's low rate: an update that
    stays near its base. Measured (benchmarks/transport/bench_transport.py): at 6× the rate (3e-3, rank 8)
    the adapter gains 0.07 nats more on its own base but its update is 3× larger, and moved onto
    another seed's base it is no better than that base; at this rate it transfers.
    """

    steps: int = 300  # ≈ 15 s on one CPU thread; held-out loss on the new plays ≈ 1.79 (base ≈ 2.20)
    batch_size: int = 16
    lr: float = 5e-4
    warmup: int = 20
    weight_decay: float = 0.0
    rank: int = 16
    lora_alpha: int = 32
    target_modules: tuple[str, ...] = ("c_attn", "c_proj", "c_fc")
    plays: tuple[str, ...] = ("the-merry-wives-of-windsor",)
    eval_tokens: int = 65536


@dataclass(frozen=True)
class GPT2NextConfig:
    """The next release of the zoo GPT-2 of the same seed: its pretraining continued on the same
    plays, the blocks in another order, at a lower rate. The case transport is meant for: a base
    re-released after more training, with a fine-tune of the first release to move onto it.
    """

    steps: int = 1000  # ≈ 25 s on one CPU thread
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    data_seed: int = 1000  # added to the seed: the blocks reach training in another order
    plays: tuple[str, ...] = DEFAULT_PLAYS
    eval_tokens: int = 65536


@dataclass(frozen=True)
class DomainFineTuneConfig:
    """A full fine-tune of a zoo model (kind ``base``, the same seed) on text of another domain:
    the task vector that transport moves to another base. The King James Bible is far from
    Shakespeare's verse in vocabulary and style, so the fine-tune gains a lot on it and forgets
    some of its pretraining text, as real domain fine-tunes do; ``steps`` × ``batch_size`` blocks
    are about 1.6 epochs of its training split."""

    base: str = "bench-gpt2"
    corpus: str = "kjv"
    steps: int = 1000
    batch_size: int = 16
    lr: float = 5e-4
    warmup: int = 50
    weight_decay: float = 0.0
    eval_tokens: int = 131072
