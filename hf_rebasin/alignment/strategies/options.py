"""Every strategy's options and registry entry: what a recipe validates before anything is loaded.

Torch-free on purpose. A recipe's ``strategy:`` section, its JSON Schema, ``--dry-run`` and the
model card need each strategy's options model, its paper and whether its options need data or
preserve B's function, none of which needs tensors. The work itself (``run``) lives in one module
per strategy (``vanilla``, ``head_perm``, ...), named by the entry's ``module`` and imported only
when the strategy runs. Each of those modules re-exports its options from here.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from hf_rebasin.alignment.strategies.base import MemoryProfile, ModelShape, Options, Strategy

__all__ = [
    "GENERALIZED_ORTHOGONAL",
    "HEAD_PERM",
    "LEARNED_ONLY",
    "MAX_BUDGET",
    "MAX_PASSES",
    "MAX_SEED",
    "MAX_STEPS",
    "TRANSFUSION",
    "VANILLA",
    "WEIGHT_MATCHING",
    "WIDE_SAMPLER",
    "Component",
    "GeneralizedOrthogonalOptions",
    "HeadPermOptions",
    "Heads",
    "Residual",
    "TransfusionOptions",
    "VanillaOptions",
    "WeightMatchingOptions",
    "head_perm_exact",
    "head_perm_statistics",
    "parse_sampler",
    "residual_maps_exact",
    "residual_moment_bytes",
    "sampler_for",
    "unset_residual",
]

# Bounds of every numeric option, checked when a recipe or `--set` is read (strict types: no "64",
# no `true`). Generous: each is far past any run that ends in a day, and none allocates anything.
MAX_SEED = 2**32 - 1  # numpy's seeds end here (torch's at 2**64 - 1)
MAX_PASSES = 10_000  # sweeps or rounds over all spaces: they stop when nothing changes, in tens
MAX_STEPS = 10_000_000  # learned matching's optimisation steps (default 200)
MAX_BUDGET = 10**12  # learned matching's tokens or examples: a trillion, a pretraining run's worth

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
    identity=True,
    memory=MemoryProfile(assignment=False),
)

# ---------------------------------------------------------------------------------------------
# weight-matching


ResidualMaps = Literal["global", "per-sublayer"]
RESIDUAL_MAPS_HELP = (
    "`per-sublayer`: one residual map per stream between sublayers (TransFusion); it moves a task "
    "vector only (job: transport), since the skip connections would need maps of their own"
)


def residual_maps_exact(options: Options) -> bool:
    """Per-sublayer residual maps do not preserve a model's function (they serve transports)."""
    return getattr(options, "residual_maps", None) != "per-sublayer"


class _PassOptions(Options):
    """Options of the strategies that sweep every space in a random order until nothing changes."""

    max_iter: int = Field(100, ge=1, le=MAX_PASSES, strict=True, description="passes over all spaces at most")
    seed: int = Field(0, ge=0, le=MAX_SEED, strict=True, description="seed of the random visiting order")


GLU_HELP = (
    "gated MLPs (Llama, Qwen, Gemma, Phi-3, OLMo-2…): `balance` matches units in a canonical scaling "
    "(‖up row‖ = ‖down column‖, up·gate ≥ 0), then gives B's units the scale and sign of A's unit they "
    "land on (exact); `keep` matches units as stored"
)
GluScaling = Literal["balance", "keep"]


class WeightMatchingOptions(_PassOptions):
    residual_maps: ResidualMaps = Field("global", description=RESIDUAL_MAPS_HELP)
    glu: GluScaling = Field("keep", description=GLU_HELP)


WEIGHT_MATCHING = Strategy(
    name="weight-matching",
    paper="Ainsworth, Hayase & Srinivasa, Git Re-Basin: Merging Models modulo Permutation Symmetries (ICLR 2023)",
    options=WeightMatchingOptions,
    module="weight_matching",
    exact=residual_maps_exact,
    summary="data-free: permutations of units, heads and the residual stream maximizing weight similarity",
)

# ---------------------------------------------------------------------------------------------
# transfusion


class TransfusionOptions(_PassOptions):
    residual_maps: ResidualMaps | None = Field(
        None, description=f"unset: `per-sublayer` in a transport, `global` otherwise; {RESIDUAL_MAPS_HELP}"
    )
    glu: GluScaling = Field("keep", description=GLU_HELP)


TRANSFUSION = Strategy(
    name="transfusion",
    paper="Rinaldi et al., Update Your Transformer to the Latest Release: Re-Basin of Task Vectors (ICML 2025)",
    options=TransfusionOptions,
    module="transfusion",
    exact=residual_maps_exact,
    summary="data-free: heads paired by singular-value spectra, then permutations inside heads and of units",
)

# ---------------------------------------------------------------------------------------------
# head-perm

Heads = Literal["head-perm", "monotonic", "ignore-heads", "vanilla-attention"]
Residual = Literal["identity", "first", "last", "all", "separate"]
Component = Literal["ff", "attn", "residual"]


class HeadPermOptions(Options):
    heads: Heads = Field("head-perm", description="how attention heads are matched")
    residual: Residual | None = Field(
        None,
        description="which residual features give the residual permutation; unset: `all` (best on the benchmark "
        "zoo), except on streamed models whose every-site statistics would outweigh both 1 GiB and half of one "
        "model in float32, which take `identity` (statistics layer by layer, a few GB for a 7B model)",
    )
    qk: Literal["shared", "separate"] = Field(
        "separate",
        description="`shared`: Q and K take their head's value/output permutation (Verma & Elbayad's main "
        "method); `separate`: their own, from the correlation of queries and keys (the paper's footnote). "
        "Rotary heads always take their own (a value permutation would not commute with the rotation)",
    )
    components: tuple[Component, ...] = Field(("ff", "attn", "residual"), description="which spaces to align")
    special_tokens: bool = Field(True, description="count special tokens ([CLS], [SEP], padding ids) in the statistics")
    form: Literal["stored", "canonical"] = Field(
        "stored",
        description="the form the two models are interpolated in: `stored` (as given) or `canonical` (norm scales "
        "folded into what reads them, as generalized-orthogonal merges; the matching is the same). On the benchmark "
        "zoo's T5 trained 12,000 steps: 58 % of vanilla's barrier against 66 %",
    )

    @field_validator("components")
    @classmethod
    def _no_duplicates(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v) or not v:
            raise ValueError("list each of ff, attn, residual at most once, and at least one")
        return v


RESIDUAL_MOMENTS_FLOOR = 2**30  # statistics this small never decide: any machine holds them


def residual_moment_bytes(layers: int, hidden: int) -> int:
    """Bytes of `residual: all`'s statistics: float64 moments of A's and B's stream, (2d)² per
    reading site, about two sites a layer plus the final state."""
    return (2 * layers + 1) * 8 * (2 * hidden) ** 2


def unset_residual(layers: int, hidden: int, params: int, streamed: bool) -> Residual:
    """head-perm's `residual` when the recipe leaves it unset: ``all``, the best choice on every
    benchmark model, unless the models are streamed and its statistics would outweigh both 1 GiB
    and half of one model in float32 (Qwen3-0.6B, TinyLlama, 7B models): then ``identity``, whose
    statistics run layer by layer in a few GB. Torch-free: the memory estimate applies it too."""
    if not streamed:
        return "all"
    limit = max(2 * params, RESIDUAL_MOMENTS_FLOOR)
    return "all" if residual_moment_bytes(layers, hidden) <= limit else "identity"


def head_perm_exact(options: HeadPermOptions) -> bool:
    """Whether head-perm with ``options`` preserves B's function (``ignore-heads`` and a separate
    residual alignment do not: they are there for experiments, and reports flag them)."""
    return options.heads != "ignore-heads" and not (options.residual == "separate" and "residual" in options.components)


def head_perm_statistics(options: HeadPermOptions, shape: ModelShape) -> int:
    """Bytes of activation statistics head-perm holds at once: one layer's cross moments (MLP units,
    heads), and with a `residual` other than ``identity`` (unset: settled from the same sizes as
    a streamed run settles it) every reading site's residual moments as well."""
    moments = 8 * (shape.width**2 + 2 * shape.hidden**2)
    residual = options.residual
    if residual is None:
        residual = unset_residual(shape.layers, shape.hidden, shape.params, streamed=True)
    if residual != "identity":  # statistics of every reading site at once, whole forward passes
        moments += residual_moment_bytes(shape.layers, shape.hidden)
    return moments


HEAD_PERM = Strategy(
    name="head-perm",
    paper="Verma & Elbayad, Merging Text Transformer Models from Different Initializations (TMLR 2024)",
    options=HeadPermOptions,
    module="head_perm",
    needs_data=lambda _o: True,
    exact=head_perm_exact,
    summary="activation matching: correlation of features on alignment data, heads permuted as units",
    memory=MemoryProfile(statistics=head_perm_statistics),
)

# ---------------------------------------------------------------------------------------------
# generalized-orthogonal

LEARNED_ONLY = (  # options that only apply with `learned: true`
    "steps",
    "budget",
    "lr",
    "sinkhorn",
    "temperature",
    "sampler",
    "learn_heads",
    "learn_glu_scales",
    "maps",
    "holdout",
    "eval_every",
    "patience",
    "dirichlet",
    "rotations",
    "straight_through",
    "warmup",
)
# learned matching's peak rate when the recipe sets none, by what the model reads (measured on the
# benchmark zoo's 3 seed pairs of each kind; benchmarks/README.md, "Barriers on the benchmark zoo")
LEARNED_LR_TEXT, LEARNED_LR_IMAGES = 0.01, 0.03


def default_learned_lr(images: bool) -> float:
    """Learned matching's rate for a model that reads images (``images``) or text."""
    return LEARNED_LR_IMAGES if images else LEARNED_LR_TEXT


_SAMPLER = re.compile(r"\s*(uniform|fixed|wide)\s*\(\s*([0-9.eE+-]+)\s*(?:,\s*([0-9.eE+-]+)\s*)?\)\s*")
# learned matching of models of different widths: ``wide(a, b)`` draws the wider model's weight
# from [a, b]. Their barrier peaks on the narrow side of the line (λ_narrow ≈ 0.5–0.75), so the
# default draws λ there: on zoo GPT-2 d 64 / d 128 (2 pairs) wide(0.1, 0.5) left 25–27 % of
# vanilla's barrier, uniform(0.4, 0.6) 28–29 %, wide(0.5, 0.9) (toward the wide model) 38 %; on
# two ViT widths 11 %, 39 % and 110 % (benchmarks/alignment/bench_widths.py --samplers)
WIDE_SAMPLER = "wide(0.1, 0.5)"


def parse_sampler(text: str) -> tuple[float, float]:
    """``uniform(a, b)`` or ``fixed(x)`` as the range ``(a, b)`` λ (A's weight) is drawn from
    (``(x, x)`` when fixed); ``wide(a, b)`` as the range of the wider model's weight (`sampler_for`)."""
    m = _SAMPLER.fullmatch(text)
    if m is None:
        raise ValueError(f"expected `uniform(a, b)`, `fixed(x)` or `wide(a, b)`, got {text!r}")
    kind, first, second = m.groups()
    if kind == "wide" and second is None:
        raise ValueError(f"`wide` takes two numbers (the wider model's weight is drawn from that range), got {text!r}")
    try:
        low = float(first)
        high = float(second) if second is not None else low
    except ValueError:
        raise ValueError(f"expected numbers in {text!r}") from None
    if (kind == "fixed") != (second is None) and kind != "wide":
        raise ValueError(f"`uniform` takes two numbers and `fixed` one, got {text!r}")
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"λ is a weight in [0, 1] and the range must not be empty, got {text!r}")
    return low, high


def sampler_for(text: str, wide: str | None, explicit: bool) -> tuple[str, str | None]:
    """The sampler learned matching runs with (A's weight), and a note when it is not the recipe's
    text. ``wide``: which model of the pair was the wider one (``"a"``, ``"b"``; None: one width).
    Models of different widths take `WIDE_SAMPLER` unless the recipe set a sampler; ``wide(a, b)``
    becomes the range of A's weight."""
    if wide is not None and not explicit:
        text = WIDE_SAMPLER
    m = _SAMPLER.fullmatch(text)
    if m is None or m.group(1) != "wide":
        return text, None
    if wide is None:
        raise ValueError(f"sampler {text!r} biases λ toward the wider model, but both models have one width")
    low, high = parse_sampler(text)
    if wide == "b":
        low, high = 1.0 - high, 1.0 - low
    resolved = f"uniform({low:g}, {high:g})"
    why = "the default for models of different widths" if not explicit else "the recipe's sampler"
    side = "A" if wide == "a" else "B"
    return resolved, f"learned matching: λ from {text} ({why}; the wider model is {side}), i.e. A's weight {resolved}"


class GeneralizedOrthogonalOptions(Options):
    iterations: int = Field(
        10, ge=1, le=MAX_PASSES, strict=True, description="alternating rounds at most (stops early when stable)"
    )
    tol: float = Field(
        0.0,
        ge=0,
        le=1,
        strict=True,
        description="stop rotating after a round that raised the match by less than this share of what all "
        "rounds so far raised it (0: until no map changes or `iterations`; 1e-3 saves rounds on trained models "
        "at the same barrier, but leaves a known rotation recovered to only ~1e-3)",
    )
    inner: Literal["orthogonal", "invertible"] = Field(
        "orthogonal",
        description="maps inside heads: `invertible` also fits shears and scales (least squares on the circuits)",
    )
    residual_maps: ResidualMaps = Field("global", description=RESIDUAL_MAPS_HELP)
    glu: GluScaling | None = Field(None, description=GLU_HELP + "; unset: `balance` with `learned: true`, else `keep`")
    learned: bool = Field(False, description="refine on the loss of the interpolated model (needs data)")
    steps: int = Field(
        200, ge=1, le=MAX_STEPS, strict=True, description="learned: optimisation steps (or give `budget`)"
    )
    budget: int | None = Field(
        None,
        ge=1,
        le=MAX_BUDGET,
        strict=True,
        description="learned: tokens (text) or examples (images) to train on, instead of `steps`",
    )
    lr: float | None = Field(
        None,
        gt=0,
        le=10,
        strict=True,
        description="learned: peak learning rate (cosine decay to 10 %); unset: 0.01 for text models, 0.03 for "
        "image models (benchmark zoo, 3 seed pairs each: GPT-2 17 % of vanilla's barrier at 0.01 against 22 % at "
        "0.03; ViT 5 % at 0.03 against 13 % at 0.01)",
    )
    sinkhorn: bool = Field(False, description="learned: soft (Sinkhorn) permutations, projected once at the end")
    temperature: float = Field(
        0.05, gt=0, le=100, strict=True, description="learned + sinkhorn: temperature of the soft permutations"
    )
    sampler: str = Field(
        "uniform(0.4, 0.6)",
        description="learned: λ (A's weight) per step, `uniform(a, b)` or `fixed(x)`; `wide(a, b)` draws the wider "
        f"model's weight from [a, b] for models of different widths (their default: `{WIDE_SAMPLER}`, toward the "
        "narrow model, where their barrier peaks; `wide(0.5, 0.9)` samples toward the wide one)",
    )
    learn_heads: bool = Field(True, description="learned: learn which head of B goes to which head of A too")
    learn_glu_scales: bool = Field(
        True,
        description="learned: learn a positive scale per gated-MLP unit of B too (exp(t) on up, exp(−t) on "
        "down: exact); signs stay as the data-free start left them (`glu: balance` gives B's units A's signs). "
        "With `glu: balance`, lower on all 8 pairs measured (benchmark-zoo Qwen3 and Gemma-2, tiny OLMo-2 and "
        "Phi-3): Gemma-2 52 % → 48 % of vanilla's barrier",
    )
    maps: Literal["all", "permutations"] = Field(
        "all", description="learned: `permutations` learns permutations only, no rotations (ablation)"
    )
    holdout: float = Field(
        0.25, gt=0, lt=1, strict=True, description="learned: share of the alignment batches held out"
    )
    eval_every: int = Field(
        50, ge=1, le=MAX_STEPS, strict=True, description="learned: steps between held-out barrier scores"
    )
    patience: int = Field(
        4,
        ge=0,
        le=MAX_STEPS,
        strict=True,
        description="learned: stop after this many scores without improvement (0: never)",
    )
    rotations: Literal["polar", "projected"] = Field(
        "polar",
        description="learned: how rotations are learned: `polar` (the forward pass reads a free matrix's polar "
        "factor and the gradient flows through it, as Theus et al.'s code) or `projected` (Adam on the free "
        "matrix, put back on the orthogonal group after each step). Benchmark zoo, 3 seed pairs each: polar is "
        "lower on all 9 pairs (GPT-2 11.6 → 10.9 %, Qwen3 22 → 21 %, Gemma-2 48 → 47 % of vanilla's barrier)",
    )
    straight_through: Literal["sinkhorn", "identity"] = Field(
        "sinkhorn",
        description="learned: the gradient a hard permutation passes to its scores: the soft (Sinkhorn) "
        "permutation's, or the permutation's own (`identity`, as Theus et al.'s code)",
    )
    warmup: float = Field(
        0.0, ge=0, lt=1, strict=True, description="learned: share of the steps the rate rises over, linearly"
    )
    dirichlet: float = Field(
        0.1,
        gt=0,
        le=1000,
        strict=True,
        description="learned + merge.universe (3+ models): concentration of the Dirichlet merge weights",
    )
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        strict=True,
        description="seed of the permutation stage's visiting order and of learned λ samples",
    )

    @field_validator("sampler")
    @classmethod
    def _sampler(cls, v: str) -> str:
        parse_sampler(v)
        return v

    @model_validator(mode="after")
    def _learned_options_need_learned(self) -> GeneralizedOrthogonalOptions:
        stray = [k for k in LEARNED_ONLY if k in self.model_fields_set]
        if stray and not self.learned:
            raise ValueError(f"{', '.join(stray)} only apply with `learned: true`")
        if self.maps == "permutations" and self.inner == "invertible":
            raise ValueError("`maps: permutations` learns no inner maps: drop `inner: invertible`")
        if self.learned and self.residual_maps == "per-sublayer":
            raise ValueError(
                "learned matching optimizes the merged model, which per-sublayer residual maps do not give: "
                "drop `residual_maps: per-sublayer` or `learned`"
            )
        if "steps" in self.model_fields_set and self.budget is not None:
            raise ValueError("give `steps` or `budget`, not both")
        return self


def learned_matching(options: GeneralizedOrthogonalOptions) -> bool:
    """Whether generalized-orthogonal's options ask for learned matching (data, whole models, gradients)."""
    return bool(options.learned)


GENERALIZED_ORTHOGONAL = Strategy(
    name="generalized-orthogonal",
    paper="Theus et al., Generalized Linear Mode Connectivity for Transformers (2025)",
    options=GeneralizedOrthogonalOptions,
    module="generalized_orthogonal",
    needs_data=learned_matching,
    exact=residual_maps_exact,
    summary="data-free: orthogonal residual map (canonical form), heads by QK/OV circuits, units by LAP",
    canonical=True,
    memory=MemoryProfile(learned=learned_matching),
    universe_refinement=learned_matching,  # the module's refine_universe: learned matching across all models
)
