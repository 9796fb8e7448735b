"""What a transport's calibration costs in arithmetic, for the dry run: floating-point operations
counted from the model's size and the budget, and the time they take at this machine's measured
matrix-multiply rate (TinyLlama-1.1B's shape on 2 CPU cores: 5.6 min measured, 7.8 min estimated at
a rate measured while the cores were shared).

Per token, a forward pass of a model of N parameters is about 2N operations and a backward pass
4N. Each step puts its batch through the teacher (2N) and the student (forward, backward, and the
forward again that activation checkpointing recomputes: 8N), and with a guard the target's batch
through the target and the student as well. The fine-tune (and, with a guard, the target) writes
the calibration text, the student rewrites its on-policy share every few steps, and the held-out
text is scored before and after.
"""

from __future__ import annotations

import time

import torch

from hf_rebasin.io.models import resolve_device
from hf_rebasin.merging.calibration.distill import REFRESH
from hf_rebasin.recipe.calibrate import Calibrate

__all__ = ["calibration_flops", "compute_line", "matmul_rate"]

PROBE = 1024  # side of the square float32 matrices the rate is measured on
PROBE_SECONDS = 0.2


def calibration_flops(cal: Calibrate, params: int, *, adapter: bool = False) -> float:
    """Floating-point operations of a calibration of a model of ``params`` parameters."""
    block = cal.block_size or 128
    steps = cal.budget(adapter)
    batches = 2 if cal.guard > 0 else 1  # the calibration text's, and the guard's
    fitted = steps * cal.batch_size * block * batches * (2 + 8)
    written = cal.samples * block * batches * 2
    own = round(cal.batch_size * cal.on_policy)
    on_policy = -(-steps // REFRESH) * own * block * 2
    measured = 2 * cal.held * block * (2 + 2)  # the KL before and after: teacher and student
    return float(params) * (fitted + written + on_policy + measured)


def matmul_rate(device: str) -> tuple[float, str]:
    """This machine's float32 matrix-multiply rate on the run's device (operations per second), and
    the device's name; measured in a fraction of a second."""
    dev = resolve_device(device)
    a = torch.randn(PROBE, PROBE, device=dev)
    torch.mm(a, a)  # the first call pays for set-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < PROBE_SECONDS:
        torch.mm(a, a)
        n += 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return 2 * PROBE**3 * n / (time.perf_counter() - start), str(dev)


def compute_line(cal: Calibrate, params: int, device: str) -> str:
    """The dry run's line: operations, and their time at the rate measured now."""
    flops = calibration_flops(cal, params)
    rate, where = matmul_rate(device)
    return (
        f"compute: calibration ≈ {flops:.2g} floating-point operations for {params / 1e6:,.0f}M parameters; at "
        f"this machine's float32 matrix-multiply rate on {where} ({rate / 1e9:,.0f} GFLOP/s, measured now) about "
        f"{_duration(flops / rate)}"
    )


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.0f} s"
