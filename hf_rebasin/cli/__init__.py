"""The ``hf-rebasin`` command: parses arguments, runs a job, prints the result.

This package is the only part of hf-rebasin that prints: ``common`` (what every command shares),
``models`` (verify, align, embed, lineage) and ``recipes`` (run, demo, zoo, push, schema). Exit codes: 0 success, 1 internal error or a
verification outside tolerance, 2 user error (bad input, missing model) with a one-paragraph
message and no traceback. The top stage: it imports any stage, and none imports it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape

from hf_rebasin import __version__
from hf_rebasin.cli.common import DEBUG_ENV, EXIT_INTERNAL, EXIT_OK, EXIT_USER, _parse_options, recipe_shorthand
from hf_rebasin.cli.models import add_align, add_embed, add_lineage, add_verify
from hf_rebasin.cli.recipes import add_demo, add_push, add_run, add_schema, add_zoo
from hf_rebasin.core.errors import RebasinUserError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; a function so the README and tests can inspect it."""
    parser = argparse.ArgumentParser(
        prog="hf-rebasin",
        description=(
            "Align, merge and transport Hugging Face Transformers across their symmetries "
            "(permutations of heads and units, orthogonal maps of the residual stream)."
        ),
        epilog="Exit codes: 0 success, 1 internal error or outputs outside tolerance, 2 user error.",
    )
    parser.add_argument("--version", action="version", version=f"hf-rebasin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_verify(sub)
    add_align(sub)
    add_embed(sub)
    add_lineage(sub)
    add_run(sub)
    add_demo(sub)
    add_zoo(sub)
    add_push(sub)
    add_schema(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-rebasin`` and ``python -m hf_rebasin``; returns the exit code."""
    out = Console(highlight=False)
    err = Console(stderr=True, highlight=False)
    parser = build_parser()
    try:
        args = parser.parse_args(recipe_shorthand(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help / --version (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USER)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USER
    saved = _terminate_as_interrupt()
    try:
        return int(args.func(args, out))
    except RebasinUserError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        return EXIT_USER
    except KeyboardInterrupt as e:  # output.OutputInterrupted says what is on disk
        err.print(escape(str(e) or "interrupted"), soft_wrap=True)
        return 130
    except Exception as e:
        if os.environ.get(DEBUG_ENV) == "1":
            err.print(escape(traceback.format_exc()), soft_wrap=True)
        err.print(
            f"[red]internal error:[/] {escape(type(e).__name__)}: {escape(str(e))}\n"
            "This is a bug in hf-rebasin; please report it on the project's issue tracker with the command you ran "
            f"(rerun with {DEBUG_ENV}=1 to include the traceback).",
            soft_wrap=True,
        )
        return EXIT_INTERNAL
    finally:
        if saved is not None:
            signal.signal(signal.SIGTERM, saved)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _terminate_as_interrupt() -> Any:
    """SIGTERM handled like Ctrl-C (temporary folders removed, a truthful message); the previous
    handler, to restore, or None where signals cannot be set (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)
    return previous if previous is not None else signal.SIG_DFL


__all__ = [
    "DEBUG_ENV",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_USER",
    "_parse_options",
    "build_parser",
    "main",
    "recipe_shorthand",
]
