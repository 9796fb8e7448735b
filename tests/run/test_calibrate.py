"""A transport's calibration, run as a user runs it, checked with stock transformers, PEFT and
safetensors: the default recipe calibrates and says so, ``calibrate: false`` writes B + α·(A_ft − A)
exactly (computed here from the files), an adapter stays an adapter PEFT loads, and bad options exit
2 with nothing written. The slow test moves the tiny zoo's chat fine-tune with the default recipe
and checks that the moved model ends its turns when it generates."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import assert_user_error, flat, run_main
from lm_folders import write_recipe
from streamed import both_ways
from vocab_models import save_chat_transport, tiny_llama

ENV = {"HF_HUB_OFFLINE": "1", "HF_REBASIN_NO_CACHE": "1"}
# a budget the tiny random models need no more of (the defaults are for real models)
SMALL = {"steps": 20, "samples": 24, "held_out": 0.25, "block_size": 24, "batch_size": 4}


def _chat_folders(root: Path) -> dict[str, Path]:
    """A ChatML fine-tune of a tiny Llama and a target that is the base permuted, then trained
    apart a little (noise on every weight: no transport moves the fine-tune exactly, so calibration
    has something to fit); the target lacks the chat tokens."""
    folders = save_chat_transport(root, tiny_llama(64, 0), tiny_llama(66, 0), tiny_llama(64, 5), [])
    target = T.AutoModelForCausalLM.from_pretrained(str(folders["target"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in target.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    target.save_pretrained(str(folders["target"]))
    return folders


def _body(folders: dict[str, Path], **extra: Any) -> dict[str, Any]:
    roles = {"base": str(folders["base"]), "finetuned": str(folders["ft"]), "target": str(folders["target"])}
    return {"job": "transport", **roles, "strategy": "weight-matching", "output": {"dir": "out"}, **extra}


def _run(root: Path, body: dict[str, Any], *args: str) -> Any:
    return run_main(str(write_recipe(root, body)), *args, env=ENV)


def _with_template(folders: dict[str, Path]) -> None:
    tok = T.AutoTokenizer.from_pretrained(str(folders["ft"]))
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok.save_pretrained(str(folders["ft"]))


def test_the_default_recipe_calibrates_and_the_record_and_card_say_what_was_fitted(tmp_path: Path) -> None:
    folders = _chat_folders(tmp_path)
    _with_template(folders)
    done = _run(tmp_path, _body(folders, calibrate=SMALL))
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    record = json.loads((out / "rebasin.json").read_text())["transport"]["calibration"]
    assert record["fit"] == "low-rank" and record["rank"] == 8 and record["steps"] == 20
    assert record["text"]["source"] == "written by the fine-tune" and "<|im_start|>" in record["text"]["opening"]
    assert record["text"]["sequences"] == 24 and record["text"]["tokens"] == 24 * 24
    assert record["kl"]["after"] < record["kl"]["before"]
    assert set(record["turn_end"]) == {"teacher", "before", "after"}
    card = flat((out / "README.md").read_text())
    assert "Calibration" in card and "written by the fine-tune" in card and "KL" in card
    model = T.AutoModelForCausalLM.from_pretrained(str(out))  # the stock class, every tensor in place
    assert model.config.vocab_size == 66 and "calibrate" in flat(done.stdout)


def test_a_chat_fit_is_judged_at_every_eighth_and_the_record_and_card_say_which_was_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random tiny model rarely ends a turn in the text it writes, so the held-out user turns are
    given here: the wiring from the judge to ``rebasin.json``, the notes and the card is what is
    checked (the judge itself: tests/merging/test_calibration.py)."""
    from hf_rebasin.run import calibrate

    monkeypatch.setattr(calibrate, "_prompts", lambda t, _context, skip=0, n=16: [[1, 3, 4, 5]] * 4)
    folders = _chat_folders(tmp_path)
    _with_template(folders)
    done = _run(tmp_path, _body(folders, calibrate=SMALL))
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text())
    cal = record["transport"]["calibration"]
    judged_at = [2, 5, 8, 10, 12, 15, 18, 20]  # every eighth of 20 steps, rounded half to even
    assert [step for step, _ in cal["judged"]] == judged_at and cal["kept_step"] in judged_at
    assert all(0 <= share <= 1 for _, share in cal["judged"])
    card = flat((tmp_path / "out" / "README.md").read_text())
    assert f"this model is the fit at step {cal['kept_step']}" in card
    kept_note = [n for n in record["notes"] if n.startswith("calibration kept the fit at step")]
    assert bool(kept_note) == (cal["kept_step"] != 20)


def test_calibrate_false_writes_b_plus_alpha_tau_exactly(tmp_path: Path) -> None:
    folders = _chat_folders(tmp_path)
    body = {**_body(folders, calibrate=False), "strategy": "vanilla", "alpha": 0.5, "tokenizer": {"source": "target"}}
    body["finetuned"] = str(folders["base"])  # the same vocabulary everywhere: the rows need no matching
    ft = tmp_path / "ft2"
    model = tiny_llama(64, 0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(ft))
    T.AutoTokenizer.from_pretrained(str(folders["base"])).save_pretrained(str(ft))
    body["finetuned"] = str(ft)
    done = _run(tmp_path, body)
    assert done.returncode == 0, done.stderr
    a, a_ft, b = (load_file(str(f / "model.safetensors")) for f in (folders["base"], ft, folders["target"]))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(b)
    for name, t in got.items():
        assert torch.equal(t, b[name] + 0.5 * (a_ft[name] - a[name])), name
    assert "calibration" not in json.loads((tmp_path / "out" / "rebasin.json").read_text())["transport"]


def test_a_streamed_calibration_fits_what_one_held_in_memory_fits(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transport streams, then calibration loads the fine-tune, the target and the student
    itself (no random initialisation): the same model as the run that holds everything whole."""
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    folders = _chat_folders(tmp_path)
    memory, streamed = both_ways(_body(folders, calibrate=SMALL), tmp_path, capsys, monkeypatch, exact=False)
    records = [json.loads((f / "rebasin.json").read_text()) for f in (memory, streamed)]
    assert any("weights streamed" in n for n in records[1]["notes"])
    assert not any("weights streamed" in n for n in records[0]["notes"])
    kls = [r["transport"]["calibration"]["kl"] for r in records]
    assert kls[1]["after"] < kls[1]["before"] and kls[1]["before"] == pytest.approx(kls[0]["before"], rel=1e-5)
    assert kls[1]["after"] == pytest.approx(kls[0]["after"], rel=1e-3)


@pytest.mark.parametrize("guard", [1.0, 0.0], ids=["guarded", "no-guard"])
def test_a_bf16_fine_tune_calibrates_streamed_and_stays_bf16(tmp_path: Path, guard: float) -> None:
    """bf16 files (as Hub releases are): the teacher and the guard run in bf16, the student is
    fitted in float32, and the output is written back in bf16 (read from the safetensors header).
    Without a guard the target is never loaded whole."""
    folders = _chat_folders(tmp_path)
    for folder in folders.values():
        model = T.AutoModelForCausalLM.from_pretrained(str(folder)).to(torch.bfloat16)
        model.save_pretrained(str(folder))
    done = _run(tmp_path, _body(folders, calibrate={**SMALL, "guard": guard}))
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    with safe_open(str(out / "model.safetensors"), framework="pt") as h:
        assert {h.get_slice(k).get_dtype() for k in h.keys()} == {"BF16"}
    record = json.loads((out / "rebasin.json").read_text())
    assert any("weights streamed" in n for n in record["notes"])
    kl = record["transport"]["calibration"]["kl"]
    assert record["transport"]["calibration"]["kept"] and kl["after"] < kl["before"]
    model = T.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 66


def test_a_calibrated_adapter_stays_an_adapter_peft_loads_on_the_target(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    folders = _chat_folders(tmp_path)
    base_dir, target_dir, adapter_dir = folders["base"], folders["target"], tmp_path / "lora"
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(T.AutoModelForCausalLM.from_pretrained(str(base_dir)), config)
    wrapped.save_pretrained(str(adapter_dir))
    body = {"job": "transport", "base": str(base_dir), "finetuned": str(adapter_dir), "target": str(target_dir)}
    cal = {**SMALL, "steps": 40, "learning_rate": 0.02}  # rank-2 factors of a random model: a faster rate
    done = _run(tmp_path, {**body, "strategy": "weight-matching", "output": {"dir": "out"}, "calibrate": cal})
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert not (out / "model.safetensors").exists()
    record = json.loads((out / "rebasin.json").read_text())["transport"]
    assert record["calibration"]["fit"] == "adapter" and record["calibration"]["adapter"] is True
    assert record["calibration"]["kl"]["after"] < record["calibration"]["kl"]["before"]
    loaded = peft.PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(str(target_dir)), str(out))
    ranks = {m.lora_A["default"].weight.shape[0] for m in loaded.modules() if hasattr(m, "lora_A") and m.lora_A}
    assert ranks == {2}


@pytest.mark.parametrize(
    ("calibrate", "needles"),
    [
        ({"steps": 0}, ["calibrate.steps", "greater than or equal to 1"]),
        ({"held_out": 1}, ["calibrate.held_out", "less than 1"]),
        ({"fit": "lora"}, ["calibrate.fit", "low-rank"]),
        ("yes please", ["calibrate", "true, false"]),
    ],
    ids=["budget-0", "held-out-all", "unknown-fit", "not-a-section"],
)
def test_bad_options_exit_2_naming_the_field_and_write_nothing(
    tmp_path: Path, calibrate: Any, needles: list[str]
) -> None:
    folders = _chat_folders(tmp_path)
    done = _run(tmp_path, _body(folders, calibrate=calibrate))
    assert_user_error(done, *needles)
    assert not (tmp_path / "out").exists()


def test_a_teacher_that_cannot_write_text_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = T.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24
    )
    for name, cls in (("base", T.BertForMaskedLM), ("target", T.BertForMaskedLM)):
        cls(config).save_pretrained(str(tmp_path / name))
    T.BertForSequenceClassification(config).save_pretrained(str(tmp_path / "ft"))
    folders = {k: tmp_path / k for k in ("base", "ft", "target")}
    done = _run(tmp_path, _body(folders))
    assert_user_error(done, "calibrate", "BertForSequenceClassification", "calibrate: false")
    assert not (tmp_path / "out").exists()
    planned = _run(tmp_path, _body(folders), "--dry-run")  # refused by the plan, before a weight is read
    assert_user_error(planned, "calibrate", "BertForSequenceClassification", "calibrate: false")


def test_calibration_data_that_is_not_text_exits_2_naming_the_field(tmp_path: Path) -> None:
    folders = _chat_folders(tmp_path)
    data = tmp_path / "ids.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": [1, 2, 3, 4]}) for _ in range(8)), encoding="utf-8")
    cal = {**SMALL, "data": {"dataset": "json", "data_files": str(data), "column": "input_ids"}}
    done = _run(tmp_path, _body(folders, calibrate=cal))
    assert_user_error(done, "calibrate.data", "input_ids")
    assert not (tmp_path / "out").exists()


def test_the_dry_run_says_what_calibration_will_fit_and_on_which_text(tmp_path: Path) -> None:
    folders = _chat_folders(tmp_path)
    done = _run(tmp_path, _body(folders), "--dry-run")
    assert done.returncode == 0, done.stderr
    text = flat(done.stdout)
    assert "calibrate:" in text and "rank-8 correction" in text and "400 steps (800 for a LoRA adapter)" in text
    assert re.search(
        r"compute: calibration ≈ [0-9.e+]+ floating-point operations .* GFLOP/s, measured now\) about", text
    )
    off = _run(tmp_path, _body(folders, calibrate=False), "--dry-run")
    assert "calibrate: no (the data-free transport)" in flat(off.stdout)
