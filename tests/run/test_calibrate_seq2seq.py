"""A transport's calibration of an encoder-decoder, run as a user runs it and checked with stock
transformers and PEFT: BART and T5 fine-tunes calibrated on the sources of ``calibrate.data`` get
closer to the fine-tune on held-out sources (the KL read here on the fine-tune's ``generate`` output)
than the uncalibrated B + (A_ft − A) computed from the files; an adapter stays an adapter PEFT loads;
without data the run is refused with a `MissingDataError` naming ``calibrate.data``."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers as T
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

import tiny
from helpers import flat, run_main
from hf_rebasin.core.errors import MissingDataError
from hf_rebasin.evaluation.data import char_tokenizer
from hf_rebasin.recipe import load_recipe, loads_recipe
from hf_rebasin.run.checks import check_calibration

TEXT = tiny.HAMLET
HELD = ["the mind to die, or to sleep", "a sea of arrows against fortune", "to suffer the question"]
ENV = {"HF_HUB_OFFLINE": "1", "HF_REBASIN_NO_CACHE": "1"}
SMALL = {"steps": 24, "samples": 16, "held_out": 0.25, "block_size": 16, "batch_size": 4, "learning_rate": 1e-2}


def _folders(root: Path, family: str) -> dict[str, Path]:
    """Base, a fine-tune of it (a rank-2 change of every linear layer) and a target that is the
    base trained apart a little: the moved model is the fine-tune plus the target's drift."""
    make = {"t5": tiny.t5, "bart": tiny.bart}[family]
    tokenizer = char_tokenizer(TEXT, mask=family == "bart")
    models = {"base": make(0), "ft": tiny.drifted(make(0), 1, 0.4), "target": tiny.drifted(make(0), 2, 0.3)}
    out = {}
    for name, model in models.items():
        out[name] = root / f"{family}-{name}"
        model.save_pretrained(str(out[name]))
        tokenizer.save_pretrained(str(out[name]))
    return out


def _pairs(root: Path) -> Path:
    lines = TEXT.splitlines()
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps({"source": a, "target": b}) + "\n" for a, b in itertools.pairwise(lines)) * 4)
    return path


def _recipe(root: Path, folders: dict[str, Path], calibrate: Any, finetuned: Any = None, **output: Any) -> str:
    body = {
        "job": "transport",
        "base": str(folders["base"]),
        "finetuned": finetuned or str(folders["ft"]),
        "target": str(folders["target"]),
        "strategy": "vanilla",
        "alpha": 1.0,
        "calibrate": calibrate,
        "output": {"dir": str(root / "out"), **output},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return str(path)


def _stock_kl(teacher: Any, student: Any, tokenizer: Any) -> float:
    """KL(teacher ‖ student) per decoder token on the teacher's greedy outputs for ``HELD``."""
    enc = tokenizer(HELD, return_tensors="pt", padding=True)
    total, n = 0.0, 0
    with torch.no_grad():
        out = teacher.generate(
            **enc, do_sample=False, max_length=12, min_length=0, num_beams=1, use_cache=False, no_repeat_ngram_size=0
        )
        args = {**enc, "decoder_input_ids": out}
        t = F.log_softmax(teacher(**args).logits.float(), -1)
        s = F.log_softmax(student(**args).logits.float(), -1)
    on = torch.ones_like(out, dtype=torch.bool)
    on[:, 1:] = (out[:, 1:] == teacher.config.eos_token_id).cumsum(1) == 0
    per = (t.exp() * (t - s)).sum(-1)[on]
    total, n = float(per.sum()), int(on.sum())
    return total / n


def _uncalibrated(folders: dict[str, Path]) -> Any:
    """B + (A_ft − A), from the files."""
    a, a_ft, b = (load_file(str(folders[k] / "model.safetensors")) for k in ("base", "ft", "target"))
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(folders["target"])).eval()
    model.load_state_dict({n: b[n] + (a_ft[n] - a[n]) for n in b}, strict=False)
    return model


# slow: the fast suite runs the same BART transport in the next test, which checks the KL it reports
@pytest.mark.slow
@pytest.mark.parametrize("family", ["bart", "t5"])
def test_a_calibrated_encoder_decoder_is_closer_to_the_fine_tune_on_held_out_sources(
    tmp_path: Path, family: str
) -> None:
    folders = _folders(tmp_path, family)
    data = {"dataset": "json", "data_files": str(_pairs(tmp_path))}
    done = run_main(_recipe(tmp_path, folders, {**SMALL, "data": data, "guard": 0.1}), env=ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    cal = json.loads((out / "rebasin.json").read_text())["transport"]["calibration"]
    assert cal["kept"] and cal["fit"] == "low-rank" and cal["kl"]["after"] < cal["kl"]["before"]
    assert "continuations of sources from `calibrate.data` (source → target pairs)" in cal["text"]["source"]
    assert cal["text"]["sequences"] == 16 and "written by the target" in cal["text"]["guard"]
    assert "Calibration" in flat((out / "README.md").read_text())
    tokenizer = T.AutoTokenizer.from_pretrained(str(folders["ft"]))
    teacher = T.AutoModelForSeq2SeqLM.from_pretrained(str(folders["ft"])).eval()
    written = T.AutoModelForSeq2SeqLM.from_pretrained(str(out)).eval()  # the stock class, every tensor in place
    assert set(load_file(str(out / "model.safetensors"))) == set(
        load_file(str(folders["target"] / "model.safetensors"))
    )
    before, after = _stock_kl(teacher, _uncalibrated(folders), tokenizer), _stock_kl(teacher, written, tokenizer)
    assert after < before, (before, after)


def _plain_kl(teacher: Any, student: Any, ids: torch.Tensor, mask: torch.Tensor, decoder: torch.Tensor) -> float:
    """KL(teacher ‖ student) per decoder position up to the one predicting the end, plain torch."""
    args = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}
    with torch.no_grad():
        t = F.log_softmax(teacher(**args).logits.float(), -1)
        s = F.log_softmax(student(**args).logits.float(), -1)
    on = torch.ones_like(decoder, dtype=torch.bool)
    on[:, 1:] = (decoder[:, 1:] == teacher.config.eos_token_id).cumsum(1) == 0
    return float((t.exp() * (t - s)).sum(-1)[on].mean())


def test_the_written_bart_computes_the_kl_the_run_reports_on_its_held_out_sources(tmp_path: Path) -> None:
    """The held-out sources rebuilt as the run reads them (the first ``held`` of ``calibrate.data``'s,
    and the fine-tune's continuations of them under ``calibrate.seed``): the stock-loaded output and
    the uncalibrated B + τ give the record's ``kl.after`` and ``kl.before``."""
    from hf_rebasin.merging.calibration.seq2seq import Sources, written
    from hf_rebasin.run.data import BatchSpec, batches

    folders = _folders(tmp_path, "bart")
    data = {"dataset": "json", "data_files": str(_pairs(tmp_path))}
    recipe = _recipe(tmp_path, folders, {**SMALL, "data": data, "guard": 0.1})
    done = run_main(recipe, env=ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    cal = json.loads((tmp_path / "out" / "rebasin.json").read_text())["transport"]["calibration"]
    teacher = T.AutoModelForSeq2SeqLM.from_pretrained(str(folders["ft"])).eval()
    spec = load_recipe(recipe).calibrate.data.model_copy(update={"block_size": 16})  # type: ignore[attr-defined]
    tokenizer = T.AutoTokenizer.from_pretrained(str(folders["ft"]))
    made = batches(spec, BatchSpec("seq2seq", 16, None, None, 0), tmp_path, tokenizer, teacher.config, where="x")
    ids, mask = made[0]["input_ids"][:16], made[0]["attention_mask"][:16]
    c = teacher.config
    text = written(
        teacher, Sources(ids, mask), 16, start=c.decoder_start_token_id, end=c.eos_token_id, pad=c.pad_token_id, seed=0
    )
    held = cal["text"]["held_out"]
    assert held == 4 and cal["kept"]
    args = (ids[:held], mask[:held], text.decoder[:held])
    out = T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out")).eval()
    assert _plain_kl(teacher, out, *args) == pytest.approx(cal["kl"]["after"], rel=1e-4, abs=1e-6)
    assert _plain_kl(teacher, _uncalibrated(folders), *args) == pytest.approx(cal["kl"]["before"], rel=1e-4, abs=1e-6)


def test_a_calibrated_float16_t5_folds_its_corrections_back_and_keeps_wo_in_float32(tmp_path: Path) -> None:
    """transformers keeps T5's ``wo`` in float32 under float16 (``_keep_in_fp32_modules``): the
    calibrated output stores each tensor as the stock class saves it, every linear layer corrected."""
    folders = _folders(tmp_path, "t5")
    data = {"dataset": "json", "data_files": str(_pairs(tmp_path))}
    done = run_main(_recipe(tmp_path, folders, {**SMALL, "data": data, "guard": 0.1}, dtype="float16"), env=ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    wo = {d for k, d in stored.items() if k.endswith(".wo.weight")}
    assert wo == {"F32"} and stored["decoder.block.0.layer.0.SelfAttention.q.weight"] == "F16"
    got, moved = load_file(str(out / "model.safetensors")), _uncalibrated(folders).state_dict()
    for name in ("decoder.block.1.layer.2.DenseReluDense.wo.weight", "encoder.block.0.layer.0.SelfAttention.o.weight"):
        rounded = moved[name].to(got[name].dtype).float()  # B + τ as the output dtype stores it
        assert (got[name].float() - rounded).abs().max() > 1e-2, name  # the correction was folded in
    assert json.loads((out / "rebasin.json").read_text())["transport"]["calibration"]["kept"]


def test_a_calibrated_bart_lora_adapter_stays_an_adapter_peft_loads(tmp_path: Path) -> None:
    import peft

    folders = _folders(tmp_path, "bart")
    tuned = tiny.bart_lora(str(folders["base"]), 0.2)
    adapter = tmp_path / "lora"
    tuned.save_pretrained(str(adapter))
    data = {"dataset": "json", "data_files": str(_pairs(tmp_path))}
    finetuned = {"model": str(adapter), "check_base": False}
    done = run_main(_recipe(tmp_path, folders, {**SMALL, "data": data, "guard": 0.1}, finetuned), env=ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    cal = json.loads((out / "rebasin.json").read_text())["transport"]["calibration"]
    assert cal["adapter"] and cal["fit"] == "adapter" and cal["kl"]["after"] <= cal["kl"]["before"]
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "SEQ_2_SEQ_LM"

    def on_target(folder: Path) -> Any:
        target = T.AutoModelForSeq2SeqLM.from_pretrained(str(folders["target"]))
        return peft.PeftModel.from_pretrained(target, str(folder)).eval()

    teacher = tuned.eval()  # the fine-tune: the adapter on its base
    tokenizer = T.AutoTokenizer.from_pretrained(str(folders["base"]))
    before = _stock_kl(teacher, on_target(adapter), tokenizer)  # the moved adapter, uncalibrated (vanilla, α = 1)
    assert _stock_kl(teacher, on_target(out), tokenizer) < before


def test_calibrating_an_encoder_decoder_without_data_is_refused_naming_calibrate_data(tmp_path: Path) -> None:
    folders = _folders(tmp_path, "bart")
    recipe = _recipe(tmp_path, folders, {"steps": 2})
    with pytest.raises(MissingDataError, match=r"`calibrate\.data`: the fine-tune is a BartForConditionalGeneration"):
        check_calibration(load_recipe(recipe), folders["ft"])
    done = run_main(recipe, env=ENV)
    assert done.returncode == 2 and "`calibrate.data`" in flat(done.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("calibrate", [False, True])
def test_the_transport_benchmarks_write_a_valid_recipe_calibrating_on_the_training_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calibrate: bool
) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "transport"))
    from calibration_recipe import calibrate_section, transport_body

    from hf_rebasin.evaluation import data as corpora

    splits: list[str] = []

    def text(corpus: str, plays: Any = None, *, split: str = "all") -> str:
        splits.append(split)
        return f"{corpus} {split} text\n" * 4

    monkeypatch.setattr(corpora, "corpus_text", text)
    ft = tmp_path / "bench-t5-ft-seed0"
    ft.mkdir()
    (ft / "training.json").write_text(json.dumps({"kind": "bench-t5-ft", "seed": 0, "config": {"corpus": "kjv"}}))
    section = calibrate_section(ft, tmp_path / "work", calibrate)
    body = transport_body("bench-t5", "bench-t5-ft", (0, 1), "weight-matching", tmp_path / "out", section)
    recipe = loads_recipe(yaml.safe_dump(body), base_dir=tmp_path)
    if not calibrate:
        assert recipe.calibrate is None and not splits  # type: ignore[attr-defined]
        return
    assert splits == ["train"]  # never the held-out ("test") split the benchmarks score on
    given = recipe.calibrate.data  # type: ignore[attr-defined]
    assert given is not None and given.dataset == "text"
    assert Path(str(given.data_files)).read_text() == "kjv train text\n" * 4
    zoo = {**body, "strategy": {"name": "transfusion", "residual_maps": "global"}, "alpha": 1.0}  # bench_transport_zoo
    assert loads_recipe(yaml.safe_dump(zoo), base_dir=tmp_path).calibrate is not None  # type: ignore[attr-defined]
