"""The machine's memory as the plan and lineage read it, against the kernel's own numbers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hf_rebasin.core.errors import RebasinUserError
from hf_rebasin.core.memory import InsufficientMemoryError, available_memory, resident


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_available_memory_is_at_most_what_the_kernel_says_and_resident_is_this_process() -> None:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kernel = int(fields["MemAvailable"].split()[0]) * 1024
    have = available_memory()
    assert have is not None and 0 < have <= kernel  # a cgroup limit may lower it, never raise it
    rss = resident()
    pages = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert 0 < rss and abs(rss - pages) < 64 * 2**20  # the same resident set, read twice


def test_too_little_memory_is_a_user_error() -> None:
    assert issubclass(InsufficientMemoryError, RebasinUserError) and issubclass(InsufficientMemoryError, MemoryError)
