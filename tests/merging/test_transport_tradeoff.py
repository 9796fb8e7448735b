"""job: transport weighs task gain against support cost, and `alpha: auto` saves the α chosen from it.

The selection rule is tested as a pure function; a transport recipe then runs end to end on tiny
GPT-2: a base A trained a little on one play (its "pretraining" text, the support data), a
fine-tune A_ft trained on another play in ROT13 (the task), and the target B = A with its units permuted, so
that B + α·π(τ) is A + α·τ in B's basis and every loss is known without the library.
"""

from __future__ import annotations

import codecs
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import tiny
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.merging.transport import add_task_vector
from hf_rebasin.recipe import AUTO_ALPHAS, load_recipe
from hf_rebasin.recipe.describe import describe
from hf_rebasin.run.auto_alpha import choose_alpha
from hf_rebasin.symmetry.adapters import graph_for

TASK_PLAY, SUPPORT_PLAY = "the-merry-wives-of-windsor", "hamlet"
ENV = {"HF_DATASETS_OFFLINE": "1"}

# ---------------------------------------------------------------------------------------------
# The selection rule


def test_all_costs_positive_the_best_gain_per_nat_of_cost_wins() -> None:
    choice = choose_alpha([0.5, 1.0, 1.5], gains=[0.10, 0.30, 0.20], costs=[0.05, 0.10, 0.30])
    assert (choice.alpha, choice.index, choice.rule) == (1.0, 1, "ratio")  # 3 per nat, against 2 and 0.67
    assert (choice.gain, choice.cost) == (0.30, 0.10) and "per nat" in choice.reason


def test_a_gain_at_no_support_cost_beats_any_ratio() -> None:
    # α = 1 has the best ratio (3 per nat), but α = 0.5 and 1.5 gain for free; α = 2 is free but loses
    choice = choose_alpha([0.5, 1.0, 1.5, 2.0], gains=[0.10, 0.30, 0.05, -0.1], costs=[-0.01, 0.10, 0.0, -0.5])
    assert (choice.alpha, choice.rule) == (0.5, "no-cost")  # the largest gain among the free ones
    assert "no support cost" in choice.reason


def test_a_budget_takes_the_largest_gain_within_it() -> None:
    alphas, gains, costs = [0.5, 1.0, 1.5], [0.10, 0.30, 0.40], [0.05, 0.10, 0.30]
    assert (choose_alpha(alphas, gains, costs, budget=0.1).alpha, "budget") == (1.0, "budget")
    assert choose_alpha(alphas, gains, costs, budget=0.3).alpha == 1.5  # the cost may equal the budget
    assert choose_alpha(alphas, gains, costs, budget=0.3).rule == "budget"
    assert choose_alpha(alphas, gains, costs, budget=0.0).rule == "fallback"


def test_nothing_within_the_budget_falls_back_to_the_smallest_cost_and_says_what_to_change() -> None:
    choice = choose_alpha([1.0, 0.5, 1.5], gains=[0.30, 0.10, 0.40], costs=[0.10, 0.05, 0.30], budget=0.01)
    assert (choice.alpha, choice.rule, choice.support_budget) == (0.5, "fallback", 0.01)
    assert "within the budget of 0.01 nats" in choice.reason
    assert "raise `alpha.support_budget` to 0.05" in choice.reason and "smaller α" in choice.reason


def test_no_gain_anywhere_falls_back_to_the_smallest_cost_and_says_so() -> None:
    choice = choose_alpha([0.5, 1.0], gains=[-0.01, -0.05], costs=[0.02, 0.01])
    assert (choice.alpha, choice.rule) == (1.0, "fallback")
    assert "no α of the grid lowers the task loss" in choice.reason and "keep B" in choice.reason


def test_ties_and_non_finite_scores() -> None:
    # equal ratios: the larger gain; a NaN score is never picked while another α is finite
    assert choose_alpha([0.5, 1.0], [0.1, 0.2], [0.05, 0.1]).alpha == 1.0
    assert choose_alpha([0.5, 1.0, 1.5], [math.nan, 0.1, 0.2], [0.0, 0.1, math.inf]).alpha == 1.0
    with pytest.raises(ValueError, match="one of each per α"):
        choose_alpha([0.5, 1.0], [0.1], [0.1])


# ---------------------------------------------------------------------------------------------
# Recipes: `alpha: auto` needs task and support data


def _write(tmp_path: Path, body: dict[str, Any], name: str = "transport.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    return path


def _recipe(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "job": "transport",
        "base": "./base",
        "finetuned": "./ft",
        "target": "./target",
        "strategy": "weight-matching",
        "alpha": "auto",
        "calibrate": False,
        "evaluate": {
            "task": "causal-lm",
            "data": {"dataset": "text", "data_files": "task.txt"},
            "support": {"dataset": "text", "data_files": "support.txt"},
            "batch_size": 16,
        },
        "output": {"dir": "moved"},
        **extra,
    }


def test_alpha_auto_without_support_data_is_refused_naming_the_field(tmp_path: Path) -> None:
    from helpers import assert_user_error, run_main

    body = _recipe(tmp_path)
    del body["evaluate"]["support"]
    err = assert_user_error(run_main(str(_write(tmp_path, body)), "--dry-run"), "`evaluate.support`", "alpha: auto")
    assert "add `evaluate.support`" in err
    del body["evaluate"]
    err = assert_user_error(run_main(str(_write(tmp_path, body)), "--dry-run"), "`alpha`", "`evaluate.support`")
    assert "an `evaluate:` section" in err


def test_alpha_auto_and_its_budget_parse_and_plan(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, _recipe(tmp_path)))
    assert recipe.alphas == list(AUTO_ALPHAS) and recipe.auto_alpha is not None
    plan = "\n".join(describe(recipe))
    assert "α chosen automatically from 0.25, 0.5, 0.75, 1, 1.25, 1.5" in plan and "per nat of support cost" in plan
    assert "old base A" in plan and "tradeoff.png" in plan
    budget = load_recipe(_write(tmp_path, _recipe(tmp_path, alpha={"auto": [0.5, 1, 1.5], "support_budget": 0.1})))
    assert budget.alphas == [0.5, 1.0, 1.5] and budget.auto_alpha is not None
    assert budget.auto_alpha.support_budget == 0.1
    assert "support cost is at most 0.1 nats" in "\n".join(describe(budget))
    assert load_recipe(_write(tmp_path, _recipe(tmp_path, alpha=[1.0, 0.5]))).auto_alpha is None


# ---------------------------------------------------------------------------------------------
# End to end on tiny models


def _train(model: torch.nn.Module, ids: torch.Tensor, steps: int, seed: int) -> None:
    """A few Adam steps of next-token prediction on random 32-token windows of ``ids``."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - 33, (8,), generator=g)
        batch = torch.stack([ids[s : s + 32] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _folders(tmp_path: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """base/ (A, trained on the support play), ft/ (A trained on the task text) and target/ (A,
    permuted) with one character tokenizer; task.txt and support.txt held out from training.
    Returns the model, A's and A_ft's state dicts and the permutation."""
    from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text

    # the task: a comedy in ROT13, text A never saw, so that learning it costs A some of its own play
    task = codecs.encode(shakespeare_text([TASK_PLAY])[:6000].lower(), "rot13")
    support = shakespeare_text([SUPPORT_PLAY])[:6000].lower()
    tok = char_tokenizer(task + support)
    assert len(tok) <= tiny.V
    model = tiny.gpt2(0)
    ids = {name: torch.tensor(tok(text[:4000])["input_ids"]) for name, text in (("task", task), ("support", support))}
    torch.manual_seed(0)
    _train(model, ids["support"], 60, seed=1)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, ids["task"], 40, seed=2)
    ft = {k: v.clone() for k, v in model.state_dict().items()}
    graph = graph_for(model.config, base.keys())
    transform = graph.random_transform("permutation", torch.Generator().manual_seed(1))
    target = graph.apply(base, transform)
    for name, sd in (("base", base), ("ft", ft), ("target", target)):
        rebuild(model, dict(sd)).save_pretrained(str(tmp_path / name))
        tok.save_pretrained(str(tmp_path / name))
    (tmp_path / "task.txt").write_text(task[4000:], encoding="utf-8")
    (tmp_path / "support.txt").write_text(support[4000:], encoding="utf-8")
    return model, base, ft, (graph, transform)


def _loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Next-token cross-entropy summed over every labelled position, over their count."""
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
            labels = b["labels"][:, 1:]
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1), ignore_index=-100, reduction="sum"
            ).item()
            count += int((labels != -100).sum())
    return total / count


def _batches(recipe_path: Path, tmp_path: Path) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The task and support batches of the recipe, cut as the run cuts them (its data module)."""
    import transformers as T

    from hf_rebasin.run.data import BatchSpec, batches

    recipe = load_recipe(recipe_path)
    ev = recipe.evaluate
    assert ev is not None and ev.support is not None
    tok = T.AutoTokenizer.from_pretrained(str(tmp_path / "target"))
    config = T.AutoConfig.from_pretrained(str(tmp_path / "ft"))
    out = {}
    for name, spec in (("task", ev.data), ("support", ev.support)):
        batching = BatchSpec("causal-lm", ev.batch_size, spec.max_tokens, spec.max_examples, ev.seed)
        out[name] = batches(spec, batching, tmp_path, tok, config, where=name)
    return out


def _png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_alpha_auto_saves_the_chosen_alpha_and_shows_the_tradeoff(tmp_path: Path, monkeypatch) -> None:
    import transformers as T

    from helpers import flat, run_main

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    model, base, ft, (graph, transform) = _folders(tmp_path)
    alphas = [1.0, 0.25, 0.5]  # the first is not the one chosen: auto saves its own pick
    path = _write(tmp_path, _recipe(tmp_path, alpha={"auto": alphas}))
    proc = run_main(str(path))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "moved"
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    moved = record["transport"]
    assert {"alphas", "loss", "metric", "support"} <= set(moved)  # the documented keys stay
    assert moved["alphas"] == alphas
    assert (
        set(moved["loss"]) == set(moved["support"]["loss"]) == {"target", "base", "finetuned", "transported", "naive"}
    )

    # every loss, independently: B + α·π(τ) is A + α·τ in B's basis
    data = _batches(path, tmp_path)
    tau = {k: ft[k] - base[k] for k in base}
    losses: dict[str, dict[str, Any]] = {}
    for name, batches in data.items():
        losses[name] = {
            "base": _loss(T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")), batches),
            "finetuned": _loss(T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ft")), batches),
            "target": _loss(T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "target")), batches),
            "transported": [_loss(rebuild(model, add_task_vector(base, tau, a)), batches) for a in alphas],
        }
        recorded = moved["loss"] if name == "task" else moved["support"]["loss"]
        for key in ("base", "finetuned", "target"):
            assert recorded[key] == pytest.approx(losses[name][key], abs=1e-5), (name, key)
        assert recorded["transported"] == pytest.approx(losses[name]["transported"], abs=1e-4), name

    # the fine-tune's own forgetting: A_ft against A on the support data (and its gain on the task)
    own = moved["tradeoff"]["finetuned"]
    assert own["cost"] == pytest.approx(losses["support"]["finetuned"] - losses["support"]["base"], abs=1e-5)
    assert own["gain"] == pytest.approx(losses["task"]["base"] - losses["task"]["finetuned"], abs=1e-5)
    assert own["gain"] > 0 and own["cost"] > 0  # it learned its play and forgot some of the other

    gains = [losses["task"]["target"] - x for x in losses["task"]["transported"]]
    costs = [x - losses["support"]["target"] for x in losses["support"]["transported"]]
    assert moved["tradeoff"]["transported"]["gain"] == pytest.approx(gains, abs=1e-4)
    assert moved["tradeoff"]["transported"]["cost"] == pytest.approx(costs, abs=1e-4)
    assert len(moved["tradeoff"]["naive"]["gain"]) == len(alphas)
    want = choose_alpha(alphas, gains, costs)
    chosen = moved["chosen"]
    assert (chosen["alpha"], chosen["rule"]) == (want.alpha, want.rule) and chosen["alpha"] != alphas[0]
    assert set(chosen) >= {"alpha", "rule", "gain", "cost", "reason"}

    # the saved weights are B + α*·π(τ): the permutation of A + α*·τ
    alpha = chosen["alpha"]
    want_sd = graph.apply(add_task_vector(base, tau, alpha), transform)
    saved = T.AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    for key, value in saved.items():
        if key in want_sd:
            assert torch.allclose(value, want_sd[key], atol=1e-5), key

    _png(out / "tradeoff.png")
    assert "| old base A |" in (out / "tradeoff.md").read_text(encoding="utf-8")
    card = (out / "README.md").read_text(encoding="utf-8")
    assert f"α = {alpha:g} chosen automatically" in card and "![task gain against support cost](tradeoff.png)" in card
    assert f"this model: B + {alpha:g}·π(τ)" in card and f"**this model**: B + α·π(τ) | {alpha:g} |" in card
    assert f"a support cost of {own['cost']:+.4f} nats: what it forgot" in card
    shown = flat(proc.stdout)
    assert f"saved: α = {alpha:g}, chosen automatically ({want.rule})" in shown
    assert "task gain against support cost" in shown and "old base A" in shown


def test_alpha_auto_moves_a_lora_adapter_by_the_chosen_alpha(tmp_path: Path, monkeypatch) -> None:
    peft = pytest.importorskip("peft")
    from test_lora import TARGETS, _adapter, _ids, _logits

    from helpers import run_main
    from hf_rebasin.merging.lora import apply_adapter, read_adapter

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    model, base, _, (graph, transform) = _folders(tmp_path)
    _adapter(rebuild(model, dict(base)), tmp_path / "lora", TARGETS["gpt2"])
    alphas = [1.0, 0.25, 0.5]
    body = _recipe(tmp_path, finetuned="./lora", alpha={"auto": alphas, "support_budget": 10.0})
    proc = run_main(str(_write(tmp_path, body)))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "moved"
    moved = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))["transport"]
    points = moved["tradeoff"]["transported"]
    want = choose_alpha(alphas, points["gain"], points["cost"], 10.0)
    alpha = moved["chosen"]["alpha"]
    assert alpha == want.alpha and moved["chosen"]["support_budget"] == 10.0
    assert alpha != alphas[0]  # the first α is not the one written
    # the adapter for B computes A + α*·ΔW in B's basis
    delta = {k: v - base[k] for k, v in apply_adapter(read_adapter(tmp_path / "lora", model), base).items()}
    target = graph.apply(base, transform)
    loaded = peft.PeftModel.from_pretrained(rebuild(model, dict(target)), str(out)).eval()
    want_logits = _logits(rebuild(model, add_task_vector(base, delta, alpha)), _ids(3))
    assert (_logits(loaded, _ids(3)) - want_logits).abs().max().item() < 1e-4
    _png(out / "tradeoff.png")


# ---------------------------------------------------------------------------------------------
# The card from a record


def test_the_card_shows_the_tradeoff_and_says_when_support_data_are_missing() -> None:
    import copy

    from test_card import transport_record

    from hf_rebasin.evaluation.report import tradeoff
    from hf_rebasin.run.card import render_card

    old = transport_record()  # a record from before the trade-off: no base, no tradeoff key
    text = render_card(old, recipe_text="job: transport\ncalibrate: false\n", command="hf-rebasin moved.yaml")
    assert "Task gain against support cost" not in text and "this model: B + 1·π(τ)" in text

    record = copy.deepcopy(old)
    moved = record["transport"]
    moved["loss"]["base"], moved["metric"]["base"] = 3.0, {"perplexity": 20.1}
    support = moved["support"] = copy.deepcopy(moved["support"])
    support["loss"].update(target=1.6, base=1.5, finetuned=1.8, transported=[1.75, 1.65], naive=[1.9, 1.7])
    support["metric"]["base"] = {"perplexity": 4.5}
    moved["tradeoff"] = tradeoff(moved)
    points = moved["tradeoff"]
    assert points["finetuned"] == pytest.approx({"gain": 3.0 - 1.9, "cost": 1.8 - 1.5})
    assert points["transported"]["gain"] == pytest.approx([3.1 - 2.0, 3.1 - 2.4])
    assert points["transported"]["cost"] == pytest.approx([0.15, 0.05])
    moved["chosen"] = choose_alpha(
        moved["alphas"], points["transported"]["gain"], points["transported"]["cost"]
    ).as_dict()
    assert moved["chosen"]["alpha"] == 0.5  # 0.7 for 0.05 beats 1.1 for 0.15
    text = render_card(record, recipe_text="job: transport\ncalibrate: false\n", command="hf-rebasin moved.yaml")
    assert "α = 0.5 chosen automatically (`alpha: auto` over 1, 0.5): the best task gain per nat" in text
    assert "this model: B + 0.5·π(τ)" in text and "this model: B + 1·π(τ)" not in text
    assert "| **this model**: B + α·π(τ) | 0.5 | 2.4000 | 1.6500 | +0.7000 | +0.0500 |" in text
    assert "| fine-tune A + τ | — | 1.9000 | 1.8000 | +1.1000 (over A) | +0.3000 (over A) |" in text
    assert "| old base A | 3.0000 | perplexity 20.1000 |" in text

    del record["transport"]["support"], record["transport"]["tradeoff"], record["transport"]["chosen"]
    text = render_card(record, recipe_text="job: transport\ncalibrate: false\n", command="hf-rebasin moved.yaml")
    assert "Support data (`evaluate.support`, e.g. B's pretraining text) would show" in text
