"""The card's numbers of a transport: the scores of target, base, fine-tune and B + α·π(τ) per α,
the α `alpha: auto` saved and why, the trade-off of task gain against support cost, and what moved.

A damaged or older record (no trade-off, no support scores) still renders: what it lacks is left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_rebasin.evaluation.scores import Scores, Transport
from hf_rebasin.run.card.text import _at, _cell, _float


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
        for module in adapter.modules_to_save or []:
            lines.append(
                f"`{_cell(str(module))}` (stored whole, `modules_to_save`, {adapter.embedding_rows} rows): the "
                "output's vocabulary rows, B's rows plus α·π(τ) matched by token, the fine-tune's new tokens included"
                + ("; its trainable tokens written back this way" if adapter.trainable_tokens else "")
            )
    for name in transport.carried or []:
        lines.append(f"`{_cell(str(name))}` (only in the fine-tune): moved whole into B's basis")
    return lines


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
    from hf_rebasin.evaluation.report import tradeoff_table

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


def _calibration(transport: Transport) -> dict[str, Any] | None:
    """The card's "Calibration": what was fitted on which text, and the measures before and after."""
    cal = transport.calibration
    if cal is None:
        return None
    text = cal.text or {}
    source = str(text.get("source", "?"))
    if "opening" in text:
        source += f", each sequence started on {text['opening']}"
    if "dataset" in text:
        source += f" (`{_cell(str(text['dataset']))}`)"
    what = {
        "rows": "the rows of the tokens the target lacks",
        "norms": "every norm and bias, and the rows of the tokens the target lacks",
        "low-rank": f"a rank-{cal.rank} correction of every linear layer (folded into its weight), every norm and "
        "bias, and the rows of the tokens the target lacks",
        "full": "every parameter",
        "adapter": "the adapter's own LoRA factors at their rank, and the rows of its new tokens",
    }.get(cal.fit, cal.fit)
    rows = []
    for label, measured, fmt in (
        ("KL to the fine-tune (nats per token)", cal.kl, "{:.4f}"),
        ("turn-end token top-1 where a turn ends", cal.turn_end, "{:.1%}"),
        ("greedy replies that end their turn", cal.replies, "{:.1%}"),
    ):
        if measured is not None:
            cells = [
                fmt.format(v) if v is not None else "—" for v in (measured.teacher, measured.before, measured.after)
            ]
            rows.append({"measure": label, "teacher": cells[0], "before": cells[1], "after": cells[2]})
    return {
        "what": _cell(what),
        "text": _cell(
            f"{_count(text.get('sequences'))} sequences of {_count(text.get('block_size'))} tokens "
            f"({_count(text.get('tokens'))} tokens), {source}"
        ),
        "guard": _cell(str(text.get("guard", "none"))),
        "steps": cal.steps,
        "fitted": f"{cal.fitted:,}" if cal.fitted is not None else "?",
        "seconds": f"{_float(cal.seconds):.0f}",
        "rows": rows,
        "replies": text.get("reply_prompts"),
        "kept": cal.kept,
        "reply_tokens": text.get("reply_tokens"),
        "judged": ", ".join(f"{step} ({share:.0%})" for step, share in cal.judged or []),
        "kept_step": cal.kept_step,
    }


def _count(value: Any) -> str:
    """A whole number with thousands separators; ``?`` where a damaged record lacks it."""
    return f"{value:,}" if isinstance(value, int) else "?"
