"""``hf-rebasin align``: strategies from the command line, and their bad input (exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers as T
import yaml
from safetensors import safe_open

import tiny
from helpers import assert_user_error, flat, run_main
from hf_rebasin.evaluation.data import char_tokenizer


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return T.GPT2LMHeadModel.from_pretrained(str(folder)).eval()(ids).logits


def _distance(a: Path, b: Path) -> float:
    """‖a − b‖ / ‖a‖ read straight from the two safetensors files."""
    num = den = 0.0
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        for key in fa.keys():
            x, y = fa.get_tensor(key).double(), fb.get_tensor(key).double()
            num, den = num + float((x - y).pow(2).sum()), den + float(x.pow(2).sum())
    return (num / den) ** 0.5


def test_align_writes_both_models_in_one_basis(saved_model, tmp_path):
    text = "to be, or not to be, that is the question"
    a, b = saved_model("gpt2", seed=0), saved_model("gpt2", seed=1)
    for folder in (a, b):
        char_tokenizer(text).save_pretrained(str(folder))
    # each its own file (the same tokens, written otherwise): other tokens are a recipe's (tests/bad_cases_tokenizers.py)
    data = json.loads((b / "tokenizer.json").read_text(encoding="utf-8"))
    (b / "tokenizer.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    out = tmp_path / "aligned"
    proc = run_main(
        "align", str(a), str(b), "--strategy", "generalized-orthogonal", "--set", "iterations=3",
        "--device", "cpu", "--output", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text_out = flat(proc.stdout)
    before = float(re.search(r"before\W*([\d.]+)", text_out).group(1))
    after = float(re.search(r"after\W*([\d.]+)", text_out).group(1))
    assert after < before
    assert "untied for the canonical form: lm_head.weight" in text_out
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "a", "alignment.json", "b", "mergekit.yaml"]
    # each written model computes what its input computed, loaded with the stock class
    ids = torch.randint(0, tiny.V, (2, 8), generator=torch.Generator().manual_seed(0))
    for written, original in ((out / "a", a), (out / "b", b)):
        torch.testing.assert_close(_logits(written, ids), _logits(original, ids), atol=1e-4, rtol=0)
        assert (written / "tokenizer.json").read_bytes() == (original / "tokenizer.json").read_bytes()
    # A is in canonical form (its head stored apart), and the two are as close as the report says
    assert json.loads((out / "a" / "config.json").read_text())["tie_word_embeddings"] is False
    assert _distance(out / "a", out / "b") == pytest.approx(after, abs=1e-4)
    record = json.loads((out / "alignment.json").read_text())
    assert record["canonical"] is True and record["strategy"] == "generalized-orthogonal"
    assert record["distance"]["after"] == pytest.approx(after, abs=1e-4)
    assert all(g["max_abs_diff"] <= g["tolerance"] for g in record["function_preserved"].values())
    config = yaml.safe_load((out / "mergekit.yaml").read_text())
    assert [m["model"] for m in config["models"]] == ["./a", "./b"] and config["merge_method"] == "slerp"
    assert str(tmp_path) not in (out / "README.md").read_text()  # no local absolute path to share


def test_a_permutation_strategy_writes_a_as_it_is(saved_model, tmp_path):
    a, b = saved_model("bert-mlm", seed=0), saved_model("bert-mlm", seed=1)
    out = tmp_path / "aligned"
    proc = run_main("align", str(a), str(b), "--strategy", "weight-matching", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    with (
        safe_open(str(a / "model.safetensors"), "pt") as fa,
        safe_open(str(out / "a" / "model.safetensors"), "pt") as fo,
    ):
        assert set(fa.keys()) == set(fo.keys())
        assert all(torch.equal(fa.get_tensor(k), fo.get_tensor(k)) for k in fa.keys())
    assert json.loads((out / "alignment.json").read_text())["canonical"] is False


def test_device_that_is_not_there_exits_2_before_loading(saved_model):
    a, b = str(saved_model("gpt2")), str(saved_model("gpt2", seed=1))
    assert_user_error(run_main("align", a, b, "--device", "tpu"), "--device", "'tpu' is not a device")
    if not torch.cuda.is_available():
        assert_user_error(run_main("align", a, b, "--device", "cuda"), "--device", "no CUDA device")


def test_models_of_different_architectures_exit_2_naming_both(saved_model):
    proc = run_main("align", str(saved_model("gpt2")), str(saved_model("bert-mlm")))
    assert_user_error(proc, "BertForMaskedLM", "GPT2LMHeadModel")


def test_models_of_different_shapes_name_the_first_differing_tensor(saved_model):
    """Shapes that are no width (those are embedded: tests/alignment/test_widths.py), here the positions."""
    small = tiny.FACTORIES["gpt2"](0)
    other = T.GPT2LMHeadModel(T.GPT2Config(**{**small.config.to_dict(), "n_positions": 32}))
    proc = run_main("align", str(saved_model(small)), str(saved_model(other)))
    assert_user_error(proc, "transformer.wpe.weight", "(64, 32)", "(32, 32)")


def test_models_of_different_widths_are_aligned_in_the_wider_shape(saved_model):
    small = tiny.FACTORIES["gpt2"](0)
    wide = T.GPT2LMHeadModel(T.GPT2Config(**{**small.config.to_dict(), "n_inner": 160}))
    proc = run_main("align", str(saved_model(small)), str(saved_model(wide)))
    assert proc.returncode == 0, proc.stderr
    assert "MODEL_A embedded into the shape of MODEL_B" in proc.stdout and "128 → 160" in proc.stdout


def test_head_perm_without_data_exits_2(saved_model):
    proc = run_main("align", str(saved_model("gpt2")), str(saved_model("gpt2", seed=1)), "--strategy", "head-perm")
    assert_user_error(proc, "head-perm", "data:")


def test_inapplicable_or_unknown_options_exit_2(saved_model):
    a, b = str(saved_model("llama-gqa")), str(saved_model("llama-gqa", seed=1))
    assert_user_error(
        run_main("align", a, b, "--strategy", "generalized-orthogonal", "--set", "sinkhorn=true"), "learned"
    )
    assert_user_error(
        run_main("align", a, b, "--strategy", "transfusion", "--set", "heads=monotonic"),
        "`--set heads=monotonic`",
        "not an option",
    )
    assert_user_error(run_main("align", a, b, "--strategy", "nope"), "unknown strategy", "weight-matching")


def test_existing_output_folder_is_refused_before_any_work(saved_model, tmp_path):
    a = saved_model("gpt2")
    proc = run_main("align", str(a), str(a), "--output", str(tmp_path))
    assert_user_error(proc, "already exists")


def test_vit_folders_with_legacy_tensor_names_load(saved_model):
    # transformers 5 writes ViT with 4.x names (`encoder.layer.N.attention.attention.query`) and renames
    # them while loading: the pre-load shape check must not call them missing
    from hf_rebasin.io.models import load_model

    loaded = load_model(saved_model("vit"))
    assert "layers.0.attn" in loaded.graph.spaces


def test_zoo_names_resolve_to_the_zoo_folder(monkeypatch, tmp_path):
    import hf_rebasin.evaluation.zoo.train as train
    from hf_rebasin.cli.common import _model_folder

    asked = []
    monkeypatch.setattr(train, "cached_model", lambda kind, seed: asked.append((kind, seed)) or tmp_path)
    assert _model_folder("zoo:gpt2-seed3", allow_pickle=False) == str(tmp_path)
    assert asked == [("gpt2", 3)]


def _hidden(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return T.BertModel.from_pretrained(str(folder)).eval()(ids).last_hidden_state


@pytest.mark.parametrize("how", ["command", "recipe"])
def test_a_bare_encoder_is_written_in_as_basis_with_its_hidden_states_permuted(tmp_path: Path, how: str) -> None:
    """A model without a head (a sentence encoder) has no logits: its written hidden states are its
    own with the features permuted, found here from the two folders alone (they used to be compared
    unmapped, and the run stopped with an internal error)."""
    for name, seed in (("a", 0), ("b", 1)):
        tiny.bert_base(seed).save_pretrained(str(tmp_path / name))
    if how == "command":
        proc = run_main("align", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(tmp_path / "out"))
        written = tmp_path / "out" / "b"
    else:
        body = {"job": "align", "models": ["./a", "./b"], "strategy": {"name": "weight-matching"}}
        (tmp_path / "r.yaml").write_text(yaml.safe_dump({**body, "output": {"dir": "out"}, "device": "cpu"}))
        proc = run_main(str(tmp_path / "r.yaml"), "--output", str(tmp_path / "out"))
        written = next(p for p in sorted((tmp_path / "out").iterdir()) if p.is_dir() and p.name != "a")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = torch.randint(0, tiny.V, (2, 9), generator=torch.Generator().manual_seed(0))
    before, after = _hidden(tmp_path / "b", ids).flatten(0, 1), _hidden(written, ids).flatten(0, 1)
    order = torch.cdist(after.T, before.T).argmin(1)  # each written feature's source in B
    assert sorted(order.tolist()) == list(range(before.shape[1]))
    assert (after - before[:, order]).abs().max() < 1e-4
