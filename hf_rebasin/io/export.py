"""Saving a result's weights as a standard model folder, and carrying model A's other files.

What the folder may be, and how it is made safe to write (a temporary folder renamed into place,
locks, overwrite rules), is `output`'s part; this module fills the folder it is given.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hf_rebasin.core.lazy import LazyState, row_blocks
from hf_rebasin.core.names import DEFAULT_SHARD_SIZE
from hf_rebasin.io.gate import support_files
from hf_rebasin.io.offload import empty_model
from hf_rebasin.io.output import write_text
from hf_rebasin.io.rebuild import float32_tensors, output_config, rebuild
from hf_rebasin.io.renames import expert_pieces
from hf_rebasin.io.tensors import write_safetensors

if TYPE_CHECKING:
    from huggingface_hub import StateDictSplit
    from transformers import PreTrainedModel

__all__ = ["FUSED", "copy_support_files", "save_merged_model", "save_streamed"]


def copy_support_files(source: Path, dest: Path) -> list[str]:
    """Copy every support file of ``source`` (model A) into ``dest``, replacing what ``dest`` has
    (``save_pretrained`` writes its own generation_config.json; A's, with its eos ids and sampling
    defaults, is the one a user expects); their names."""
    copied: list[str] = []
    for name, real in support_files(source).items():
        target = Path(dest) / name
        target.parent.mkdir(exist_ok=True)  # a named chat template's folder
        if target.is_symlink() or target.exists():
            target.unlink()
        shutil.copyfile(real, target)  # the bytes that passed the gate (a snapshot's blob, not the link)
        copied.append(name)
    return copied


FUSED = "fused"  # an input whose experts are stored as the model's 3-D tensors (`LoadedModel.expert_layout`)


def _origins(model: PreTrainedModel, meta: Mapping[str, Tensor], saved: Mapping[str, Tensor]) -> dict[str, _Origin]:
    """For each tensor ``save_pretrained`` writes (``saved``, reverted from the meta tensors of
    ``meta``): the model tensor it comes from, and None when it is that tensor, else the part and
    expert of it that it is: transformers cuts a 3-D expert tensor into one tensor per expert and
    projection, which its loading stacks again (`renames.expert_pieces`, that loading followed)."""
    name_of = {id(t): n for n, t in meta.items()}
    pieces = expert_pieces(model, [k for k, t in saved.items() if id(t) not in name_of])
    out: dict[str, _Origin] = {}
    for key, t in saved.items():
        if id(t) in name_of:
            out[key] = (name_of[id(t)], None)
        elif key in pieces and pieces[key][0] in meta:
            name, part, parts, expert = pieces[key]
            out[key] = (name, (part, parts, expert))
        else:
            raise NotImplementedError(
                f"transformers saves {key!r} computed from the model's tensors in a way hf-rebasin does not "
                "follow while streaming; write this model without streaming"
            )
    return out


_Origin = tuple[str, tuple[int, int, int] | None]  # model tensor, (part, parts, expert) of it or None: all of it


def save_merged_model(
    template: PreTrainedModel,
    state_dict: Mapping[str, Tensor],
    dest: Path,
    *,
    untie: bool = False,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    progress: Callable[[int, int], None] | None = None,
    expert_layout: str | None = None,
    leave_out: Collection[str] = (),
) -> None:
    """``state_dict`` saved as a standard folder of ``template``'s class and config (safetensors).

    ``untie`` stores a tied LM head apart (canonical forms of orthogonal strategies); the folder
    still loads with the stock class, which reads ``tie_word_embeddings: false`` from the config.
    ``dtype`` casts every floating tensor for writing (the work is done in float32, but a bf16
    input should not come out twice its size); config.json's ``dtype`` then says so, and
    ``from_pretrained`` loads it in that dtype. None writes the tensors as they are. ``dtypes``:
    floating tensors written in a dtype of their own (a checkpoint's float32 norms beside bf16
    matrices keep theirs), by model name. ``expert_layout``: how a mixture of experts' experts are
    written: ``fused`` as the model holds them (``mlp.experts.gate_up_proj`` [E, 2f, d]), else one
    tensor per expert and projection as ``save_pretrained`` writes them (the layout of the input,
    `LoadedModel.expert_layout`). A `LazyState` is written tensor by tensor (`save_streamed`),
    with ``progress(tensors written, total)``. ``leave_out``: tensors not written, which loading
    initialises (no input held them: `merging.initialised`).
    """
    if isinstance(state_dict, LazyState):
        if leave_out:  # pragma: no cover - a model whose files lack a tensor is loaded whole, never streamed
            raise ValueError("a streamed state cannot leave tensors out")
        save_streamed(
            template,
            state_dict,
            dest,
            untie=untie,
            max_shard_size=max_shard_size,
            dtype=dtype,
            dtypes=dtypes,
            progress=progress,
            expert_layout=expert_layout,
        )
        return
    model = rebuild(template, dict(state_dict), untie=untie)  # rebuilt on the CPU
    cast: set[int] = set()  # a tied tensor is one object under two names: cast once, from float32
    fp32 = _float32_by_dtype(model)  # T5's wo in a float16 output: from_pretrained keeps them in float32
    for name, tensor in model.state_dict(keep_vars=True).items():
        target = (dtypes or {}).get(name) or dtype
        target = _kept_float32(name, target, fp32) if target is not None else None
        if target is not None and tensor.is_floating_point() and id(tensor) not in cast:
            tensor.data = tensor.data.to(target)
            cast.add(id(tensor))
    kept = {k: v for k, v in model.state_dict().items() if k not in leave_out} if leave_out else None
    model.save_pretrained(  # safetensors, sharded past the size
        str(dest), max_shard_size=max_shard_size, save_original_format=expert_layout != FUSED, state_dict=kept
    )


def save_streamed(
    template: PreTrainedModel,
    state: LazyState,
    dest: Path,
    *,
    untie: bool = False,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    progress: Callable[[int, int], None] | None = None,
    expert_layout: str | None = None,
) -> None:
    """The folder `save_pretrained` would write for ``state`` in ``template``'s class, with each
    tensor computed from ``state`` just before it is written: the same names (tied copies left
    out, renamed as transformers saves them), shards, index, config and generation config, while
    memory holds one tensor at a time. A mixture of experts' 3-D expert tensors are written one
    tensor per expert and projection, as `save_pretrained` writes them, each 3-D tensor computed
    once for all of its experts (the one tensor then held); or as they are with ``expert_layout``
    ``fused`` (`save_merged_model`)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    config = output_config(template, untie)
    model = empty_model(type(template), config)  # which names the output ties, and how it saves them
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})  # stored once, under the name it is tied to
    fp32 = _float32_by_dtype(model)  # T5's wo in a float16 output: from_pretrained keeps them in float32
    saved, origin = _saved_tensors(model, state, tied, dtype, dtypes, expert_layout, fp32)
    split = split_torch_state_dict_into_shards(saved, max_shard_size=max_shard_size)
    _write_shards(Path(dest), state, saved, origin, split, progress)
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": sum(p.numel() for n, p in model.named_parameters() if n not in tied)}
            | split.metadata,
            "weight_map": {n: file for file, names in split.filename_to_tensors.items() for n in names},
        }
        write_text(Path(dest) / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.dtype = str(dtype or torch.float32).split(".")[1]
    config.architectures = [type(template).__name__]
    config.save_pretrained(str(dest))
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(str(dest))


def _float32_by_dtype(model: PreTrainedModel) -> dict[torch.dtype, set[str]]:
    return {dtype: float32_tensors(model, dtype) for dtype in (torch.float16, torch.bfloat16)}


def _kept_float32(name: str, target: torch.dtype, fp32: Mapping[torch.dtype, Collection[str]]) -> torch.dtype:
    """``target``, or float32 for a tensor that `from_pretrained` keeps in float32 when it loads the
    class in ``target`` (``fp32``: those names per half-precision dtype)."""
    return torch.float32 if name in fp32.get(target, ()) else target


def _saved_tensors(
    model: PreTrainedModel,
    state: LazyState,
    tied: set[str],
    dtype: torch.dtype | None,
    dtypes: Mapping[str, torch.dtype] | None,
    expert_layout: str | None,
    fp32: Mapping[torch.dtype, Collection[str]] | None = None,
) -> tuple[dict[str, Tensor], dict[str, _Origin]]:
    """The tensors `save_pretrained` would write for ``model`` (meta tensors of their shapes and
    written dtypes), each with its origin, ordered so that the pieces cut from one model tensor
    follow one another: the shards are planned from them before any tensor is computed."""
    from transformers.core_model_loading import revert_weight_conversion

    def written(name: str) -> torch.dtype:
        stored = state.dtype(name)
        if not stored.is_floating_point:
            return stored
        return _kept_float32(name, (dtypes or {}).get(name) or dtype or stored, fp32 or {})

    meta = {n: torch.empty(t.shape, dtype=written(n), device="meta") for n, t in model.state_dict().items()}
    kept = {n: t for n, t in meta.items() if n not in tied}
    saved = kept if expert_layout == FUSED else revert_weight_conversion(model, kept)
    origin = _origins(model, meta, saved)
    first: dict[str, int] = {}  # the tensors cut from one model tensor, one after the other: each computed once
    for n in saved:
        first.setdefault(origin[n][0], len(first))
    return dict(sorted(saved.items(), key=lambda kv: first[origin[kv[0]][0]])), origin


def _write_shards(
    dest: Path,
    state: LazyState,
    saved: Mapping[str, Tensor],
    origin: Mapping[str, _Origin],
    split: StateDictSplit,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Each shard of ``split`` written tensor by tensor, each computed from ``state`` just before it
    is written, so that memory holds one model tensor at a time (a large embedding in blocks of rows)."""

    def rows_of(name: str) -> Iterator[torch.Tensor]:  # a large embedding in blocks of rows, each cast and written
        for (block,) in row_blocks([state], name):
            yield block

    held: dict[str, Tensor] = {}  # the model tensor the last written piece was cut from

    def produce(saved_name: str) -> Tensor | Iterator[Tensor]:
        name, view = origin[saved_name]
        if view is None:
            held.clear()
            return rows_of(name)
        if name not in held:
            held.clear()
            held[name] = state[name].contiguous()
        part, parts, expert = view
        rows = held[name].shape[1] // parts
        return held[name][expert, part * rows : (part + 1) * rows]

    count, total = 0, len(saved)

    def tick(_name: str) -> None:
        nonlocal count
        count += 1
        if progress is not None:
            progress(count, total)

    for file, names in split.filename_to_tensors.items():
        entries = [(n, tuple(saved[n].shape), saved[n].dtype) for n in names]
        write_safetensors(dest / file, entries, produce, done=tick)
    held.clear()
