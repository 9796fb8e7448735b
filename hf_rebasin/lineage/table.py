"""The lineage tables the terminal shows (rich renderables; the CLI prints them)."""

from __future__ import annotations

from rich.table import Table

from hf_rebasin.lineage.record import LayerMap, LineageRecord, PairRecord

__all__ = ["evidence_table", "layer_map_table", "p_text", "verdict_table"]

_COLOURS = {
    "same basis": "green",
    "related up to symmetry": "yellow",
    "shared embeddings": "magenta",
    "independent": "cyan",
}


def p_text(log10_p: float) -> str:
    """A p-value as a person reads it: 0.31, 2.0e-05, or 1e-11101 past what a float holds."""
    if log10_p > -4:
        return f"{10**log10_p:.2g}"
    if log10_p > -300:
        return f"{10**log10_p:.1e}"
    return f"1e{log10_p:.0f}"


def verdict_table(record: LineageRecord) -> Table:
    """One row per pair: the verdict, the bulk similarity aligned and as stored, and the p-values."""
    names = [m.given for m in record.models]
    table = Table(title="lineage (bulk similarity: 1 = the same weights, ~0 = trained apart)", title_justify="left")
    for column in ("A", "B", "verdict", "aligned", "as stored", "p (related)", "p (same basis)"):
        table.add_column(column, justify="right" if column not in ("A", "B", "verdict") else "left")
    for p in record.pairs:
        colour = _COLOURS.get(p.verdict, "white")
        table.add_row(
            names[p.a],
            names[p.b],
            f"[{colour}]{p.verdict}[/]",
            f"{p.statistic:.3f}",
            f"{p.raw_statistic:.3f}",
            p_text(p.log10_p),
            p_text(p.raw_log10_p),
        )
    return table


def evidence_table(record: LineageRecord, pair: PairRecord) -> Table:
    """One row per space of one pair: which layers match, how strongly, and the map that aligns them."""
    names = [m.given for m in record.models]
    table = Table(title=f"evidence: {names[pair.a]} vs {names[pair.b]}", title_justify="left")
    for column in ("space", "aligned", "as stored", "z", "in place", "map (B → A)"):
        table.add_column(column, justify="left" if column in ("space", "map (B → A)") else "right")
    for s in pair.spaces:
        label = s.space if s.counted else f"{s.space} (tested apart)"
        place = (
            ("yes" if s.in_place else "[yellow]no[/]") if s.counted else ("shared" if s.space in pair.shared else "")
        )
        z = s.z if s.counted else max(s.z, s.raw_z)  # a table is shared aligned or as stored
        table.add_row(label, f"{s.similarity:.3f}", f"{s.raw_similarity:.3f}", f"{z:.0f}", place, s.map)
    return table


def layer_map_table(record: LineageRecord, lmap: LayerMap) -> Table:
    """One row per layer of the mapped model: the parent layer it descends from and the evidence."""
    names = [m.given for m in record.models]
    parents = " + ".join(names[p] for p in lmap.parents)
    stack = f", {lmap.stack}" if lmap.stack else ""  # an encoder-decoder: one map per stack
    table = Table(title=f"layer map: {names[lmap.model]} from {parents} ({lmap.kind}{stack})", title_justify="left")
    for column in ("layer", "from", "circuits alike", "bulk aligned", "p (kin)"):
        table.add_column(column, justify="left" if column == "from" else "right")
    for m in lmap.layers:
        where = "[yellow]no kin layer[/]" if m.source is None else f"layer {m.source}"
        if len(lmap.parents) > 1 and m.source is not None:
            where += f" of {names[m.parent]}"
        table.add_row(str(m.layer), where, f"{m.score:.3f}", f"{m.similarity:.3f}", p_text(m.log10_p))
    return table
