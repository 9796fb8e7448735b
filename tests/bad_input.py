"""The bad-input corpus: what an attacker or a careless user hands hf-rebasin, one row per case.

Each row (`Case`) builds its input in a fresh folder (`Workspace`), runs the real CLI (in process by
default, in a subprocess when the case needs signals, a terminal or the local Hub: forked from a
helper that has imported torch, tests/warm_cli.py), and states the outcome it must have: the exit
code, words the message must contain, and a check of what is on disk afterwards (inputs untouched,
no output, no leftovers). Rows live in the ``bad_cases_*`` modules by area; ``test_bad_input.py``
runs them all. A case that already passed when the corpus was written stays a row, so that it
cannot come back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import tiny
import warm_cli

ROOT = Path(__file__).resolve().parent.parent
TEXT = tiny.HAMLET * 6


@dataclass
class Outcome:
    """What a CLI run did: exit code and the two streams (whitespace collapsed in ``err``/``out``)."""

    code: int
    stdout: str
    stderr: str
    seconds: float = 0.0  # how long the CLI ran (a refusal is never slower than the work it saves)

    @property
    def err(self) -> str:
        return " ".join(self.stderr.split())

    @property
    def out(self) -> str:
        return " ".join(self.stdout.split())


class Workspace:
    """A case's folder with builders for the usual inputs: tiny models, text, recipes.

    Every path a case creates is under ``root``; ``snapshot()`` / ``unchanged()`` prove that a run
    left the inputs as they were.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env: dict[str, str] = {}
        self.hub: Any = None  # the local Hub server (tests/hub_server.py) when the case asks for one
        self._snap: dict[str, str] | None = None

    # -- inputs ---------------------------------------------------------------------------------

    def model(self, name: str = "a", kind: str = "gpt2", seed: int = 0, *, tokenizer: bool = True) -> Path:
        """A tiny model saved with ``save_pretrained`` (and, for text models, a character tokenizer)."""
        from hf_rebasin.evaluation.data import char_tokenizer

        folder = self.root / name
        tiny.FACTORIES[kind](seed).save_pretrained(str(folder))
        if tokenizer and kind.startswith(("gpt2", "bert", "roberta")):
            char_tokenizer(TEXT).save_pretrained(str(folder))
        return folder

    def text(self, name: str = "corpus.txt", body: str = TEXT) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
        return path

    def write(self, name: str, data: bytes | str) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data, encoding="utf-8")
        return path

    def recipe(self, body: Mapping[str, Any] | str, name: str = "recipe.yaml") -> Path:
        """A recipe file (a mapping is dumped as YAML; a string is written as it is)."""
        text = body if isinstance(body, str) else yaml.safe_dump(dict(body), sort_keys=False)
        return self.write(name, text)

    def merge_recipe(self, output: str | Mapping[str, Any] = "out", *, evaluate: bool = False, **changes: Any) -> Path:
        """A vanilla merge of models ``a`` and ``b`` (built if missing) into ``output`` (a folder or a
        whole ``output`` section); ``changes`` replace top-level sections."""
        for name, seed in (("a", 0), ("b", 1)):
            if not (self.root / name).exists():
                self.model(name, seed=seed)
        body: dict[str, Any] = {
            "job": "merge",
            "models": ["./a", "./b"],
            "strategy": "vanilla",
            "output": dict(output) if isinstance(output, Mapping) else {"dir": output},
            "device": "cpu",
        }
        if evaluate:
            self.text()
            body["evaluate"] = {
                "task": "causal-lm",
                "data": {"dataset": "text", "data_files": "corpus.txt"},
                "points": 3,
            }
        body.update(changes)
        return self.recipe(body)

    # -- what is on disk ------------------------------------------------------------------------

    def listing(self) -> dict[str, str]:
        """Every file under ``root`` (relative path -> sha256), cache folders excluded."""
        out: dict[str, str] = {}
        for path in sorted(self.root.rglob("*")):
            rel = path.relative_to(self.root).as_posix()
            if path.is_file() and not rel.startswith(("ds-cache/", "hf-home/", "rebasin-cache/")):
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        return out

    def snapshot(self) -> None:
        self._snap = self.listing()

    def unchanged(self, *, allow_new: tuple[str, ...] = ()) -> None:
        """Every file that existed at ``snapshot()`` is still there, byte for byte; new files only
        under ``allow_new`` prefixes."""
        assert self._snap is not None, "snapshot() first"
        now = self.listing()
        lost = [p for p, h in self._snap.items() if now.get(p) != h]
        assert not lost, f"changed or removed: {lost[:5]}"
        new = [p for p in now if p not in self._snap and not p.startswith(allow_new)]
        assert not new, f"new files: {new[:5]}"

    def leftovers(self) -> list[str]:
        """Hidden temporary folders and lock files a run left beside its outputs."""
        return sorted(
            p.relative_to(self.root).as_posix() for p in self.root.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name
        )


Build = Callable[[Workspace], list[str]]
Check = Callable[[Workspace, Outcome], None]


@dataclass(frozen=True)
class Case:
    """One row of the corpus.

    ``build`` makes the inputs and returns the CLI arguments; the run must exit ``code`` with every
    ``needles`` string in its stderr (exit 2: an ``error:`` paragraph, never a traceback), and then
    ``check`` (if any) inspects the disk. ``subprocess``: run as a separate process (signals, a
    terminal, the local Hub, environment read at import). A run in process that is still going
    after ``timeout`` seconds (a FIFO opened by a regression blocks forever) is interrupted and
    fails (`Hung`), as a subprocess would be killed. ``before`` says what the code did when the
    corpus was written (the issue's table).
    """

    id: str
    area: str
    build: Build
    code: int
    needles: tuple[str, ...] = ()
    check: Check | None = None
    before: str = "handled"
    subprocess: bool = False
    slow: bool = False
    timeout: float = 120.0
    env: Mapping[str, str] = field(default_factory=dict)
    hub: bool = False  # a local Hub server in ``Workspace.hub`` (the `hub` fixture); implies a subprocess
    max_file_bytes: int | None = None  # a full disk: writes past this size fail (RLIMIT_FSIZE); implies a subprocess


def offline_env(ws: Workspace) -> dict[str, str]:
    """No network, caches inside the case's folder."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(ws.root / "ds-cache"),
        "HF_HOME": str(ws.root / "hf-home"),
        "HF_REBASIN_NO_CACHE": "1",
        "COLUMNS": "200",
    }


def run_case(case: Case, ws: Workspace, argv: list[str]) -> Outcome:
    """Run the CLI with ``argv`` from ``ws.root`` as the case asks (in process or in a subprocess)."""
    start = time.perf_counter()
    done = _run(case, ws, argv)
    return dataclasses.replace(done, seconds=time.perf_counter() - start)


def _run(case: Case, ws: Workspace, argv: list[str]) -> Outcome:
    env = {**offline_env(ws), **case.env, **ws.env}
    if case.subprocess or case.hub or case.max_file_bytes:
        environ = {k: v for k, v in os.environ.items() if k != "HF_REBASIN_DEBUG"}
        environ.update(env)
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        proc = warm_cli.run_module(
            argv, env=environ, cwd=ws.root, timeout=case.timeout, max_file_bytes=case.max_file_bytes
        )
        return Outcome(proc.returncode, proc.stdout, proc.stderr)
    from helpers import run_main

    cwd = Path.cwd()
    os.chdir(ws.root)
    try:
        with interrupted_after(case.timeout):
            done = run_main(*argv, env=env)
    finally:
        os.chdir(cwd)
    return Outcome(done.returncode, done.stdout, done.stderr)


class Hung(BaseException):
    """An in-process run past its case's timeout (a BaseException: the CLI's own handler for
    internal errors must not turn it into an exit code)."""


@contextlib.contextmanager
def interrupted_after(seconds: float) -> Iterator[None]:
    """Raise `Hung` in this (the main) thread after ``seconds``, even inside a blocking ``open()``
    of a FIFO: a timer thread sends SIGUSR1, whose handler raises (SIGALRM is pytest-timeout's)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def hung(signum: int, frame: Any) -> None:
        raise Hung(f"the CLI was still running after {seconds:g} s")

    previous = signal.signal(signal.SIGUSR1, hung)
    main = threading.main_thread().ident
    timer = threading.Timer(seconds, lambda: signal.pthread_kill(main, signal.SIGUSR1))  # type: ignore[arg-type]
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR1, previous)


# a ``str.format``/f-string placeholder left in a message (``{s!r}``, ``{name}``, ``{0}``,
# ``{x.y}``, ``{x[0]}``, ``{n:,}``), not YAML or JSON braces (``{source: union}``, ``{"a": 1}``) nor
# an empty mapping shown as given (``{}``: a bare ``{}`` placeholder cannot be told from one)
_TEMPLATE = re.compile(r"\{[A-Za-z_]\w*(?:\.\w+|\[\w+\])*(?:![rsa])?(?::[^}\s]*)?\}|\{\d+\}")
# the same prefix twice in a row: ``MODEL 2: MODEL 2: …``, ```models.0.model`: `models.0.model`: …``
_DOUBLED = re.compile(r"(?:^|: )([^:\n]{1,80}): \1: ")


def message_problems(text: str) -> list[str]:
    """What a user-facing message must never show: a format placeholder, or a prefix doubled."""
    problems = [f"a template placeholder {m.group(0)!r}" for m in _TEMPLATE.finditer(text)]
    problems += [f"a doubled prefix {m.group(1)!r}" for m in _DOUBLED.finditer(text)]
    return problems


def assert_outcome(case: Case, result: Outcome) -> None:
    """Exit code and message as the case says; exit 2 is one ``error:`` paragraph, no traceback."""
    detail = f"exit {result.code}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-3000:]}"
    assert result.code == case.code, detail
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, detail
    if case.code == 2:
        assert result.err.startswith("error:"), detail
    for needle in case.needles:
        assert needle in result.err or needle in result.out, f"{needle!r} not in the output\n{detail}"
    problems = message_problems(result.err)  # no message shows a template or names its field twice
    assert not problems, f"{problems}\n{detail}"


def untouched(ws: Workspace, result: Outcome) -> None:
    """The usual check after a refusal: the inputs as they were, no output folder, no leftovers."""
    ws.unchanged()
    assert not (ws.root / "out").exists()
    assert not ws.leftovers(), ws.leftovers()


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
