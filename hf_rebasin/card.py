"""The model card (README.md) of an output folder, rendered from ``model_cards/rebasin.md``.

The card is built from the run record alone (a `RunRecord`, or ``rebasin.json`` read back with
`RunRecord.from_json`), so a card can be re-rendered from an old output folder. Data preparation
(escaping, number formatting, picking Hub ids for the metadata) lives here; layout lives in the
Jinja template. Nothing time- or machine-dependent is added, so the same record always gives the
same card (golden-file tests rely on it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePath, PureWindowsPath
from typing import Any, TypeVar

from huggingface_hub import ModelCard, ModelCardData

from .recipe.jobs import JOBS, CardPart
from .record import DatasetEntry, Findings, ModelEntry, RunRecord
from .resources import resource
from .scores import AdapterSummary, Preservation, Score, Scores, Transport, Universe

TAGS = ("merge", "hf-rebasin", "re-basin")

PIPELINE_TAGS = {
    "causal-lm": "text-generation",
    "masked-lm": "fill-mask",
    "sequence-classification": "text-classification",
    "image-classification": "image-classification",
}

AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
}

# the part of a job this version does not know (a record written by a newer one): a report
_UNKNOWN_JOB = CardPart(
    title=lambda names: "Re-basin run: " + ", ".join(names),
    intro="This folder was written by a job of hf-rebasin (`{{ job }}`) that this version does not know.",
    why="",
    preserved="Aligning a model only re-expresses its weights in another basis; its outputs should not change.",
    pair="a model and its aligned form",
)

V = TypeVar("V")

# Hugging Face user access tokens; a recipe has no field for one, but a card must never carry one.
_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")


def render_card(record: RunRecord | Mapping[str, Any], *, recipe_text: str, command: str) -> str:
    """The README.md of an output folder: Hub metadata (YAML front matter) + body.

    ``record`` is the run's record, or ``rebasin.json`` as read (old and partial records too);
    ``recipe_text`` the recipe verbatim and ``command`` the one line that reproduces the run. Both
    are embedded so the card alone is enough to redo the merge.
    """
    record = _typed(record)
    template = resource("model_cards", "rebasin.md")
    card = ModelCard.from_template(
        card_metadata(record), template_path=str(template), **_context(record, recipe_text, command)
    )
    text = str(card)
    return text if text.endswith("\n") else text + "\n"


def card_metadata(record: RunRecord | Mapping[str, Any]) -> ModelCardData:
    """Hub metadata: lineage (Hub ids only, never local paths), tags, task and datasets."""
    record = _typed(record)
    job, found = record.job, record.findings
    hub_models = [m.model for m in record.models if m.source == "hub"]
    fields: dict[str, Any] = {"tags": _unique([*TAGS, found.strategy])}
    adapter = _adapter(found) is not None
    if adapter:  # an adapter's base is the model it loads onto: the target
        hub_models = [m.model for m in record.models[:1] if m.source == "hub"]
    if hub_models:
        fields["base_model"] = hub_models
        relation = _part(job).relation
        if relation is not None:
            fields["base_model_relation"] = relation
        elif adapter:
            fields["base_model_relation"] = "adapter"
    if _writes_model(job):
        fields["library_name"] = "peft" if adapter else "transformers"
        pipeline_tag = PIPELINE_TAGS.get(found.task)
        if pipeline_tag:
            fields["pipeline_tag"] = pipeline_tag
    hub_datasets = _unique(d.dataset for d in record.datasets if d.source == "hub")
    if hub_datasets:
        fields["datasets"] = hub_datasets
    licenses = _unique(m.license for m in record.models if m.license)
    if len(licenses) == 1:  # the inputs that declare a licence agree: the result inherits it
        fields["license"] = licenses[0]
    return ModelCardData(**fields)


def read_license(folder: Path) -> str | None:
    """The ``license`` a model folder's README.md declares in its metadata, None if none (or no card)."""
    from huggingface_hub.repocard import metadata_load

    path = Path(folder) / "README.md"
    try:
        metadata = metadata_load(path) if path.is_file() else None
    except Exception:  # a broken card (bad YAML, not text): no licence read from it
        return None
    value = (metadata or {}).get("license")
    return value.strip() if isinstance(value, str) and value.strip() else None


# --- data preparation for the template ---------------------------------------------------------


def _typed(record: RunRecord | Mapping[str, Any]) -> RunRecord:
    """The record, typed: a JSON object (``rebasin.json`` as read, old or partial) is parsed first."""
    return record if isinstance(record, RunRecord) else RunRecord.from_json(record)


def _adapter(found: Findings) -> AdapterSummary | None:
    """A transported LoRA adapter's entry (rank, modules, ...); None for a full model or a merge."""
    return found.transport.adapter if found.transport is not None else None


def _context(record: RunRecord, recipe_text: str, command: str) -> dict[str, Any]:
    """Everything the template shows, already escaped and formatted (names avoid card_data's keys)."""
    job, found = record.job, record.findings
    strategy = found.strategy or "unknown"
    transport = found.transport or Transport()
    inputs = _inputs(record)
    curves = _curves(found.curves, strategy)
    recipe = _redact(recipe_text.rstrip("\n"))
    cmd = _redact(command.strip())
    part, model = _part(job), _writes_model(job)
    context = {
        "job": job,
        "makes_model": model,
        "title": part.title([r["short"] for r in inputs] or ["?"]),
        "inputs": inputs,
        "show_weights": found.merge_weights is not None,
        "strategy_name": strategy,
        "aligns_nothing": _identity(strategy),
        "strategy_paper": _paper(strategy),
        "strategy_options": [
            {"name": _cell(str(k)), "value": _cell(_value(v))} for k, v in found.strategy_options.items()
        ],
        "data_sources": [_data_source(d) for d in record.datasets],
        "barrier_table": _barrier_table(curves, found.barrier),
        "barrier_reading": _barrier_reading(curves, found.barrier, strategy),
        "learned": _learned(found.diagnostics.get("learned")),
        "alignment_reading": _alignment_reading(found.diagnostics.get("alignment")),
        "merged_scores": _merged_scores(found.merged, strategy, found.universe),
        "transport_rows": _transport_rows(transport, transport),
        "transport_support": _transport_rows(transport.support, transport),
        "chosen": _chosen(transport),
        "tradeoff_table": _tradeoff_table(transport),
        "tradeoff_reading": _tradeoff_reading(transport),
        "tradeoff_missing": _scored(transport) and transport.support is None,
        "adapter": _adapter(found),
        "moved": _moved(transport),
        "function_preserved": _function_preserved(found.function_preserved, part.pair),
        "notes": list(record.notes),
        "canonical": found.canonical and model,
        "canonical_form": found.canonical,  # of the models a job writes in subfolders
        "untied": list(found.untied) if model else [],
        "command": cmd,
        "command_fence": _fence(cmd),
        "recipe_text": recipe,
        "recipe_fence": _fence(recipe),
        "version": record.hf_rebasin_version or "unknown",
        "load": _load(record) if model else None,
        "dtype": _dtype(record, model),
        "job_preserved": part.preserved,
    }
    context["job_intro"] = _render(part.intro, context)
    context["job_why"] = _render(part.why, context)
    return context


def _part(job: str) -> CardPart:
    """The job's part of the card (`jobs.Job.card`)."""
    return JOBS[job].card if job in JOBS else _UNKNOWN_JOB


def _writes_model(job: str) -> bool:
    """Whether the job's folder holds a model (the others write a report only)."""
    return job in JOBS and JOBS[job].writes_model


def _render(text: str, context: Mapping[str, Any]) -> str:
    """A job's Jinja text of the card, with the card's context."""
    import jinja2

    return jinja2.Template(text).render(**context)


_DTYPE_SOURCES = {
    "output.dtype": "as `output.dtype` asks",
    "finetuned": "the adapter's own dtype",
    "target": "the target B's dtype",
    "A": "model A's dtype",
}


def _dtype(record: RunRecord, model: bool) -> str | None:
    """One sentence on the dtype of the written weights, and that the scores are of those weights
    (rounded to it) while every computation ran in float32; None for old records and reports."""
    entry, found = record.dtype, record.findings
    out = entry.output
    if not model or not out:
        return None
    what = "The adapter's tensors are" if _adapter(found) is not None else "The weights are"
    why = _DTYPE_SOURCES.get(str(entry.source), "the reference model's dtype")
    compute = _cell(entry.compute or "float32")
    sentence = f"{what} stored as {_cell(str(out))} ({why}); every computation ran in {compute}"
    scored = bool(found.merged) or (found.transport is not None and _scored(found.transport))
    if scored and out != compute:
        sentence += f", and the scores above are of the weights rounded to {_cell(str(out))}, as stored"
    return sentence + "."


def _scored(scores: Scores | None) -> bool:
    """Whether a transport was scored on the data (a record without ``evaluate`` has the α only)."""
    return scores is not None and scores.loss is not None


def _moved(transport: Transport) -> list[str]:
    """What a transport carried where, in words (the card's "What moved")."""
    lines = []
    adapter = transport.adapter
    if adapter is not None:
        lines.append(
            f"LoRA factors of {adapter.modules} modules (rank {adapter.rank}, lora_alpha {adapter.lora_alpha}), "
            "each factor mapped on the axis it shares with its weight"
            + (
                "; the residual stream is rotated: a factor that reads a norm takes A's norm scale in and "
                "1/B's out, a factor that writes the residual is centered"
                if adapter.canonical
                else ""
            )
        )
        for name in adapter.full_tensors:
            lines.append(f"`{_cell(str(name))}` (stored whole): target + π(saved − base)")
        for name in adapter.whole_biases:
            lines.append(
                f"`{_cell(str(name))}` (stored whole, `bias: lora_only`): B's bias plus the shift the update makes "
                "through the norm's folded β"
            )
    for name in transport.carried or []:
        lines.append(f"`{_cell(str(name))}` (only in the fine-tune): moved whole into B's basis")
    return lines


def _merged_scores(
    merged: Mapping[str, Score], strategy: str, universe: Universe | None = None
) -> list[dict[str, str]]:
    """Rows of the merged-model table: this merge first, then (universe) the merge it started
    from, then the unaligned average if scored."""
    scored = [(f"this model (`{strategy}`)", merged[strategy])] if strategy in merged else []
    if universe is not None and universe.reference is not None:
        before = f"every model aligned to A only (before the {universe.rounds} universe rounds)"
        scored.append((before, universe.reference))
    scored += [(f"the same weights without alignment (`{k}`)", v) for k, v in merged.items() if k != strategy]
    rows = []
    for name, score in scored:
        metric = ", ".join(f"{k} {float(v):.4f}" for k, v in score.metric.items()) or "—"
        rows.append({"model": _cell(name), "loss": f"{_float(score.loss):.4f}", "metric": _cell(metric)})
    return rows


def _saved_index(transport: Transport) -> int:
    """Which α of ``alphas`` the folder holds: the one `alpha: auto` chose, else the first."""
    chosen = transport.chosen.alpha if transport.chosen is not None else None
    return transport.alphas.index(chosen) if chosen is not None and chosen in transport.alphas else 0


def _transport_rows(scores: Scores | None, outer: Transport) -> list[dict[str, str]]:
    """Rows of a transport table: target, old base, fine-tune, then naive and transported per α."""
    if scores is None or scores.loss is None:
        return []
    loss, metric = scores.loss, scores.metric
    saved = _saved_index(outer)

    def row(label: str, value: float | None, extra: Mapping[str, Any] | None) -> dict[str, str]:
        shown = ", ".join(f"{k} {float(v):.4f}" for k, v in (extra or {}).items()) or "—"
        return {"model": _cell(label), "loss": f"{_float(value):.4f}", "metric": _cell(shown)}

    rows = [row("target B", loss.target, metric.target if metric else None)]
    if loss.base is not None:  # recorded since the trade-off: what the fine-tune forgot is A_ft against A
        rows.append(row("old base A", loss.base, metric.base if metric else None))
    rows.append(row("fine-tune A + τ", loss.finetuned, metric.finetuned if metric else None))
    for i, alpha in enumerate(outer.alphas):
        if loss.naive is not None:
            naive = _at(metric.naive if metric else None, i)
            rows.append(row(f"naive B + {alpha:g}·τ (no alignment)", _at(loss.naive, i), naive))
        this = f"this model: B + {alpha:g}·π(τ)" if i == saved else f"B + {alpha:g}·π(τ)"
        rows.append(row(this, _at(loss.transported, i), _at(metric.transported if metric else None, i)))
    return rows


def _float(value: float | None) -> float:
    """A number as the tables show it; one written as null (not finite) is shown as nan."""
    return math.nan if value is None else float(value)


_RULES = {
    "no-cost": "it gains on the task at no cost on the support data",
    "ratio": "the best task gain per nat of support cost",
    "budget": "the largest task gain within the support budget",
    "fallback": "no α qualified",
}


def _chosen(transport: Transport) -> str | None:
    """One sentence on the α `alpha: auto` saved, and why; None when the recipe gave α itself."""
    chosen = transport.chosen
    if chosen is None:
        return None
    reason = chosen.reason or _RULES.get(chosen.rule, chosen.rule)
    grid = ", ".join(f"{a:g}" for a in transport.alphas)
    return _cell(f"α = {chosen.alpha:g} chosen automatically (`alpha: auto` over {grid}): {reason}.")


def _tradeoff_table(transport: Transport) -> str | None:
    """The trade-off table of a record that has one (records from before it render as they did)."""
    if transport.tradeoff is None:
        return None
    from .report import tradeoff_table

    saved = transport.alphas[_saved_index(transport)] if transport.alphas else None
    try:
        table = tradeoff_table(transport.to_json(), saved)
    except (KeyError, TypeError, ValueError, IndexError):  # a damaged record still renders a card
        return None
    return table.rstrip("\n") if table else None


def _tradeoff_reading(transport: Transport) -> str | None:
    """One sentence on the fine-tune's own forgetting, beside what the saved model costs B."""
    points = transport.tradeoff
    own = points.finetuned if points is not None else None
    if points is None or own is None or own.gain is None or own.cost is None:  # not finite: null
        return None
    text = (
        f"The fine-tune itself, on its own base A, has a task gain of {own.gain:+.4f} nats and a "
        f"support cost of {own.cost:+.4f} nats: what it forgot, τ carries along."
    )
    moved = points.transported
    if moved is not None:
        i = _saved_index(transport)
        gain, cost = (_at(values, i) for values in (moved.gain, moved.cost))
        if gain is None or cost is None:  # a damaged record still renders a card
            return None
        text += f" This model, over B: task gain {gain:+.4f} nats, support cost {cost:+.4f} nats."
    return text


def _at(values: Sequence[V] | None, i: int) -> V | None:
    """``values[i]``, None past the end (a damaged record still renders a card)."""
    return values[i] if values is not None and 0 <= i < len(values) else None


def _alignment_reading(similarity: Mapping[str, Any] | None) -> str | None:
    """One sentence for ``alignment.png``: where matched features are least alike after alignment,
    and how much the alignment did on average; None when the record has no such diagnostics."""
    try:
        spaces = {str(e["space"]): (float(e["before"]), float(e["after"])) for e in (similarity or {})["spaces"]}
        measure = str((similarity or {}).get("measure") or "weight cosine").removesuffix(" of matched features")
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not spaces:
        return None
    name = min(spaces, key=lambda n: spaces[n][1])
    before, after = (round(x, 2) + 0.0 for x in spaces[name])  # + 0.0: no "-0.00"
    gain = sum(a - b for b, a in spaces.values()) / len(spaces)
    return (
        f"The alignment is weakest in `{_cell(name)}`: its matched features have a mean {measure} of "
        f"{after:.2f} after alignment ({before:.2f} before); over all {len(spaces)} spaces alignment raised "
        f"it by {gain:+.2f} on average."
    )


def _learned(history: Mapping[str, Any] | None) -> str | None:
    """One sentence on learned matching's curve (``learned.png``): where it started, where the kept
    maps are, after how much data, and why it stopped; None when it did not run."""
    if not history or not history.get("barrier"):
        return None
    try:
        unit = str(history.get("unit") or "steps")
        barriers = [float(v) for v in history["barrier"]]
        seen = [int(v) for v in history.get(unit) or history["steps"]]
        steps = [int(v) for v in history["steps"]]
    except (TypeError, ValueError, KeyError):
        return None  # a damaged record still renders a card
    best = min(range(len(barriers)), key=barriers.__getitem__)
    where = _cell(str(history.get("held_out") or "held-out data"))
    measure = _cell(str(history.get("measure") or "midpoint barrier"))
    text = (
        f"{measure[:1].upper()}{measure[1:]} on {where}: {barriers[0]:.4f} nats at the data-free start, "
        f"{barriers[best]:.4f} for the maps kept (step {steps[best]:,}, {seen[best]:,} {unit}), "
        f"over {steps[-1]:,} steps and {seen[-1]:,} {unit} in all."
    )
    if best == 0:
        text += " Training never beat the start, so the data-free maps were kept."
    return text


def _unique(items: Iterable[str]) -> list[str]:
    return [x for x in dict.fromkeys(items) if x]


def _cell(text: str) -> str:
    """A Markdown table cell: ``|`` would end the cell and a line break the row."""
    return " ".join(text.split()).replace("|", "\\|")


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


_MARKDOWN = re.compile(r"([\\`*_{}\[\]<>()#+!|~&])")


def _text(text: str) -> str:
    """``text`` as Markdown shows it, letter for letter: a folder or repo name may hold ``<img …>``,
    ``*`` or ``[…](…)``, which a Hub page would otherwise render as HTML or a link."""
    return _MARKDOWN.sub(r"\\\1", " ".join(text.split()))


def _code(text: str) -> str:
    """``text`` as an inline code span inside a table cell: fenced past any backticks it holds."""
    text = _cell(text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _short(model: ModelEntry) -> str:
    """A model's name for titles, as Markdown text: the label, the Hub id, or a folder's own name."""
    name = model.shown
    return _text(name if model.source == "hub" or model.label else (PurePath(name).name or name))


def _role(i: int) -> str:
    return "A (reference)" if i == 0 else chr(ord("A") + i) if i < 26 else f"#{i + 1}"


def _inputs(record: RunRecord) -> list[dict[str, str]]:
    weights = record.findings.merge_weights
    rows = []
    for i, m in enumerate(record.models):
        if m.source == "hub":
            shown = f"[{_cell(_text(m.shown))}](https://huggingface.co/{m.model})"
        else:
            shown = _code(m.shown)
        weight = weights[i] if weights is not None and i < len(weights) else None
        rows.append(
            {
                "role": _TRANSPORT_ROLES.get(str(m.role), _role(i)),
                "model": shown,
                "source": m.source,
                "revision": f"`{_cell(str(m.revision))}`" if m.revision else "—",
                "commit": f"`{_cell(str(m.commit))}`" if m.commit else "—",
                "weight": f"{float(weight):g}" if weight is not None else "—",
                "short": _short(m),
            }
        )
    return rows


_TRANSPORT_ROLES = {"target": "target B (new base)", "base": "base A", "finetuned": "fine-tune A + τ"}


def _identity(name: str) -> bool:
    """Whether the strategy aligns nothing (its curve is the plain average); False for a name this
    version does not know (a record from a newer one)."""
    from .strategies import REGISTRY

    return name in REGISTRY.names and REGISTRY.get(name).identity


def _identity_name() -> str:
    """The registered strategy that aligns nothing, as a recipe names it."""
    from .strategies import REGISTRY

    return next(name for name in REGISTRY.names if REGISTRY.get(name).identity)


def _paper(name: str) -> str:
    """The strategy's paper from the registry; a record from a newer version may name an unknown one."""
    from .errors import StrategyOptionError
    from .strategies import get_strategy

    try:
        return get_strategy(name).paper
    except StrategyOptionError:
        return ""


_SOURCE_WORDS = {"hub": "Hub dataset", "local": "local files", "builtin": "built into hf-rebasin"}


def _data_source(entry: DatasetEntry) -> dict[str, str]:
    name, source = entry.dataset, entry.source
    details = [f"split `{entry.split}`"] if entry.split else []
    if source in _SOURCE_WORDS:
        details.append(_SOURCE_WORDS[source])
    shown = f"[{name}](https://huggingface.co/datasets/{name})" if source == "hub" else f"`{name}`"
    return {"role": entry.role, "dataset": shown, "details": ", ".join(details)}


def _curves(raw: Mapping[str, Any], strategy: str) -> dict[str, Any]:
    """``Curve`` objects from ``rebasin.json``'s ``curves``, the strategy's own curve first."""
    from .evaluate import Curve

    names = sorted(raw, key=lambda n: n != strategy)  # stable: the rest keep the record's order
    return {
        n: Curve(
            lambdas=[float(x) for x in raw[n]["lambdas"]],
            losses=[float(x) for x in raw[n]["loss"]],
            metrics={k: [float(x) for x in v] for k, v in (raw[n].get("metric") or {}).items()},
        )
        for n in names
    }


def _barrier_table(curves: Mapping[str, Any], barriers: Mapping[str, Mapping[str, float]]) -> str | None:
    if not curves:
        return None
    from .report import markdown_table

    return markdown_table(curves, barriers).rstrip("\n")


def _linear(curves: Mapping[str, Any], barriers: Mapping[str, Mapping[str, float]], name: str) -> float | None:
    if name in barriers and "linear" in barriers[name]:
        return float(barriers[name]["linear"])
    if name in curves:
        from .evaluate import barrier

        try:
            return barrier(curves[name].lambdas, curves[name].losses)["linear"]
        except ValueError:  # a curve without its end points has no barrier
            return None
    return None


def _barrier_reading(
    curves: Mapping[str, Any], barriers: Mapping[str, Mapping[str, float]], strategy: str
) -> str | None:
    """One sentence that reads the table: what alignment did to the linear barrier."""
    if not curves:
        return None
    ours = _linear(curves, barriers, strategy)
    if ours is None or not math.isfinite(ours):
        return None
    if _identity(strategy):
        return f"The plain average (no alignment) has a linear barrier of {ours:.3f} nats."
    plain = next((name for name in curves if _identity(name)), None)
    base = _linear(curves, barriers, plain) if plain is not None else None
    if base is None or not math.isfinite(base):
        return (
            f"`{strategy}` leaves a linear barrier of {ours:.3f} nats; add `{_identity_name()}` to "
            "`evaluate.compare` to see the barrier without alignment."
        )
    if ours == base:
        return f"`{strategy}` leaves the linear barrier unchanged at {ours:.3f} nats."
    verb = "lowers" if ours < base else "raises"
    change = ""
    if base > 0:
        pct = (ours - base) / base * 100
        change = f" ({'−' if pct < 0 else '+'}{abs(pct):.0f} %)"
    return f"`{strategy}` {verb} the linear barrier from {base:.3f} to {ours:.3f} nats{change}."


def _function_preserved(entry: Preservation | None, pair: str) -> str:
    if entry is None:
        return "Function preservation was not recorded for this run."
    if entry.max_abs_diff is None:
        return f"max |Δ logits| between {pair} was not measured: {entry.reason or 'no reason recorded'}."
    where = f" (on {entry.inputs})" if entry.inputs else ""
    tol = f", within the tolerance {entry.tolerance:.1e}" if entry.tolerance is not None else ""
    return f"max |Δ logits| between {pair}: {entry.max_abs_diff:.2e}{where}{tol}."


def _load(record: RunRecord) -> dict[str, str]:
    """How to load the output folder: the Hub repo it is pushed to, else the output folder (both
    read from the recipe as run, a JSON object with the recipe schema of the version that wrote it)."""
    output = record.recipe.get("output") or {}
    push = output.get("push_to_hub") or {}
    where = str(push.get("repo") or _shown_dir(output.get("dir")))
    task = record.findings.task
    models = record.models
    target = models[0].model if models and models[0].source == "hub" else "path/to/target"
    return {
        "target": json.dumps(target),
        "model_class": AUTO_CLASSES.get(task, "AutoModel"),
        "processor_class": "AutoImageProcessor" if task == "image-classification" else "AutoTokenizer",
        "processor_var": "processor" if task == "image-classification" else "tokenizer",
        "path": json.dumps(where),
    }


def leaves_folder(path: str) -> bool:
    """Whether ``path`` as written points outside the folder it is relative to (absolute, ``~``, a
    drive, or through ``..``): published text shows such a path by its own name only, since the
    whole of it would publish the user's own folder layout."""
    posix, windows = PurePath(path), PureWindowsPath(path)
    absolute = posix.is_absolute() or windows.is_absolute() or bool(windows.drive) or path.startswith("~")
    return absolute or ".." in windows.parts


def _shown_dir(value: Any) -> str:
    """The output folder as the card may show it: a relative path inside the recipe's folder as
    given; an absolute path or one reaching outside (``../``) only by its name."""
    if not value:
        return "path/to/this/folder"
    text = str(value)
    if leaves_folder(text):
        return PureWindowsPath(text).name or "path/to/this/folder"
    return text


def _fence(text: str) -> str:
    """A code fence longer than any run of backticks inside ``text``, so the block cannot end early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _redact(text: str) -> str:
    return _TOKEN.sub("hf_***", text)
