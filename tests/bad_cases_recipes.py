"""Bad-input corpus rows: recipes that cost too much to read (see tests/bad_input.py).

A recipe is a few dozen lines of YAML; these are the ones a stranger can make expensive: nested
100 000 deep, 50 MB of comments or of list, more values than any recipe needs, a recipe path that is
a FIFO, a device or a symlink loop. Each is refused before anything else is read, in well under a
second, and the limit is named in the message (hf_rebasin/recipe/limits.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from bad_input import Case, Outcome, Workspace, untouched

_MB50 = 50 * 1024 * 1024
_STARTED: dict[Path, float] = {}  # the case's folder -> when its build ended (the run starts next)

# -- helpers ------------------------------------------------------------------------------------


def _ready(ws: Workspace, argv: list[str]) -> list[str]:
    """Snapshot the inputs and start the clock: the run comes next. The modules the command
    imports before it reads the recipe (torch, 2-4 s) are imported first: the clock times the
    recipe's checks, not the first import in a test process."""
    import hf_rebasin.cli
    import hf_rebasin.run  # noqa: F401

    ws.snapshot()
    _STARTED[ws.root] = time.monotonic()
    return argv


_untouched = untouched  # nothing written: inputs as they were, no output, no leftovers


def _refused(within: float, *, absent: tuple[str, ...] = ()) -> Callable[[Workspace, Outcome], None]:
    """`_untouched`, in less than ``within`` seconds, and none of ``absent`` in the message."""

    def check(ws: Workspace, result: Outcome) -> None:
        elapsed = time.monotonic() - _STARTED.pop(ws.root)
        assert elapsed < within, f"took {elapsed:.1f} s"
        _untouched(ws, result)
        for word in absent:
            assert word not in result.err.lower(), result.err

    return check


def _base(ws: Workspace) -> str:
    """The vanilla merge of ./a and ./b into ./out, as text."""
    return ws.merge_recipe().read_text(encoding="utf-8")


def _padded(ws: Workspace, head: str, line: str, size: int) -> list[str]:
    """A recipe of ``head`` and then ``line`` repeated to exactly ``size`` bytes."""
    count, rest = divmod(size - len(head.encode()), len(line.encode()))
    recipe = ws.recipe(head + line * count + "#" * rest)
    return _ready(ws, [str(recipe)])


# -- builds -------------------------------------------------------------------------------------


def _nested_flow(ws: Workspace) -> list[str]:
    recipe = ws.recipe(_base(ws) + "extra: " + "[" * 100_000 + "]" * 100_000 + "\n")
    return _ready(ws, [str(recipe)])


def _nested_block_mappings(ws: Workspace) -> list[str]:
    # block mappings 10 000 deep need 50 MB of indentation (a size refusal, as below); 1 000 is 0.5 MB
    nested = "".join(f"{' ' * i}k{i}:\n" for i in range(1_000)) + " " * 1_000 + "leaf\n"
    recipe = ws.recipe(_base(ws) + "extra:\n" + "".join(" " + line + "\n" for line in nested.splitlines()))
    return _ready(ws, [str(recipe)])


def _nested_block_sequences(ws: Workspace) -> list[str]:
    recipe = ws.recipe(_base(ws) + "extra:\n  " + "- " * 10_000 + "leaf\n")
    return _ready(ws, [str(recipe)])


def _comments_50mb(ws: Workspace) -> list[str]:
    return _padded(ws, _base(ws), "# " + "a long comment " * 5 + "\n", _MB50)


def _list_50mb(ws: Workspace) -> list[str]:
    head = "job: merge\nstrategy: vanilla\noutput: {dir: out}\ndevice: cpu\nmodels: [./a, ./b"
    _base(ws)
    return _padded(ws, head, ", ./a, ./b", _MB50)  # the list left open: the size is refused first


def _values_900kb(ws: Workspace) -> list[str]:
    models = ", ".join(["./a", "./b"] * 90_000)  # 180 000 values in 900 KB, written out (no alias)
    text = f"job: merge\nmodels: [{models}]\nstrategy: vanilla\noutput: {{dir: out}}\ndevice: cpu\n"
    _base(ws)
    assert 800_000 < len(text) < 1_000_000
    return _ready(ws, [str(ws.recipe(text))])


def _fifo(ws: Workspace) -> list[str]:
    _base(ws)
    path = ws.root / "pipe.yaml"
    os.mkfifo(path)  # no writer: opening it for reading would wait forever
    return _ready(ws, [str(path)])


def _symlink_loop(ws: Workspace) -> list[str]:
    _base(ws)
    path = ws.root / "loop.yaml"
    path.symlink_to("loop.yaml")
    return _ready(ws, [str(path)])


def _dev_zero(ws: Workspace) -> list[str]:
    _base(ws)
    path = ws.root / "zero.yaml"
    path.symlink_to("/dev/zero")  # endless zeros: a read of it never ends
    return _ready(ws, [str(path)])


def _comments_600kb(ws: Workspace) -> list[str]:
    text = _base(ws) + ("# " + "a long comment " * 5 + "\n") * 7_500
    assert 550_000 < len(text) < 650_000
    return _ready(ws, [str(ws.recipe(text))])


def _comments_small(ws: Workspace) -> list[str]:
    text = "# merge the two seeds: the card keeps this comment\n" + _base(ws) + "# and this one\n"
    return _ready(ws, [str(ws.recipe(text))])


def _pad_2_40(ws: Workspace) -> list[str]:
    recipe = ws.merge_recipe(tokenizer={"pad_to_multiple_of": 2**40})  # rows for a list of 2**40: all memory
    return _ready(ws, [str(recipe), "--dry-run"])


def _merge_source(source: str) -> Callable[[Workspace], list[str]]:
    """A merge of two models whose tokenizer comes from ``source`` (not a merge's)."""

    def build(ws: Workspace) -> list[str]:
        return _ready(ws, [str(ws.merge_recipe(tokenizer={"source": source}))])

    return build


def _transport_source_base(ws: Workspace) -> list[str]:
    for name, seed in (("a", 0), ("b", 1), ("c", 2)):
        ws.model(name, seed=seed)
    body = {"job": "transport", "base": "./a", "finetuned": "./b", "target": "./c", "strategy": "vanilla"}
    body |= {"calibrate": False}
    recipe = ws.recipe({**body, "tokenizer": {"source": "base"}, "output": {"dir": "out"}, "device": "cpu"})
    return _ready(ws, [str(recipe)])


def _set_nested(ws: Workspace) -> list[str]:
    ws.model("a", seed=0)
    ws.model("b", seed=1)
    value = "max_iter=" + "[" * 100_000 + "]" * 100_000
    return _ready(ws, ["align", "./a", "./b", "--strategy", "weight-matching", "--set", value])


# -- checks -------------------------------------------------------------------------------------


def _card(ws: Workspace) -> str:
    """The run wrote ./out and nothing else; its card."""
    ws.unchanged(allow_new=("out/",))
    assert not ws.leftovers(), ws.leftovers()
    return (ws.root / "out" / "README.md").read_text(encoding="utf-8")


def _card_without_comments(ws: Workspace, result: Outcome) -> None:
    card = _card(ws)
    assert len(card.encode()) < 32 * 1024, len(card.encode())
    assert "7,500 comment lines left out" in card, card[:3000]
    assert "a long comment" not in card


def _card_with_comments(ws: Workspace, result: Outcome) -> None:
    card = _card(ws)
    assert "# merge the two seeds: the card keeps this comment" in card and "# and this one" in card
    assert "left out" not in card


_TOO_BIG = ("1 MiB (1,048,576 bytes)",)
_NO_TEMPLATE = ("{s", "!r}")  # the message shows the value, not its placeholder
_SOURCE_BEFORE = "exit 2, the message ending in a literal `not {s!r}`: the value never shown"

CASES: list[Case] = [
    Case(
        "recipe-nested-100k-flow",
        "recipe",
        _nested_flow,
        2,
        needles=("recipe.yaml", "more than 64 levels deep"),
        check=_refused(3.0),
        before="exit 1 after 4.9 s (a subprocess): internal error RecursionError",
    ),
    Case(
        "recipe-nested-block-mappings",
        "recipe",
        _nested_block_mappings,
        2,
        needles=("recipe.yaml", "more than 64 levels deep"),
        check=_refused(3.0),
        before="exit 1: internal error RecursionError",
    ),
    Case(
        "recipe-nested-block-sequences-10k",
        "recipe",
        _nested_block_sequences,
        2,
        needles=("recipe.yaml", "more than 64 levels deep"),
        check=_refused(3.0),
        before="exit 1: internal error RecursionError",
    ),
    Case(
        "recipe-50mb-comments",
        "recipe",
        _comments_50mb,
        2,
        needles=("recipe.yaml", "52,428,800 bytes", *_TOO_BIG),
        check=_refused(2.0),
        before="exit 0 after 63 s here (143 s in the issue), with a 50 MB README.md",
    ),
    Case(
        "recipe-50mb-list",
        "recipe",
        _list_50mb,
        2,
        needles=("recipe.yaml", "52,428,800 bytes", *_TOO_BIG),
        check=_refused(2.0, absent=("alias",)),
        before="still parsing after 200 s (stopped); the issue saw it refused, as an alias bomb",
    ),
    Case(
        "recipe-values-literal",
        "recipe",
        _values_900kb,
        2,
        needles=("recipe.yaml", "more than 100000 values", "no recipe needs that many"),
        check=_refused(5.0, absent=("alias",)),
        before="exit 2 after 6.6 s, called an alias bomb (there is no alias)",
    ),
    Case(
        "recipe-fifo",
        "recipe",
        _fifo,
        2,
        needles=("pipe.yaml", "FIFO", "not a regular file"),
        check=_untouched,
        timeout=60,  # a regression blocks on the FIFO: interrupted then (bad_input.Hung), and fails
        before="hung (stopped after 200 s): opening a FIFO waits for a writer",
    ),
    Case(
        "recipe-symlink-loop",
        "recipe",
        _symlink_loop,
        2,
        needles=("loop.yaml", "symlink loop"),
        check=_untouched,
        before="exit 2 'cannot be read: [Errno 40] Too many levels of symbolic links'",
    ),
    Case(
        "recipe-dev-zero",
        "recipe",
        _dev_zero,
        2,
        needles=("zero.yaml", "/dev/zero", "character device"),
        check=_refused(5.0),
        before="read /dev/zero until memory ran out: exit 1, internal error MemoryError",
    ),
    Case(
        "recipe-comments-600kb",
        "recipe",
        _comments_600kb,
        0,
        check=_card_without_comments,
        before="exit 0 with a 587 KB README.md (every comment echoed)",
    ),
    Case(
        "recipe-comments-kept",
        "recipe",
        _comments_small,
        0,
        check=_card_with_comments,
    ),
    Case(
        "recipe-pad-to-multiple-of-2-40",
        "recipe",
        _pad_2_40,
        2,
        needles=("`tokenizer.pad_to_multiple_of`", "less than or equal to 4096", "1099511627776"),
        check=_refused(1.0),
        before="the dry run built a list of 2**40 rows: exit 137 after 23 GB (a stale lock left), or exit 1 with "
        'an internal MemoryError under a memory limit; `"64"` and `true` were accepted',
    ),
    Case(
        "recipe-merge-tokenizer-source-models-5",
        "recipe",
        _merge_source("models[5]"),
        2,
        needles=("`tokenizer.source`", "not 'models[5]'"),
        check=_refused(2.0, absent=_NO_TEMPLATE),
        before=_SOURCE_BEFORE,
    ),
    Case(
        "recipe-merge-tokenizer-source-target",
        "recipe",
        _merge_source("target"),
        2,
        needles=("`tokenizer.source`", "not 'target'"),
        check=_refused(2.0, absent=_NO_TEMPLATE),
        before=_SOURCE_BEFORE,
    ),
    Case(
        "recipe-transport-tokenizer-source-base",
        "recipe",
        _transport_source_base,
        2,
        needles=("`tokenizer.source`", "not 'base'"),
        check=_refused(2.0, absent=_NO_TEMPLATE),
        before=_SOURCE_BEFORE,
    ),
    Case(
        "align-set-nested-100k",
        "recipe",
        _set_nested,
        2,
        needles=("--set max_iter", "more than 64 levels deep"),
        check=_refused(5.0),
        before="exit 1: internal error RecursionError",
    ),
]
