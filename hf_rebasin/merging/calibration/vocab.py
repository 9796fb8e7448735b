"""Tokens in a run's common rows. Where vocabularies differ, a run loads every model into one
layout of working rows (a token at the same row in each); a row a model has no token for holds a
filler. Calibration text is written in those rows; a model's distribution is read only over the
rows it has tokens for, and a model's own ids (its tokenizer's) are brought to the working rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Rows"]


@dataclass(frozen=True)
class Rows:
    """A model's rows in the working layout: ``columns`` are the working rows it has tokens for
    (None: every row), ``working[i]`` is the working row of its own id ``i`` (None: the same ids)."""

    columns: Tensor | None = None
    working: Tensor | None = None

    @classmethod
    def of(cls, sources: Sequence[int] | None) -> Rows:
        """From the layout's ``sources`` of one model (its own row per working row, -1: none)."""
        if sources is None:
            return cls()
        own = torch.tensor(list(sources), dtype=torch.long)
        columns = torch.nonzero(own >= 0).squeeze(-1)
        working = torch.zeros(int(own.max()) + 1 if len(own) else 0, dtype=torch.long)
        working[own[columns]] = columns
        return cls(columns, working)

    def read(self, logits: Tensor) -> Tensor:
        """``logits`` over the rows this model has tokens for."""
        return logits if self.columns is None else logits[..., self.columns.to(logits.device)]

    def mask(self, logits: Tensor) -> Tensor:
        """``logits`` with the rows this model lacks at -inf (nothing is sampled there)."""
        if self.columns is None:
            return logits
        out = torch.full_like(logits, float("-inf"))
        cols = self.columns.to(logits.device)
        out[..., cols] = logits[..., cols]
        return out

    def ids(self, own: Sequence[int]) -> list[int]:
        """The model's own ids as working rows."""
        return list(own) if self.working is None else [int(self.working[i]) for i in own]
