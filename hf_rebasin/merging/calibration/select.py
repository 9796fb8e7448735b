"""The point of a fit that is kept: for a chat model, the one whose greedy replies end most often.

Teacher-forced, a calibrated chat model ends its turns as the fine-tune does at every point of the
fit; run freely, a small difference in the fitted weights decides whether a reply loops until the
token limit. Along one fit the share of replies that end swings (19 → 84 → 16 % at steps 100,
150 and 200 of one small model's fit), and which point does best moves from one calibration seed to
the next. So the fit is judged at every eighth of its budget (``AT``, and its end) on held-out user
turns that the record does not report, and the best point's fitted numbers are put back: the most
replies ended, then the later point. Judging reads no random numbers, so the fit's own course is
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.merging.calibration.distill import replies_ended
from hf_rebasin.merging.calibration.fit import Fitted

__all__ = ["AT", "BestPoint"]

AT = tuple(k / 8 for k in range(1, 8))  # shares of the budget at which the fit is judged, besides its end


@dataclass
class BestPoint:
    """The best point seen so far of ``fitted``'s fit of ``student``, judged on ``prompts``."""

    student: Any
    fitted: Fitted
    prompts: list[list[int]]
    end: int
    tokens: int
    steps: int
    best: tuple[float, int] | None = None  # (replies ended, step)
    saved: list[Tensor] = field(default_factory=list)
    seen: dict[int, float] = field(default_factory=dict)  # step -> replies ended

    @property
    def judged_at(self) -> set[int]:
        return {max(1, round(share * self.steps)) for share in AT} | {self.steps}

    def progress(self, step: int) -> None:
        """Judge the fit after ``step`` where that is one of the points (the student is training)."""
        if step in self.judged_at and step < self.steps:
            self.student.eval()
            self._judge(step)
            self.student.train()

    def finish(self) -> int:
        """Judge the end, put the best point's numbers back; the step kept."""
        self._judge(self.steps)
        assert self.best is not None
        if self.best[1] != self.steps:
            with torch.no_grad():
                for p, value in zip(self.fitted.params, self.saved, strict=True):
                    p.copy_(value)
        return self.best[1]

    def _judge(self, step: int) -> None:
        replies = replies_ended(self.student, self.prompts, self.end, self.tokens)
        assert replies is not None  # there are prompts
        self.seen[step] = replies
        if self.best is None or (replies, step) > self.best:
            self.best = (replies, step)
            if step != self.steps:  # the end needs no copy: it is what the student holds
                self.saved = [p.detach().clone() for p in self.fitted.params]
