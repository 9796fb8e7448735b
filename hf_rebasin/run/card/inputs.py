"""The card's account of what went in and how to use what came out: the input models by role, the
data sources, the dtype the weights are stored in, and the lines that load the output folder.

Models are named as the record shows them: a Hub id with its link, a local folder as code (its own
name only in titles), never more of the user's machine than the recipe gave.
"""

from __future__ import annotations

import json
from pathlib import PurePath

from hf_rebasin.evaluation.record import DatasetEntry, ModelEntry, RunRecord
from hf_rebasin.run.card.metadata import _adapter
from hf_rebasin.run.card.text import _cell, _code, _text, shown_dir
from hf_rebasin.run.card.transport import _scored


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


def _short(model: ModelEntry) -> str:
    """A model's name for titles, as Markdown text: the label, the Hub id, or a folder's own name."""
    name = model.shown
    return _text(name if model.source == "hub" or model.label else (PurePath(name).name or name))


def _role(i: int) -> str:
    return "A (reference)" if i == 0 else chr(ord("A") + i) if i < 26 else f"#{i + 1}"


_TRANSPORT_ROLES = {"target": "target B (new base)", "base": "base A", "finetuned": "fine-tune A + τ"}


_SOURCE_WORDS = {"hub": "Hub dataset", "local": "local files", "builtin": "built into hf-rebasin"}


def data_source(entry: DatasetEntry) -> dict[str, str]:
    """One data set of the run as the card lists it: a Hub data set linked, a local or built-in one named."""
    name, source = entry.dataset, entry.source
    details = [f"split `{entry.split}`"] if entry.split else []
    if source in _SOURCE_WORDS:
        details.append(_SOURCE_WORDS[source])
    shown = f"[{name}](https://huggingface.co/datasets/{name})" if source == "hub" else f"`{name}`"
    return {"role": entry.role, "dataset": shown, "details": ", ".join(details)}


AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
}


def _load(record: RunRecord) -> dict[str, str]:
    """How to load the output folder: the Hub repo it is pushed to, else the output folder (both
    read from the recipe as run, a JSON object with the recipe schema of the version that wrote it)."""
    output = record.recipe.get("output") or {}
    push = output.get("push_to_hub") or {}
    where = str(push.get("repo") or shown_dir(output.get("dir")))
    task = record.findings.task
    models = record.models
    target = models[0].model if models and models[0].source == "hub" else "path/to/target"
    speech = record.findings.speech and task == "seq2seq"  # Whisper: features and a tokenizer
    image = task == "image-classification"
    return {
        "target": json.dumps(target),
        "model_class": "AutoModelForSpeechSeq2Seq" if speech else AUTO_CLASSES.get(task, "AutoModel"),
        "processor_class": "AutoImageProcessor" if image else "AutoProcessor" if speech else "AutoTokenizer",
        "processor_var": "processor" if image or speech else "tokenizer",
        "path": json.dumps(where),
    }


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
