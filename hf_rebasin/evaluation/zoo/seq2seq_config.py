"""The zoo's encoder-decoders: what they are trained with (torch-free, like the rest of the catalogue).

Plain text has no targets, so every kind is pretrained as its family was: BART on text infilling,
T5 on span corruption (`hf_rebasin.evaluation.seq2seq`), with fresh noise every epoch (the seed of
an epoch draws it) and held-out text noised once with a fixed seed. Two sizes: a character-level
BART of the tiny zoo's size (recipes and slow tests), and the benchmark zoo's BART and T5 with a
BPE vocabulary, 4 + 4 layers of width 128, blocks of 128 tokens over every play.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hf_rebasin.core.names import ALL_PLAYS, DEFAULT_PLAYS, Kind

__all__ = ["BART_FAMILIES", "SENTINELS", "SEQ2SEQ_CONFIGS", "Seq2SeqTrainConfig"]

BART_FAMILIES = ("bart", "mbart")  # text infilling over a vocabulary with <mask>
SENTINELS = 32  # T5 sentinels added to a BPE vocabulary (<extra_id_0> …): a 128-token block uses about 6


@dataclass(frozen=True)
class Seq2SeqTrainConfig:
    """An encoder-decoder of ``family`` (``bart`` or ``t5``) pretrained by denoising.

    ``vocab_size`` 0 means characters (the tiny zoo's vocabulary), else a byte-level BPE vocabulary
    of that size learned on the training split. ``num_layers`` counts each stack. ``head_dim`` is
    T5's ``d_kv`` (BART's heads are ``hidden_size / num_heads``). ``options`` sets any other field of
    the family's config, as transformers names it (kept in the cache key), and ``embedding_std``, the
    embeddings' initial scale where the family's own is kept out of a short run's reach (T5: 1.0).
    """

    family: str
    vocab_size: int = 0
    steps: int = 2500
    batch_size: int = 16
    block_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int | None = None
    intermediate_size: int = 256
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    options: tuple[tuple[str, Any], ...] = ()
    plays: tuple[str, ...] = DEFAULT_PLAYS
    eval_tokens: int = 65536


def _bench(family: str, **changes: Any) -> Seq2SeqTrainConfig:
    """The benchmark zoo's size (bench-gpt2's): a BPE vocabulary of 2048, 4 + 4 layers of width 128,
    blocks of 128 tokens, every play, 4000 steps."""
    base = Seq2SeqTrainConfig(
        family=family,
        vocab_size=2048,
        steps=4000,
        block_size=128,
        hidden_size=128,
        num_layers=4,
        warmup=200,
        plays=ALL_PLAYS,
        eval_tokens=131072,
    )
    return dataclasses.replace(base, **changes)


# the benchmark T5 (v1.1-style: gated-GELU MLP of ⅔ · 512 units, the head apart from the embeddings,
# 4 heads of width 32, RMSNorm, relative positions), bench-gpt2's rate
# Embeddings start at bench-gpt2's 0.02, not T5's 1.0: after 4000 steps from 1.0 the table was still
# mostly its random start (weight decay had taken it to std 0.65; the two seeds' tables had a linear
# CKA of 0.06, bench-gpt2's 0.99), a vocabulary that learned nothing, unlike any released T5's.
_T5: dict[str, Any] = {
    "head_dim": 32,
    "intermediate_size": 352,
    "lr": 2e-3,
    "weight_decay": 0.1,
    "options": (("embedding_std", 0.02),),
}

SEQ2SEQ_CONFIGS: dict[Kind, Seq2SeqTrainConfig] = {
    # BART at the tiny zoo's size: post-LayerNorm, characters, the tied head
    "bart": Seq2SeqTrainConfig(family="bart"),
    # the benchmark BART: MLPs of 4 × width; post-norm, so a gentler rate than bench-gpt2's
    "bench-bart": _bench("bart", intermediate_size=512, lr=1e-3),
    # the same in mBART's layout: pre-norm layers and a final norm per stack, which leave the copy plateau
    # early on every seed (post-norm bench-bart left it on seed 0 only, in 4000 steps)
    "bench-mbart": _bench("mbart", intermediate_size=512, lr=1e-3),
    "bench-t5": _bench("t5", **_T5),
    # the same, three times as long (12,000 steps, the schedule stretched): whether the two seeds' input
    # tables and streams draw closer with training, as released T5s' were trained far longer
    "bench-t5-long": _bench("t5", **_T5, steps=12000, warmup=600),
}


@dataclass(frozen=True)
class Seq2SeqFineTuneConfig:
    """A fine-tune of a zoo encoder-decoder (kind ``base``, the same seed) on text of another domain,
    denoised as the base was pretrained: the King James Bible, as ``bench-gpt2-ft``'s, so that the
    fine-tune gains a lot on it and forgets some Shakespeare. ``rank`` > 0 trains a PEFT LoRA adapter
    (``SEQ_2_SEQ_LM``) on ``target_modules`` instead of every weight."""

    base: str = "bench-t5"
    corpus: str = "kjv"
    steps: int = 1000
    batch_size: int = 16
    block_size: int = 128
    lr: float = 5e-4
    warmup: int = 50
    weight_decay: float = 0.0
    rank: int = 0
    lora_alpha: int = 32
    target_modules: tuple[str, ...] = ()
    eval_tokens: int = 131072


# the same as a rank-16 LoRA adapter on every projection (bench-gpt2-ft-lora's rank and rate)
_T5_LORA: dict[str, Any] = {"lr": 1e-3, "rank": 16, "target_modules": ("q", "k", "v", "o", "wi_0", "wi_1", "wo")}

SEQ2SEQ_TUNED: dict[Kind, Seq2SeqFineTuneConfig] = {
    "bench-t5-ft": Seq2SeqFineTuneConfig(),
    "bench-t5-ft-lora": Seq2SeqFineTuneConfig(**_T5_LORA),
    # the same fine-tunes of the pair trained three times as long
    "bench-t5-long-ft": Seq2SeqFineTuneConfig(base="bench-t5-long"),
    "bench-t5-long-ft-lora": Seq2SeqFineTuneConfig(base="bench-t5-long", **_T5_LORA),
}
