"""Learned matching with gated-unit scales (`learn_glu_scales`): B's rescaled units compute what B
computes in the stock transformers class, the scales are found where a known mismatch puts them,
a cache hit rebuilds them bit for bit, and the option is checked before anything runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

import tiny
from hf_rebasin.alignment import cache
from hf_rebasin.alignment.strategies import Alignment, AlignmentData, Pair, align, get_strategy
from hf_rebasin.core.errors import StrategyOptionError
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text, text_blocks
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.recipe import RecipeError, load_recipe, loads_recipe
from hf_rebasin.run import run_recipe
from hf_rebasin.symmetry import glu
from hf_rebasin.symmetry.adapters import graph_for
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.transforms import AxisMap

CASE = "qwen3-untied"
TEXT = shakespeare_text(["hamlet"])[:6000].lower()
TOKENIZER = char_tokenizer(TEXT)
LEARNED = {"learned": True, "steps": 30, "lr": 0.05, "eval_every": 10, "patience": 0, "learn_heads": False}


def _data() -> AlignmentData:
    """Four batches of 8 × 32 characters with labels (the model's own loss is what is learned on)."""
    blocks = text_blocks(TOKENIZER, TEXT, 32)
    batches = [blocks[8 * i : 8 * (i + 1)] for i in range(4)]
    return AlignmentData([{"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b} for b in batches])


def _fitted(data: AlignmentData, steps: int = 80) -> torch.nn.Module:
    """A tiny Qwen3 fitted to ``data``: its MLP units matter, so a scale mismatch costs loss."""
    model = tiny.FACTORIES[CASE](0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    torch.manual_seed(0)
    for step in range(steps):
        loss = model(**data.batches[step % len(data.batches)]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


class Case:
    """A fitted A and B = A with its MLP units permuted and rescaled (|s| in [0.2, 5], positive:
    `glu: keep` sees the mismatch, and exp(t) can undo it)."""

    def __init__(self) -> None:
        self.data = _data()
        self.a = _fitted(self.data)
        self.sd_a = self.a.state_dict()
        self.graph: SymmetryGraph = graph_for(self.a.config, self.sd_a.keys())
        g = torch.Generator().manual_seed(3)
        spaces = [u.space for u in self.graph.glus]
        sizes = {s: self.graph.ref_size(s) for s in spaces}
        # log-uniform in [1/5, 5], indexed by A's units
        self.true_logs = {
            s: (torch.rand(sizes[s], generator=g, dtype=torch.float64) * 2 - 1) * math.log(5) for s in spaces
        }
        self.perm = {s: AxisMap(sizes[s], index=torch.randperm(sizes[s], generator=g)) for s in spaces}
        scaled = glu.apply_unit_scales(self.graph, self.sd_a, {s: t.exp() for s, t in self.true_logs.items()})
        self.sd_b = self.graph.apply(scaled, {**self.graph.identity(), **self.perm})
        self.b = rebuild(self.a, self.sd_b).eval()

    def pair(self) -> Pair:
        return Pair(self.graph, self.sd_a, self.sd_b, self.a, self.b, self.data)

    def undo(self, space: str) -> torch.Tensor:
        """The log-scale that brings each of B's units (B's order) back to its A unit's scale."""
        return -self.true_logs[space][self.perm[space].index]


@pytest.fixture(scope="module")
def case() -> Case:
    return Case()


@pytest.fixture(scope="module")
def runs(case: Case) -> dict[str, Alignment]:
    """The constructed pair aligned by generalized-orthogonal + learned, with and without scales."""
    return {
        "plain": align("generalized-orthogonal", case.pair(), {**LEARNED, "glu": "keep", "learn_glu_scales": False}),
        "scales": align("generalized-orthogonal", case.pair(), {**LEARNED, "glu": "keep", "learn_glu_scales": True}),
        "balanced": align(
            "generalized-orthogonal", case.pair(), {**LEARNED, "learn_glu_scales": True, "glu": "balance"}
        ),
        "default": align("generalized-orthogonal", case.pair(), LEARNED),
    }


def test_learned_matching_balances_and_learns_gated_units_unless_told_otherwise(
    case: Case, runs: dict[str, Alignment]
) -> None:
    """Unset, `glu` is `balance` for learned matching (and says so) and `keep` without it, and the
    scales are learned: the default run is the explicit `glu: balance` + `learn_glu_scales` run."""
    from hf_rebasin.alignment.strategies.base import glu_mode
    from hf_rebasin.alignment.strategies.options import GeneralizedOrthogonalOptions, WeightMatchingOptions

    assert glu_mode(GeneralizedOrthogonalOptions(learned=True)) == "balance"
    assert glu_mode(GeneralizedOrthogonalOptions()) == "keep"
    assert glu_mode(GeneralizedOrthogonalOptions(learned=True, glu="keep")) == "keep"
    assert glu_mode(WeightMatchingOptions()) == "keep"
    default, balanced = runs["default"], runs["balanced"]
    assert default.glu_matched and default.resolved.get("glu") == "balance"
    assert any(n.startswith("glu: balance (unset") for n in default.notes)
    assert "glu" not in balanced.resolved
    assert default.glu_scales is not None and balanced.glu_scales is not None
    for space, s in balanced.glu_scales.items():
        assert torch.equal(default.glu_scales[space], s)
    aligned, expected = default.aligned_b(), balanced.aligned_b()
    assert aligned.keys() == expected.keys() and all(torch.equal(aligned[k], expected[k]) for k in expected)


def _logits(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a fresh stock model of ``model``'s class with ``sd`` loaded (strictly)."""
    fresh = type(model)(model.config).eval()
    fresh.load_state_dict(sd, strict=True)
    ids = torch.randint(0, tiny.V, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        return fresh(input_ids=ids).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["llama-tied-bias", "phi3"])
def test_log_scaled_is_apply_unit_scales_and_differentiable(family: str) -> None:
    """The float32 scaling learned matching differentiates is the exact one (up's bias, Phi-3's
    fused gate_up included), and its gradient reaches every unit."""
    model = tiny.FACTORIES[family](0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    g = torch.Generator().manual_seed(1)
    logs = {u.space: torch.randn(graph.ref_size(u.space), generator=g, requires_grad=True) for u in graph.glus}
    soft = glu.log_scaled(graph, sd, logs)
    exact = glu.apply_unit_scales(graph, sd, {s: t.detach().double().exp() for s, t in logs.items()})
    assert soft.keys() == exact.keys()
    assert max((soft[k].detach() - exact[k]).abs().max().item() for k in soft) < 1e-5
    assert any(not torch.equal(exact[k], sd[k]) for k in sd)  # it did scale something
    sum(v.square().sum() for v in soft.values() if v.requires_grad).backward()
    assert all(t.grad is not None and bool((t.grad != 0).all()) for t in logs.values())


@pytest.mark.parametrize("which", ["scales", "balanced"])
def test_rescaled_b_computes_b_in_the_stock_model(case: Case, runs: dict[str, Alignment], which: str) -> None:
    """The returned B (canonical form, units rescaled by the learned scales, and by A's with
    `glu: balance`) loaded into a fresh transformers model gives B's logits; so does aligned B."""
    alignment = runs[which]
    assert alignment.glu_scales is not None
    assert max(float(s.log().abs().max()) for s in alignment.glu_scales.values()) > 0.1  # B really moved
    if which == "scales":  # balanced, this B's barrier is already ~0 (1e-7 nats): learning may keep the start
        assert any("learned gated-unit scales" in n for n in alignment.notes)
    expected = _logits(case.b, case.sd_b)
    for sd in (dict(alignment.sd_b), alignment.aligned_b()):
        assert (_logits(case.b, sd) - expected).abs().max().item() <= 1e-4


def test_the_learned_scales_lower_the_barrier_and_undo_the_mismatch(case: Case, runs: dict[str, Alignment]) -> None:
    """Both runs find the unit permutation (`glu: keep` still sees it in the gate rows), so what is
    left of the barrier is the scale mismatch: only the scales can remove it, and they do by moving
    each unit towards the scale that undoes its mismatch."""
    plain, scaled = runs["plain"], runs["scales"]
    for alignment in (plain, scaled):
        for space, m in case.perm.items():
            assert torch.equal(alignment.transform[space].index, m.index.argsort())
    before, after = plain.diagnostics["learned"]["best"], scaled.diagnostics["learned"]["best"]
    assert plain.glu_scales is None
    assert after < 0.5 * before, (before, after)
    assert scaled.glu_scales is not None
    learned = torch.cat([scaled.glu_scales[s].log() for s in case.perm])
    truth = torch.cat([case.undo(s) for s in case.perm])
    # closer to the scales that undo the mismatch: in log-scale, and as B's aligned up rows
    assert float((truth - learned).abs().mean()) < 0.9 * float(truth.abs().mean())
    assert float(torch.corrcoef(torch.stack([learned, truth]))[0, 1]) > 0.4
    up = {}
    for name in ("plain", "scales"):
        aligned = runs[name].aligned_b()
        up[name] = sum(float((aligned[u.up[0]] - runs[name].sd_a[u.up[0]]).norm()) for u in case.graph.glus)
    assert up["scales"] < 0.9 * up["plain"], up


# ---------------------------------------------------------------------------------------------
# The cache


def test_a_cache_entry_holds_the_scales_and_rebuilds_b_bit_for_bit(
    case: Case, runs: dict[str, Alignment], tmp_path: Path
) -> None:
    """Matched (`glu: balance`) and learned scales in one float64 vector per gated MLP, stored as
    tensors of the entry; a hit applies them to B's canonical form again: the same bits."""
    fresh = runs["balanced"]
    assert fresh.glu_matched and fresh.glu_scales is not None
    path = cache.save_alignment("g" * 64, fresh, case.pair(), root=tmp_path)
    assert path is not None
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["hf_rebasin"])
        stored = {space: f.get_tensor(name) for space, name in meta["glu_scales"].items()}
    assert stored.keys() == fresh.glu_scales.keys()
    assert all(t.dtype == torch.float64 and torch.equal(t, fresh.glu_scales[s]) for s, t in stored.items())
    hit = cache.read_alignment("g" * 64, case.pair(), "generalized-orthogonal", root=tmp_path)
    assert hit.glu_matched and hit.glu_scales is not None
    for mine, theirs in ((hit.sd_b, fresh.sd_b), (hit.aligned_b(), fresh.aligned_b())):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_rerun_of_the_recipe_hits_the_cache_and_merges_the_same_tensors(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the runner, with `glu: balance` (matched and learned scales together): the second
    run reads the alignment back and writes the same merged model, bit for bit."""
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setenv("HF_REBASIN_CACHE", str(tmp_path / "cache"))
    for name, model in (("a", case.a), ("b", case.b)):
        model.save_pretrained(str(tmp_path / name))
        TOKENIZER.save_pretrained(str(tmp_path / name))

    def run(out: str) -> dict[str, Any]:
        body = {
            "job": "merge",
            "models": ["./a", "./b"],
            "strategy": {
                "name": "generalized-orthogonal",
                **LEARNED,
                "steps": 10,
                "eval_every": 5,
                "glu": "balance",
                "learn_glu_scales": True,
            },
            "data": {"dataset": "shakespeare", "name": "hamlet", "split": "test", "max_tokens": 2048},
            "output": {"dir": out},
            "device": "cpu",
        }
        path = tmp_path / f"{out}.yaml"
        path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
        result = run_recipe(load_recipe(path))
        record: dict[str, Any] = json.loads((result.output / "rebasin.json").read_text(encoding="utf-8"))
        return record

    first, second = run("first"), run("second")
    assert first["cache"] == {"enabled": True, "hits": 0, "misses": 1}
    assert second["cache"] == {"enabled": True, "hits": 1, "misses": 0}
    assert any("learned gated-unit scales" in n for n in first["notes"]), first["notes"]
    one, two = (load_file(str(tmp_path / out / "model.safetensors")) for out in ("first", "second"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


# ---------------------------------------------------------------------------------------------
# The option


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"learned": True, "learn_glu_scale": True}, "strategy.learn_glu_scale: Extra inputs"),
        ({"learned": True, "learn_glu_scales": "maybe"}, "strategy.learn_glu_scales: Input should be a valid boolean"),
        ({"learn_glu_scales": True}, "learn_glu_scales only apply with `learned: true`"),
    ],
)
def test_the_option_is_checked_before_anything_runs(options: dict[str, Any], match: str) -> None:
    with pytest.raises(StrategyOptionError, match=match):
        get_strategy("generalized-orthogonal").parse(options)
    assert get_strategy("generalized-orthogonal").parse({"learned": True, "learn_glu_scales": True})
    assert get_strategy("generalized-orthogonal").parse({"learned": True}).learn_glu_scales  # type: ignore[attr-defined]
    off = get_strategy("generalized-orthogonal").parse({"learned": True, "learn_glu_scales": False})
    assert not off.learn_glu_scales  # type: ignore[attr-defined]


def test_a_recipe_with_a_misspelt_option_names_it() -> None:
    text = (
        "job: merge\nmodels: [./a, ./b]\nstrategy: {name: generalized-orthogonal, learned: true, "
        "learn_glu_scale: true}\ndata: {dataset: shakespeare, split: test}\noutput: {dir: out}\n"
    )
    with pytest.raises(RecipeError) as info:
        loads_recipe(text)
    assert [p.path for p in info.value.problems] == ["strategy.learn_glu_scale"]
    assert "did you mean `learn_glu_scales`" in str(info.value)
