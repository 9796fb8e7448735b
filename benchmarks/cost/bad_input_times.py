"""Rows of the bad-input corpus run through the real CLI, timed: what each refusal says and how long
it takes (a refusal is never slower than the work it saves).

    python benchmarks/cost/bad_input_times.py                       # the file, tokenizer and recipe rows
    python benchmarks/cost/bad_input_times.py --area files --ids config-json-list-run header-is-a-list

Prints a markdown table: the row, the exit code, the seconds the CLI ran (a subprocess where the row
asks for one, so Python's start-up is counted there), and the first words of its message.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(ROOT / "tests"),
    str(ROOT / "tests" / "cli"),
]  # the corpus helpers, and the test that lists its rows

from test_bad_input import CASES  # noqa: E402

from bad_input import Workspace, run_case  # noqa: E402

DEFAULT_AREAS = ("files", "tokenizers", "recipe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--area", nargs="*", default=None, help=f"row areas (default: {', '.join(DEFAULT_AREAS)})")
    parser.add_argument("--ids", nargs="*", default=None, help="only these rows")
    parser.add_argument("--width", type=int, default=110, help="characters of each message shown")
    args = parser.parse_args()
    areas = set(args.area) if args.area else None
    chosen = [
        c
        for c in CASES
        if (args.ids is None or c.id in args.ids)
        and (args.ids or c.area in (areas if areas is not None else DEFAULT_AREAS))
    ]
    print(f"{len(CASES)} rows in the corpus; {len(chosen)} run here\n")
    print("| row | exit | seconds | message |")
    print("|---|---:|---:|---|")
    for case in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            ws = Workspace(Path(tmp))
            with contextlib.redirect_stderr(io.StringIO()):  # the builders' save_pretrained progress bars
                argv = case.build(ws)
            done = run_case(case, ws, argv)
        text = (done.err or done.out).replace(tmp, "…").replace("|", "\\|")
        shown = text[: args.width] + ("…" if len(text) > args.width else "")
        ok = "" if done.code == case.code else f" (expected {case.code})"
        print(f"| {case.id} | {done.code}{ok} | {done.seconds:.2f} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
