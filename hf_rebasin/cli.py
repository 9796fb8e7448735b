"""The ``hf-rebasin`` command: parses arguments, runs a job, prints the result.

This is the only module that prints. Exit codes: 0 success, 1 internal error or a
verification outside tolerance, 2 user error (bad input, missing model) with a one-paragraph
message and no traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import IncompatibleModelsError, PickleRefusedError, RebasinUserError, named
from .names import KINDS

if TYPE_CHECKING:
    from .run import RunResult
    from .scores import Transport
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


def _quiet_datasets() -> None:
    """Silence `datasets` logging and progress bars (reading local files is not worth a bar). Its
    errors too: a file it cannot read becomes hf-rebasin's own error naming the file and line, and
    `datasets`' line before it ("Failed to load JSON ...") would only repeat it in other words."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        from datasets.utils import logging as ds_logging
    except ImportError:  # pragma: no cover - datasets is a dependency
        return
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    ds_logging.disable_progress_bar()


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
    _add_verify(sub)
    _add_align(sub)
    _add_embed(sub)
    _add_lineage(sub)
    _add_run(sub)
    _add_demo(sub)
    _add_zoo(sub)
    _add_push(sub)
    _add_schema(sub)
    return parser


def _add_verify(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``verify`` command's arguments."""
    verify = sub.add_parser(
        "verify",
        help="apply a random allowed symmetry transform to a model and check its outputs do not change",
        description=(
            "Apply a random transform drawn from the model's symmetry classes and print the max |Δ| "
            "of its outputs. Exit 0 when within tolerance, 1 otherwise, 2 on bad input."
        ),
    )
    verify.add_argument(
        "model",
        metavar="MODEL",
        help="a local model folder (config.json + model.safetensors), a Hub id[@revision] or zoo:KIND-seedN",
    )
    verify.add_argument("--seed", type=int, default=0, help="seed of the random transform and inputs (default 0)")
    verify.add_argument(
        "--class",
        dest="transform_class",
        choices=("permutation", "signed-permutation", "orthogonal"),
        default="permutation",
        help="richest transform class to draw from (default permutation); spaces that do not admit it "
        "fall back (orthogonal to signed permutations where a norm's scale cannot be folded, else to "
        "permutations), and the report says which",
    )
    verify.add_argument(
        "--allow-pickle",
        action="store_true",
        help="load pytorch_model.bin checkpoints (pickle can run code: only for sources you trust)",
    )
    verify.set_defaults(func=cmd_verify)


def _add_align(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``align`` command's arguments."""
    al = sub.add_parser(
        "align",
        help="bring model B into model A's basis with one strategy and report how far apart they are",
        description=(
            "Align model B to model A (same architecture) with a data-free strategy, print the distance "
            "between their weights before and after, and optionally write both models in one basis as standard model "
            "folders, ready for any merge tool (mergekit, a notebook). "
            "Recipes (`hf-rebasin RECIPE.yaml`) add alignment data, merging and barriers."
        ),
    )
    al.add_argument(
        "model_a", metavar="MODEL_A", help="reference model: a local folder, a Hub id[@revision] or zoo:KIND-seedN"
    )
    al.add_argument(
        "model_b",
        metavar="MODEL_B",
        help="model to align to MODEL_A: a local folder, a Hub id[@revision] or zoo:KIND-seedN",
    )
    al.add_argument("--strategy", default="weight-matching", help="strategy name (default weight-matching)")
    al.add_argument(
        "--set",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a strategy option (YAML value), e.g. --set iterations=5; repeatable",
    )
    al.add_argument(
        "--output",
        metavar="DIR",
        help="write both models in one basis here, as DIR/a (A, in canonical form when the strategy uses one) and "
        "DIR/b (B in A's basis), for mergekit or any other merge tool (refused if DIR exists)",
    )
    al.add_argument("--device", metavar="DEVICE", default="auto", help="auto (default), cpu, cuda, cuda:N or mps")
    al.add_argument("--allow-pickle", action="store_true", help="load pytorch_model.bin checkpoints")
    al.set_defaults(func=cmd_align)


def _add_embed(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``embed`` command's arguments."""
    em = sub.add_parser(
        "embed",
        help="write a model into the wider shape of another model of its family, computing the same function",
        description=(
            "Write MODEL into the shape of WIDE (same family, depth and vocabulary; hidden size, MLP units and "
            "attention heads at least as large): zeros where WIDE is wider, norms rescaled, a card saying what was "
            "padded. The result loads with the stock class and computes MODEL's logits (checked before writing). "
            "Recipes do this themselves for models of different widths."
        ),
    )
    em.add_argument(
        "model", metavar="MODEL", help="the narrower model: a local folder, a Hub id[@revision] or zoo:KIND-seedN"
    )
    em.add_argument(
        "--like",
        required=True,
        metavar="WIDE",
        help="a model of the wide shape (only its config.json is read): a folder, a Hub id or zoo:KIND-seedN",
    )
    em.add_argument(
        "--output", required=True, metavar="DIR", help="where to write the embedded model (refused if it exists)"
    )
    em.add_argument("--allow-pickle", action="store_true", help="load pytorch_model.bin checkpoints")
    em.set_defaults(func=cmd_embed)


def _add_lineage(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``lineage`` command's arguments."""
    li = sub.add_parser(
        "lineage",
        help="are these models related (a fine-tune, continued pretraining, a merge), up to every symmetry?",
        description=(
            "For every pair of the models (one family and depth): same basis (a plain average or naive transport "
            "is right), related up to symmetry (B is A's kin, permuted, rotated, rescaled or widened: align first) "
            "or independent (trained apart), with a p-value and the evidence per layer. Data-free: the weights' "
            "bulk (what is left of each matrix past its top singular directions) is compared after aligning the "
            "signals. Exit 0 with any verdict, 2 on bad input."
        ),
    )
    li.add_argument(
        "models",
        nargs="+",
        metavar="MODEL",
        help="two models or more: local folders, Hub ids[@revision] or zoo:KIND-seedN",
    )
    li.add_argument("--output", metavar="DIR", help="write lineage.json and lineage.png here (refused if DIR exists)")
    li.add_argument("--json", action="store_true", help="print lineage.json instead of the tables")
    li.add_argument("--allow-pickle", action="store_true", help="load pytorch_model.bin checkpoints")
    li.set_defaults(func=cmd_lineage)


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``run`` command's arguments."""
    run = sub.add_parser(
        "run",
        help="run a recipe (the same as `hf-rebasin RECIPE.yaml`)",
        description=(
            "Run a YAML recipe: the job it names (`job:`) on its models, with its strategy. "
            "`hf-rebasin schema` prints the recipe's JSON Schema, one per job."
        ),
    )
    run.add_argument("recipe", metavar="RECIPE.yaml", help="the recipe file")
    _run_options(run, "write the result here instead of `output.dir`")
    run.set_defaults(func=cmd_run, command_line=None)


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``demo`` command's arguments."""
    demo = sub.add_parser(
        "demo",
        help="run the shipped demo recipe offline: two tiny GPT-2 trained from different seeds, merged",
        description=(
            "Train two tiny GPT-2 on Shakespeare from seeds 0 and 1 (first use only, about a minute each on "
            "one core; cached in $HF_REBASIN_CACHE or ~/.cache/hf-rebasin), merge them with "
            "generalized-orthogonal and compare the loss barrier with plain averaging. The recipe is "
            "recipes/demo.yaml; the result goes to ./rebasin-demo."
        ),
    )
    _run_options(demo, f"result folder (default ./{DEMO_OUTPUT})", output=DEMO_OUTPUT)
    demo.set_defaults(func=cmd_demo)


def _add_zoo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``zoo`` command's arguments."""
    zoo = sub.add_parser(
        "zoo",
        help="train (first use) or find the zoo's tiny models and print their folders",
        description=(
            "The zoo: tiny models hf-rebasin trains itself, offline, for demos and tests (gpt2: character-level "
            "Shakespeare, about a minute; vit: 8x8 digits, about 30 s; gpt2-ft: the gpt2 of the same seed "
            "fine-tuned on another play, about 10 s; gpt2-lora: a PEFT LoRA adapter of it trained on that play, about "
            "10 s; gpt2-next: the gpt2 of the same seed trained further, a re-release, about 25 s; bert: a masked LM on "
            "the same text, about 2 min; qwen3, gemma, gemma2, gemma3, olmo2, phi3, pythia: causal LMs of those "
            "families trained like gpt2, about a minute each; distilbert, xlm-roberta, modernbert: masked LMs trained "
            "like bert, about 2 min each; dinov2, siglip: classifiers trained like vit, about 30 s each; mixtral: a "
            "mixture of experts trained like gpt2, about a minute; gpt2-d96, gpt2-d128, vit-d128: wider twins of gpt2 "
            "and vit (head width kept) for models of different widths, 2 to 7 min; gpt2-d96-h4: gpt2's 4 heads, each "
            "wider; one CPU core each; and the benchmark zoo, models closer to released ones that defaults are chosen on: bench-gpt2, "
            "bench-modernbert, bench-vit, bench-qwen3, bench-gemma2, 4 layers of width 128, 20 to 45 min each, and bench-gpt2-ft, bench-gpt2 fine-tuned "
            "on the King James Bible, pip install 'hf-rebasin[bench]'). Prints one folder per seed; recipes "
            "name them as zoo:KIND-seedN."
        ),
    )
    zoo.add_argument("kind", choices=KINDS, help="which model")
    zoo.add_argument("seeds", nargs="*", type=int, default=[0, 1], metavar="SEED", help="seeds (default 0 1)")
    zoo.set_defaults(func=cmd_zoo)


def _add_push(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``push`` command's arguments."""
    push = sub.add_parser(
        "push",
        help="upload an output folder to the Hub as one commit (e.g. to retry a failed push)",
        description=(
            "Create the repo if needed and upload the folder (model, card, rebasin.json, plot) as one commit. "
            "The token comes from HF_TOKEN or `hf auth login`."
        ),
    )
    push.add_argument("folder", metavar="FOLDER", help="an hf-rebasin output folder (holds rebasin.json)")
    push.add_argument("--repo", required=True, help="Hub repo id: name or org/name")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--revision", metavar="BRANCH", help="branch to push to (created if missing; default main)")
    push.add_argument("--message", metavar="TEXT", help="commit message")
    push.set_defaults(func=cmd_push)


def _add_schema(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``schema`` command's arguments."""
    schema = sub.add_parser("schema", help="print the JSON Schema of recipe files (for editors)")
    schema.set_defaults(func=cmd_schema)


def _run_options(parser: argparse.ArgumentParser, output_help: str, output: str | None = None) -> None:
    """``--dry-run``, ``--output``, ``--device``: shared by ``run`` and ``demo``."""
    parser.add_argument(
        "--dry-run", action="store_true", help="validate and print the plan; no weights loaded, nothing trained"
    )
    parser.add_argument("--output", metavar="DIR", default=output, help=output_help)
    parser.add_argument("--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps (overrides `device`)")
    parser.add_argument(
        "--no-memory-check",
        action="store_true",
        help="run even when the estimated peak memory exceeds what is available (the dry run prints the estimate)",
    )


COMMANDS = ("verify", "align", "run", "demo", "zoo", "push", "schema")
DEMO_OUTPUT = "rebasin-demo"
RECIPE_SUFFIXES = (".yaml", ".yml")


def recipe_shorthand(argv: Sequence[str]) -> list[str]:
    """``hf-rebasin RECIPE.yaml ...`` as ``hf-rebasin run RECIPE.yaml ...``.

    A first positional argument that names a sub-command keeps it; otherwise, when a positional
    argument ends in .yaml / .yml (or the first one is an existing file), it is a recipe and ``run``
    is put in front of everything (so ``--output DIR RECIPE.yaml`` works too).
    """
    args = list(argv)
    positionals = [a for a in args if not a.startswith("-")]
    if not positionals or positionals[0] in COMMANDS:
        return args
    if any(a.lower().endswith(RECIPE_SUFFIXES) for a in positionals) or os.path.isfile(positionals[0]):
        return ["run", *args]
    return args


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
    from .models import dtype_name, load_model
    from .verify import verify_model

    try:
        loaded = load_model(_model_folder(args.model, args.allow_pickle), allow_pickle=args.allow_pickle)
    except PickleRefusedError as e:
        raise PickleRefusedError(f"{e} (on the command line: --allow-pickle)") from None
    model = loaded.model
    config: Any = getattr(model, "config", None)
    desc = f"{loaded.path} ({type(model).__name__}, model_type {getattr(config, 'model_type', '?')})"
    # loaded as float32 whatever is stored: a bf16 model would round away more than the tolerance
    desc += f"; stored as {dtype_name(loaded.stored_dtype)}, compared in float32"
    with console.status("verifying…"):
        report = verify_model(model, args.transform_class, args.seed)
    print_verify_report(console, report, desc, args.seed)
    if loaded.ignored:  # after the report: what the check ran on, then what it did not read
        names = ", ".join(sorted(loaded.ignored))
        console.print(f"ignored as stock transformers ignores them when loading (legacy buffers): {names}")
    return EXIT_OK if report.ok else EXIT_INTERNAL


def _model_folder(value: str, allow_pickle: bool, where: str = "MODEL") -> str:
    """A folder as given, a zoo model (``zoo:gpt2-seed0``, trained on first use) or a Hub
    ``id[@revision]`` downloaded (what hf-rebasin reads of it)."""
    from pathlib import Path

    from . import hub
    from .recipe import ZOO_PATTERN

    zoo = ZOO_PATTERN.fullmatch(value)
    if zoo is not None:
        from .train import cached_model

        return str(cached_model(zoo.group(1), int(zoo.group(2))))
    repo, revision = hub.split_ref(value)
    if Path(value).exists() or hub.is_path(value) or not hub.is_repo_id(repo):
        return value
    try:
        return str(hub.download_model(repo, revision, allow_pickle=allow_pickle, where=where).folder)
    except RebasinUserError as e:
        if "/" in repo:
            raise
        raise type(e)(f"{e}; and there is no local folder {value!r} here (give ./{value} for a folder)") from None


def _parse_options(items: Sequence[str]) -> dict[str, Any]:
    import yaml

    from .errors import StrategyOptionError
    from .recipe.limits import YamlLimitError, load_limited

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise StrategyOptionError(f"`--set {item}`: expected KEY=VALUE, e.g. --set max_iter=5")
        try:
            parsed = load_limited(value, "the value")[1]  # nesting and size bounded as a recipe's are
        except YamlLimitError as e:
            raise StrategyOptionError(f"`--set {key.strip()}=...`: {e.message}") from None
        except yaml.YAMLError as e:
            what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
            raise StrategyOptionError(
                f"`--set {item}`: the value of {key.strip()} is not valid YAML ({what or e}); quote it, "
                "e.g. --set name='[1, 2]', or write a number, true/false, a word or a [list]"
            ) from None
        if not _plain_yaml(parsed):
            raise StrategyOptionError(
                f"`--set {item}`: the value of {key.strip()} is a {type(parsed).__name__}; an option is a number, "
                "true/false, a string, or a list or mapping of those"
            )
        out[key.strip()] = parsed
    return out


def _plain_yaml(value: Any) -> bool:
    """Whether a parsed ``--set`` value is plain data (no dates, binary, sets from YAML tags)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_plain_yaml(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_yaml(v) for k, v in value.items())
    return False


def cmd_align(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin align``: align B to A (folders or Hub ids), report distances, optionally write both."""
    from pathlib import Path

    _quiet_libraries()
    from .basis import check_gaps, function_gap, write_pair
    from .models import check_compatible, load_model, resolve_device, to_device
    from .output import check_output
    from .recipe import strategy_spec
    from .run.widths import to_widest
    from .strategies import Pair
    from .strategies.base import relative_distance

    given = {item.partition("=")[0].strip(): item for item in args.options}
    spec = strategy_spec(args.strategy, _parse_options(args.options), given)  # checked as a recipe's section
    strategy, options = spec.strategy, spec.options
    device = resolve_device(args.device, where="--device")
    named = {"A": args.model_a, "B": args.model_b}
    if args.output:  # before any download or load: a refused output costs nothing
        check_output(
            Path(args.output), False, inputs=[(f"MODEL_{k}", Path(v)) for k, v in named.items()], where="--output"
        )
    folders = {k: _model_folder(v, args.allow_pickle, where=f"MODEL_{k}") for k, v in named.items()}
    inputs = [(f"MODEL_{k}", Path(v)) for k, v in folders.items()]
    if args.output and folders != named:  # a download: its folder is an input too
        check_output(Path(args.output), False, inputs=inputs, where="--output")
    a, b = (load_model(folders[k], allow_pickle=args.allow_pickle) for k in ("A", "B"))
    (a, b), embedded = to_widest([a, b], [f"MODEL_{k} {v!r}" for k, v in named.items()])
    check_compatible(a, b)
    for done in embedded:
        console.print(f"note: {escape(done.note([f'MODEL_{k}' for k in named]))}", soft_wrap=True)
    for loaded in (a, b):
        to_device(loaded.model, device)
    pair = Pair(a.graph, a.model.state_dict(), b.model.state_dict(), a.model, b.model)
    with console.status(f"aligning with {strategy.name} on {device}…"):
        alignment = strategy.run(pair, options, None)
        aligned = alignment.aligned_b()
    distance = {
        "before": relative_distance(alignment.sd_a, alignment.sd_b),
        "after": relative_distance(alignment.sd_a, aligned),
    }
    gaps = {}
    if args.output and alignment.exact:
        with console.status("checking that both models compute what they did…"):
            gaps = {"A": function_gap(a.model, alignment.sd_a, bool(alignment.untied))}
            gaps["B"] = function_gap(b.model, aligned, bool(alignment.untied))
    table = Table(title=f"{strategy.name}: {strategy.paper}", title_justify="left")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("‖A − B‖ / ‖A‖ before", f"{distance['before']:.4f}")
    table.add_row("‖A − B‖ / ‖A‖ after", f"{distance['after']:.4f}")
    table.add_row(
        "seconds (of which in solvers)", f"{alignment.timings['total']:.2f} ({alignment.timings['solver']:.2f})"
    )
    table.add_row("function preserving", "yes" if alignment.exact else "[red]no[/] (experimental option)")
    for label, gap in gaps.items():
        table.add_row(f"max |Δ logits| of {label} as written", f"{gap.max_abs_diff:.2e} (≤ {gap.tolerance:.0e})")
    console.print(table)
    for note in alignment.notes:
        console.print(f"note: {escape(note)}", soft_wrap=True)
    if alignment.untied:
        console.print("untied for the canonical form: " + escape(", ".join(alignment.untied)), soft_wrap=True)
    if args.output:
        check_gaps(gaps)
        summary = {
            "strategy": strategy.name,
            "options": options.model_dump(mode="json"),
            "exact": alignment.exact,
            "distance": distance,
            "function_preserved": {
                k: {"max_abs_diff": g.max_abs_diff, "tolerance": g.tolerance} for k, g in gaps.items()
            },
        }
        models = {k: (named[k], loaded) for k, loaded in (("A", a), ("B", b))}
        folder = write_pair(Path(args.output), models, alignment, aligned, summary, inputs=inputs)
        what = "A in canonical form" if alignment.canonical else "A"
        console.print(
            f"written to {escape(str(folder))}: a/ ({what}) and b/ (B in A's basis), each as its input is stored; "
            "alignment.json and README.md say how they were made; mergekit.yaml merges them with mergekit",
            soft_wrap=True,
        )
    return EXIT_OK


def cmd_lineage(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin lineage``: every pair's verdict, its evidence, optionally written to a folder."""
    import json
    from pathlib import Path

    _quiet_libraries()
    from .lineage.pairs import lineage_of
    from .lineage.table import evidence_table, verdict_table
    from .models import load_model
    from .output import check_output

    if len(args.models) < 2:
        raise RebasinUserError("lineage compares two models or more: give MODEL_A MODEL_B [MODEL_C …]")
    named_inputs = [(f"MODEL {i + 1}", Path(m)) for i, m in enumerate(args.models)]
    if args.output:  # before any download or load: a refused output costs nothing
        check_output(Path(args.output), False, inputs=named_inputs, where="--output")
    folders = [_model_folder(m, args.allow_pickle, where=f"MODEL {i + 1}") for i, m in enumerate(args.models)]
    loaded = []
    for i, folder in enumerate(folders):
        with named(f"MODEL {i + 1}"):
            loaded.append(load_model(folder, allow_pickle=args.allow_pickle))
    with console.status("comparing…") as status:
        record = lineage_of(loaded, args.models, progress=lambda stage: status.update(escape(stage)))
    if args.json:
        console.print_json(record.model_dump_json())
    else:
        console.print(verdict_table(record))
        for pair in record.pairs:
            console.print(evidence_table(record, pair))
            console.print(f"next: {escape(pair.next_step)}", soft_wrap=True)
    if args.output:
        from .lineage.plot import plot_lineage
        from .output import output_folder, write_text

        inputs = [(f"MODEL {i + 1}", Path(f)) for i, f in enumerate(folders)]
        with output_folder(Path(args.output), overwrite=False, inputs=inputs, where="--output") as tmp:
            write_text(tmp / "lineage.json", json.dumps(record.model_dump(mode="json"), indent=1) + "\n")
            plot_lineage(record, tmp / "lineage.png", float(record.settings["null_similarity"]))
        if not args.json:
            console.print(f"written to {escape(args.output)}: lineage.json and lineage.png", soft_wrap=True)
    return EXIT_OK


def cmd_embed(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin embed``: MODEL written into WIDE's shape, checked, with a card."""
    from pathlib import Path

    _quiet_libraries()

    from .basis import write_embedded
    from .embed import embed_model
    from .models import load_model, read_config
    from .output import check_output

    refs = {"MODEL": args.model, "--like": args.like}
    check_output(Path(args.output), False, inputs=[(k, Path(v)) for k, v in refs.items()], where="--output")
    folders = {k: _model_folder(v, args.allow_pickle, where=k) for k, v in refs.items()}
    inputs = [(k, Path(v)) for k, v in folders.items()]
    loaded = load_model(folders["MODEL"], allow_pickle=args.allow_pickle)
    with named("--like"):
        like = read_config(Path(folders["--like"]))  # through the gate: confined, regular, typed
    with console.status("embedding…"):
        wide, embedding = embed_model(loaded.model, like)
        if not embedding.grown:
            raise IncompatibleModelsError(
                f"--like: {args.like!r} has the same widths as {args.model!r}: there is nothing to embed"
            )
        gap = write_embedded(Path(args.output), (args.model, args.like), loaded, wide, embedding, inputs=inputs)
    for line in embedding.describe():
        console.print(f"- {escape(line)}", soft_wrap=True)
    console.print(f"max |Δ logits| against {escape(args.model)}: {gap.max_abs_diff:.2e} (≤ {gap.tolerance:.0e})")
    console.print(
        f"written to {escape(args.output)} (README.md and embedding.json say what was padded)", soft_wrap=True
    )
    return EXIT_OK


def _progress_bars(console: Console) -> Any:
    """Rich progress bars, one per stage (loading, statistics, solving, each λ sweep)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


_PASS = re.compile(r"(.*) \(pass \d+\)")


def _stage_reporter(bars: Any) -> Any:
    """``progress(stage, done, total)`` for `run_recipe`: a bar per stage, created on first sight.

    Passes of one stage (``rotations (pass 3)``) share a bar that shows the current pass.
    """
    tasks: dict[str, Any] = {}

    def report(stage: str, done: int, total: int) -> None:
        match = _PASS.fullmatch(stage)
        key = match.group(1) if match else stage
        if key not in tasks:
            for task in bars.tasks:  # a new stage ends the earlier ones (a descent may stop early)
                if task.total is None or task.completed < task.total:
                    end = max(task.completed, 1)
                    bars.update(task.id, total=end, completed=end)
            tasks[key] = bars.add_task(escape(stage), total=total or None)
        bars.update(tasks[key], completed=done, total=total or None, description=escape(stage))

    return report


def print_run_summary(console: Console, result: RunResult) -> None:
    """The final table: one row per curve (both barriers, loss at ½), then what was written."""
    from .evaluate import Curve

    if result.curves:
        table = Table(title="loss barriers (nats)", title_justify="left")
        table.add_column("curve")
        table.add_column("midpoint", justify="right")
        table.add_column("linear", justify="right")
        table.add_column("loss at ½", justify="right")
        for name, curve in result.curves.items():
            c: Curve = curve
            half = min(range(len(c.lambdas)), key=lambda i: abs(c.lambdas[i] - 0.5))
            b = result.barriers[name]
            label = f"{c.losses[half]:.4f}" + ("" if c.lambdas[half] == 0.5 else f" (λ={c.lambdas[half]:.2f})")
            table.add_row(escape(name), f"{b['midpoint']:.4f}", f"{b['linear']:.4f}", label)
        console.print(table)
    if result.transport is not None and result.transport.loss is not None:
        _print_transport(console, result.transport)
    for label, score in result.merged.items():
        metrics = "".join(f", {k} {v:.4g}" for k, v in score.metric.items())
        what = "merged model" if label == result.strategy else f"merged without alignment ({label})"
        console.print(f"{escape(what)}: loss {score.loss:.4f}{escape(metrics)}")
    preserved = result.function_preserved
    if preserved is not None and preserved.max_abs_diff is not None:
        console.print(f"function preserved: max |Δ logits| of aligned models = {preserved.max_abs_diff:.3g}")
    else:
        reason = preserved.reason if preserved is not None else None
        console.print(f"function preserved: not checked ({escape(str(reason))})")
    for note in result.notes:
        console.print(f"note: {escape(note)}", soft_wrap=True)
    if result.canonical:
        untied = f"; untied: {', '.join(result.untied)}" if result.untied else ""
        console.print(f"note: the merged model is saved in canonical form (norm scales folded{escape(untied)})")
    t = result.timings
    train = f"train {t['train']:.1f}, " if "train" in t else ""
    check = f", check {t['check']:.1f}" if "check" in t else ""
    console.print(
        f"seconds: {train}load {t['load']:.1f}, align {t['align']:.1f}{check}, evaluate {t['evaluate']:.1f}, "
        f"save {t['save']:.1f}"
    )
    if result.pushed is not None:
        console.print(
            f"pushed to {escape(result.pushed.repo)}@{escape(result.pushed.revision)}: commit {result.pushed.commit} "
            f"({escape(result.pushed.url)})",
            soft_wrap=True,
        )
    console.print(
        f"{result.written} written to {escape(str(result.output))} ({escape(', '.join(result.files))})", soft_wrap=True
    )


def _print_transport(console: Console, moved: Transport) -> None:
    """Loss (and metric) of B, A_ft, B + α·τ and B + α·π(τ) on the task data, and on the support data."""
    for title, scores in (("task data", moved), ("support data", moved.support)):
        if scores is None or scores.loss is None or scores.metric is None:
            continue
        table = Table(title=f"transport: loss on the {title} (nats)", title_justify="left")
        table.add_column("model")
        table.add_column("loss", justify="right")
        table.add_column("metric", justify="right")

        loss, metric = scores.loss, scores.metric
        rows = [("target B", loss.target, metric.target)]
        if loss.base is not None and metric.base is not None:
            rows.append(("old base A", loss.base, metric.base))
        rows.append(("fine-tune A + τ", loss.finetuned, metric.finetuned))
        for i, alpha in enumerate(moved.alphas):
            if loss.naive is not None and metric.naive is not None:
                rows.append((f"naive B + {alpha:g}·τ", loss.naive[i], metric.naive[i]))
            rows.append((f"transported B + {alpha:g}·π(τ)", loss.transported[i], metric.transported[i]))
        for label, value, extra in rows:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in extra.items())
            table.add_row(escape(label), f"{value:.4f}", escape(shown))
        console.print(table)
    _print_tradeoff(console, moved)


def _print_tradeoff(console: Console, moved: Transport) -> None:
    """Task gain and support cost over B per α (and the fine-tune's own over A), and the α that
    `alpha: auto` saved."""
    points = moved.tradeoff
    if points is not None and points.transported is not None:
        table = Table(title="transport: task gain against support cost (nats over B)", title_justify="left")
        for column in ("model", "α", "task gain", "support cost"):
            table.add_column(column, justify="left" if column == "model" else "right")
        own = points.finetuned
        if own is not None:
            table.add_row("fine-tune A + τ (over A)", "—", f"{own.gain:+.4f}", f"{own.cost:+.4f}")
        for i, alpha in enumerate(points.alphas):
            for method, label in ((points.naive, "naive B + α·τ"), (points.transported, "transported B + α·π(τ)")):
                if method is not None:
                    table.add_row(escape(label), f"{alpha:g}", f"{method.gain[i]:+.4f}", f"{method.cost[i]:+.4f}")
        console.print(table)
    chosen = moved.chosen
    if chosen is not None:
        why = "no α qualified, see the note below" if chosen.rule == "fallback" else chosen.reason
        console.print(
            f"saved: α = {chosen.alpha:g}, chosen automatically ({escape(chosen.rule)}): {escape(why)}", soft_wrap=True
        )


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin run RECIPE.yaml`` (or ``hf-rebasin RECIPE.yaml``): validate, plan or run a recipe."""
    from pathlib import Path

    from .recipe import load_recipe

    recipe = load_recipe(args.recipe)  # before torch is imported: a refused recipe answers at once
    from .run import build_plan, run_recipe

    output = Path(args.output) if args.output else None
    if args.dry_run:
        planned = build_plan(recipe, output=output)
        for line in planned.lines():
            console.print(escape(line), soft_wrap=True)
        if planned.memory is not None and not args.no_memory_check:
            planned.memory.check()  # the numbers, and exit 2, as the run would stop
        return EXIT_OK
    _quiet_libraries()
    _quiet_datasets()
    with _progress_bars(console) as bars:
        result = run_recipe(
            recipe,
            output=output,
            device=args.device,
            progress=_stage_reporter(bars),
            command=args.command_line,
            check_memory=not args.no_memory_check,
        )
    print_run_summary(console, result)
    if result.push_error is not None:
        Console(stderr=True, highlight=False).print(f"[red]error:[/] {escape(result.push_error)}", soft_wrap=True)
        return EXIT_USER
    return EXIT_OK


def cmd_push(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin push DIR --repo R``: upload a finished output folder as one commit (retrying a push)."""
    from pathlib import Path

    from . import hub
    from .errors import ModelNotFoundError

    folder = Path(args.folder)
    if not (folder / "rebasin.json").is_file():
        raise ModelNotFoundError(f"FOLDER: {str(folder)!r} is not an hf-rebasin output folder (no rebasin.json)")
    _quiet_libraries()
    with console.status(f"pushing {folder} to {args.repo}…"):
        result = hub.push_folder(
            folder,
            args.repo,
            private=args.private or None,
            revision=args.revision,
            commit_message=args.message,
            retry=False,  # the user just ran the command to retry with
        )
    console.print(f"pushed to {escape(result.repo)}@{escape(result.revision)}: commit {result.commit}")
    console.print(escape(result.url), soft_wrap=True)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin demo``: the shipped recipes/demo.yaml, written to ./rebasin-demo by default."""
    from .resources import resource

    args.recipe = str(resource("recipes", "demo.yaml"))
    args.command_line = "hf-rebasin demo"
    return cmd_run(args, console)


def cmd_zoo(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin zoo KIND SEED...``: the zoo folders (trained on first use), one per line."""
    _quiet_libraries()
    from .recipe import ModelRef
    from .run import resolve_model

    with _progress_bars(Console(stderr=True, highlight=False)) as bars:  # stdout: the folders only
        folders = [
            resolve_model(
                ModelRef(model=f"zoo:{args.kind}-seed{s}", revision=None, label=None),
                "zoo",
                progress=_stage_reporter(bars),
            )
            for s in args.seeds
        ]
    for resolved in folders:
        console.print(escape(str(resolved.folder)), soft_wrap=True)
    return EXIT_OK


def cmd_schema(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin schema``: the recipe JSON Schema on stdout (plain, so it can be redirected)."""
    import json

    from .recipe import recipe_json_schema

    sys.stdout.write(json.dumps(recipe_json_schema(), indent=2, ensure_ascii=False) + "\n")
    return EXIT_OK


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


if __name__ == "__main__":
    sys.exit(main())
