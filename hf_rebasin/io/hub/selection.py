"""Which files of a Hub repo are downloaded, and the limits a repo must meet before any is.

Exactly what hf-rebasin reads or carries into its output, by exact file name (`download_files`):
config, card, the non-weight files `layout.is_support_file` keeps (tokenizer, generation config, chat
template, processor configs), and the weights stock ``from_pretrained`` reads: ``model.safetensors``,
else ``model.safetensors.index.json`` and the shards it names (else, when allowed, the same for
``pytorch_model.bin``); never ``consolidated*.safetensors``, other precisions (``model.fp16.safetensors``)
or sub-folders (``onnx/``, ``original/``). Pickle checkpoints are refused unless the recipe allows them.
No network here: the file list and sizes come from `resolve`, the index from `download` or the cache.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from hf_rebasin.core.errors import ModelNotFoundError, PickleRefusedError
from hf_rebasin.io.hub.client import HubError
from hf_rebasin.io.layout import PICKLE, PICKLE_INDEX, SAFETENSORS, SAFETENSORS_INDEX, index_shards, is_support_file

__all__ = ["download_files", "weight_layout"]

# the weights stock `from_pretrained` reads (no `variant`, default `use_safetensors`), in its order:
# one file, else an index naming its shards; pickles only when the recipe allows them
# top-level files that may be weights (an index may name any such file as a shard): the size limits
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
PICKLE_PATTERNS = ("*.bin", "*.bin.index.json")
# how a repo's other weight formats look, to name them when none of them is loadable
_OTHER_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".index.json")
# besides the weights: the config, the card (its licence) and every file of the model that
# `layout.is_support_file` carries into the output (tokenizer, generation config, chat template,
# processor configs, ...): one list for what is downloaded and what is copied
CONFIG_FILES = ("config.json", "README.md")
# the largest file of each kind a repo may advertise (what the download would write to disk)
MAX_CONFIG_BYTES = 16 << 20  # config.json and the other small JSON files
MAX_SUPPORT_BYTES = 512 << 20  # tokenizer and processor files (the largest tokenizer.json are ~30 MB)
MAX_WEIGHT_FILE_BYTES = 256 << 30  # one safetensors / bin file
# weights may take at most this many bytes per parameter the config implies (float64 is 8; the
# estimate is rough, so with slack) and never less than the floor (tiny or unusual configs)
BYTES_PER_PARAM = 32
MIN_WEIGHT_BUDGET = 256 << 20


def check_file_name(name: str, at: str) -> None:
    """Refuse a file name that would land outside the download folder (``../x``, ``/x``, ``a\\b``)."""
    parts = PurePosixPath(name).parts
    if not name or name.startswith("/") or "\\" in name or "\x00" in name or any(p in ("..", ".") for p in parts):
        raise HubError(
            f"{at} lists a file named {name!r}, which points outside the repository; refusing to download "
            "anything from it (a malicious or broken repository)"
        )


def support_names(files: Sequence[str]) -> list[str]:
    """The files of a repo that a run reads or carries into its output besides the weights."""
    return [f for f in files if f in CONFIG_FILES or is_support_file(f)]


def _limit(name: str) -> tuple[int, str] | None:
    """(largest size, kind) for a file hf-rebasin may download, None for files it never fetches
    (sub-folders other than the named chat templates': ``onnx/``, ``original/``, ...). Any top-level safetensors or bin file may be a shard
    an index names, so each is bounded."""
    fetched = (*WEIGHT_PATTERNS, *PICKLE_PATTERNS, "adapter_config.json", "adapter_model.*")
    if not support_names([name]) and ("/" in name or not any(fnmatch.fnmatch(name, p) for p in fetched)):
        return None  # named chat templates are the one sub-folder a loader reads (`layout.CHAT_TEMPLATE_DIR`)
    base = name.rsplit("/", 1)[-1]
    if base.endswith(".jinja"):
        return MAX_CONFIG_BYTES, "chat template"
    if base.endswith((".safetensors", ".bin")):
        return MAX_WEIGHT_FILE_BYTES, "weights file"
    if base.endswith(".json") and not base.startswith("tokenizer"):
        return MAX_CONFIG_BYTES, "configuration file"
    return MAX_SUPPORT_BYTES, "tokenizer or processor file"


def _mb(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def check_file_sizes(sizes: Mapping[str, int | None], at: str) -> None:
    """Refuse a repo that advertises a file far larger than any of its kind (before downloading)."""
    for name, size in sizes.items():
        bound = _limit(name)
        if size is not None and bound is not None and size > bound[0]:
            raise HubError(
                f"{at} lists {name} at {_mb(size)}, more than any {bound[1]} needs ({_mb(bound[0])} at most); "
                "refusing to download it (a broken or malicious repository)"
            )


def estimate_parameters(config: Mapping[str, Any]) -> int | None:
    """A generous estimate of a transformer's parameter count from its config (None: cannot tell).

    Embeddings (vocabulary, positions; input and output) plus, per layer, attention (4 h²) and
    MLP (3 h × intermediate, times the experts of a mixture); nested sub-configs add up.
    """

    def num(*keys: str) -> int | None:
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    nested = [estimate_parameters(v) for v in config.values() if isinstance(v, Mapping) and "model_type" in v]
    hidden = num("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
    layers = num("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    own = None
    if hidden is not None and layers is not None:
        inter = num("intermediate_size", "n_inner", "ffn_dim", "d_ff", "hidden_dim", "encoder_ffn_dim") or 4 * hidden
        experts = num("num_local_experts", "num_experts", "n_routed_experts") or 1
        decoder = num("decoder_layers", "num_decoder_layers") or 0
        vocab = num("vocab_size") or 0
        positions = num("max_position_embeddings", "n_positions", "n_ctx") or 0
        per_layer = 4 * hidden * hidden + 3 * hidden * inter * experts + 16 * hidden
        own = (layers + decoder) * per_layer * 2 + 2 * (vocab + positions) * hidden
    known = [n for n in [own, *nested] if n is not None]
    return sum(known) if known else None


def check_weights_size(files: Mapping[str, int | None], config: Mapping[str, Any], at: str) -> None:
    """Refuse weights far larger than the parameters ``config`` implies (before downloading them).

    ``files``: the advertised sizes of the files the download fetches (`download_files`), not of
    every file of the repo: a repo may also hold copies in other formats that are never fetched."""
    params = estimate_parameters(config)
    if params is None:
        return
    total = sum(size or 0 for name, size in files.items() if name.endswith((".safetensors", ".bin")))
    budget = max(MIN_WEIGHT_BUDGET, BYTES_PER_PARAM * params)
    if total > budget:
        raise HubError(
            f"{at} lists {_mb(total)} of weights, while its config.json implies about {params:,} parameters "
            f"({_mb(budget)} at most); refusing to download them (a broken or malicious repository)"
        )


def weight_layout(
    repo: str, revision: str | None, files: Sequence[str], *, allow_pickle: bool, where: str
) -> tuple[list[str], str | None]:
    """What to download of ``repo``, known from its file list alone, as exact file names: the
    support files and the weights stock ``from_pretrained`` reads, plus the shard index among them
    (None: not sharded) whose shards `shard_names` adds once it is read.

    ``model.safetensors``, else ``model.safetensors.index.json``, else (only with ``allow_pickle``)
    ``pytorch_model.bin`` or its index; never ``consolidated*.safetensors``, other precisions
    (``model.fp16.safetensors``), sub-folders (``onnx/``) or pickles beside safetensors.
    A PEFT adapter: ``adapter_config.json`` and its weights.
    """
    at = f"{where}: " if where else ""
    shown = f"{repo!r}@{revision or 'main'}"
    card = ["README.md"] if "README.md" in files else []  # its licence, for the output's card
    if "config.json" not in files and "adapter_config.json" in files:  # a PEFT adapter
        if "adapter_model.safetensors" in files:
            return ["adapter_config.json", "adapter_model.safetensors", *card], None
        if "adapter_model.bin" in files:
            if not allow_pickle:
                raise PickleRefusedError(
                    f"{at}{shown} holds its adapter only as a pickle (adapter_model.bin), and "
                    "loading a pickle can run code; set `allow_pickle: true` in the recipe if you trust its author"
                )
            return ["adapter_config.json", "adapter_model.bin", *card], None
        raise ModelNotFoundError(f"{at}{shown} has adapter_config.json but no adapter weights")
    if "config.json" not in files:
        raise ModelNotFoundError(
            f"{at}{shown} has no config.json, so it is not a Transformers model "
            f"(files: {', '.join(sorted(files)[:10]) or 'none'})"
        )
    support = support_names(files)
    present = set(files)
    if SAFETENSORS in present:
        return [*support, SAFETENSORS], None
    if SAFETENSORS_INDEX in present:
        return [*support, SAFETENSORS_INDEX], SAFETENSORS_INDEX
    others = sorted(f for f in files if f.lower().endswith(_OTHER_WEIGHTS))
    if PICKLE in present or PICKLE_INDEX in present:
        pickle = PICKLE if PICKLE in present else PICKLE_INDEX
        if not allow_pickle:
            unread = [f for f in others if f.endswith(".safetensors")]
            besides = f"; its safetensors ({_listing(unread)}) are not what from_pretrained reads" if unread else ""
            raise PickleRefusedError(
                f"{at}{shown} holds only pickle weights ({pickle}{besides}), and loading a pickle can run "
                "code; set `allow_pickle: true` in the recipe (or --allow-pickle) if you trust its author"
            )
        return [*support, pickle], (PICKLE_INDEX if pickle == PICKLE_INDEX else None)
    found = f"it holds only {_listing(others)}, which from_pretrained does not read" if others else "it holds none"
    raise ModelNotFoundError(
        f"{at}{shown} has no weights that transformers loads: from_pretrained reads {SAFETENSORS} or "
        f"{SAFETENSORS_INDEX} with the shards it names (or, with `allow_pickle: true`, {PICKLE} or its index); {found}"
    )


def _listing(names: Sequence[str], most: int = 10) -> str:
    return ", ".join(names[:most]) + (f", … ({len(names)} in all)" if len(names) > most else "")


def shard_names(index: Path, name: str, files: Sequence[str], at: str, holder: str = "the repository") -> list[str]:
    """The shard files the shard index ``name`` (read from ``index``) names, sorted (`layout.index_shards`),
    each one that ``files`` (the listing of ``holder``: the repository, or its cached snapshot) hold."""
    shards = index_shards(Path(index), f"{at}: {name}")
    present = set(files)
    for shard in shards:
        if shard not in present:
            raise ModelNotFoundError(f"{at}: {name} names the shard {shard!r}, which {holder} does not hold")
    return shards


def download_files(
    repo: str,
    revision: str | None,
    files: Sequence[str],
    *,
    allow_pickle: bool,
    where: str,
    read_index: Callable[[str], Path],
    holder: str = "the repository",
) -> list[str]:
    """The exact files of ``repo`` to download (`weight_layout`, then the shards of its index, which
    ``read_index(name)`` gives as a local file: fetched from the Hub, or found in the cache);
    ``files`` lists what ``holder`` holds (the repository, or its cached snapshot)."""
    names, index = weight_layout(repo, revision, files, allow_pickle=allow_pickle, where=where)
    if index is None:
        return names
    at = f"{where}: {repo!r}@{revision or 'main'}"
    return [*names, *shard_names(read_index(index), index, files, at, holder)]
