"""The job's score blocks of ``rebasin.json``, typed: ``function_preserved`` (`Preservation`),
``merged`` and a universe merge's reference (`Score`), ``universe`` (`Universe`) and ``transport``
(`Transport`, with its `Scores`, `Tradeoff`, `Choice` and `AdapterSummary`).

Producers build them, `record.Findings` holds them, the card reads their attributes. Each block
is complete when built (frozen) and keeps, read back, the keys this version does not know (a newer
version's, or those that vary with the options, such as metrics). A number that was not finite is
written as null and reads back as None (`Num`).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import ConfigDict, Field

from hf_rebasin.core.lenient import Num, Part

__all__ = [
    "AdapterSummary",
    "Block",
    "Calibration",
    "Choice",
    "GainCost",
    "Measured",
    "PerModel",
    "Preservation",
    "Score",
    "Scores",
    "Tradeoff",
    "Transport",
    "Universe",
    "WrittenGap",
]

T = TypeVar("T")


class Block(Part):
    """A score block: complete when built (frozen); unknown keys are kept."""

    model_config = ConfigDict(extra="allow", frozen=True)


class WrittenGap(Block):
    """max |Δ logits| of one model as written against the model as given, and its bound."""

    max_abs_diff: Num = None
    tolerance: Num = None


class Preservation(Block):
    """``function_preserved``: the worst max |Δ logits| between the models and their aligned forms
    on ``inputs``, within ``tolerance``; or, not measured (``max_abs_diff`` null), the ``reason``.
    job align: ``written``, each model as written (A, B, ...) against itself as given."""

    _omit_none = frozenset({"tolerance", "inputs", "reason", "written"})

    max_abs_diff: Num = None
    tolerance: Num = None
    inputs: str | None = None  # "evaluation or alignment data" | "random example inputs"
    reason: str | None = None
    written: dict[str, WrittenGap] | None = None


class Score(Block):
    """A model's loss (nats) and metrics on the evaluation data, over ``count`` predictions."""

    _omit_none = frozenset({"count"})

    loss: Num = None
    metric: dict[str, Any] = Field(default_factory=dict)
    count: int | None = None


class Universe(Block):
    """``universe`` (``merge.universe``): rounds run, the mean's relative change per round, the
    models' spread around it (``spread[0]``: the reference merge), per round the models whose
    previous map was kept, and the reference merge's score (every model aligned to A only)."""

    _omit_none = frozenset({"reference"})

    rounds: int = 0
    change: list[Num] = Field(default_factory=list)
    spread: list[Num] = Field(default_factory=list)
    kept: list[int] = Field(default_factory=list)
    converged: bool = False
    reference: Score | None = None


class PerModel(Block, Generic[T]):
    """One value per model of a transport (a loss, or a metric mapping): target B, old base A,
    fine-tune A_ft, then B + α·π(τ) and (``compare: [vanilla]``) B + α·τ per α. Without the
    target, the fine-tune or the transported values, a block read back is damaged: read as none."""

    _omit_none = frozenset({"base", "naive"})

    target: T
    base: T | None = None  # recorded since the trade-off
    finetuned: T
    transported: list[T]
    naive: list[T] | None = None


class Scores(Block):
    """Loss and metrics of every model of a transport on one data set."""

    _omit_none = frozenset({"loss", "metric"})

    loss: PerModel[Num] | None = None
    metric: PerModel[dict[str, Any]] | None = None


class GainCost(Block, Generic[T]):
    """Task gain and support cost, in nats (one per α, or the fine-tune's own over its base)."""

    gain: T
    cost: T


class Tradeoff(Block):
    """``transport.tradeoff`` (`report.tradeoff`): gain against cost per α and method, and the
    fine-tune's own point."""

    _omit_none = frozenset({"naive", "transported", "finetuned"})

    alphas: list[float] = Field(default_factory=list)
    naive: GainCost[list[Num]] | None = None
    transported: GainCost[list[Num]] | None = None
    finetuned: GainCost[Num] | None = None


class Choice(Block):
    """The α `alpha: auto` saved (``transport.chosen``): which, by what rule ("no-cost", "ratio",
    "budget" or "fallback"), its task gain and support cost over B, and why, in words."""

    alpha: float  # a ``chosen`` without it is damaged: read as none
    index: int | None = None  # in the grid
    rule: str = ""
    gain: Num = None
    cost: Num = None
    reason: str = ""
    support_budget: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """``rebasin.json``'s ``transport.chosen``."""
        return self.to_json()


class AdapterSummary(Block):
    """``transport.adapter``: the LoRA adapter moved (the card's "What moved", library peft). An
    adapter trained with new tokens also holds the output's embedding and LM head whole
    (``modules_to_save``, with ``embedding_rows`` rows: the target is resized to them to load it)."""

    _omit_none = frozenset({"modules_to_save", "embedding_rows", "trainable_tokens"})

    peft_type: str | None = None
    modules: int | None = None
    rank: int | list[int] | None = None
    lora_alpha: int | float | None = None
    target_modules: list[str] | str | None = None
    full_tensors: list[str] = Field(default_factory=list)  # stored whole: target + π(saved − base)
    canonical: bool = False  # the factors took the norm scales (generalized-orthogonal)
    whole_biases: list[str] = Field(default_factory=list)  # biases that carry a folded β's shift
    modules_to_save: list[str] | None = None  # written whole with the output's vocabulary rows
    embedding_rows: int | None = None  # their rows: what the target is resized to before the adapter loads
    trainable_tokens: bool | None = None  # the adapter trained token rows: written back as modules_to_save


class Measured(Block):
    """One measure of a calibration: the fine-tune's own value (``teacher``), the moved model's
    before fitting and after."""

    teacher: Num = None
    before: Num = None
    after: Num = None


class Calibration(Block):
    """``transport.calibration``: what was fitted (``fit``, ``fitted`` numbers, ``rank``), on which
    text (``text``: its ``source``, ``sequences``, ``tokens`` and ``opening``), how long (``steps``,
    ``seconds``), and the measures on held-out text: ``kl`` (KL to the fine-tune per token),
    ``turn_end`` (its turn-end token top-1 where a turn ends) and ``replies`` (greedy replies that end
    their turn), the last two where the fine-tune has a chat template; for a chat model also the
    points of the fit that were judged (``judged``) and the one written (``kept_step``)."""

    _omit_none = frozenset({"turn_end", "replies", "rank", "adapter", "judged", "kept_step"})

    fit: str = ""
    fitted: int | None = None
    rank: int | None = None
    steps: int | None = None
    guard: float | None = None
    seconds: Num = None
    text: dict[str, Any] = Field(default_factory=dict)
    kl: Measured | None = None
    turn_end: Measured | None = None
    replies: Measured | None = None
    adapter: bool | None = None  # the factors of a LoRA adapter were fitted
    kept: bool = True  # False: the fit raised the held-out KL, and the transported weights were written
    judged: list[tuple[int, float]] | None = None  # chat: (step, share of judging replies that end) per point
    kept_step: int | None = None  # chat: the point of the fit written (`merging.calibration.select`)


class Transport(Scores):
    """``transport`` (job transport): the α grid; with ``evaluate``, the scores on the task data
    (``loss``, ``metric``), on the support data and their trade-off; the tensors only the
    fine-tune has (carried whole), the α ``alpha: auto`` chose, and a LoRA adapter's summary."""

    _omit_none = Scores._omit_none | {"support", "tradeoff", "carried", "chosen", "adapter", "calibration"}

    alphas: list[float] = Field(default_factory=list)
    support: Scores | None = None
    tradeoff: Tradeoff | None = None
    carried: list[str] | None = None
    chosen: Choice | None = None
    adapter: AdapterSummary | None = None
    calibration: Calibration | None = None
