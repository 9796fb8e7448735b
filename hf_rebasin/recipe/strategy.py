"""The ``strategy:`` section: ``name`` plus that strategy's options side by side, one pydantic model
per registered strategy, built from the registry (its options are never restated here), and the
message when a strategy needs alignment data the recipe does not give.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic_core import PydanticCustomError

from hf_rebasin.alignment.strategies import REGISTRY, Options, Strategy, get_strategy

if TYPE_CHECKING:
    StrategyName = str
else:
    StrategyName = Literal[tuple(REGISTRY.names)]


class StrategySpec(BaseModel):
    """Base of every ``strategy:`` section: ``name`` plus that strategy's options, side by side."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str

    @property
    def strategy(self) -> Strategy:
        """The registered strategy this section names (paper, run, needs_data, exact)."""
        return get_strategy(self.name)

    @property
    def options(self) -> Options:
        """The options as the strategy's own ``Options`` instance (what ``align`` takes)."""
        return self.strategy.options.model_validate(self.model_dump(exclude={"name"}, exclude_unset=True))

    @property
    def needs_data(self) -> bool:
        """True when these options need alignment data (the recipe then needs `data:`)."""
        return bool(self.strategy.needs_data(self.options))

    @property
    def runs_learned_matching(self) -> bool:
        """True when these options run learned matching: whole models with gradients, never streamed."""
        return bool(self.strategy.memory.learned(self.options))


def _section_model(strategy: Strategy) -> type[StrategySpec]:
    clash = {"name", "strategy", "options", "needs_data", "runs_learned_matching"} & set(strategy.options.model_fields)
    if clash:
        raise RuntimeError(f"strategy {strategy.name!r} has options named {sorted(clash)}: reserved in recipes")
    title = "".join(part.title() for part in strategy.name.split("-")) + "Strategy"
    bases: Any = (StrategySpec, strategy.options)  # the section is both: name + that strategy's options
    return create_model(
        title,
        __base__=bases,
        __doc__=strategy.summary or strategy.paper,
        name=(Literal[strategy.name], Field(description=strategy.paper)),
    )


SECTIONS: dict[str, type[StrategySpec]] = {name: _section_model(REGISTRY.get(name)) for name in REGISTRY.names}

if TYPE_CHECKING:
    StrategySection = StrategySpec
else:
    StrategySection = Annotated[functools.reduce(operator.or_, SECTIONS.values()), Field(discriminator="name")]


def yamlish(value: Any) -> str:
    """A value as it would be written in the recipe (``true``, ``[ff, attn]``)."""
    text = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True)
    return str(text).strip().removesuffix("...").strip()


def needs_data_message(spec: StrategySpec, at: str | None = None) -> PydanticCustomError:
    """The error of a strategy whose options need alignment data in a recipe that has none: it names
    the options that asked for it, so the user sees which to drop if they have no data."""
    given = {k: getattr(spec, k) for k in sorted(spec.model_fields_set - {"name"})}
    with_opts = f" with {', '.join(f'{k}: {yamlish(v)}' for k, v in given.items())}" if given else ""
    return PydanticCustomError(
        "recipe",
        "strategy '{name}'{opts} needs alignment data: add a top-level `data:` section "
        "(dataset, data_files, split, column), or choose a data-free strategy or option",
        {"name": spec.name, "opts": with_opts, **({"at": at} if at else {})},
    )
