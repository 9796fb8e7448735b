"""The jobs table (hf_rebasin.run.jobs) matches the recipe's job names, and says so when it does not."""

from __future__ import annotations

from typing import get_args

import pytest

from hf_rebasin.recipe import Job
from hf_rebasin.run.jobs import JOBS, check_jobs


def test_every_recipe_job_has_exactly_one_module() -> None:
    assert set(JOBS) == set(get_args(Job))
    assert all(callable(run) for run in JOBS.values())


def test_a_table_that_misses_a_job_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"missing \['transport'\], unknown \['sweep'\]"):
        check_jobs({"merge": None, "barrier": None, "sweep": None}, get_args(Job))
