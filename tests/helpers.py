"""Helpers the tests share: the CLI run as a user runs it (`run_cli`, a subprocess) or in this
process (`run_main`), and the checks of what it printed. Models to test on are in `tiny.py`, the
local Hub in `hub_server.py`, real checkpoint layouts in `checkpoints.py`."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import warm_cli

ROOT = Path(__file__).resolve().parent.parent


def start_cli(*args: str, code: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``python -m hf_rebasin ARGS`` (or ``python -c CODE ARGS``) from the repo root, offline."""
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "hf_rebasin", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=_environ(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _environ(env: dict[str, str] | None) -> dict[str, str]:
    """This process's environment, offline, with ``env`` on top (it may turn downloads back on,
    for tests against the local Hub)."""
    environ = {k: v for k, v in os.environ.items() if k != "HF_REBASIN_DEBUG"}
    environ.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        COLUMNS="200",
    )
    environ.update(env or {})
    return environ


def finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    """Wait for a started CLI process (killed after 300 s) and collect its output."""
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(*args: str, code: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion (see :func:`start_cli`), stdin from /dev/null. ``python -m
    hf_rebasin`` is forked from a helper that has imported torch (tests/warm_cli.py): a fresh
    process all the same, without the second or so of torch's import."""
    if code is not None:
        return finish(start_cli(*args, code=code, env=env))
    light = not args or args[0].startswith("-")  # --help, --version, no command: no torch to import
    return warm_cli.run_module(list(args), env=_environ(env), cwd=ROOT, timeout=300, kind="light" if light else "torch")


def run_main(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI run in this process: no interpreter start-up (4–5 s for torch and transformers), for
    runs that need no signals or isolation. ``env`` is set for the call only, so it reaches what is
    read at call time (caches, the debug switch), not what a library read when it was imported."""
    from hf_rebasin.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def flat(text: str) -> str:
    """Whitespace collapsed, so assertions do not depend on where the console wrapped a line."""
    return " ".join(text.split())


def assert_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, an ``error:`` message on stderr naming every needle, and no traceback."""
    err = flat(proc.stderr)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert err.startswith("error:"), proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    for needle in needles:
        assert needle in err, (needle, proc.stderr)
    return err


def sparse_bf16_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file whose header states ``shapes`` in bfloat16 and whose data are a hole (a
    sparse file): what a plan reads of a 7B-class checkpoint, without its bytes on disk."""
    import json
    import math
    import struct

    header, offset = {}, 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + 2 * math.prod(shape)]}
        offset += 2 * math.prod(shape)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as h:
        h.write(struct.pack("<Q", len(raw)) + raw)
        h.truncate(8 + len(raw) + offset)
