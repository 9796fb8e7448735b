"""The commands on models: ``verify``, ``align``, ``embed`` and ``lineage``."""

from __future__ import annotations

import argparse
import functools
import re
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hf_rebasin.core.errors import IncompatibleModelsError, PickleRefusedError, named

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from hf_rebasin.alignment.strategies import Alignment, Strategy
    from hf_rebasin.alignment.verify import VerifyReport
    from hf_rebasin.io.models import LoadedModel
    from hf_rebasin.lineage.record import LineageRecord
    from hf_rebasin.merging.basis import Gap

from hf_rebasin.cli.common import EXIT_INTERNAL, EXIT_OK, _model_folder, _parse_options, quiet_libraries


def add_verify(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def add_align(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def add_embed(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def add_lineage(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``lineage`` command's arguments."""
    li = sub.add_parser(
        "lineage",
        help="are these models related (a fine-tune, continued pretraining, a merge), up to every symmetry?",
        description=(
            "For every pair of the models (one family and depth): same basis (a plain average or naive transport "
            "is right), related up to symmetry (B is A's kin, permuted, rotated, rescaled or widened: align first), "
            "shared embeddings (one origin, no layer in common: align as for independent models) or independent "
            "(trained apart), with a p-value and the evidence per layer. Data-free: the weights' "
            "bulk (what is left of each matrix past its top singular directions) is compared after aligning the "
            "signals. A recipe (`job: lineage` with `data`) starts each alignment from maps fitted on the models' "
            "activations instead. Exit 0 with any verdict, 2 on bad input."
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
    for note in report.pinned:
        console.print(f"  [yellow]{escape(note)}[/]: it keeps the identity", soft_wrap=True)
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
    quiet_libraries()
    from hf_rebasin.alignment.verify import verify_model
    from hf_rebasin.io.checkpoint import dtype_name
    from hf_rebasin.io.models import load_model
    from hf_rebasin.io.ties import untied_note

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
    if loaded.untied:  # the transform ran on the model transformers loads: the head apart from the embeddings
        console.print(f"note: {escape(untied_note(str(loaded.path), loaded.untied))}", soft_wrap=True)
    if loaded.initialised:
        from hf_rebasin.merging.initialised import initialised_note

        console.print(f"note: {escape(initialised_note(str(loaded.path), loaded.initialised))}", soft_wrap=True)
    return EXIT_OK if report.ok else EXIT_INTERNAL


def cmd_align(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin align``: align B to A (folders or Hub ids), report distances, optionally write both."""
    from pathlib import Path

    quiet_libraries()
    from hf_rebasin.alignment.strategies import Pair
    from hf_rebasin.alignment.strategies.base import relative_distance
    from hf_rebasin.io.models import resolve_device
    from hf_rebasin.merging.basis import check_gaps, function_gap, write_pair
    from hf_rebasin.recipe import strategy_spec

    given = {item.partition("=")[0].strip(): item for item in args.options}
    spec = strategy_spec(args.strategy, _parse_options(args.options), given)  # checked as a recipe's section
    strategy, options = spec.strategy, spec.options
    device = resolve_device(args.device, where="--device")
    named, inputs, a, b = _align_inputs(args, console, device)
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
            gaps["B"] = function_gap(b.model, aligned, bool(alignment.untied), (alignment.graph, alignment.transform))
    console.print(_align_table(strategy, alignment, distance, gaps))
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


def _align_inputs(
    args: argparse.Namespace, console: Console, device: torch.device
) -> tuple[dict[str, str], list[tuple[str, Path]], LoadedModel, LoadedModel]:
    """``align``'s MODEL_A and MODEL_B as given, their folders as inputs of ``--output``, and both
    models loaded in one shape on ``device``. ``--output`` is checked before any download or load,
    and again with a downloaded folder among its inputs."""
    from pathlib import Path

    from hf_rebasin.alignment.widths import to_widest
    from hf_rebasin.io.models import check_compatible, load_model, to_device
    from hf_rebasin.io.output import check_output

    named = {"A": args.model_a, "B": args.model_b}
    if args.output:  # before any download or load: a refused output costs nothing
        check_output(
            Path(args.output), False, inputs=[(f"MODEL_{k}", Path(v)) for k, v in named.items()], where="--output"
        )
    folders = {k: _model_folder(v, args.allow_pickle, where=f"MODEL_{k}") for k, v in named.items()}
    inputs = [(f"MODEL_{k}", Path(v)) for k, v in folders.items()]
    _refuse_other_vocabularies(args, named, folders)  # before loading: rows are paired by position here
    if args.output and folders != named:  # a download: its folder is an input too
        check_output(Path(args.output), False, inputs=inputs, where="--output")
    a, b = (load_model(folders[k], allow_pickle=args.allow_pickle) for k in ("A", "B"))
    (a, b), embedded = to_widest([a, b], [f"MODEL_{k} {v!r}" for k, v in named.items()])
    check_compatible(a, b)
    for done in embedded:
        console.print(f"note: {escape(done.note([f'MODEL_{k}' for k in named]))}", soft_wrap=True)
    for loaded in (a, b):
        to_device(loaded.model, device)
    return named, inputs, a, b


def _refuse_other_vocabularies(args: argparse.Namespace, named: dict[str, str], folders: dict[str, str]) -> None:
    """``align`` pairs embedding rows by position; models whose tokens differ are aligned by a recipe
    (``job: align``), which matches rows by token and writes each model in its own vocabulary: refused
    with that recipe written out. Rows of other counts with no tokenizer are refused as a run would."""
    from pathlib import Path

    import yaml

    from hf_rebasin.core.errors import IncompatibleModelsError
    from hf_rebasin.merging.vocabulary.output import matched_by_token
    from hf_rebasin.recipe.jobs import get_job

    rule = get_job("align").vocabulary  # as `job: align` chooses, with no `tokenizer` section
    assert rule is not None, "job: align decides its output's vocabulary"
    found = matched_by_token(rule(None, None), [Path(folders["A"]), Path(folders["B"])], ["MODEL_A", "MODEL_B"])
    if found is None:
        return
    strategy = {"name": args.strategy, **_parse_options(args.options)}
    recipe = {"job": "align", "models": [named["A"], named["B"]], "strategy": strategy}
    recipe["output"] = {"dir": args.output or "aligned"}
    text = yaml.safe_dump(recipe, sort_keys=False, default_flow_style=None).strip()
    raise IncompatibleModelsError(
        f"{found.notes()[0]}. `hf-rebasin align` pairs the models' embedding rows by position, so it aligns "
        "models of one vocabulary; a recipe matches rows by token and writes each model in its own vocabulary. "
        f"Write it to align.yaml and run `hf-rebasin align.yaml`:\n{text}"
    )


def _align_table(strategy: Strategy, alignment: Alignment, distance: dict[str, float], gaps: dict[str, Gap]) -> Table:
    """``align``'s report: distances before and after, time, whether it preserves function and,
    for what is written, each model's max |Δ logits|."""
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
    return table


def _lineage_models(folders: list[str], allow_pickle: bool, stream: bool) -> tuple[list[Any], list[str]]:
    """Each folder loaded (streamed where ``stream``); a PEFT adapter as its base with the adapter
    merged in (in memory), with a note saying so."""
    from pathlib import Path

    from hf_rebasin.io.models import load_model
    from hf_rebasin.merging.initialised import initialised_note
    from hf_rebasin.run.adapter_models import is_bare_adapter, merged_adapter

    loaded, notes = [], []
    for i, folder in enumerate(folders):
        where = f"MODEL {i + 1}"
        with named(where):
            if is_bare_adapter(Path(folder)):
                resolve = functools.partial(_model_folder, allow_pickle=allow_pickle, where=where)
                lm, note = merged_adapter(Path(folder), resolve, allow_pickle=allow_pickle, where=where)
                loaded.append(lm)
                notes.append(note)
            else:
                loaded.append(load_model(folder, allow_pickle=allow_pickle, stream=stream))
        if loaded[-1].initialised:
            notes.append(initialised_note(where, loaded[-1].initialised))
    return loaded, notes


def _pairs_line(n: int) -> str:
    pairs = n * (n - 1) // 2
    return f"{n} models: {pairs} pair{'s' * (pairs != 1)}"


def cmd_lineage(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin lineage``: every pair's verdict, its evidence, optionally written to a folder."""
    import json
    from pathlib import Path

    quiet_libraries()
    from hf_rebasin.alignment.widths import differ_in_width
    from hf_rebasin.io.output import check_output
    from hf_rebasin.lineage.pairs import check_count, lineage_of

    check_count(len(args.models))
    named_inputs = [(f"MODEL {i + 1}", Path(m)) for i, m in enumerate(args.models)]
    if args.output:  # before any download or load: a refused output costs nothing
        check_output(Path(args.output), False, inputs=named_inputs, where="--output")
    folders = [_model_folder(m, args.allow_pickle, where=f"MODEL {i + 1}") for i, m in enumerate(args.models)]
    stream = not differ_in_width([Path(f) for f in folders])  # widths that differ are embedded in memory
    loaded, notes = _lineage_models(folders, args.allow_pickle, stream)
    said = Console(stderr=True) if args.json else console  # --json: stdout holds the record alone
    for note in notes:
        said.print(f"note: {escape(note)}", soft_wrap=True)
    from hf_rebasin.lineage.estimate import duration, estimate_seconds

    expected, per_layer = estimate_seconds(loaded)
    said.print(
        f"comparing {_pairs_line(len(loaded))}, about {duration(expected)} on this machine "
        f"(from one layer's split here: {per_layer:.2f} s)",
        soft_wrap=True,
    )
    with console.status("comparing…") as status:
        record = lineage_of(loaded, args.models, progress=lambda stage: status.update(escape(stage)))
    if args.json:
        console.print_json(record.model_dump_json())
    else:
        _print_lineage(record, console)
    if args.output:
        from hf_rebasin.io.output import output_folder, write_text
        from hf_rebasin.lineage.plot import plot_lineage

        inputs = [(f"MODEL {i + 1}", Path(f)) for i, f in enumerate(folders)]
        with output_folder(Path(args.output), overwrite=False, inputs=inputs, where="--output") as tmp:
            write_text(tmp / "lineage.json", json.dumps(record.model_dump(mode="json"), indent=1) + "\n")
            plot_lineage(record, tmp / "lineage.png", float(record.settings["null_similarity"]))
        if not args.json:
            console.print(f"written to {escape(args.output)}: lineage.json and lineage.png", soft_wrap=True)
    return EXIT_OK


def _print_lineage(record: LineageRecord, console: Console) -> None:
    """The verdicts, each pair's evidence, layer maps, what it shares and the next step."""
    from hf_rebasin.lineage.record import KIN
    from hf_rebasin.lineage.table import evidence_table, layer_map_table, verdict_table

    console.print(verdict_table(record))
    for pair in record.pairs:
        console.print(evidence_table(record, pair))
        if pair.layer_map is not None and pair.verdict in KIN:
            console.print(layer_map_table(record, pair.layer_map))
        for lmap in pair.stack_maps if pair.verdict in KIN else []:
            console.print(layer_map_table(record, lmap))
        console.print(f"shared: {escape(pair.origin)}", soft_wrap=True)
        console.print(f"next: {escape(pair.next_step)}", soft_wrap=True)
    for stack in record.layer_maps:
        console.print(layer_map_table(record, stack))
        console.print(f"mergekit config that rebuilds it from its parents:\n{escape(stack.mergekit)}", soft_wrap=True)
    if "vocabulary" in record.settings:
        console.print(f"vocabularies differ: {escape(str(record.settings['vocabulary']))}", soft_wrap=True)
    if "heads" in record.settings:
        console.print(f"label counts differ: {escape(str(record.settings['heads']))}", soft_wrap=True)


def cmd_embed(args: argparse.Namespace, console: Console) -> int:
    """``hf-rebasin embed``: MODEL written into WIDE's shape, checked, with a card."""
    from pathlib import Path

    quiet_libraries()

    from hf_rebasin.alignment.widths import embed_model
    from hf_rebasin.io.models import load_model, read_config
    from hf_rebasin.io.output import check_output
    from hf_rebasin.merging.basis import write_embedded

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
