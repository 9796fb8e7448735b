"""``python -m hf_rebasin`` (or ``python -c CODE``) in a fresh process, without paying the imports of
torch (1–3 s) or the HTTP stack (0.3 s) on every run.

A helper process imports the heavy libraries that read no per-run setting at import (`PRELOAD`:
torch, numpy, ...; `LIGHT` for code that never imports torch) and forks one child per run. It never
imports huggingface_hub, transformers, datasets or hf_rebasin: they read HF_ENDPOINT,
HF_HUB_OFFLINE, HF_HOME and the like at import, so the child imports them after it has taken the
run's environment. Before that, the child also takes the run's folder, stdin (/dev/null), output
files and file-size limit, as `subprocess.run` would give them; signals are Python's defaults, as
the helper never changes them. What the interpreter reads at start-up (``PYTHON*``: the path, the
buffering) is the helper's: one helper per kind and per such setting. A fork is only safe while one
thread runs: the helper checks that after its imports (OpenMP/BLAS pools start no thread with
``OMP_NUM_THREADS=1``, as tests/conftest.py sets) and, if not, says so and every run falls back to a
plain subprocess.

Run as a script, this file is the helper: one JSON request a line on stdin, one JSON answer a line.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# libraries that read nothing a case sets at import and start no thread, among them what
# transformers' model classes pull in (dynamo, DTensor, scipy.optimize); never pandas or pyarrow
# (jemalloc's background thread) nor anything that imports huggingface_hub
LIGHT = ("regex", "yaml", "jinja2", "pydantic", "httpcore2", "httpx2", "trio", "requests", "filelock", "fsspec", "tqdm")
PRELOAD = (
    *("torch", "torch._dynamo", "torch._inductor", "torch.distributed.tensor", "torch.onnx"),
    *("numpy", "scipy", "scipy.linalg", "scipy.optimize", "sympy", "safetensors", "tokenizers", "dill"),
    *LIGHT,
)
KINDS = {"torch": PRELOAD, "light": LIGHT}
FORBIDDEN = ("huggingface_hub", "transformers", "datasets", "hf_rebasin")

ROOT = Path(__file__).resolve().parent.parent
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
_helpers: dict[tuple[str, ...], subprocess.Popen[bytes] | None] = {}  # None: it cannot fork safely


def run_module(
    argv: list[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    timeout: float,
    max_file_bytes: int | None = None,
    kind: str = "torch",
) -> subprocess.CompletedProcess[str]:
    """``python -m hf_rebasin ARGV`` with exactly ``env`` in ``cwd``, stdin from /dev/null; raises
    `subprocess.TimeoutExpired` (the child killed) past ``timeout`` seconds, as `subprocess.run` does.
    ``kind="light"`` for a run that imports no torch (``--help``): its child exits sooner."""
    cmd = [sys.executable, "-m", "hf_rebasin", *argv]
    return _run(kind, cmd, {"argv": argv}, env=env, cwd=cwd, timeout=timeout, max_file_bytes=max_file_bytes)


def run_code(code: str, *, env: Mapping[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -c CODE`` (code that needs no torch) as `run_module` runs the CLI."""
    return _run("light", [sys.executable, "-c", code], {"code": code}, env=env, cwd=cwd, timeout=timeout)


def _run(
    kind: str, cmd: list[str], what: dict[str, Any], *, env: Mapping[str, str], cwd: Path, timeout: float, **more: Any
) -> subprocess.CompletedProcess[str]:
    helper = _helper(kind, {k: v for k, v in env.items() if k.startswith("PYTHON")})
    if helper is None:
        return _plain(cmd, env=env, cwd=cwd, timeout=timeout, max_file_bytes=more.get("max_file_bytes"))
    with tempfile.TemporaryDirectory(prefix="warm-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        request = {**what, **more, "env": dict(env), "cwd": str(cwd), "timeout": timeout}
        answer = _ask(helper, {**request, "stdout": str(out), "stderr": str(err)})
        if answer.get("timeout"):
            raise subprocess.TimeoutExpired(cmd, timeout, _text(out.read_bytes()), _text(err.read_bytes()))
        return subprocess.CompletedProcess(cmd, answer["code"], _text(out.read_bytes()), _text(err.read_bytes()))


def _plain(cmd: list[str], *, env: Mapping[str, str], cwd: Path, timeout: float, max_file_bytes: int | None) -> Any:
    """The same run as a plain subprocess (the helper could not fork safely)."""
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        preexec_fn=(lambda: limit_file_size(max_file_bytes)) if max_file_bytes else None,
    )


def _text(data: bytes) -> str:
    """Bytes decoded as `subprocess.run(text=True)` decodes them (locale encoding, universal newlines)."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def limit_file_size(size: int | None) -> None:
    """In the child: writes past ``size`` bytes fail with EFBIG, as on a full disk (SIGXFSZ ignored)."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def _helper(kind: str, startup: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """The helper of this test process for ``kind`` and these ``PYTHON*`` settings, started on first
    use; None where it cannot fork safely."""
    key = (kind, *sorted(f"{k}={v}" for k, v in startup.items()))
    if not sys.platform.startswith("linux"):  # it counts threads in /proc and waits on a pidfd
        return None
    if key not in _helpers:
        environ = {k: v for k, v in os.environ.items() if k != "HF_REBASIN_DEBUG" and not k.startswith("PYTHON")}
        helper = subprocess.Popen(
            [sys.executable, __file__, kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**environ, **startup},
            cwd=Path(__file__).parent,
        )
        atexit.register(_stop, helper)
        _helpers[key] = helper if _read(helper).get("ready") else None
    return _helpers[key]


def _stop(helper: subprocess.Popen[bytes]) -> None:
    if helper.poll() is None:
        helper.stdin.close()  # type: ignore[union-attr]
        helper.wait(timeout=30)


def _read(helper: subprocess.Popen[bytes]) -> dict[str, Any]:
    line = helper.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise RuntimeError(f"the warm CLI helper stopped (exit {helper.wait()})")
    return json.loads(line)


def _ask(helper: subprocess.Popen[bytes], request: dict[str, Any]) -> dict[str, Any]:
    helper.stdin.write(json.dumps(request).encode() + b"\n")  # type: ignore[union-attr]
    helper.stdin.flush()  # type: ignore[union-attr]
    return _read(helper)


# -- the helper -----------------------------------------------------------------------------------


def _serve(kind: str) -> dict[str, Any]:
    """Preload, then fork a child per request and answer its exit code; returns only in a child."""
    import gc
    import importlib

    for name in KINDS[kind]:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed here: the child imports what it needs
            pass
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN))
    threads = len(os.listdir("/proc/self/task"))
    gc.freeze()  # a child's collections skip what was preloaded: its exit copies 0.3 s fewer pages
    _answer({"ready": threads == 1 and not loaded, "threads": threads, "loaded": loaded})
    for line in sys.stdin.buffer:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        _answer(_wait(pid, request["timeout"]))
    sys.exit(0)


def _answer(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def _wait(pid: int, timeout: float) -> dict[str, Any]:
    """The child's exit code (negative: killed by that signal), or ``timeout`` once it was killed."""
    import select
    import signal

    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return {"timeout": True} if not ready else {"code": os.waitstatus_to_exitcode(status)}


def _enter(request: dict[str, Any]) -> None:
    """In the child: the run's stdin, output files, folder, environment, file-size limit, argv and
    ``sys.path[0]`` (the folder for ``-m``, '' for ``-c``, where it was this file's folder)."""
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("max_file_bytes"):
        limit_file_size(request["max_file_bytes"])
    code = request.get("code")
    sys.argv = ["-c"] if code is not None else ["-m", *request["argv"]]
    sys.path[0] = "" if code is not None else os.getcwd()


if __name__ == "__main__":
    _REQUEST = _serve(sys.argv[1])
    _enter(_REQUEST)
    if _REQUEST.get("code") is None:
        import runpy

        runpy.run_module("hf_rebasin", run_name="__main__", alter_sys=True)
    else:
        import types

        _main = types.ModuleType("__main__")
        sys.modules["__main__"] = _main
        exec(compile(_REQUEST["code"], "<string>", "exec"), _main.__dict__)
