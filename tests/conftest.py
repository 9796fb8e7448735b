"""Shared test setup: `import tiny` from any test, and tiny models saved to folders.

Torch runs on one thread per test process unless ``OMP_NUM_THREADS`` says otherwise (set before
torch is imported, so the CLI subprocesses inherit it): the tests' models are tiny, where a second
intra-op thread costs more than it brings, and the suite runs one process per core (``-n 2``). On
2 cores this took the fast suite from 13.4 min (2 threads, one process) to 4.9 min.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
# `datasets` reads its cache folder once, at import: runs of the CLI in this process (`run_main`)
# cache what they read here, never in the user's ~/.cache
_DATASETS_CACHE = tempfile.mkdtemp(prefix="hf-rebasin-tests-datasets-")
os.environ.setdefault("HF_DATASETS_CACHE", _DATASETS_CACHE)
atexit.register(shutil.rmtree, _DATASETS_CACHE, True)

import pytest  # noqa: E402 (after the environment torch and datasets read at import)
import torch  # noqa: E402

TESTS = Path(__file__).resolve().parent
# the shared helpers (tests/*.py) and every stage's folder: a test may reuse another's builders by
# module name (``from test_lineage import _fine_tuned``) wherever either lives
for _folder in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import tiny  # noqa: E402
from bad_input import message_problems  # noqa: E402
from hf_rebasin.core.errors import RebasinError  # noqa: E402
from hub_server import HubServer, serve_hub  # noqa: E402

SaveModel = Callable[..., Path]

# -- every error message hf-rebasin builds, checked -------------------------------------------------
# RebasinError.__init__ is wrapped for the whole run: each message any test makes hf-rebasin build
# (raised to the user or not) is checked for a format placeholder or a doubled prefix, and the test
# that built a bad one fails. HF_REBASIN_ERROR_SITES=DIR writes the distinct places in hf_rebasin/
# that built one (file:line) to DIR, one file per test process: the error paths the check covered.
ROOT = TESTS.parent
_BAD: list[str] = []  # the current test's bad messages
_SITES: set[str] = set()
_original_init = RebasinError.__init__


def _site(error: BaseException) -> str:
    """file:line that built ``error``: the first frame above the exception classes' own __init__."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is error:
        frame = frame.f_back
    path = Path(frame.f_code.co_filename)
    where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    return f"{where}:{frame.f_lineno}"


def _checked_init(self: RebasinError, *args: Any, **kwargs: Any) -> None:
    super(RebasinError, self).__init__(*args, **kwargs)
    site = _site(self)
    if site.startswith("hf_rebasin/"):
        _SITES.add(site)
    try:
        message = str(self)
    except Exception:  # a message that cannot be shown is its own bug, found elsewhere
        return
    problems = message_problems(message)
    if problems:
        _BAD.append(f"{type(self).__name__} built at {site}: {'; '.join(problems)}\n  {message[:500]}")


RebasinError.__init__ = _checked_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def error_messages_are_clean() -> Iterator[None]:
    """The test fails if hf-rebasin built an error message with a template or a doubled prefix."""
    _BAD.clear()
    yield
    if _BAD:
        found = "\n".join(dict.fromkeys(_BAD))
        _BAD.clear()
        pytest.fail(f"hf-rebasin built error messages a user must never see:\n{found}", pytrace=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With HF_REBASIN_ERROR_SITES=DIR: the places that built an error, for counting the paths covered."""
    folder = os.environ.get("HF_REBASIN_ERROR_SITES")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"sites-{worker}.txt").write_text("".join(f"{s}\n" for s in sorted(_SITES)))


@pytest.fixture(autouse=True)
def no_alignment_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The alignment cache is off in every test (CLI subprocesses inherit this): runs must not read
    alignments left in ~/.cache by an earlier session, nor time a cache hit as an alignment.
    tests/alignment/test_cache.py turns it on, with its own cache root."""
    monkeypatch.setenv("HF_REBASIN_NO_CACHE", "1")


@pytest.fixture
def saved_model(tmp_path: Path) -> SaveModel:
    """Factory: ``saved_model("gpt2")`` (a `tiny.FACTORIES` name) or ``saved_model(model)`` -> folder.

    The folder is what ``save_pretrained`` writes (config.json + model.safetensors), the same
    thing a user hands to the CLI.
    """
    count = 0

    def save(model: str | torch.nn.Module, *, seed: int = 0, name: str | None = None) -> Path:
        nonlocal count
        label = model if isinstance(model, str) else type(model).__name__
        module: Any = tiny.FACTORIES[model](seed) if isinstance(model, str) else model
        count += 1
        folder = tmp_path / (name or f"{label}-{count}")
        module.save_pretrained(str(folder))
        return folder

    return save


@pytest.fixture
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """A local Hub-compatible server (tests/hub_server.py); tokens: ALICE_TOKEN -> alice, BOB_TOKEN -> bob.

    The client reads HF_ENDPOINT at import: talk to it from a subprocess (`hub_server.run_client`).
    """
    with serve_hub(tmp_path_factory.mktemp("hub-storage")) as server:
        yield server


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA: skipped, with the reason, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (benchmarks/scale/gpu_check.sh runs these where one is)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
