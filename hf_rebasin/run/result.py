"""What a run returns to its caller, and what a job hands to the pipeline to write."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_rebasin.evaluation.evaluate import Curve
from hf_rebasin.evaluation.record import Findings
from hf_rebasin.evaluation.scores import Preservation, Score, Transport, Universe

__all__ = ["JobOutput", "RunResult"]


@dataclass
class RunResult:
    """What a run produced: where, the job's findings (what ``rebasin.json`` records), the curves
    as objects, timings, notes and the push. The job's numbers are read from ``findings``, never
    kept twice."""

    output: Path
    job: str
    saved_model: bool
    findings: Findings
    written: str  # what the folder holds, in words ("merged model and report")
    curves: dict[str, Curve] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    pushed: Any = None  # hub.push.PushResult when output.push_to_hub succeeded
    push_error: str | None = None  # why the push failed (the local folder is complete)

    @property
    def strategy(self) -> str:
        return self.findings.strategy

    @property
    def barriers(self) -> dict[str, dict[str, Any]]:
        return self.findings.barrier

    @property
    def merged(self) -> dict[str, Score]:
        """Loss / metric of the merged model(s)."""
        return self.findings.merged

    @property
    def function_preserved(self) -> Preservation | None:
        return self.findings.function_preserved

    @property
    def transport(self) -> Transport | None:
        """job transport: alphas and scores."""
        return self.findings.transport

    @property
    def universe(self) -> Universe | None:
        """merge.universe: rounds, change per round, reference."""
        return self.findings.universe

    @property
    def canonical(self) -> bool:
        """The saved model is in canonical form (norm scales folded); false when no model is saved."""
        return self.saved_model and self.findings.canonical

    @property
    def untied(self) -> list[str]:
        """Tied tensors stored separately in the saved model."""
        return self.findings.untied if self.saved_model else []


@dataclass
class JobOutput:
    """A finished job: its result (with its findings) and the files it writes into the output folder.

    The pipeline writes ``save``'s files (timed as ``save``), then ``rebasin.json`` and the card,
    then pushes: the same tail for every job."""

    result: RunResult
    save: Callable[[Path], None]  # writes the job's own files (model, plot, tables) into a folder
