"""The lineage testbed: labelled pairs from the zoo and the benchmark zoo, scored by `hf-rebasin
lineage` and by a symmetry-blind baseline (the cosine of raw weights, layer by layer).

Related pairs (B descends from A): A itself under a random transform of every class its family
allows (permutations; signed permutations; rotations of the residual stream in canonical form;
gated units rescaled, signs included); A with only some spaces moved (every layer's MLP units and
one layer's heads; one layer's MLP units; gated units rescaled with attention untouched), which
must be *related up to symmetry*, never *same basis*; fine-tunes (full at the zoo's low rate and at 10× it, a LoRA
merged in, a domain fine-tune of the benchmark GPT-2), continued pretraining, merges that contain A,
and A written into a wider shape; each plain and under a random rotation. Independent pairs: every
pair of seeds of every kind, fine-tunes against the other seeds' bases, and one initialisation
trained twice on other text (the zoo GPT-2's seeds on five comedies instead of five tragedies).

    python benchmarks/lineage/bench_lineage.py                 # trains missing zoo seeds first (≈ 1 min each)
    python benchmarks/lineage/bench_lineage.py --seeds 0 1 2   # a smaller testbed
    python benchmarks/lineage/bench_lineage.py --data 8        # alignments started from activations (8 batches)
    python benchmarks/lineage/bench_lineage.py --copies        # each model against itself, its bf16 copy, its LoRA

Prints the confusion of verdicts, ROC AUC of the statistic, the false-positive rate at the default
threshold, the smallest margin between the groups, and the baseline's numbers on the same pairs;
writes every case to ``$HF_REBASIN_CACHE/lineage-bench/results.json``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "alignment"))  # bench_barriers
from bench_barriers import alignment_data

from hf_rebasin.alignment.strategies import AlignmentData
from hf_rebasin.alignment.widths import embed_model
from hf_rebasin.core.resources import cache_root
from hf_rebasin.evaluation.zoo.catalogue import DEFAULT_CONFIGS, GPT2FineTuneConfig, GPT2TrainConfig
from hf_rebasin.evaluation.zoo.train import cached_model
from hf_rebasin.io.models import LoadedModel, load_model
from hf_rebasin.lineage import compare
from hf_rebasin.lineage.datamaps import LineageData
from hf_rebasin.lineage.pairs import lineage_of
from hf_rebasin.merging.lora import apply_adapter, read_adapter
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.canonical import canonicalize

TINY = ("gpt2", "qwen3", "gemma2", "olmo2", "phi3", "pythia", "vit", "bert")
BENCH = ("bench-gpt2", "bench-qwen3", "bench-gemma2")
CLASSES = ("permutation", "signed-permutation", "orthogonal")
# the zoo GPT-2 trains on five tragedies; its twins train from the same seed (the same initial
# weights: the comedies' characters are the tragedies') on five comedies instead
COMEDIES = ("a-midsummer-night-s-dream", "as-you-like-it", "twelfth-night", "much-ado-about-nothing", "the-tempest")
BLIND_THRESHOLD = 0.5  # the baseline calls a pair related at this raw-weight cosine or above
State = dict[str, torch.Tensor]


@dataclass
class Case:
    label: str  # related | independent
    group: str
    kind: str
    how: str
    expect: str  # the verdict that is right: same basis, related up to symmetry, independent
    verdict: str = ""
    statistic: float = 0.0
    raw_statistic: float = 0.0
    log10_p: float = 0.0
    blind: float = 0.0
    seconds: float = 0.0
    space_min: float = 0.0  # the lowest bulk similarity of a counted space (a layer's heads, units, experts)
    space_max: float = 0.0  # the highest
    passes: dict[str, int] = field(default_factory=dict)  # of the alignment: permutations, rotations


def _load(kind: str, seed: int) -> LoadedModel:
    return load_model(cached_model(kind, seed))


def _transformed(lm: LoadedModel, sd: Mapping[str, torch.Tensor], cls: str, seed: int) -> State:
    canonical, cgraph, _ = canonicalize(lm.graph, sd)
    return cgraph.apply(canonical, cgraph.random_transform(cls, torch.Generator().manual_seed(seed)))


def _rescaled(lm: LoadedModel, sd: Mapping[str, torch.Tensor], seed: int) -> State:
    """Every gated unit scaled by ±exp(N(0, 1)): the same function, other weights."""
    g = torch.Generator().manual_seed(seed)
    scales = {}
    for unit in lm.graph.glus:
        n = lm.graph.ref_size(unit.space)
        signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
        scales[unit.space] = signs * torch.exp(torch.randn(n, generator=g, dtype=torch.float64))
    return glu.apply_unit_scales(lm.graph, dict(sd), scales)


def _partly_moved(lm: LoadedModel, sd: Mapping[str, torch.Tensor], seed: int) -> Iterator[tuple[str, State]]:
    """Copies in which only some spaces moved: no plain average of them with A is right."""
    graph = lm.graph
    drawn = graph.random_transform("permutation", torch.Generator().manual_seed(seed))
    kinds = {n: getattr(sp, "kind", None) for n, sp in graph.spaces.items()}
    mlps = sorted(n for n, k in kinds.items() if k == "mlp")
    heads = sorted(n for n, k in kinds.items() if k == "attention")

    def only(spaces: set[str]) -> State:
        return graph.apply(dict(sd), {**graph.identity(), **{k: v for k, v in drawn.items() if k in spaces}})

    if mlps and heads:
        yield "MLP units permuted in every layer, the heads of the first layer only", only({*mlps, heads[0]})
    if mlps:
        yield f"one layer's MLP units permuted ({mlps[-1]})", only({mlps[-1]})
    if graph.glus:
        yield "gated units rescaled (±) in every layer, attention untouched", _rescaled(lm, sd, seed)


def blind_similarity(sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor]) -> float:
    """The symmetry-blind baseline: cosine of the raw weight matrices, layer by layer (tensors
    grouped by the layer index in their names), median over layers."""
    sums: dict[str, list[float]] = {}
    for name, a in sd_a.items():
        b = sd_b.get(name)
        if b is None or b.shape != a.shape or not a.is_floating_point() or a.dim() < 2:
            continue
        layer = next((p for p in name.split(".") if p.isdigit()), "top")
        x, y = a.double().flatten(), b.double().flatten()
        s = sums.setdefault(layer, [0.0, 0.0, 0.0])
        s[0], s[1], s[2] = s[0] + float(x @ y), s[1] + float(x @ x), s[2] + float(y @ y)
    per_layer = [d / (na * nb) ** 0.5 for layer, (d, na, nb) in sums.items() if layer != "top" and na * nb > 0]
    return statistics.median(per_layer) if per_layer else 0.0


def probe_data(kind: str, batches: int, cache: dict[str, AlignmentData]) -> AlignmentData:
    """``batches`` batches of the kind's training data (text or digits), made once per kind."""
    if kind not in cache:
        cache[kind] = alignment_data(kind, cached_model(kind, 0), batches)
    return cache[kind]


def _score(
    case: Case,
    lm: LoadedModel,
    sd_a: Mapping[str, torch.Tensor],
    sd_b: Mapping[str, torch.Tensor],
    data: AlignmentData | None = None,
) -> Case:
    start = time.perf_counter()
    probe = None if data is None else LineageData(data.batches, lm.model, data.special_ids)
    found = compare(lm.graph, sd_a, sd_b, data=probe)
    case.seconds = time.perf_counter() - start
    case.verdict, case.statistic, case.raw_statistic = found.verdict, found.statistic, found.raw_statistic
    case.log10_p, case.passes = found.log10_p, found.passes
    spaces = [e.similarity for e in found.spaces if e.counted]
    case.space_min, case.space_max = min(spaces), max(spaces)
    case.blind = blind_similarity(sd_a, sd_b)
    return case


def _descendants(kind: str, seed: int) -> Iterator[tuple[str, str, Callable[[], State]]]:
    """(group, how, B) for the trained descendants of ``kind`` seed ``seed`` the zoo can make."""
    if kind != "gpt2":
        return
    yield "fine-tune", "full fine-tune (lr 5e-4, 300 steps)", lambda: _load("gpt2-ft", seed).model.state_dict()
    big = GPT2FineTuneConfig(lr=5e-3)
    yield (
        "fine-tune",
        "full fine-tune at 10× the rate (lr 5e-3)",
        lambda: load_model(cached_model("gpt2-ft", seed, config=big)).model.state_dict(),
    )
    yield (
        "continued pretraining",
        "pretraining continued 1,000 steps",
        lambda: _load("gpt2-next", seed).model.state_dict(),
    )

    def lora() -> State:
        base = _load("gpt2", seed).model
        adapter = read_adapter(cached_model("gpt2-lora", seed), base)
        return apply_adapter(adapter, base.state_dict())

    yield "LoRA merged", "LoRA (rank 16) merged in", lora

    def merge() -> State:
        a, b = _load("gpt2", seed).model.state_dict(), _load("gpt2-ft", seed).model.state_dict()
        return {k: (a[k] + b[k]) / 2 if a[k].is_floating_point() else a[k] for k in a}

    yield "merge", "average with its own fine-tune", merge


def related_cases(seeds: list[int], bench: tuple[str, ...] = BENCH) -> Iterator[tuple[Case, LoadedModel, State, State]]:
    for kind in TINY + bench:
        for seed in seeds[:2] if kind in TINY else [0]:
            lm = _load(kind, seed)
            sd = lm.model.state_dict()
            for i, cls in enumerate(CLASSES):
                if kind in BENCH and cls != "orthogonal":
                    continue
                b = _transformed(lm, sd, cls, 100 + i)
                yield Case("related", "transform", kind, f"seed {seed}, {cls}", "related up to symmetry"), lm, sd, b
            for how, b in _partly_moved(lm, sd, 20 + seed):
                yield Case("related", "partly moved", kind, f"seed {seed}, {how}", "related up to symmetry"), lm, sd, b
            if lm.graph.glus:
                b = _transformed(lm, _rescaled(lm, sd, 7), "orthogonal", 9)
                how = f"seed {seed}, gated units rescaled (±), rotated"
                yield Case("related", "transform", kind, how, "related up to symmetry"), lm, sd, b
            for group, how, make in _descendants(kind, seed):
                b = make()
                yield Case("related", group, kind, f"seed {seed}, {how}", "same basis"), lm, sd, b
                b = _transformed(lm, b, "orthogonal", 11)
                yield Case("related", group, kind, f"seed {seed}, {how}, rotated", "related up to symmetry"), lm, sd, b
    if "bench-gpt2" not in bench:
        return
    lm = _load("bench-gpt2", 0)
    ft = _load("bench-gpt2-ft", 0).model.state_dict()
    sd = lm.model.state_dict()
    how = "domain fine-tune (KJV, 1,000 steps)"
    yield Case("related", "fine-tune", "bench-gpt2", how, "same basis"), lm, sd, ft
    rotated = _transformed(lm, ft, "orthogonal", 12)
    yield Case("related", "fine-tune", "bench-gpt2", how + ", rotated", "related up to symmetry"), lm, sd, rotated


def widened_cases(seeds: list[int], data: AlignmentData | None = None) -> Iterator[Case]:
    """A tiny GPT-2 written into a wider shape (exactly), then moved by a random permutation."""
    for seed in seeds[:2]:
        narrow = _load("gpt2", seed)
        like = copy.deepcopy(narrow.model.config)
        like.n_embd, like.n_head = 96, 6
        wide, _ = embed_model(narrow.model, like)
        sd = wide.state_dict()
        graph = graph_for(wide.config, sd.keys())
        moved = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(seed)))
        wide.load_state_dict(moved)
        how = f"seed {seed}, d 64 → 96, permuted"
        wide_lm = LoadedModel(model=wide, graph=graph, path=Path("wide"))
        yield _pair(narrow, wide_lm, "related", "widened", "gpt2", how, "related up to symmetry", data)


def _extended(seed: int, folder: Path) -> Path:
    """The zoo GPT-2 of ``seed`` re-released with 4 new tokens (rows at the mean of the old): a
    release that extends its vocabulary, written with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = cached_model("gpt2", seed)
    model, tok = AutoModelForCausalLM.from_pretrained(str(source)), AutoTokenizer.from_pretrained(str(source))
    tok.add_tokens([f"<ctl_{i}>" for i in range(4)])
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[-4:] = emb[:-4].mean(0)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def _moved(lm: LoadedModel, seed: int) -> LoadedModel:
    """``lm`` with a random permutation of every space (its tokenizer's folder kept)."""
    sd = lm.model.state_dict()
    moved = lm.graph.apply(sd, lm.graph.random_transform("permutation", torch.Generator().manual_seed(seed)))
    model = copy.deepcopy(lm.model)
    model.load_state_dict(moved)
    return LoadedModel(model=model, graph=lm.graph, path=lm.path)


def vocabulary_cases(seeds: list[int], data: AlignmentData | None = None, *, bench: bool = True) -> Iterator[Case]:
    """Pairs whose vocabularies differ, judged on the tokens both have (`lineage_of`): a chat
    fine-tune (ChatML added) and a release with 4 more tokens against their base (plain, and the
    chat fine-tune permuted), and chat fine-tunes against other seeds' bases."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="lineage-vocab-"))
    for seed in seeds[:2]:
        base, chat = _load("gpt2", seed), _load("gpt2-chat", seed)
        extended = load_model(_extended(seed, tmp / f"extended-{seed}"))
        yield _pair(base, chat, "related", "chat fine-tune", "gpt2", f"seed {seed}, ChatML added", "same basis", data)
        how = f"seed {seed}, ChatML added, permuted"
        yield _pair(base, _moved(chat, seed), "related", "chat fine-tune", "gpt2", how, "related up to symmetry", data)
        how = f"seed {seed}, 4 tokens added"
        yield _pair(base, extended, "related", "extended vocabulary", "gpt2", how, "same basis", data)
        for other in (s for s in seeds[:3] if s != seed):
            how = f"base seed {other}, chat fine-tune of seed {seed}"
            yield _pair(
                _load("gpt2", other),
                chat,
                "independent",
                "chat fine-tune of another seed",
                "gpt2",
                how,
                "independent",
                data,
            )
    if not bench:  # the benchmark GPT-2 and its chat fine-tune: about 45 minutes to train on first use
        return
    bench, bench_chat = _load("bench-gpt2", 0), _load("bench-gpt2-chat", 0)
    how = "seed 0, ChatML added, KJV exchange"
    yield _pair(bench, bench_chat, "related", "chat fine-tune", "bench-gpt2", how, "same basis", data)
    how = "base seed 1, chat fine-tune of seed 0"
    yield _pair(
        _load("bench-gpt2", 1),
        bench_chat,
        "independent",
        "chat fine-tune of another seed",
        "bench-gpt2",
        how,
        "independent",
        data,
    )


def _pair(
    a: LoadedModel, b: LoadedModel, label: str, group: str, kind: str, how: str, expect: str, data: AlignmentData | None
) -> Case:
    start = time.perf_counter()
    record = lineage_of([a, b], ["A", "B"], data=data)
    p = record.pairs[0]
    case = Case(label, group, kind, how, expect)
    case.verdict, case.statistic, case.raw_statistic, case.log10_p = p.verdict, p.statistic, p.raw_statistic, p.log10_p
    case.seconds, case.blind, case.passes = time.perf_counter() - start, 0.0, p.passes  # shapes differ: no baseline
    spaces = [e.similarity for e in p.spaces if e.counted]
    case.space_min, case.space_max = min(spaces), max(spaces)
    return case


def independent_cases(
    seeds: list[int], bench: tuple[str, ...] = BENCH
) -> Iterator[tuple[Case, LoadedModel, State, State]]:
    for kind in TINY + bench:
        kind_seeds = seeds if kind in TINY else [0, 1, 2]
        loaded = {s: _load(kind, s) for s in kind_seeds}
        for s, t in itertools.combinations(kind_seeds, 2):
            lm = loaded[s]
            case = Case("independent", "seed pair", kind, f"seeds {s}, {t}", "independent")
            yield case, lm, lm.model.state_dict(), loaded[t].model.state_dict()
    for s, t in itertools.permutations(seeds[:3], 2):
        lm = _load("gpt2", t)
        case = Case(
            "independent", "fine-tune of another seed", "gpt2", f"base seed {t}, fine-tune of seed {s}", "independent"
        )
        yield case, lm, lm.model.state_dict(), _load("gpt2-ft", s).model.state_dict()


def shared_init_cases(seeds: list[int]) -> Iterator[tuple[Case, LoadedModel, State, State]]:
    """One initialisation trained twice on other text: the zoo GPT-2 (five tragedies) against the
    same seed (the same initial weights) trained from scratch on five comedies. Neither descends
    from the other: independent."""
    other = GPT2TrainConfig(plays=COMEDIES)
    for seed in seeds[:3]:
        lm = _load("gpt2", seed)
        b = load_model(cached_model("gpt2", seed, config=other)).model.state_dict()
        case = Case("independent", "same seed, other data", "gpt2", f"seed {seed}, five comedies", "independent")
        yield case, lm, lm.model.state_dict(), b


def copies(seeds: list[int], bench: tuple[str, ...] = BENCH) -> Iterator[tuple[str, str, LoadedModel, State, State]]:
    """(kind, how, A, A's weights, B's) where B is A itself, A rounded to bf16 (as a bf16 release
    stores it) or, for the zoo GPT-2, A with its LoRA merged in: pairs in which no space moved."""
    for kind in TINY + bench:
        for seed in seeds[:2] if kind in TINY else [0]:
            lm = _load(kind, seed)
            sd = lm.model.state_dict()
            yield kind, f"seed {seed}, itself", lm, sd, {k: v.clone() for k, v in sd.items()}
            half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
            yield kind, f"seed {seed}, bf16 copy", lm, sd, half
            for group, how, make in _descendants(kind, seed):
                if group == "LoRA merged":
                    yield kind, f"seed {seed}, {how}", lm, sd, make()


def copies_check(seeds: list[int], bench: tuple[str, ...]) -> str:
    """Every copy's verdict and its lowest (aligned − stored) bulk similarity over every space: an
    alignment that moves nothing never reads less than the stored order."""
    worst: dict[str, float] = {}
    lines = ["| model | B | verdict | min over spaces of aligned − stored | in | spaces not in place |"]
    lines.append("|---|---|---|---:|---|---:|")
    for kind, how, lm, sd_a, sd_b in copies(seeds, bench):
        found = compare(lm.graph, sd_a, sd_b)
        low = min(found.spaces, key=lambda e: e.similarity - e.raw_similarity)
        gap = low.similarity - low.raw_similarity
        what = how.split(", ", 1)[1]
        worst[what] = min(worst.get(what, gap), gap)
        moved = sum(not e.in_place for e in found.spaces if e.counted)
        lines.append(f"| {kind} | {how} | {found.verdict} | {gap:+.2e} | {low.space} ({low.map}) | {moved} |")
        print(lines[-1], flush=True)
    lines += ["", *(f"{what}: min aligned − stored {gap:+.2e}" for what, gap in worst.items())]
    return "\n".join(lines)


def auc(pos: list[float], neg: list[float]) -> float:
    """ROC AUC: the chance a related pair scores above an independent one (ties count half)."""
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def summary(cases: list[Case]) -> str:
    rel = [c for c in cases if c.label == "related"]
    ind = [c for c in cases if c.label == "independent"]
    called = lambda c: c.verdict != "independent"  # noqa: E731
    lines = [f"{len(rel)} related pairs, {len(ind)} independent pairs", ""]
    lines += ["| | hf-rebasin lineage | raw-weight cosine per layer (symmetry-blind) |", "|---|---:|---:|"]
    rel_blind = [c for c in rel if c.group != "widened"]
    lines.append(
        f"| ROC AUC | {auc([c.statistic for c in rel], [c.statistic for c in ind]):.3f} | "
        f"{auc([c.blind for c in rel_blind], [c.blind for c in ind]):.3f} |"
    )
    fpr = sum(called(c) for c in ind) / len(ind)
    fpr_blind = sum(c.blind >= BLIND_THRESHOLD for c in ind) / len(ind)
    lines.append(f"| independent called related (FPR) | {fpr:.3f} | {fpr_blind:.3f} |")
    tpr = sum(called(c) for c in rel) / len(rel)
    tpr_blind = sum(c.blind >= BLIND_THRESHOLD for c in rel_blind) / len(rel_blind)
    lines.append(f"| related found (TPR) | {tpr:.3f} | {tpr_blind:.3f} |")
    margin = min(c.statistic for c in rel) - max(c.statistic for c in ind)
    margin_blind = min(c.blind for c in rel_blind) - max(c.blind for c in ind)
    lines.append(f"| smallest margin (lowest related − highest independent) | {margin:.3f} | {margin_blind:.3f} |")
    lines.append(
        f"| per space: highest independent, lowest related | {max(c.space_max for c in ind):.3f}, "
        f"{min(c.space_min for c in rel):.3f} | |"
    )
    right = sum(c.verdict == c.expect for c in cases) / len(cases)
    lines += ["", f"verdict exactly right (same basis / related up to symmetry / independent): {100 * right:.1f} %", ""]
    lines += [*confusion(cases), ""]
    lines += [
        "| group | pairs | verdicts | statistic (min–max) | baseline (min–max) | seconds (median) |",
        "|---|---:|---|---|---|---:|",
    ]
    for (label, group), members in itertools.groupby(
        sorted(cases, key=lambda c: (c.label, c.group)), key=lambda c: (c.label, c.group)
    ):
        ms = list(members)
        counts = {v: sum(c.verdict == v for c in ms) for v in ("same basis", "related up to symmetry", "independent")}
        said = ", ".join(f"{v}: {n}" for v, n in counts.items() if n)
        lines.append(
            f"| {label}: {group} | {len(ms)} | {said} | {min(c.statistic for c in ms):.3f}–{max(c.statistic for c in ms):.3f} | "
            f"{min(c.blind for c in ms):.3f}–{max(c.blind for c in ms):.3f} | {statistics.median(c.seconds for c in ms):.2f} |"
        )
    wrong = [c for c in cases if c.verdict != c.expect]
    if wrong:
        lines += ["", "verdicts other than expected:"] + [
            f"- {c.kind} {c.how}: {c.verdict} (expected {c.expect}, statistic {c.statistic:.3f})" for c in wrong
        ]
    return "\n".join(lines)


VERDICTS = ("same basis", "related up to symmetry", "independent")


def confusion(cases: list[Case]) -> list[str]:
    """Rows: the verdict that is right; columns: the verdict given."""
    lines = ["| right → given | " + " | ".join(VERDICTS) + " |", "|---|" + "---:|" * len(VERDICTS)]
    for want in VERDICTS:
        counts = [sum(c.expect == want and c.verdict == got for c in cases) for got in VERDICTS]
        lines.append(f"| {want} | " + " | ".join(str(n) for n in counts) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5], help="tiny zoo seeds")
    parser.add_argument("--out", type=Path, default=None, help="results.json (default: under the cache)")
    parser.add_argument(
        "--data",
        type=int,
        default=0,
        metavar="BATCHES",
        help="start every alignment from activations on this many batches",
    )
    parser.add_argument("--vocabularies", action="store_true", help="only the pairs whose vocabularies differ")
    parser.add_argument("--tiny-only", action="store_true", help="leave out the benchmark zoo (trained on first use)")
    parser.add_argument("--copies", action="store_true", help="only each model against itself, bf16 and its LoRA")
    args = parser.parse_args(argv)
    assert all(k in DEFAULT_CONFIGS for k in TINY + BENCH)
    if args.copies:
        print(copies_check(args.seeds, () if args.tiny_only else BENCH))
        return
    cases: list[Case] = []
    made: dict[str, AlignmentData] = {}
    if args.vocabularies:
        probe = probe_data("gpt2", args.data, made) if args.data else None
        for case in vocabulary_cases(args.seeds, probe, bench=not args.tiny_only):
            cases.append(case)
            print(
                f"{case.label:11s} {case.kind:12s} {case.how:50s} {case.verdict:24s} {case.statistic:6.3f}", flush=True
            )
        print(summary(cases))
        return
    bench = () if args.tiny_only else BENCH
    pairs = itertools.chain(
        related_cases(args.seeds, bench), independent_cases(args.seeds, bench), shared_init_cases(args.seeds)
    )
    for case, lm, a, b in pairs:
        cases.append(_score(case, lm, a, b, probe_data(case.kind, args.data, made) if args.data else None))
        print(
            f"{case.label:11s} {case.kind:12s} {case.how:60s} {case.verdict:24s} {case.statistic:6.3f} blind {case.blind:6.3f}",
            flush=True,
        )
    cases.extend(widened_cases(args.seeds, probe_data("gpt2", args.data, made) if args.data else None))
    probe = probe_data("gpt2", args.data, made) if args.data else None
    cases.extend(vocabulary_cases(args.seeds, probe, bench=not args.tiny_only))
    out = args.out or cache_root() / "lineage-bench" / ("results-data.json" if args.data else "results.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(c) for c in cases], indent=1))
    print(summary(cases))
    print(f"\nwritten: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
