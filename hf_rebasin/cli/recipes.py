"""The commands on recipes and output folders: ``run`` (and its shorthand), ``demo``, ``zoo``,
``push`` and ``schema``; the run's progress bars and summary."""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hf_rebasin.core.names import KINDS

if TYPE_CHECKING:
    from hf_rebasin.evaluation.scores import Transport
    from hf_rebasin.run import RunResult

from hf_rebasin.cli.common import DEMO_OUTPUT, EXIT_OK, EXIT_USER, quiet_datasets, quiet_libraries, run_options


def add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    run_options(run, "write the result here instead of `output.dir`")
    run.set_defaults(func=cmd_run, command_line=None)


def add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    run_options(demo, f"result folder (default ./{DEMO_OUTPUT})", output=DEMO_OUTPUT)
    demo.set_defaults(func=cmd_demo)


def add_zoo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
            "on the King James Bible (bench-gpt2-ft-lora: as a LoRA adapter), bench-gpt2-chat, bench-qwen3-chat: "
            "fine-tuned on it as ChatML dialogue (bench-gpt2-chat-lora: as a LoRA adapter), about 5 min each, pip "
            "install 'hf-rebasin[bench]'). Prints one folder per seed; recipes "
            "name them as zoo:KIND-seedN."
        ),
    )
    zoo.add_argument("kind", choices=KINDS, help="which model")
    zoo.add_argument("seeds", nargs="*", type=int, default=[0, 1], metavar="SEED", help="seeds (default 0 1)")
    zoo.set_defaults(func=cmd_zoo)


def add_push(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def add_schema(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``schema`` command's arguments."""
    schema = sub.add_parser("schema", help="print the JSON Schema of recipe files (for editors)")
    schema.set_defaults(func=cmd_schema)


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
    from hf_rebasin.evaluation.evaluate import Curve

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
    calibrate = f", calibrate {t['calibrate']:.1f}" if "calibrate" in t else ""
    console.print(
        f"seconds: {train}load {t['load']:.1f}, align {t['align']:.1f}{check}, evaluate {t['evaluate']:.1f}"
        f"{calibrate}, save {t['save']:.1f}"
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

    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.recipe.jobs import get_job

    recipe = load_recipe(args.recipe)  # before torch is imported: a refused recipe answers at once
    from hf_rebasin.run import build_plan, run_recipe

    output = Path(args.output) if args.output else None
    if args.dry_run:
        planned = build_plan(recipe, output=output)
        for line in planned.lines():
            console.print(escape(line), soft_wrap=True)
        if planned.memory is not None and not args.no_memory_check:
            planned.memory.check()  # the numbers, and exit 2, as the run would stop
        if get_job(recipe.job).lineage_preview:  # what the models are to each other, when it is cheap
            quiet_libraries()
            from hf_rebasin.run.lineage_preview import preview_lines

            with console.status("lineage…"):
                lines = preview_lines(planned)
            for line in lines:
                console.print(escape(line), soft_wrap=True)
        return EXIT_OK
    quiet_libraries()
    quiet_datasets()
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

    from hf_rebasin.core.errors import ModelNotFoundError
    from hf_rebasin.io.files import probe
    from hf_rebasin.io.hub.push import push_folder

    folder = Path(args.folder)
    probe(folder, "FOLDER")  # a name too long, no permission: named, in words
    if not (folder / "rebasin.json").is_file():
        raise ModelNotFoundError(f"FOLDER: {str(folder)!r} is not an hf-rebasin output folder (no rebasin.json)")
    quiet_libraries()
    with console.status(f"pushing {folder} to {args.repo}…"):
        result = push_folder(
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
    from hf_rebasin.core.resources import resource

    args.recipe = str(resource("recipes", "demo.yaml"))
    args.command_line = "hf-rebasin demo"
    return cmd_run(args, console)


def cmd_zoo(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin zoo KIND SEED...``: the zoo folders (trained on first use), one per line."""
    quiet_libraries()
    from hf_rebasin.recipe import ModelRef
    from hf_rebasin.run import resolve_model

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

    from hf_rebasin.recipe import recipe_json_schema

    sys.stdout.write(json.dumps(recipe_json_schema(), indent=2, ensure_ascii=False) + "\n")
    return EXIT_OK
