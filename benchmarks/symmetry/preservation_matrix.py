"""The function-preservation matrix: every tiny model × every transform class, and negative controls.

    python benchmarks/symmetry/preservation_matrix.py                       # every factory (~30 s on 2 cores)
    python benchmarks/symmetry/preservation_matrix.py --only gpt2 llama-gqa --seeds 1 --json out.json

For every factory in `tests/tiny.FACTORIES` (read at run time), every class of
`hf_rebasin.symmetry.spaces.TRANSFORM_CLASSES` plus ``invertible heads`` (a random orthogonal transform
with random invertible inner maps in every head space, as `tests/symmetry/test_adapters.py` draws it) and
each seed: apply a random allowed transform (on the canonical form where the class needs it:
orthogonal and invertible heads) and measure max |Δ| over the model's outputs against the
untransformed model, hidden states mapped into the new basis (`hf_rebasin.alignment.verify.compare`).
Tolerance 1e-4 in float32.

Negative controls, generated from each model's graph (forbidden transforms, applied with
``check=False``; each must move the outputs by more than 1e-3, or the preservation test could not
catch an adapter that claims too much):

- ``residual rotation``: a random orthogonal map not fixing 1 of each residual space whose class is
  below orthogonal or centered (canonical form);
- ``mlp rotation``: a random rotation of each MLP unit space (kind ``mlp``);
- ``qk rotation``: a random orthogonal Q/K inner map in each head space whose Q/K mode is
  ``planes`` or ``fixed``;
- ``residual signs``: a random sign flip of each residual space that does not allow signs
  (canonical form);
- ``cross-stream read``: in an encoder-decoder with a stream per stack (Whisper), the tensors of one
  stack that read the other's stream (cross-attention's keys and values) moved with their own
  stack's map instead: that stream permuted at random, theirs with it.
- ``pinned stream permutation``: a random permutation of each pinned residual space (Marian's and
  M2M100's: sinusoidal positions the model regenerates on load), the state's position tables
  permuted with it, then ``save_pretrained`` and ``from_pretrained``: Marian's table is a parameter,
  so the permutation looks exact in memory and breaks on reload; M2M100's is a buffer, never moved.
  Not run where the class saves its tables (a bare ``MarianModel``: its ``_keys_to_ignore_on_save``
  is empty, so the permuted table is read back): the family's stream stays pinned there too, since
  ``MarianMTModel``, the class of the released checkpoints, drops them.

Each control is applied to one space at a time; the table shows the weakest space. A space whose
control moves nothing is checked for reach: if noise on every tensor with an axis on it leaves the
outputs too, no output reads it (``siglip-cls``: `SiglipForImageClassification`'s attention-pooling
head, whose pooled embedding the classifier never reads) and it is listed as unread instead. Prints two
Markdown tables on stdout, progress on stderr; exits 1 when a row fails, a control is weak (Δ ≤
1e-3) or a model errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's hf_rebasin, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # `import tiny`

import tiny
from hf_rebasin.alignment.verify import TOLERANCE, compare, example_inputs, outputs_of
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import get_adapter
from hf_rebasin.symmetry.adapters.base import ArchitectureSpec
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import TRANSFORM_CLASSES, HeadSpace, Space, TransformClass
from hf_rebasin.symmetry.transforms import (
    AxisMap,
    HeadMap,
    Transform,
    plain_class,
    random_invertible_head_map,
    random_orthogonal,
)

INVERTIBLE = "invertible heads"
CLASSES: tuple[str, ...] = (*TRANSFORM_CLASSES, INVERTIBLE)
SEEDS = (0, 1, 2)
BROKEN = 1e-3  # a negative control must move the outputs by more than this
CONTROLS = (
    "residual rotation",
    "mlp rotation",
    "qk rotation",
    "residual signs",
    "cross-stream read",
    "pinned stream permutation",
)
Outputs = dict[str, torch.Tensor]


@dataclass
class Row:
    """One (model, class): max |Δ| per seed and the class each space got."""

    model: str
    model_type: str
    cls: str
    deltas: list[float] = field(default_factory=list)
    residual: str = ""
    classes: dict[str, str] = field(default_factory=dict)
    error: str = ""

    @property
    def max_delta(self) -> float:
        return _worst(self.deltas)

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.deltas) and math.isfinite(self.max_delta) and self.max_delta <= TOLERANCE


@dataclass
class Control:
    """One negative control of one model: Δ per space it was applied to."""

    model: str
    model_type: str
    control: str
    deltas: dict[str, float] = field(default_factory=dict)
    error: str = ""
    unread: list[str] = field(default_factory=list)  # spaces no compared output reads: no control possible

    @property
    def weakest(self) -> tuple[str, float]:
        """The space whose Δ is smallest (NaN counts as broken: it moved the outputs)."""
        name = min(self.deltas, key=lambda k: self.deltas[k] if math.isfinite(self.deltas[k]) else math.inf)
        return name, self.deltas[name]

    @property
    def ok(self) -> bool:
        if self.error or not self.deltas:
            return not self.error and bool(self.unread)
        delta = self.weakest[1]
        return not math.isfinite(delta) or delta > BROKEN


def _worst(values: Sequence[float]) -> float:
    """max that keeps NaN (Python's max may drop it)."""
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=math.nan)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]


# ------------------------------------------------------------------------------------------------
# the allowed transforms


def residual_label(graph: SymmetryGraph, classes: dict[str, str]) -> str:
    """The class the residual space(s) got, compressed: one label, or ``text: …; vision: …``."""
    res = {n: classes[n] for n, sp in graph.spaces.items() if isinstance(sp, Space) and sp.kind == "residual"}
    if not res:
        return "—"
    if len(set(res.values())) == 1:
        return next(iter(res.values()))
    return "; ".join(f"{name.removesuffix('.res')}: {got}" for name, got in res.items())


def allowed_transform(
    graph: SymmetryGraph, sd: dict[str, torch.Tensor], cls: str, seed: int
) -> tuple[SymmetryGraph, dict[str, torch.Tensor], Transform, bool]:
    """A random allowed transform of class ``cls`` and the state it applies to (canonical form for
    orthogonal maps): ``(graph, transformed state, transform, untie)``."""
    untied: list[str] = []
    if cls in ("orthogonal", INVERTIBLE):
        sd, graph, untied = canonicalize(graph, sd)
    g = torch.Generator().manual_seed(seed)
    if cls == INVERTIBLE:
        transform = graph.random_transform("orthogonal", g)
        for name, space in graph.spaces.items():
            if isinstance(space, HeadSpace):
                transform[name] = random_invertible_head_map(space, g, spread=1.0)
    else:
        transform = graph.random_transform(_as_class(cls), g)
    return graph, graph.apply(sd, transform), transform, bool(untied)


def _as_class(cls: str) -> TransformClass:
    for c in TRANSFORM_CLASSES:
        if c == cls:
            return c
    raise ValueError(f"unknown transform class {cls!r}")


def space_classes(graph: SymmetryGraph, cls: str) -> dict[str, str]:
    """The class each space gets from ``random_transform`` for ``cls``: ``graph.classes``, but plain
    spaces as drawn (strictly: a signed-permutation space gets plain permutations when those are
    asked for), and for invertible heads orthogonal with invertible head inner maps."""
    out = graph.classes(_as_class("orthogonal" if cls == INVERTIBLE else cls))
    for name, space in graph.spaces.items():
        if isinstance(space, Space) and space.pinned:
            continue  # graph.classes says "pinned (identity only: …)"
        if isinstance(space, Space):
            got = plain_class(space, _as_class("orthogonal" if cls == INVERTIBLE else cls), strict=True)
            out[name] = got + (" (fixing 1)" if got == "orthogonal" and space.centered else "")
        elif cls == INVERTIBLE and isinstance(space, HeadSpace):  # experts keep their orthogonal-class draw
            qk = {"free": "invertible", "planes": "scaled plane rotations", "fixed": "fixed"}[space.qk]
            out[name] = f"head-permutation + invertible inner (Q/K {qk})"
    return out


# ------------------------------------------------------------------------------------------------
# the negative controls


def _dense(size: int, g: torch.Generator) -> AxisMap:
    return AxisMap(size, blocks=random_orthogonal(size, g)[None])


def _signs(size: int, g: torch.Generator) -> AxisMap:
    signs = torch.randint(0, 2, (size,), generator=g) * 2 - 1
    signs[0] = -1  # never the identity
    return AxisMap.signed(None, signs)


def _qk_rotation(ident: HeadMap, space: HeadSpace, g: torch.Generator) -> HeadMap:
    qk = random_orthogonal(space.head_dim, g, batch=space.num_kv_heads)
    return HeadMap(ident.kv_perm, ident.q_perm, qk, ident.vo)


def control_targets(graph: SymmetryGraph) -> dict[str, list[str]]:
    """Per control, the spaces it applies to (what the graph does not claim)."""
    plain = {n: sp for n, sp in graph.spaces.items() if isinstance(sp, Space)}
    residual = {n: sp for n, sp in plain.items() if sp.kind == "residual"}
    return {
        "residual rotation": [n for n, sp in residual.items() if sp.max_class != "orthogonal" or sp.centered],
        "mlp rotation": [n for n, sp in plain.items() if sp.kind == "mlp" and sp.max_class != "orthogonal"],
        "qk rotation": [
            n for n, sp in graph.spaces.items() if isinstance(sp, HeadSpace) and sp.qk in ("planes", "fixed")
        ],
        "residual signs": [n for n, sp in residual.items() if not sp.allows_signs],
        "cross-stream read": [n for n in residual if foreign_readers(graph, n)],
        "pinned stream permutation": [n for n, sp in residual.items() if sp.pinned],
    }


def _home_streams(graph: SymmetryGraph) -> dict[str, str]:
    """Per stack of the graph, the residual space its tensors bind most (its own stream)."""
    residual = {n for n, sp in graph.spaces.items() if isinstance(sp, Space) and sp.kind == "residual"}
    homes: dict[str, str] = {}
    for stack in graph.stacks:
        counts: dict[str, int] = {}
        for tensor, binding in graph.bindings.items():
            if tensor.startswith(stack + "."):
                for ref in binding.axes:
                    for sp in _spaces(ref):
                        if sp in residual:
                            counts[sp] = counts.get(sp, 0) + 1
        if counts:
            homes[stack] = max(counts, key=lambda k: counts[k])
    return homes


def foreign_readers(graph: SymmetryGraph, name: str) -> dict[str, str]:
    """Tensors of another stack that read residual space ``name`` (cross-attention's keys and values
    read the encoder's stream), each with its own stack's stream, of the same size."""
    out: dict[str, str] = {}
    for stack, home in _home_streams(graph).items():
        if home == name or graph.spaces[home].size != graph.spaces[name].size:
            continue
        for tensor, binding in graph.bindings.items():
            if tensor.startswith(stack + ".") and any(name in _spaces(ref) for ref in binding.axes):
                out[tensor] = home
    return out


def cross_stream(graph: SymmetryGraph, name: str, seed: int) -> tuple[SymmetryGraph, Transform]:
    """The graph with ``name``'s foreign readers rebound to their own stack's stream, and a random
    permutation of that stream (the identity elsewhere): applied, they move with the wrong map."""
    readers = foreign_readers(graph, name)
    bindings = dict(graph.bindings)
    for tensor, home in readers.items():
        b = bindings[tensor]
        bindings[tensor] = dataclasses.replace(b, axes=tuple(home if r == name else r for r in b.axes))
    home = next(iter(readers.values()))
    transform = graph.identity()
    transform[home] = graph.random_transform("permutation", torch.Generator().manual_seed(seed))[home]
    return dataclasses.replace(graph, bindings=bindings), transform


def _spaces(ref: Any) -> tuple[str, ...]:
    """The spaces an axis reference names (a head space's ``:q``/``:k``/``:v``/``:o`` dropped)."""
    parts = () if ref is None else (ref,) if isinstance(ref, str) else tuple(ref.parts)
    return tuple(p.split(":")[0] for p in parts)


def forbidden(graph: SymmetryGraph, control: str, name: str, seed: int) -> Transform:
    """The identity but for space ``name``, which gets the forbidden map of ``control``."""
    g = torch.Generator().manual_seed(seed)
    t = graph.identity()
    space = graph.spaces[name]
    if control == "qk rotation":
        ident = t[name]
        assert isinstance(space, HeadSpace) and isinstance(ident, HeadMap)
        t[name] = _qk_rotation(ident, space, g)
    elif control == "pinned stream permutation":
        assert isinstance(space, Space)
        t[name] = AxisMap(space.size, index=torch.roll(torch.randperm(space.size, generator=g), 1))
    else:
        assert isinstance(space, Space)
        t[name] = _signs(space.size, g) if control == "residual signs" else _dense(space.size, g)
    return t


# ------------------------------------------------------------------------------------------------
# one model


class Probe:
    """One tiny model: its spec, graph, state, and the untransformed outputs per input seed."""

    def __init__(self, name: str, factory: Callable[..., torch.nn.Module]) -> None:
        self.name = name
        model: Any = factory(0)
        self.model: Any = model.float().eval()
        self.model_type: str = model.config.model_type
        self.spec: ArchitectureSpec = get_adapter(self.model_type)
        self.sd = dict(self.model.state_dict())
        self.graph = self.spec.graph(self.model.config, self.sd.keys())
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}
        self._before: dict[int, Outputs] = {}
        self._canonical: tuple[dict[str, torch.Tensor], SymmetryGraph, bool] | None = None

    def inputs(self, seed: int) -> dict[str, torch.Tensor]:
        if seed not in self._inputs:
            self._inputs[seed] = example_inputs(self.spec, self.model.config, torch.Generator().manual_seed(seed + 1))
        return self._inputs[seed]

    def before(self, seed: int) -> Outputs:
        if seed not in self._before:
            self._before[seed] = outputs_of(self.model, self.spec, self.inputs(seed))
        return self._before[seed]

    def canonical(self) -> tuple[dict[str, torch.Tensor], SymmetryGraph, bool]:
        if self._canonical is None:
            sd, graph, untied = canonicalize(self.graph, self.sd)
            self._canonical = dict(sd), graph, bool(untied)
        return self._canonical

    def delta(
        self, graph: SymmetryGraph, state: dict[str, torch.Tensor], transform: Transform, untie: bool, seed: int
    ) -> float:
        """max |Δ| of every output of the model rebuilt from ``state``, hidden states mapped by ``transform``."""
        after = outputs_of(rebuild(self.model, state, untie=untie), self.spec, self.inputs(seed))
        return compare(self.spec, graph, transform, self.before(seed), after)

    def reloaded_delta(self, transform: Transform, seed: int) -> float:
        """max |Δ| after ``transform`` (a pinned stream's map) and a save/load round trip: the position
        tables in the state are permuted too (as a learned table would be), then regenerated on load."""
        state = self.graph.apply(self.sd, transform, check=False)
        for t in transform.values():
            index = t.index if isinstance(t, AxisMap) else None
            for key in [k for k in state if k.endswith("embed_positions.weight") and index is not None]:
                state[key] = state[key][:, index]
        with tempfile.TemporaryDirectory() as folder:
            rebuild(self.model, state).save_pretrained(folder)
            reloaded = type(self.model).from_pretrained(folder).float().eval()
        after = outputs_of(reloaded, self.spec, self.inputs(seed))
        return compare(self.spec, self.graph, transform, self.before(seed), after)

    def regenerates_positions(self) -> bool:
        """Whether ``save_pretrained`` leaves out every position table of the state (or it has none)."""
        ignored = getattr(self.model, "_keys_to_ignore_on_save", None) or set()
        return all(k in ignored for k in self.sd if k.endswith("embed_positions.weight"))

    def reaches_outputs(self, name: str, seed: int) -> bool:
        """Whether space ``name`` reaches a compared output: noise on every tensor with an axis on it
        moves the outputs by more than `BROKEN`."""
        g = torch.Generator().manual_seed(seed)
        noisy = dict(self.sd)
        for tensor, binding in self.graph.bindings.items():
            if any(name in _spaces(ref) for ref in binding.axes):
                noisy[tensor] = noisy[tensor] + torch.randn(noisy[tensor].shape, generator=g)
        return self.delta(self.graph, noisy, self.graph.identity(), False, seed) > BROKEN

    def row(self, cls: str, seeds: Sequence[int]) -> Row:
        row = Row(self.name, self.model_type, cls)
        try:
            row.classes = space_classes(self.graph, cls)
            row.residual = residual_label(self.graph, row.classes)
            if cls == INVERTIBLE and not any(isinstance(sp, HeadSpace) for sp in self.graph.spaces.values()):
                row.error = "no head space"
                return row
            for seed in seeds:
                graph, state, transform, untie = allowed_transform(self.graph, self.sd, cls, seed)
                row.deltas.append(self.delta(graph, state, transform, untie, seed))
        except Exception as e:  # a half-written adapter: report it, go on with the others
            row.error = _short(e)
            traceback.print_exc(file=sys.stderr)
        return row

    def controls(self, seed: int) -> list[Control]:
        out = []
        try:
            targets = control_targets(self.graph)
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            return [Control(self.name, self.model_type, "(graph)", error=_short(e))]
        if not self.regenerates_positions():
            targets["pinned stream permutation"] = []
        for control in CONTROLS:
            if not targets[control]:
                continue
            c = Control(self.name, self.model_type, control)
            try:
                canonical = control in ("residual rotation", "residual signs")  # γ folded: only the claim breaks
                sd, graph, untie = self.canonical() if canonical else (self.sd, self.graph, False)
                for name in targets[control]:
                    if control == "cross-stream read":
                        rebound, t = cross_stream(graph, name, seed)
                        delta = self.delta(graph, rebound.apply(sd, t, check=False), t, untie, seed)
                    else:
                        t = forbidden(graph, control, name, seed)
                        if control == "pinned stream permutation":
                            c.deltas[name] = self.reloaded_delta(t, seed)
                            continue
                        delta = self.delta(graph, graph.apply(sd, t, check=False), t, untie, seed)
                    if not delta > BROKEN and not self.reaches_outputs(name, seed):
                        c.unread.append(name)
                    else:
                        c.deltas[name] = delta
            except Exception as e:
                c.error = _short(e)
                traceback.print_exc(file=sys.stderr)
            out.append(c)
        return out


# ------------------------------------------------------------------------------------------------
# the tables


def _num(x: float) -> str:
    return "NaN" if math.isnan(x) else f"{x:.2e}"


def matrix_table(rows: list[Row]) -> str:
    lines = [
        "| model | model_type | class | residual class | max \\|Δ\\| | tolerance | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = _num(r.max_delta) if r.deltas else "—"
        ok = "yes" if r.ok else f"**NO** ({r.error})" if r.error else "**NO**"
        lines.append(f"| {r.model} | {r.model_type} | {r.cls} | {r.residual} | {delta} | {TOLERANCE:.0e} | {ok} |")
    return "\n".join(lines)


def compact_table(rows: list[Row], controls: list[Control]) -> str:
    """One row per model: the residual class under `orthogonal`, the max |Δ| per class over the
    seeds, and the weakest negative control (the form of the matrix in benchmarks/README.md)."""
    by_model: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_model.setdefault(r.model, {})[r.cls] = r
    weakest: dict[str, tuple[float, str]] = {}
    for c in controls:
        if c.deltas:
            low = min(c.deltas.values())
            if c.model not in weakest or low < weakest[c.model][0]:
                weakest[c.model] = (low, c.control)
    head = " | ".join(CLASSES)
    lines = [
        f"| model | residual class | {head} | weakest negative control (Δ) |",
        "|---|---|" + "---|" * len(CLASSES) + "---|",
    ]
    for model, per in by_model.items():
        first = next(iter(per.values()))
        residual = per.get("orthogonal", first).residual
        cells = " | ".join(
            (_num(per[c].max_delta) if per[c].ok else f"**{_num(per[c].max_delta)}**") if c in per else "—"
            for c in CLASSES
        )
        low = weakest.get(model)
        control = f"{low[1]} ({low[0]:.2g})" if low else "—"
        lines.append(f"| {model} | {residual} | {cells} | {control} |")
    return "\n".join(lines)


def controls_table(controls: list[Control]) -> str:
    lines = [
        "| model | control | spaces | Δ (weakest space) | weakest space | ok |",
        "|---|---|---|---|---|---|",
    ]
    for c in controls:
        if c.error or not c.deltas:
            ok = "unread" if c.ok else f"**ERROR** ({c.error})"
            lines.append(f"| {c.model} | {c.control} | {len(c.deltas)} | — | — | {ok} |")
            continue
        name, delta = c.weakest
        ok = "yes" if c.ok else f"**WEAK** (≤ {BROKEN:.0e})"
        lines.append(f"| {c.model} | {c.control} | {len(c.deltas)} | {_num(delta)} | {name} | {ok} |")
    return "\n".join(lines)


def run(names: Sequence[str], seeds: Sequence[int]) -> tuple[list[Row], list[Control]]:
    """The matrix rows and the negative controls of the factories ``names``."""
    rows: list[Row] = []
    controls: list[Control] = []
    for i, name in enumerate(names, 1):
        start = time.perf_counter()
        print(f"[{i}/{len(names)}] {name} ...", end="", file=sys.stderr, flush=True)
        try:
            probe = Probe(name, tiny.FACTORIES[name])
        except Exception as e:
            print(" ERROR", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            rows.extend(Row(name, "?", cls, error=_short(e)) for cls in CLASSES)
            continue
        new_rows = [probe.row(cls, seeds) for cls in CLASSES]
        new_controls = probe.controls(seeds[0])
        rows += new_rows
        controls += new_controls
        bad = [r.cls for r in new_rows if not r.ok] + [c.control for c in new_controls if not c.ok]
        status = f" FAILED: {', '.join(bad)}" if bad else " ok"
        print(f"{status} ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return rows, controls


def _json(x: float) -> float | None:
    return x if math.isfinite(x) else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="factories of tests/tiny.py to run (default: all)")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds per (model, class) (default: 3)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the raw numbers here")
    parser.add_argument("--compact", action="store_true", help="one row per model (the table of benchmarks/README.md)")
    args = parser.parse_args(argv)
    names = list(tiny.FACTORIES) if not args.only else args.only
    unknown = [n for n in names if n not in tiny.FACTORIES]
    if unknown:
        parser.error(f"unknown factories {unknown}; known: {sorted(tiny.FACTORIES)}")
    seeds = list(range(args.seeds))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend with each other
    start = time.perf_counter()
    try:
        rows, controls = run(names, seeds)
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - start

    print(f"## Function preservation ({len(names)} models × {len(CLASSES)} classes, {len(seeds)} seeds)\n")
    if args.compact:
        print(compact_table(rows, controls))
    else:
        print(matrix_table(rows))
        print(f"\n## Negative controls (forbidden transforms; each must move the outputs by > {BROKEN:.0e})\n")
        print(controls_table(controls))
    failing = [r for r in rows if not r.ok]
    weak = [c for c in controls if not c.ok]
    print(f"\n{len(rows) - len(failing)}/{len(rows)} rows ok, {len(controls) - len(weak)}/{len(controls)} controls ok")
    for r in failing:
        print(f"- FAILING: {r.model} × {r.cls}: {r.error or f'max |Δ| {_num(r.max_delta)} > {TOLERANCE:.0e}'}")
    for c in controls:
        for name in c.unread:
            print(f"- UNREAD: {c.model} × {c.control}: space {name!r} reaches no compared output (no control)")
    for c in weak:
        what = c.error or f"space {c.weakest[0]!r}: Δ {_num(c.weakest[1])} ≤ {BROKEN:.0e}"
        print(f"- WEAK CONTROL: {c.model} × {c.control}: {what}")
        print(f"!!! weak negative control: {c.model} × {c.control}: {what}", file=sys.stderr)
    print(f"\nelapsed: {elapsed:.1f} s")
    if args.json:
        data = {
            "tolerance": TOLERANCE,
            "broken": BROKEN,
            "seeds": seeds,
            "elapsed_s": elapsed,
            "rows": [
                {**asdict(r), "deltas": [_json(d) for d in r.deltas], "max_delta": _json(r.max_delta), "ok": r.ok}
                for r in rows
            ],
            "controls": [
                {**asdict(c), "deltas": {k: _json(v) for k, v in c.deltas.items()}, "ok": c.ok} for c in controls
            ],
        }
        args.json.write_text(json.dumps(data, indent=1))
    return 0 if not failing and not weak else 1


if __name__ == "__main__":
    sys.exit(main())
