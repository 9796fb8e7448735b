"""Every strategy's options and registry entry: what a recipe validates before anything is loaded.

Torch-free on purpose. A recipe's ``strategy:`` section, its JSON Schema, ``--dry-run`` and the
model card need each strategy's options model, its paper and whether its options need data or
preserve B's function, none of which needs tensors. The work itself (``run``) lives in one module
per strategy (``vanilla``, ``head_perm``, ...), named by the entry's ``module`` and imported only
when the strategy runs. Each of those modules re-exports its options from here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import Options, Strategy

__all__ = [
    "GENERALIZED_ORTHOGONAL",
    "HEAD_PERM",
    "LEARNED_ONLY",
    "TRANSFUSION",
    "VANILLA",
    "WEIGHT_MATCHING",
    "Component",
    "GeneralizedOrthogonalOptions",
    "HeadPermOptions",
    "Heads",
    "Residual",
    "TransfusionOptions",
    "VanillaOptions",
    "WeightMatchingOptions",
    "head_perm_exact",
]

# ---------------------------------------------------------------------------------------------
# vanilla


class VanillaOptions(Options):
    pass


VANILLA = Strategy(
    name="vanilla",
    paper="no alignment (plain weight averaging)",
    options=VanillaOptions,
    module="vanilla",
    summary="identity transform: interpolate the weights as they are",
)

# ---------------------------------------------------------------------------------------------
# weight-matching


class _PassOptions(Options):
    """Options of the strategies that sweep every space in a random order until nothing changes."""

    max_iter: int = Field(100, ge=1, description="passes over all spaces at most")
    seed: int = Field(0, description="seed of the random visiting order")


class WeightMatchingOptions(_PassOptions):
    pass


WEIGHT_MATCHING = Strategy(
    name="weight-matching",
    paper="Ainsworth, Hayase & Srinivasa, Git Re-Basin: Merging Models modulo Permutation Symmetries (ICLR 2023)",
    options=WeightMatchingOptions,
    module="weight_matching",
    summary="data-free: permutations of units, heads and the residual stream maximizing weight similarity",
)

# ---------------------------------------------------------------------------------------------
# transfusion


class TransfusionOptions(_PassOptions):
    pass


TRANSFUSION = Strategy(
    name="transfusion",
    paper="Rinaldi et al., Update Your Transformer to the Latest Release: Re-Basin of Task Vectors (ICML 2025)",
    options=TransfusionOptions,
    module="transfusion",
    summary="data-free: heads paired by singular-value spectra, then permutations inside heads and of units",
)

# ---------------------------------------------------------------------------------------------
# head-perm

Heads = Literal["head-perm", "monotonic", "ignore-heads", "vanilla-attention"]
Residual = Literal["identity", "first", "last", "all", "separate"]
Component = Literal["ff", "attn", "residual"]


class HeadPermOptions(Options):
    heads: Heads = Field("head-perm", description="how attention heads are matched")
    residual: Residual = Field("identity", description="which residual features give the residual permutation")
    components: tuple[Component, ...] = Field(("ff", "attn", "residual"), description="which spaces to align")
    special_tokens: bool = Field(True, description="count special tokens ([CLS], [SEP], padding ids) in the statistics")

    @field_validator("components")
    @classmethod
    def _no_duplicates(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v) or not v:
            raise ValueError("list each of ff, attn, residual at most once, and at least one")
        return v


def head_perm_exact(options: HeadPermOptions) -> bool:
    """Whether head-perm with ``options`` preserves B's function (``ignore-heads`` and a separate
    residual alignment do not: they are there for experiments, and reports flag them)."""
    return options.heads != "ignore-heads" and not (options.residual == "separate" and "residual" in options.components)


HEAD_PERM = Strategy(
    name="head-perm",
    paper="Verma & Elbayad, Merging Text Transformer Models from Different Initializations (TMLR 2024)",
    options=HeadPermOptions,
    module="head_perm",
    needs_data=lambda _o: True,
    exact=head_perm_exact,
    summary="activation matching: correlation of features on alignment data, heads permuted as units",
)

# ---------------------------------------------------------------------------------------------
# generalized-orthogonal

LEARNED_ONLY = ("steps", "lr", "sinkhorn", "temperature")  # options that only apply with `learned: true`


class GeneralizedOrthogonalOptions(Options):
    iterations: int = Field(10, ge=1, description="alternating rounds at most (stops early when stable)")
    learned: bool = Field(False, description="refine on the loss of the interpolated model (needs data)")
    steps: int = Field(200, ge=1, description="learned: optimisation steps")
    lr: float = Field(1e-2, gt=0, description="learned: Adam learning rate")
    sinkhorn: bool = Field(False, description="learned: soft (Sinkhorn) permutations during optimisation")
    temperature: float = Field(0.05, gt=0, description="learned + sinkhorn: temperature of the soft permutations")
    seed: int = Field(0, description="seed of the permutation stage's visiting order and of learned λ samples")

    @model_validator(mode="after")
    def _learned_options_need_learned(self) -> GeneralizedOrthogonalOptions:
        stray = [k for k in LEARNED_ONLY if k in self.model_fields_set]
        if stray and not self.learned:
            raise ValueError(f"{', '.join(stray)} only apply with `learned: true`")
        return self


GENERALIZED_ORTHOGONAL = Strategy(
    name="generalized-orthogonal",
    paper="Theus et al., Generalized Linear Mode Connectivity for Transformers (2025)",
    options=GeneralizedOrthogonalOptions,
    module="generalized_orthogonal",
    needs_data=lambda o: bool(o.learned),
    summary="data-free: orthogonal residual map (canonical form), heads by QK/OV circuits, units by LAP",
)
