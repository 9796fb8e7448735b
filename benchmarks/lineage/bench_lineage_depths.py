"""The lineage testbed across depths: depth-pruned, up-scaled and two-parent stacked descendants of
trained models, and the same built from independent seeds, scored by `hf-rebasin lineage` (the
verdict and the layer map) and by a symmetry-blind baseline (each of B's layers matched to the layer
of A whose raw weights have the highest cosine; related at a median cosine of 0.5 or more).

    python benchmarks/lineage/bench_lineage_depths.py            # the benchmark zoo's 4-layer models (cached)

Descendants (of the benchmark GPT-2, Qwen3 and Gemma 2, 4 layers each; "trained" = built from the
GPT-2's domain fine-tune, 1,000 steps on the KJV, where the family has one, else 5 % of each tensor's
RMS in noise as a stand-in): every second layer kept; the last layer dropped; SOLAR-style up-scaling
(layers 0–2 then 1–3); each also under a random orthogonal transform (related up to symmetry); the
GPT-2's three built from the base and then trained 300 steps on the KJV (cached after the first run); a
`passthrough` stack of the base's layers 0–2 and its fine-tune's 1–3 given with both parents; an
equal-depth stack of two independent seeds' halves. Independent: the same descendants built from
seed 1 scored against seed 0, and from the tiny zoo GPT-2's seeds 1–3 against seed 0 (2 layers:
layer 1 alone, layers 0, 1, 1). Prints every case, the confusion of verdicts, how many layer maps
are exact, and the baseline beside ours.
"""

from __future__ import annotations

import copy
import itertools
import re
import statistics
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_lineage import VERDICTS, _load, _transformed

from hf_rebasin.io.models import LoadedModel
from hf_rebasin.lineage.pairs import lineage_of
from hf_rebasin.symmetry.adapters import graph_for

State = dict[str, torch.Tensor]
LAYERS = re.compile(r"^(.*?\.(?:h|layers))\.(\d+)\.(.*)$")
BLIND = 0.5


@dataclass
class DepthCase:
    label: str
    kind: str
    how: str
    expect: str
    sources: list[tuple[int, int]]  # (parent, layer) per layer of the descendant
    verdict: str = ""
    exact: bool = False  # the layer map is the one the descendant was built with
    blind: float = 0.0
    blind_exact: bool = False
    seconds: float = 0.0


def stacked(
    parents: list[LoadedModel], states: list[State], sources: list[tuple[int, int]], noise: float = 0.0
) -> LoadedModel:
    """A model whose layer j is ``states[p]``'s layer i for ``(p, i) = sources[j]`` (the rest from
    the first parent), plus ``noise`` of each tensor's RMS."""
    config = copy.deepcopy(parents[0].model.config)
    setattr(config, "n_layer" if hasattr(config, "n_layer") else "num_hidden_layers", len(sources))
    if getattr(config, "layer_types", None):  # sliding / full attention per layer: the source layer's
        config.layer_types = [parents[0].model.config.layer_types[i] for _, i in sources]
    model = type(parents[0].model)(config).eval()
    g = torch.Generator().manual_seed(3)
    out = {}
    for name in model.state_dict():
        found = LAYERS.match(name)
        if found is None:
            t = states[0][name]
        else:
            p, i = sources[int(found.group(2))]
            t = states[p][f"{found.group(1)}.{i}.{found.group(3)}"]
        if noise and t.is_floating_point() and t.numel() > 1:
            t = t + noise * t.pow(2).mean().sqrt() * torch.randn(t.shape, generator=g)
        out[name] = t
    model.load_state_dict(out, strict=False)
    return LoadedModel(model=model, graph=graph_for(config, model.state_dict().keys()), path=Path("B"))


def blind_map(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> tuple[float, list[int]]:
    """The symmetry-blind baseline: each of B's layers matched to A's layer of highest raw cosine
    (its matrices concatenated); the median of those cosines and the map."""

    def layers(sd: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        out: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in sd.items():
            found = LAYERS.match(name)
            if found is not None and t.dim() >= 2:
                out.setdefault(int(found.group(2)), {})[found.group(3)] = t.double().flatten()
        return out

    la, lb = layers(a), layers(b)
    best, chosen = [], []
    for j in sorted(lb):
        cos = {i: _cosine(la[i], lb[j]) for i in sorted(la)}
        chosen.append(max(cos, key=cos.__getitem__))
        best.append(cos[chosen[-1]])
    return statistics.median(best), chosen


def _cosine(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
    keys = [k for k in x if k in y and x[k].shape == y[k].shape]
    dot = sum(float(x[k] @ y[k]) for k in keys)
    return dot / (sum(float(x[k] @ x[k]) for k in keys) * sum(float(y[k] @ y[k]) for k in keys)) ** 0.5


def _states(lm: LoadedModel) -> State:
    return {k: v.float() for k, v in lm.model.state_dict().items()}


TRAIN_STEPS = 300  # after pruning or up-scaling: 300 steps of 16 KJV blocks at the domain fine-tune's rate


def trained_after(base: LoadedModel, kept: list[int], tag: str) -> LoadedModel:
    """The benchmark GPT-2's layers ``kept``, then trained `TRAIN_STEPS` steps on the KJV (the domain
    fine-tune's data and rate): what a pruned or up-scaled release does to recover; cached."""
    from hf_rebasin.core.resources import cache_root
    from hf_rebasin.evaluation.zoo.catalogue import DomainFineTuneConfig
    from hf_rebasin.evaluation.zoo.causal import run_text
    from hf_rebasin.evaluation.zoo.train import _finetune_data
    from hf_rebasin.io.models import load_model

    out = cache_root() / "lineage-bench" / f"bench-gpt2-{tag}-trained{TRAIN_STEPS}"
    if not (out / "config.json").exists():
        cfg = DomainFineTuneConfig(steps=TRAIN_STEPS)
        _, tokenizer, train, test = _finetune_data(0, None, cfg.eval_tokens, base_kind="bench-gpt2", corpus=cfg.corpus)
        child = stacked([base], [_states(base)], [(0, i) for i in kept]).model.train()
        run_text("bench-gpt2-ft", 0, cfg, out, lambda: child, tokenizer, train, test, progress=None, threads=2)
    return load_model(out)


def descendant_cases() -> Iterator[tuple[DepthCase, list[LoadedModel]]]:
    shapes = {"every second layer": [0, 2], "last layer dropped": [0, 1, 2], "up-scaled (0–2, 1–3)": [0, 1, 2, 1, 2, 3]}
    for kind in ("bench-gpt2", "bench-qwen3", "bench-gemma2"):
        base = _load(kind, 0)
        trained = _states(_load("bench-gpt2-ft", 0)) if kind == "bench-gpt2" else None
        for how, kept in shapes.items():
            sources = [(0, i) for i in kept]
            state, noise, what = (
                (trained, 0.0, "of its KJV fine-tune") if trained is not None else (_states(base), 0.05, "+ 5 % noise")
            )
            child = stacked([base], [state], sources, noise)
            yield DepthCase("related", kind, f"{how} {what}", "same basis", sources), [base, child]
            moved = _transformed(child, child.model.state_dict(), "orthogonal", 5)
            child.model.load_state_dict(moved, strict=False)
            yield DepthCase("related", kind, f"{how} {what}, rotated", "related up to symmetry", sources), [base, child]
    base = _load("bench-gpt2", 0)
    for tag, (how, kept) in zip(("pruned", "dropped", "upscaled"), shapes.items(), strict=True):
        child = trained_after(base, kept, tag)
        case = DepthCase(
            "related", "bench-gpt2", f"{how}, then trained {TRAIN_STEPS} steps", "same basis", [(0, i) for i in kept]
        )
        yield case, [base, child]
    ft = _load("bench-gpt2-ft", 0)
    sources = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
    child = stacked([base, ft], [_states(base), _states(ft)], sources)
    yield (
        DepthCase(
            "stack", "bench-gpt2", "passthrough: base 0–2 + its fine-tune 1–3", "related up to symmetry", sources
        ),
        [base, ft, child],
    )
    other = _load("bench-gpt2", 1)
    sources = [(0, 0), (0, 1), (1, 2), (1, 3)]
    child = stacked([base, other], [_states(base), _states(other)], sources)
    yield (
        DepthCase("stack", "bench-gpt2", "passthrough: seed 0's 0–1 + seed 1's 2–3", "related up to symmetry", sources),
        [base, other, child],
    )
    sources = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
    child = stacked([base, other], [_states(base), _states(other)], sources)
    how = "passthrough: seed 0's 0–2 + seed 1's 1–3 (deeper)"
    yield DepthCase("stack", "bench-gpt2", how, "related up to symmetry", sources), [base, other, child]


def independent_cases() -> Iterator[tuple[DepthCase, list[LoadedModel]]]:
    base, other = _load("bench-gpt2", 0), _load("bench-gpt2", 1)
    for how, kept in {"every second layer": [0, 2], "up-scaled (0–2, 1–3)": [0, 1, 2, 1, 2, 3]}.items():
        child = stacked([other], [_states(other)], [(0, i) for i in kept], 0.05)
        yield DepthCase("independent", "bench-gpt2", f"seed 1 {how} vs seed 0", "independent", []), [base, child]
    tiny = _load("gpt2", 0)
    for seed in (1, 2, 3):
        other = _load("gpt2", seed)
        for how, kept in {"layer 1 alone": [1], "layers 0, 1, 1": [0, 1, 1]}.items():
            child = stacked([other], [_states(other)], [(0, i) for i in kept], 0.05)
            yield DepthCase("independent", "gpt2", f"seed {seed} {how} vs seed 0", "independent", []), [tiny, child]


def score(case: DepthCase, models: list[LoadedModel]) -> DepthCase:
    start = time.perf_counter()
    record = lineage_of(models, [f"m{k}" for k in range(len(models))])
    case.seconds = time.perf_counter() - start
    child = len(models) - 1
    pair = next(p for p in record.pairs if p.b == child and p.a == 0)
    case.verdict = pair.verdict
    if case.label == "stack":
        found = [m for m in record.layer_maps if m.model == child]
        got = [(m.parent, m.source) for m in found[0].layers] if found else []
        case.exact = got == case.sources
        case.verdict = "related up to symmetry" if found and case.exact else f"no stack ({pair.verdict} to parent 0)"
    elif pair.layer_map is not None:
        case.exact = pair.layer_map.model == child and [(0, m.source) for m in pair.layer_map.layers] == case.sources
    case.blind, chosen = blind_map(models[0].model.state_dict(), models[-1].model.state_dict())
    case.blind_exact = bool(case.sources) and [(0, i) for i in chosen] == case.sources
    return case


def main() -> None:
    cases = []
    for case, models in itertools.chain(descendant_cases(), independent_cases()):
        score(case, models)
        cases.append(case)
        print(
            f"{case.label:11s} {case.kind:12s} {case.how:52s} {case.verdict:24s} map {'exact' if case.exact else '-':5s} "
            f"blind {case.blind:6.3f} {'exact' if case.blind_exact else '-'} {case.seconds:5.1f}s",
            flush=True,
        )
    print("\n| right → given | " + " | ".join(VERDICTS) + " |\n|---|" + "---:|" * len(VERDICTS))
    for want in VERDICTS:
        counts = [sum(c.expect == want and c.verdict == got for c in cases) for got in VERDICTS]
        print(f"| {want} | " + " | ".join(str(n) for n in counts) + " |")
    mapped = [c for c in cases if c.sources]
    ind = [c for c in cases if c.label == "independent"]
    print(
        f"\nlayer maps exact: {sum(c.exact for c in mapped)}/{len(mapped)} (blind baseline: {sum(c.blind_exact for c in mapped)}/{len(mapped)})"
    )
    print(
        f"independent called related: {sum(c.verdict != 'independent' for c in ind)}/{len(ind)} "
        f"(blind baseline at cosine ≥ {BLIND}: {sum(c.blind >= BLIND for c in ind)}/{len(ind)})"
    )
    rel = [c for c in cases if c.label == "related"]
    print(
        f"related found: {sum(c.verdict != 'independent' for c in rel)}/{len(rel)} (blind: {sum(c.blind >= BLIND for c in rel)}/{len(rel)})"
    )


if __name__ == "__main__":
    main()
