"""The ``hf-rebasin`` command: parses arguments, runs a job, prints the result.

This is the only module that prints. Exit codes (DESIGN.md §9): 0 success, 1 internal error or a
verification outside tolerance, 2 user error (bad input, missing model) with a one-paragraph
message and no traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import PickleRefusedError, RebasinUserError

if TYPE_CHECKING:
    from .verify import VerifyReport

EXIT_OK = 0
EXIT_INTERNAL = 1  # also: verification outside tolerance
EXIT_USER = 2
DEBUG_ENV = "HF_REBASIN_DEBUG"


def _quiet_libraries() -> None:
    """Silence transformers/hub logging and progress bars so the CLI prints only its own report.

    Done here (not at import of the library modules) so that users of the Python API keep their own
    logging settings.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover - older huggingface_hub
        pass


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

    verify = sub.add_parser(
        "verify",
        help="apply a random allowed symmetry transform to a model and check its outputs do not change",
        description=(
            "Apply a random transform drawn from the model's symmetry classes and print the max |Δ| "
            "of its outputs. Exit 0 when within tolerance, 1 otherwise, 2 on bad input."
        ),
    )
    verify.add_argument("model", metavar="MODEL", help="a local model folder (config.json + model.safetensors)")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random transform and inputs (default 0)")
    verify.add_argument(
        "--class",
        dest="transform_class",
        choices=("permutation", "orthogonal"),
        default="permutation",
        help="richest transform class to draw from (default permutation); spaces that do not admit it "
        "fall back to permutations, and the report says which",
    )
    verify.add_argument(
        "--allow-pickle",
        action="store_true",
        help="load pytorch_model.bin checkpoints (pickle can run code: only for sources you trust)",
    )
    verify.set_defaults(func=cmd_verify)

    al = sub.add_parser(
        "align",
        help="bring model B into model A's basis with one strategy and report how far apart they are",
        description=(
            "Align model B to model A (same architecture) with a data-free strategy, print the distance "
            "between their weights before and after, and optionally save aligned B as a standard model folder. "
            "Recipes (`hf-rebasin RECIPE.yaml`) add alignment data, merging and barriers."
        ),
    )
    al.add_argument("model_a", metavar="MODEL_A", help="reference model folder")
    al.add_argument("model_b", metavar="MODEL_B", help="model folder to align to MODEL_A")
    al.add_argument("--strategy", default="weight-matching", help="strategy name (default weight-matching)")
    al.add_argument(
        "--set",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a strategy option (YAML value), e.g. --set iterations=5; repeatable",
    )
    al.add_argument("--output", metavar="DIR", help="save aligned B here (refused if it exists)")
    al.add_argument("--allow-pickle", action="store_true", help="load pytorch_model.bin checkpoints")
    al.set_defaults(func=cmd_align)
    return parser


def _group_spaces(classes: dict[str, str]) -> list[tuple[str, int, str]]:
    """Per-layer spaces compressed to one row: ``h.0.attn``, ``h.1.attn`` -> ``h.{i}.attn`` x 2."""
    rows: dict[tuple[str, str], int] = {}
    for name, cls in classes.items():
        key = (re.sub(r"\d+", "{i}", name), cls)
        rows[key] = rows.get(key, 0) + 1
    return [(pattern, count, cls) for (pattern, cls), count in rows.items()]


def _format_tolerance(tol: float) -> str:
    mantissa, exponent = f"{tol:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def print_verify_report(console: Console, report: VerifyReport, model_desc: str, seed: int) -> None:
    """The human-readable verify report: spaces, fallbacks, untied aliases, outputs, max |Δ|."""
    console.print(f"model: {escape(model_desc)}")
    console.print(f"transform: random {report.transform_class} (seed {seed})")

    table = Table(title="symmetry spaces", title_justify="left")
    table.add_column("space")
    table.add_column("count", justify="right")
    table.add_column("class")
    for pattern, count, cls in _group_spaces(report.classes):
        table.add_row(escape(pattern), str(count), escape(cls))
    console.print(table)

    if report.fallbacks:
        console.print(
            f"[yellow]{report.transform_class} requested: {len(report.fallbacks)} space(s) fall back to permutation[/]"
        )
        for note in report.fallbacks:
            console.print(f"  fallback: {escape(note)}", soft_wrap=True)
    if report.untied:
        console.print(
            "untied for the canonical form (tied to the embeddings, stored separately in the transformed model): "
            + escape(", ".join(report.untied)),
            soft_wrap=True,
        )
    console.print(f"compared outputs: {escape(', '.join(report.compared)) or '(none)'}")
    line = f"max |Δ| = {report.max_abs_diff:.3g} (tolerance {_format_tolerance(report.tolerance)})"
    if report.ok:
        console.print(f"{line}  [green]OK[/]: outputs unchanged")
    else:
        console.print(f"{line}  [red]FAILED[/]: the transform changed the outputs")


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin verify``: load a folder, run a random allowed transform, report max |Δ|."""
    _quiet_libraries()
    from .models import load_model
    from .verify import verify_model

    try:
        loaded = load_model(args.model, allow_pickle=args.allow_pickle)
    except PickleRefusedError as e:
        raise PickleRefusedError(f"{e} (on the command line: --allow-pickle)") from None
    model = loaded.model
    config: Any = getattr(model, "config", None)
    desc = f"{loaded.path} ({type(model).__name__}, model_type {getattr(config, 'model_type', '?')})"
    with console.status("verifying…"):
        report = verify_model(model, args.transform_class, args.seed)
    print_verify_report(console, report, desc, args.seed)
    return EXIT_OK if report.ok else EXIT_INTERNAL


def _parse_options(items: Sequence[str]) -> dict[str, Any]:
    import yaml

    from .errors import StrategyOptionError

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise StrategyOptionError(f"--set {item!r}: expected KEY=VALUE, e.g. --set iterations=5")
        out[key.strip()] = yaml.safe_load(value)
    return out


def cmd_align(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin align``: load two folders, align B to A, report distances, optionally save B."""
    _quiet_libraries()
    from .models import check_compatible, check_output_folder, load_model, save_model
    from .strategies import Pair, get_strategy
    from .strategies.base import relative_distance

    strategy = get_strategy(args.strategy)
    options = strategy.parse(_parse_options(args.options))
    if args.output:
        check_output_folder(args.output)
    a = load_model(args.model_a, allow_pickle=args.allow_pickle)
    b = load_model(args.model_b, allow_pickle=args.allow_pickle)
    check_compatible(a, b)
    pair = Pair(a.graph, a.model.state_dict(), b.model.state_dict(), a.model, b.model)
    with console.status(f"aligning with {strategy.name}…"):
        alignment = strategy.run(pair, options, None)
        aligned = alignment.aligned_b()
    table = Table(title=f"{strategy.name}: {strategy.paper}", title_justify="left")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("‖A − B‖ / ‖A‖ before", f"{relative_distance(alignment.sd_a, alignment.sd_b):.4f}")
    table.add_row("‖A − B‖ / ‖A‖ after", f"{relative_distance(alignment.sd_a, aligned):.4f}")
    table.add_row(
        "seconds (of which in solvers)", f"{alignment.timings['total']:.2f} ({alignment.timings['solver']:.2f})"
    )
    table.add_row("function preserving", "yes" if alignment.exact else "[red]no[/] (experimental option)")
    console.print(table)
    for note in alignment.notes:
        console.print(f"note: {escape(note)}", soft_wrap=True)
    if alignment.untied:
        console.print("untied for the canonical form: " + escape(", ".join(alignment.untied)), soft_wrap=True)
    if args.output:
        folder = save_model(b.model, aligned, args.output, untie=bool(alignment.untied))
        console.print(f"aligned B saved to {escape(str(folder))}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-rebasin`` and ``python -m hf_rebasin``; returns the exit code."""
    out = Console(highlight=False)
    err = Console(stderr=True, highlight=False)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USER)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USER
    try:
        return int(args.func(args, out))
    except RebasinUserError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        return EXIT_USER
    except KeyboardInterrupt:
        err.print("interrupted")
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


if __name__ == "__main__":
    sys.exit(main())
