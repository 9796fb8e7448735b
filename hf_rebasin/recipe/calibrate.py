"""A transport's ``calibrate`` section: after the weights move, the fine-tune teaches the moved
model by distillation (``hf_rebasin.merging.calibration``). On by default; ``calibrate: false``
gives the data-free transport."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from hf_rebasin.recipe.common import Section, quoted
from hf_rebasin.recipe.data import MAX_BLOCK_SIZE, DataSpec

__all__ = ["Calibrate", "calibrate_schema", "parse_calibrate"]

MAX_STEPS = 10**7
MAX_SAMPLES = 10**7
MAX_RANK = 1 << 16
MAX_BATCH = 1 << 16
MAX_SEED = 2**32 - 1
MAX_HELD_OUT = 256  # held-out sequences measured before and after: enough for a rate, cheap to score
STEPS = 400  # the default budget of a full model's correction
ADAPTER_STEPS = 800  # of an adapter's own factors: at 400 steps half as many of its greedy replies end


class Calibrate(Section):
    """Distillation from the fine-tune after transport: what is fitted, on which text, for how long."""

    fit: Literal["rows", "norms", "low-rank", "full"] = Field(
        "low-rank",
        description="what is fitted, each containing the one before: `rows` (the rows of tokens the target "
        "lacks), `norms` (and every norm and bias), `low-rank` (and a rank-`rank` correction of every linear "
        "layer, folded into the weights), `full` (every parameter). A LoRA adapter fits its own factors",
    )
    rank: int = Field(8, ge=1, le=MAX_RANK, strict=True, description="rank of the low-rank correction")
    steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        strict=True,
        description=f"optimizer steps (the budget); default {STEPS}, or {ADAPTER_STEPS} for a LoRA adapter, whose "
        "few factors need more steps to end its chat turns",
    )
    batch_size: int = Field(16, ge=1, le=MAX_BATCH, strict=True, description="sequences per step")
    learning_rate: float = Field(
        2e-3, gt=0, le=1, strict=True, allow_inf_nan=False, description="AdamW's rate (warm-up, then cosine)"
    )
    guard: float = Field(
        1.0,
        ge=0,
        le=100,
        strict=True,
        allow_inf_nan=False,
        description="weight of KL(target ‖ moved) on text the target writes itself: what keeps the moved "
        "model from forgetting the target's own knowledge (0: off)",
    )
    on_policy: float = Field(
        0.5,
        ge=0,
        le=1,
        strict=True,
        allow_inf_nan=False,
        description="share of each batch the moved model writes itself (a prefix of the calibration text "
        "continued greedily; for a chat model, a reply after a user turn) for the fine-tune to correct: where its "
        "own text goes, a loop or a turn never ended",
    )
    divergence: Literal["forward", "reverse", "symmetric"] = Field(
        "forward",
        description="what is minimized against the fine-tune: `forward` KL(fine-tune ‖ moved), which covers all "
        "it says; `reverse` KL(moved ‖ fine-tune), which seeks its most likely tokens; `symmetric`, their mean",
    )
    data: DataSpec | None = Field(
        None,
        description="calibration text (read with the fine-tune's tokenizer); default: the recipe's `data`, "
        "else text the fine-tune writes itself (through its chat template where it has one). An encoder-decoder "
        "(T5, BART, ...) needs one of the two: its sources (source → target pairs, or plain text noised as the "
        "model was pretrained), from which the fine-tune writes the continuations it is calibrated on",
    )
    samples: int = Field(
        1024,
        ge=2,
        le=MAX_SAMPLES,
        strict=True,
        description="sequences of calibration text (written, or read from `data`), and of the target's own",
    )
    block_size: int | None = Field(
        None,
        ge=8,
        le=MAX_BLOCK_SIZE,
        strict=True,
        description="tokens per sequence; default 128, or the model's context when shorter",
    )
    held_out: float = Field(
        0.125,
        gt=0,
        lt=1,
        strict=True,
        allow_inf_nan=False,
        description="share of the sequences kept out of the fitting (at least 1, at most 256), on which the KL to "
        "the fine-tune and the turn-end rate are measured before and after",
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, strict=True, description="seed of the written text and the batches")

    @property
    def held(self) -> int:
        """The held-out sequences: ``held_out`` of ``samples``, at least 1 and 256 at most, one left to fit on."""
        return min(self.samples - 1, max(1, min(MAX_HELD_OUT, round(self.held_out * self.samples))))

    def budget(self, adapter: bool) -> int:
        """The steps to fit for: the recipe's, else the default of a full model or of an adapter."""
        return self.steps if self.steps is not None else ADAPTER_STEPS if adapter else STEPS

    def describe(self) -> str:
        """One line for the dry run and the card."""
        parts = {"rows": "new tokens' rows", "norms": "norms, biases and new rows", "full": "every parameter"}
        what = parts.get(self.fit, f"a rank-{self.rank} correction of every linear layer, norms, biases and new rows")
        text = "its `data`" if self.data is not None else "the recipe's data, else text the fine-tune writes"
        guard = f"guard {self.guard:g} (text the target writes)" if self.guard else "no guard"
        block = self.block_size or 128
        tokens = self.budget(False) * self.batch_size * block * (2 if self.guard else 1)
        steps = f"{STEPS} steps ({ADAPTER_STEPS} for a LoRA adapter)" if self.steps is None else f"{self.steps} steps"
        return (
            f"{what}; {steps} of {self.batch_size} sequences, learning rate {self.learning_rate:g} "
            f"({tokens:,} tokens through the moved model at {'up to ' if self.block_size is None else ''}{block} a "
            f"sequence{', half of them the guard' if self.guard else ''}); {self.samples} sequences "
            f"({self.held} held out) of {text}; {guard}; seed {self.seed}"
        )


def parse_calibrate(value: Any) -> Any:
    """``true``/empty → the defaults, ``false`` → off, a mapping → its settings."""
    if value is True or value is None:
        return {}
    if value is False:
        return None
    if isinstance(value, (Mapping, Calibrate)):
        return value
    raise PydanticCustomError(
        "recipe",
        "must be true, false, or a mapping with `fit`, `steps`, `data`, ... ; given {given}",
        {"given": quoted(value)},
    )


def calibrate_schema(schema: JsonDict) -> None:
    """`calibrate: false` in editors too (the validator turns `true` into the defaults)."""
    given = schema.get("anyOf")
    schema["anyOf"] = [{"type": "boolean"}, *(given if isinstance(given, list) else [])]
