"""A corpus of checkpoints written the way real repositories store them, for every supported family.

Each *layout* writes a tiny model (`tiny.py`) into a folder as some era or tool of the ecosystem
wrote it: `save_pretrained` today, sharded safetensors, the legacy buffers older transformers
versions saved (BERT/CLIP `position_ids`, GPT-2 `attn.bias` / `attn.masked_bias`, Llama-2-era
per-layer `rotary_emb.inv_freq`), weights saved from the base class (no `bert.` / `transformer.`
prefix, the original GPT-2 repos' layout), a tied head stored in the file, pickles (one file and
sharded with an index), float16, mixed float32/bf16 tensors, and a config whose dtype disagrees
with the stored tensors. The files are written with `safetensors` and `torch.save` directly, not by
hf-rebasin, so that stock `from_pretrained` is the judge of what they hold.

Used by `test_conformance.py` and by `benchmarks/symmetry/bench_conformance.py` (the table in benchmarks/README.md).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny

# family -> tiny model factory: one per supported model_type and the layouts that matter to it
FAMILIES: dict[str, Callable[..., torch.nn.Module]] = {
    "gpt2": tiny.gpt2,
    "gpt2-untied": tiny.gpt2_untied,
    "bert-mlm": tiny.bert_mlm,
    "bert-base": tiny.bert_base,  # a BertModel, as sentence-transformers exports (all-MiniLM-L6-v2)
    "roberta-mlm": tiny.roberta_mlm,
    "vit": tiny.vit,
    "llama": tiny.llama,
    "mistral": tiny.mistral,
    "qwen2-tied": tiny.qwen2,
    "clip": tiny.clip,
    "xlm-roberta-mlm": tiny.xlm_roberta_mlm,
    "distilbert-mlm": tiny.distilbert_mlm,
    "modernbert-mlm": tiny.modernbert_mlm,
    "dinov2-cls": tiny.dinov2_cls,
    "gemma": tiny.gemma,
    "qwen3-tied": tiny.qwen3_tied,
    "phi3": tiny.phi3,
    "gpt-neox": tiny.gpt_neox,
    "bart": tiny.bart,
    "t5": tiny.FACTORIES["t5"],  # v1.1: the head stored apart
    "t5-relu": tiny.FACTORIES["t5-relu"],  # the original T5: ReLU, the head tied and rescaled
    "whisper": tiny.whisper,
    "mbart": tiny.mbart,
    "marian": tiny.marian,
    "m2m100": tiny.m2m100,
}


def _legacy_buffers(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The buffers older transformers versions saved for ``model``'s family, named as they stored them."""
    config = model.config
    kind = config.model_type
    out: dict[str, torch.Tensor] = {}
    if kind in ("bert", "roberta", "xlm-roberta"):
        positions = config.max_position_embeddings
        out[f"{prefix}embeddings.position_ids"] = torch.arange(positions)[None]
    elif kind == "gpt2":
        n = config.n_positions
        for i in range(config.n_layer):
            out[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
            out[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    elif kind in ("llama", "mistral", "qwen2"):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        for i in range(config.num_hidden_layers):
            out[f"{prefix}layers.{i}.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()
    elif kind == "gpt_neox":  # Pythia's checkpoints: causal mask, its constant, rotary frequencies per layer
        n = config.max_position_embeddings
        rotary = int(config.hidden_size // config.num_attention_heads * _rotary_pct(config))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
        for i in range(config.num_hidden_layers):
            out[f"{prefix}layers.{i}.attention.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
            out[f"{prefix}layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
            out[f"{prefix}layers.{i}.attention.rotary_emb.inv_freq"] = inv_freq.clone()
    elif kind == "t5":  # the original t5-* files: a cross-attention bias no layer reads (transformers ignores it)
        bias = torch.randn(config.relative_attention_num_buckets, config.num_heads)
        out[f"{prefix}decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = bias
    elif kind == "bart":  # fairseq-converted BART files: each stack's version counter
        out[f"{prefix}encoder.version"] = torch.tensor([2.0])
        out[f"{prefix}decoder.version"] = torch.tensor([2.0])
    elif kind == "clip":
        out["text_model.embeddings.position_ids"] = torch.arange(config.text_config.max_position_embeddings)[None]
        patches = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
        out["vision_model.embeddings.position_ids"] = torch.arange(patches + 1)[None]
    return out


def _rotary_pct(config: object) -> float:
    rope = getattr(config, "rope_parameters", None)
    found = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return float(found or getattr(config, "rotary_pct", None) or 0.25)


def _prefix(model: torch.nn.Module) -> str:
    """``bert.`` / ``transformer.`` / ``model.``: the base model's prefix in a head class's names."""
    prefix = getattr(model, "base_model_prefix", "")
    return (
        f"{prefix}."
        if prefix and hasattr(model, prefix) and type(model).__name__ != type(model.base_model).__name__
        else ""
    )


def _files(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def stored_keys(folder: Path) -> list[str]:
    """Every tensor name the folder's files hold (safetensors or pickles, sharded or not)."""
    keys: list[str] = []
    for file in sorted(folder.glob("*.safetensors")):
        keys += load_file(str(file))
    for file in sorted(folder.glob("*.bin")):
        keys += torch.load(file, weights_only=True)
    return keys


def _write(folder: Path, state: dict[str, torch.Tensor]) -> None:
    state = {k: v.contiguous().clone() for k, v in state.items()}  # tied tensors share memory: two copies
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))


def modern(model: torch.nn.Module, folder: Path) -> None:
    """`save_pretrained` of the installed transformers: one model.safetensors."""
    model.save_pretrained(str(folder))


def sharded(model: torch.nn.Module, folder: Path) -> None:
    """`save_pretrained` in several shards with model.safetensors.index.json."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(str(folder), max_shard_size=max(1024, total // 3))
    assert (folder / "model.safetensors.index.json").is_file()


def legacy_buffers(model: torch.nn.Module, folder: Path) -> None:
    """As transformers 2.x–4.30 saved it: the buffers that since became non-persistent or moved."""
    model.save_pretrained(str(folder))
    state = _files(folder)
    state.update(_legacy_buffers(model, _prefix(model)))
    _write(folder, state)


def base_class(model: torch.nn.Module, folder: Path) -> None:
    """Saved from the base class: no ``transformer.`` / ``bert.`` prefix on the body, a tied head
    left out (the original GPT-2 repos, plus their `attn.bias` buffers)."""
    model.save_pretrained(str(folder))
    prefix = _prefix(model)
    state = {k.removeprefix(prefix): v for k, v in _files(folder).items()}
    state.update(_legacy_buffers(model, ""))
    _write(folder, state)


def _made_on_load(model: torch.nn.Module, key: str) -> bool:
    """Whether stock loading makes ``key`` itself when the files lack it (``_keys_to_ignore_on_load_missing``)."""
    return any(re.search(p, key) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ())


def made_on_load(model: torch.nn.Module, folder: Path) -> None:
    """Files that lack what the class makes itself on load (MarianMTModel: ``final_logits_bias``, zeros;
    ``save_pretrained`` already leaves out its sinusoidal tables), as converted Marian checkpoints do."""
    model.save_pretrained(str(folder))
    _write(folder, {k: v for k, v in _files(folder).items() if not _made_on_load(model, k)})


def tied_stored(model: torch.nn.Module, folder: Path) -> None:
    """A tied head written into the file as well (as some exporters do): the same values twice."""
    model.save_pretrained(str(folder))
    state = _files(folder)
    full = model.state_dict()
    for alias in getattr(model, "all_tied_weights_keys", {}) or {}:
        state[alias] = full[alias]
    _write(folder, state)


def pickle(model: torch.nn.Module, folder: Path) -> None:
    """pytorch_model.bin only (needs `allow_pickle`)."""
    model.save_pretrained(str(folder))
    state = _files(folder)
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")


def pickle_sharded(model: torch.nn.Module, folder: Path) -> None:
    """pytorch_model-0000N-of-0000M.bin with pytorch_model.bin.index.json (needs `allow_pickle`)."""
    model.save_pretrained(str(folder))
    state = _files(folder)
    (folder / "model.safetensors").unlink()
    names = list(state)
    count = 3
    per = math.ceil(len(names) / count)
    weight_map = {}
    for i in range(count):
        file = f"pytorch_model-{i + 1:05d}-of-{count:05d}.bin"
        part = {k: state[k] for k in names[i * per : (i + 1) * per]}
        torch.save(part, folder / file)
        weight_map |= dict.fromkeys(part, file)
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": weight_map,
    }
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


def float16(model: torch.nn.Module, folder: Path) -> None:
    """A float16 checkpoint (config dtype float16)."""
    model.to(torch.float16).save_pretrained(str(folder))
    model.to(torch.float32)


def mixed_dtypes(model: torch.nn.Module, folder: Path) -> None:
    """bf16 matrices with float32 vectors (norms, biases), as mixed-precision exports store them."""
    model.save_pretrained(str(folder))
    state = {k: v if v.dim() <= 1 else v.to(torch.bfloat16) for k, v in _files(folder).items()}
    _write(folder, state)
    _edit_config(folder, dtype="bfloat16")


def config_dtype_disagrees(model: torch.nn.Module, folder: Path) -> None:
    """float32 tensors under a config.json that says bfloat16 (and the old key torch_dtype)."""
    model.save_pretrained(str(folder))
    _edit_config(folder, dtype="bfloat16", torch_dtype="bfloat16")


LAYOUTS: dict[str, Callable[[torch.nn.Module, Path], None]] = {
    "modern": modern,
    "sharded": sharded,
    "legacy-buffers": legacy_buffers,
    "base-class": base_class,
    "tied-stored": tied_stored,
    "made-on-load": made_on_load,
    "pickle": pickle,
    "pickle-sharded": pickle_sharded,
    "float16": float16,
    "mixed-dtypes": mixed_dtypes,
    "config-dtype": config_dtype_disagrees,
}


@functools.cache
def applies(family: str, layout: str) -> bool:
    """Layouts that exist for a family: legacy buffers where its classes had them, a prefix to strip,
    a tie to store."""
    model = _example(family)
    if layout == "legacy-buffers":
        return bool(_legacy_buffers(model, _prefix(model)))
    if layout == "base-class":
        return bool(_prefix(model))
    if layout == "tied-stored":
        return bool(getattr(model, "all_tied_weights_keys", None))
    if layout == "made-on-load":
        ignored = getattr(model, "_keys_to_ignore_on_save", None) or set()
        return any(_made_on_load(model, k) for k in model.state_dict() if k not in ignored)
    return True


@functools.cache
def _example(family: str) -> torch.nn.Module:
    return FAMILIES[family](0)


def cases() -> list[tuple[str, str]]:
    """Every (family, layout) of the corpus."""
    return [(f, layout) for f in FAMILIES for layout in LAYOUTS if applies(f, layout)]


def permuted_mlp(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """A copy of ``model`` whose MLP hidden units are permuted at random: the same function, other tensors."""
    from hf_rebasin.io.rebuild import rebuild
    from hf_rebasin.symmetry.adapters import graph_for
    from hf_rebasin.symmetry.spaces import HeadSpace
    from hf_rebasin.symmetry.transforms import AxisMap

    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    transform = graph.identity()
    g = torch.Generator().manual_seed(seed)
    for name, space in graph.spaces.items():
        if not isinstance(space, HeadSpace) and space.kind == "mlp":
            transform[name] = AxisMap(space.size, index=torch.randperm(space.size, generator=g))
    return rebuild(model, graph.apply(sd, transform))  # type: ignore[arg-type]
