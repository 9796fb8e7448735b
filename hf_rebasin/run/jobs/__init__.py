"""The jobs a recipe can name, one flat module each, in one explicit table checked against the
recipe's ``job`` choices: a job added to the recipe without a module here fails at import."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import get_args

from ...recipe import Job
from ..load import Workspace
from ..result import JobOutput
from . import barrier, merge, transport

__all__ = ["JOBS", "check_jobs"]

JOBS: Mapping[str, Callable[[Workspace], JobOutput]] = {
    "merge": merge.run,
    "barrier": barrier.run,
    "transport": transport.run,
}


def check_jobs(table: Mapping[str, object], names: tuple[str, ...]) -> None:
    """``table`` runs exactly the jobs ``names`` lists (the recipe's ``job`` Literal)."""
    if set(table) != set(names):
        missing, extra = sorted(set(names) - set(table)), sorted(set(table) - set(names))
        raise RuntimeError(f"the jobs table does not match the recipe's jobs: missing {missing}, unknown {extra}")


check_jobs(JOBS, get_args(Job))
