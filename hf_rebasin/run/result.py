"""What a run returns to its caller, and what a job hands to the pipeline to write."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..evaluate import Curve
from ..record import Findings

__all__ = ["JobOutput", "RunResult"]


@dataclass
class RunResult:
    """What a run produced: where, the curves and barriers, the preservation check and timings."""

    output: Path
    job: str
    strategy: str
    saved_model: bool
    barriers: dict[str, dict[str, float]] = field(default_factory=dict)
    curves: dict[str, Curve] = field(default_factory=dict)
    merged: dict[str, dict[str, Any]] = field(default_factory=dict)  # loss / metric of the merged model(s)
    function_preserved: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    transport: dict[str, Any] = field(default_factory=dict)  # job transport: alphas and scores
    pushed: Any = None  # hub.PushResult when output.push_to_hub succeeded
    push_error: str | None = None  # why the push failed (the local folder is complete)
    canonical: bool = False  # the merged model was saved in canonical form (norm scales folded)
    untied: list[str] = field(default_factory=list)  # tied tensors stored separately in the merged model
    universe: dict[str, Any] = field(default_factory=dict)  # merge.universe: rounds, change per round, reference


@dataclass
class JobOutput:
    """A finished job: its result, the files it writes into the output folder, its findings.

    The pipeline writes ``save``'s files (timed as ``save``), then ``rebasin.json`` and the card,
    then pushes: the same tail for every job."""

    result: RunResult
    save: Callable[[Path], None]  # writes the job's own files (model, plot, tables) into a folder
    findings: Findings
