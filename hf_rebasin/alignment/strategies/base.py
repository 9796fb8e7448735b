"""What every strategy takes and returns, and the registry that names them.

A strategy is a function ``run(pair, options, progress) -> Alignment`` plus a pydantic options
model (``extra="forbid"``: recipes validate against it) and its capabilities: the facts the rest of
the package asks of a strategy instead of testing its name (whether its options need alignment
data or preserve the function, whether it aligns anything at all, whether it works on canonical
forms, what it holds in memory, whether it refines a universe merge). A new strategy declares them
in its `Strategy` entry and is cached, estimated and compared like the built-in ones.

Torch-free at import: the registry, the options and these types are what a recipe and a dry run
need, so tensors, solvers and the symmetry graph are only named for type checking here; a
strategy's module (and with it torch) is imported when the strategy runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from hf_rebasin.core.errors import MissingDataError, StrategyOptionError

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel

    from hf_rebasin.symmetry.graph import SymmetryGraph
    from hf_rebasin.symmetry.transforms import Transform

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: the CLI turns it into progress bars."""


class Options(BaseModel):
    """Base of every strategy's options: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class AlignmentData:
    """Alignment data, already tokenized: model-keyword batches (``input_ids``, ``attention_mask``,
    ``pixel_values``, ``labels``…), and the token ids that count as special tokens."""

    batches: Sequence[Mapping[str, Tensor]]
    special_ids: frozenset[int] = frozenset()
    description: str = "alignment data"


@dataclass
class Pair:
    """The reference model A and the model B to bring into A's basis (same architecture)."""

    graph: SymmetryGraph
    sd_a: Mapping[str, Tensor]
    sd_b: Mapping[str, Tensor]
    model_a: PreTrainedModel | None = None
    model_b: PreTrainedModel | None = None
    data: AlignmentData | None = None

    def __post_init__(self) -> None:
        from hf_rebasin.io.checks import check_same_shapes

        check_same_shapes(self.sd_a, self.sd_b)


@dataclass
class Alignment:
    """A transform of B in A's basis, with the form (original or canonical) it applies to.

    ``sd_a`` / ``sd_b`` are the state dicts the transform refers to: canonical forms for orthogonal
    strategies (γ folded; merged models are built from them, with ``untied`` aliases stored apart).
    ``exact`` is False for experimental options that change B's function (flagged in reports).
    """

    strategy: str
    graph: SymmetryGraph
    sd_a: Mapping[str, Tensor]
    sd_b: Mapping[str, Tensor]
    transform: Transform
    exact: bool = True
    canonical: bool = False
    # B's gated-MLP units rescaled to A's (``glu.match_scales``): a cache rebuilds sd_b the same way
    glu_matched: bool = False
    # where set, the unit scales (float64, by unit space) that took B from its (canonical) form to
    # ``sd_b``: matched and learned scales in one; a cache stores them and applies them again
    glu_scales: dict[str, Tensor] | None = None
    untied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    diagnostics: dict[str, Any] = field(default_factory=dict)  # curves a run draws (``learned``: barrier vs steps)
    # options left unset in the recipe that the strategy settled from the models (head-perm's `residual`)
    resolved: dict[str, Any] = field(default_factory=dict)

    def aligned_b(self) -> dict[str, Tensor]:
        """B's state dict in A's basis."""
        return self.graph.apply(self.sd_b, self.transform)


@dataclass
class UniverseMaps:
    """A universe merge after its rounds, as a joint refinement sees it: each model's state dict in
    the form its map applies to, its map into the shared basis, and the merge's weights."""

    template: PreTrainedModel  # model 0, live: the class and config every merged model is run as
    graph: SymmetryGraph
    state_dicts: Sequence[Mapping[str, Tensor]]
    transforms: Sequence[Transform]
    weights: Sequence[float]
    untied: list[str]  # aliases untied by the canonical form
    data: AlignmentData


@dataclass
class Refinement:
    """A joint refinement's result: a new map per model, notes for the run, and the curve it drew."""

    transforms: list[Transform]
    notes: list[str]
    history: dict[str, Any]


class ModelShape(Protocol):
    """A model's sizes as the memory estimate knows them from its files (`run.memory.ModelFootprint`)."""

    @property
    def params(self) -> int: ...  # elements of its tensors
    @property
    def width(self) -> int: ...  # its widest hidden space (MLP units or residual)
    @property
    def hidden(self) -> int: ...  # the residual stream's width
    @property
    def layers(self) -> int: ...


def _never(_options: Any) -> bool:
    return False


def _always(_options: Any) -> bool:
    return True


@dataclass(frozen=True)
class MemoryProfile:
    """What a strategy holds in memory besides the models it is given, in the terms the dry run's
    estimate (`run.memory.estimate`) adds up, so that a new strategy is estimated from its entry.
    The defaults are those of a data-free matching strategy (the estimate errs on the high side)."""

    assignment: bool = True
    """It solves assignment problems: the widest space's cost matrices are held while it runs."""
    statistics: Callable[[Any, ModelShape], int] | None = None
    """Bytes of activation statistics it holds at once, by options and model shape (a streamed run
    adds the hidden states and one layer of each model); None: it reads no activations."""
    learned: Callable[[Any], bool] = _never
    """Whether these options run the learned-matching engine: models held whole with gradients, never streamed."""


@dataclass(frozen=True)
class Strategy:
    """One registered strategy: what reports and recipes need, its capabilities, and the module
    whose ``run`` does the work.

    ``module`` names a module with a function ``run(pair, options, progress) -> Alignment``: a
    module of this package (``"head_perm"``), or, dotted, any importable module
    (``"my_package.my_strategy"``: a strategy registered from outside). It is imported by
    `Strategy.run`, so naming, validating and describing a strategy never imports torch.
    """

    name: str
    paper: str
    options: type[Options]
    module: str
    needs_data: Callable[[Any], bool] = _never
    """Whether these options need alignment data (and both live models): the recipe then needs `data:`."""
    exact: Callable[[Any], bool] = _always
    """Whether these options preserve B's function (reports flag experimental ones that do not)."""
    summary: str = ""
    identity: bool = False
    """It aligns nothing (the identity map): not worth caching, no matching to estimate, and the
    naive baseline (plain average, B + α·τ) a run compares the others with."""
    canonical: bool = False
    """It works on canonical forms (norm scales folded, a tied head untied), where its maps are
    exact: every model is held in that form too, and an adapter must be able to follow it."""
    memory: MemoryProfile = MemoryProfile()
    """What it holds besides the models (the dry run's memory estimate)."""
    universe_refinement: Callable[[Any], bool] = _never
    """Whether, with these options, a universe merge of 3+ models ends with every map refined
    together: the module's ``refine_universe(maps, options, progress) -> Refinement``."""

    @property
    def module_path(self) -> str:
        """The full name of the module holding ``run``: ``module`` itself when dotted, else this package's."""
        return self.module if "." in self.module else f"{__package__}.{self.module}"

    def run(self, pair: Pair, options: Any, progress: Progress | None) -> Alignment:
        """Bring B of ``pair`` into A's basis: ``run`` of this strategy's module (imported now)."""
        run: Callable[[Pair, Any, Progress | None], Alignment] = importlib.import_module(self.module_path).run
        alignment = run(pair, options, progress)
        if self.identity:
            return alignment
        from hf_rebasin.alignment.experts import expert_spaces, fit_router_shifts

        if expert_spaces(alignment.graph):  # B's softmax routers in A's gauge, exactly
            alignment.transform = fit_router_shifts(
                alignment.graph, alignment.sd_a, alignment.sd_b, alignment.transform
            )
        return alignment

    def refine_universe(self, maps: UniverseMaps, options: Any, progress: Progress | None) -> Refinement:
        """Every model's map of a universe merge refined together (where `universe_refinement`
        says so): ``refine_universe`` of this strategy's module (imported now)."""
        refine: Callable[[UniverseMaps, Any, Progress | None], Refinement] = importlib.import_module(
            self.module_path
        ).refine_universe
        return refine(maps, options, progress)

    def parse(self, options: Mapping[str, Any] | Options | None) -> Options:
        """Options from a mapping (a recipe's ``strategy`` section minus ``name``)."""
        if isinstance(options, self.options):
            return options
        try:
            return self.options.model_validate(dict(options or {}))
        except ValidationError as e:
            problems = "; ".join(f"strategy.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            raise StrategyOptionError(f"invalid options for strategy {self.name!r}: {problems}") from None


class StrategyRegistry:
    """Explicit registry: refuses duplicate and malformed names."""

    def __init__(self) -> None:
        self._by_name: dict[str, Strategy] = {}

    def register(self, strategy: Strategy) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]*", strategy.name):
            raise ValueError(f"bad strategy name {strategy.name!r}: lowercase words joined by '-'")
        if strategy.name in self._by_name:
            raise ValueError(f"strategy {strategy.name!r} is registered twice")
        # found, not imported: a misspelt module fails here, at import of the registry, not mid-run
        if not _findable(strategy.module):
            raise ValueError(
                f"strategy {strategy.name!r} names no module of {__package__} (nor, dotted, an importable "
                f"module): {strategy.module!r}"
            )
        self._by_name[strategy.name] = strategy

    def unregister(self, name: str) -> None:
        """Forget strategy ``name`` (one registered for a while: a test's, a plug-in's)."""
        self.get(name)
        del self._by_name[name]

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> Strategy:
        found = self._by_name.get(name)
        if found is None:
            raise StrategyOptionError(f"unknown strategy {name!r}; choose one of: {', '.join(self.names)}")
        return found


def _findable(module: object) -> bool:
    """Whether ``module`` names a module `Strategy.run` can import: one of this package by its bare
    name, or a dotted full name (whose parent packages ``find_spec`` imports, not the module)."""
    if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
        return False
    try:
        return importlib.util.find_spec(module if "." in module else f"{__package__}.{module}") is not None
    except (ImportError, ValueError):  # a parent package that is not there, or not a package
        return False


def require_data(pair: Pair, strategy: str, why: str) -> AlignmentData:
    """The alignment data, or a user error saying how to provide it."""
    if pair.data is None or not pair.data.batches:
        raise MissingDataError(
            f"strategy {strategy!r} {why}, so it needs alignment data: add a `data:` section to the recipe "
            "(a `datasets` builder or Hub dataset id and a split), or choose a data-free strategy "
            "(weight-matching, transfusion, or generalized-orthogonal without `learned`)"
        )
    if pair.model_a is None or pair.model_b is None:
        raise MissingDataError(f"strategy {strategy!r} {why}: it needs both loaded models, not only state dicts")
    return pair.data


@contextmanager
def timed() -> Iterator[dict[str, float]]:
    """Wall time (``total``) and time inside the solvers (``solver``) of the block, plus any stage
    times the block adds itself; filled in when the block ends."""
    from hf_rebasin.alignment.solvers import solver_clock  # torch: a strategy is running, so it is loaded already

    timings: dict[str, float] = {}
    start = time.perf_counter()
    with solver_clock() as clock:
        yield timings
    timings["solver"] = clock.seconds
    timings["total"] = time.perf_counter() - start


def glu_mode(options: Any) -> str:
    """How a strategy's options treat gated MLPs: as set, else ``balance`` for learned matching (B's
    units in A's scales and signs, then their scales learned) and ``keep`` for the data-free strategies."""
    mode = getattr(options, "glu", "keep")
    if mode is None:
        return "balance" if getattr(options, "learned", False) else "keep"
    return str(mode)


def matching_forms(
    pair: Pair, sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], options: Any
) -> tuple[Mapping[str, Tensor], Mapping[str, Tensor], bool]:
    """The forms weight-based matching compares: both models' softmax routers centred (their gauge,
    :mod:`hf_rebasin.alignment.experts`), and their gated MLPs balanced (unit scales and signs made canonical)
    when ``options`` ask for it (`glu_mode`) and the graph has any; and whether they were balanced."""
    from hf_rebasin.alignment.experts import center_routers

    sd_a, sd_b = center_routers(pair.graph, sd_a), center_routers(pair.graph, sd_b)
    if glu_mode(options) != "balance" or not pair.graph.glus:
        return sd_a, sd_b, False
    from hf_rebasin.symmetry import glu

    return glu.balance(pair.graph, sd_a), glu.balance(pair.graph, sd_b), True


def relative_distance(sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor]) -> float:
    """``‖A − B‖ / ‖A‖`` over all floating-point tensors: how far apart two models' weights are."""
    num = den = 0.0
    for k, a in sd_a.items():
        if a.is_floating_point():
            num += float((a.double() - sd_b[k].double()).pow(2).sum())
            den += float(a.double().pow(2).sum())
    return (num / den) ** 0.5 if den else 0.0
