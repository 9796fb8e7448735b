"""The machine's memory: what this process may still use, what it holds, and the error for too little.

Every stage that refuses work up front (a run's plan, lineage's pairs) reads the same figures.
Standard library only: the dry run reads them without importing torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_rebasin.core.errors import RebasinUserError

__all__ = ["GIB", "OVERHEAD", "InsufficientMemoryError", "available_memory", "resident"]

GIB = 1024**3
OVERHEAD = 1 * GIB  # Python with torch, transformers and datasets imported, before any model


class InsufficientMemoryError(RebasinUserError, MemoryError):
    """The run's estimated peak memory exceeds what the machine has available."""


def available_memory() -> int | None:
    """Bytes this process can still use: the kernel's MemAvailable, lowered to the cgroup's limit."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            pass
    return min(found) if found else None


def resident() -> int:
    """This process's resident memory now: already in use, so not part of what is available."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
