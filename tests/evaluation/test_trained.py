"""Trained models from different seeds: every alignment strategy lowers the loss barrier of the
GPT-2 (on the ViT: matching on activations and on the loss), and generalized-orthogonal at least
halves vanilla's linear barrier; on tiny Qwen3, Gemma-2 and Pythia it lowers it by half a nat or
more; a fine-tune (full or LoRA) moved
onto another seed's base does better at its task than that base and than the naive transport; on
two BERTs head-perm with `residual: all` is the best of Verma & Elbayad's variants
(slow: trains the tiny models on first use, about a minute each, cached afterwards)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "alignment"))  # bench_barriers, bench_verma
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "transport"))  # bench_transport

from bench_barriers import barrier_table, markdown
from bench_transport import markdown as transport_markdown
from bench_transport import transport_row


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "vit"])
def test_alignment_lowers_the_barrier_of_models_trained_from_different_seeds(kind):
    rows = {r["strategy"]: r for r in barrier_table(kind)}
    print("\n" + markdown(kind, list(rows.values())))
    vanilla = rows.pop("vanilla")
    assert vanilla["linear"] > 0.05, "the two seeds should not be linearly connected before alignment"
    # On the tiny ViT (weights near their initialisation) data-free matching swings with the descent's
    # visiting order and with the trained weights, which differ across CPUs: benchmarks/README.md's 4 seeds give
    # weight matching 2.07-4.05 against vanilla 3.15, and ViTs trained on an AMD EPYC give 5.20 against
    # 3.04. Matching on activations or on the loss has no such problem; those are asserted there.
    lowered = rows if kind == "gpt2" else {k: rows[k] for k in ("head-perm", "generalized-orthogonal + learned")}
    for name, row in lowered.items():
        assert row["linear"] < vanilla["linear"], name
        assert row["midpoint"] < vanilla["midpoint"], name
    best_go = min(rows["generalized-orthogonal"]["linear"], rows["generalized-orthogonal + learned"]["linear"])
    assert best_go <= 0.5 * vanilla["linear"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "pythia"])
def test_alignment_lowers_the_barrier_of_other_causal_lm_families(kind):
    """Measured (benchmarks/README.md): linear barriers vanilla 2.54 / 2.31 / 2.08 nats (qwen3 / gemma2 / pythia),
    generalized-orthogonal 1.18 / 1.59 / 1.28, learned on top of it 0.77 / 1.32 / 0.65."""
    rows = {r["strategy"]: r for r in barrier_table(kind)}
    print("\n" + markdown(kind, list(rows.values())))
    assert max(rows["vanilla"]["loss_a"], rows["vanilla"]["loss_b"]) < 2.0  # the GPT-2's ≈ 1.68
    vanilla = rows.pop("vanilla")
    assert vanilla["linear"] > 1.0, "the two seeds should have a clear barrier before alignment"
    assert rows["weight-matching"]["linear"] < vanilla["linear"]
    go, learned = rows["generalized-orthogonal"], rows["generalized-orthogonal + learned"]
    assert go["linear"] < vanilla["linear"] - 0.5
    assert learned["linear"] < go["linear"]


@pytest.mark.slow
def test_a_fine_tune_and_a_lora_adapter_transfer_to_a_base_from_another_seed():
    pytest.importorskip("peft")
    row = transport_row(0, 1)
    print("\n" + transport_markdown([row]))
    assert abs(row["lora_ft"] - row["lora_dense_ft"]) < 1e-4, "PEFT and the dense update disagree on A"
    for kind in ("full", "lora"):
        moved, naive = row[f"{kind}_go"], row[f"{kind}_naive"]
        assert moved < row["target"] - 0.01, f"{kind}: B + π(τ) is not clearly below B"
        assert moved < naive - 0.01, f"{kind}: B + π(τ) is not clearly below B + τ"


@pytest.mark.slow
def test_on_a_re_release_the_alignment_costs_nothing_and_the_fine_tune_keeps_its_gain():
    """B = A's training continued (zoo:gpt2-next): the bases share their basis, so every
    alignment should find the identity, and the moved task vector should keep most of its gain."""
    pytest.importorskip("peft")
    row = transport_row(0, 0, target_kind="gpt2-next")
    print("\n" + transport_markdown([row]))
    for kind in ("full", "lora"):
        for moved in (f"{kind}_go", f"{kind}_transfusion"):
            assert row[moved] <= row[f"{kind}_naive"] + 0.005, moved
        assert row[f"{kind}_go"] < row["target"] - 0.3, kind


@pytest.mark.slow
def test_on_a_zoo_bert_pair_residual_all_is_the_best_head_perm_variant():
    """Verma & Elbayad's variants on two BERTs (masked LM) trained from different seeds: matching
    the residual stream by its encoder sites (`residual: all`) lowers the barrier well below
    vanilla's and below the other residual choices; a permutation per site (`separate`) breaks B."""
    from bench_verma import markdown as verma_markdown
    from bench_verma import measure

    rows = ["vanilla", "hp-sep", "res-first-sep", "res-last-sep", "res-all-sep", "res-separate"]
    result = measure(rows, ((0, 1),), batches=16)
    print("\n" + verma_markdown(result, rows))
    linear = {key: entry["linear"][0] for key, entry in result["rows"].items()}
    assert linear["vanilla"] > 1.0, "the two seeds should have a clear barrier before alignment"
    assert linear["res-all-sep"] < linear["vanilla"] - 0.3
    assert linear["res-all-sep"] == min(linear.values())
    assert linear["res-separate"] > linear["vanilla"]
