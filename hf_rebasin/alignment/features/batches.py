"""Which of the alignment data counts: each process's share of the batches and, in a batch, the
positions whose features are kept (padding and special tokens dropped).

Shared by the activation statistics (`activations`, `lockstep`) and the lineage's data maps, so
that every reader of activations masks and splits the data the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def process_grid() -> tuple[int, int]:
    """(number of processes, this process's index) from accelerate's ``PartialState``.

    ``ACCELERATE_USE_CPU`` is honoured as ``Accelerator`` does (a bare ``PartialState()`` ignores
    it), so a CPU multi-process launch reduces over gloo instead of running P lone copies.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    return state.num_processes, state.process_index


def kept_positions(batch: Mapping[str, Any], special: Tensor | None, target: bool = False) -> Tensor | None:
    """The ``[batch, seq]`` positions whose features count: not padding (``attention_mask``) and,
    with ``special`` ids, not a special token; None when nothing is dropped (images). With
    ``target``, an encoder-decoder's decoder positions (``decoder_attention_mask``, else the labels
    that are scored)."""
    if target:
        mask, ids = batch.get("decoder_attention_mask"), batch.get("decoder_input_ids")
        labels = batch.get("labels")
        if not isinstance(mask, Tensor) and isinstance(labels, Tensor) and labels.dim() == 2:
            mask = labels != -100
    else:
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
    mask = mask.bool() if isinstance(mask, Tensor) else None
    if special is not None and isinstance(ids, Tensor):
        plain = ~torch.isin(ids, special.to(ids.device))
        mask = plain if mask is None else mask & plain
    return mask


@dataclass
class Batch:
    """One batch's mask of kept positions and its token count.

    ``tokens`` is None until known: text batches count kept tokens up front, image batches the rows
    of the first hooked activation. ``mask_on`` caches the mask per device (models may sit on
    different devices, or be split over several). An encoder-decoder's batch also has ``target``,
    the decoder's kept positions (its targets are of another length, with their own padding).
    """

    mask: Tensor | None
    tokens: int | None
    mask_on: dict[torch.device, Tensor] = field(default_factory=dict)
    target: Batch | None = None

    @classmethod
    def of(cls, batch: Mapping[str, Any], special: Tensor | None) -> Batch:
        target = None
        if isinstance(batch.get("decoder_input_ids"), Tensor):
            kept = kept_positions(batch, special, target=True)
            target = cls(kept, int(kept.sum()) if kept is not None else batch["decoder_input_ids"].numel())
        mask = kept_positions(batch, special)
        if mask is not None:
            return cls(mask, int(mask.sum()), target=target)
        ids = batch.get("input_ids")
        return cls(None, ids.numel() if isinstance(ids, Tensor) else None, target=target)

    def at(self, positions: str) -> Batch:
        """The positions a site reads: the sources' (this batch) or an encoder-decoder's targets'."""
        return self.target if positions == "target" and self.target is not None else self

    def count(self, x: Tensor) -> None:
        """Count the batch from the first hooked activation when it has no token ids."""
        if self.tokens is None:
            self.tokens = x.numel() // x.shape[-1]

    def features(self, t: Tensor, offset: int, size: int, copy: bool, groups: int = 1) -> Tensor:
        """Masked features ``[n_tok, size]`` of the last axis of ``t``; a fresh float32 copy when
        asked (A's features must outlive the forward and survive in-place ops). With ``groups``,
        the axis is that many blocks, each giving ``size / groups`` features from ``offset``."""
        if groups > 1:
            t = t.unflatten(-1, (groups, -1))[..., offset : offset + size // groups].flatten(-2)
        elif offset != 0 or size != t.shape[-1]:
            t = t[..., offset : offset + size]
        mask = self.mask
        if mask is not None and tuple(t.shape[:-1]) == tuple(mask.shape):
            return t[self._mask(t.device)].to(torch.float32)
        flat = t.reshape(-1, size)
        rows = self.rows(flat)
        if rows is not None:  # [batch·seq, d]: a MoE block flattens the stream before its router
            return flat[rows].to(torch.float32)
        return flat.to(torch.float32, copy=True) if copy else flat

    def _mask(self, device: torch.device) -> Tensor:
        assert self.mask is not None
        if device not in self.mask_on:
            self.mask_on[device] = self.mask.to(device)
        return self.mask_on[device]

    def rows(self, t: Tensor) -> Tensor | None:
        """The kept rows of a flattened ``[batch·seq, …]`` tensor; None when nothing is masked or
        the rows are not the batch's positions."""
        if self.mask is None or t.dim() < 1 or t.shape[0] != self.mask.numel() or self.mask.dim() < 2:
            return None
        return self._mask(t.device).reshape(-1)
