"""Encoder-decoders (BART) through every job, checked with stock transformers (``AutoModelForSeq2SeqLM``,
not hf-rebasin's loader): losses on source → target pairs against the model's own loss, plain text
noised as BART was trained; a calibration without data to read sources from refuses, naming
`calibrate.data`, and writes nothing."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import transformers as T
import yaml
from safetensors.torch import load_file

import tiny
from helpers import flat, run_cli, run_main
from hf_rebasin.evaluation.data import char_tokenizer

TEXT = tiny.HAMLET


@pytest.fixture
def barts(tmp_path: Path) -> list[Path]:
    tokenizer = char_tokenizer(TEXT, mask=True)
    assert len(tokenizer) <= tiny.V
    folders = []
    for seed in range(2):
        folder = tmp_path / f"bart-{seed}"
        tiny.bart(seed).save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        folders.append(folder)
    return folders


@pytest.fixture
def texts(tmp_path: Path) -> dict[str, Path]:
    lines = TEXT.splitlines()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"source": a, "target": b}) + "\n" for a, b in itertools.pairwise(lines) for _ in "ab")
    )
    plain = tmp_path / "plain.txt"
    plain.write_text(TEXT * 4)
    return {"pairs": pairs, "plain": plain}


def _stock_loss(folder: Path, pairs: Path) -> float:
    """The mean loss per target token, from the model's own loss (labels shifted by BART itself)."""
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(folder)).eval()
    tokenizer = T.AutoTokenizer.from_pretrained(str(folder))
    total, count = 0.0, 0
    for line in pairs.read_text().splitlines():
        row = json.loads(line)
        source = torch.tensor([tokenizer(row["source"])["input_ids"]])
        target = torch.tensor([tokenizer(row["target"])["input_ids"]])
        with torch.no_grad():
            total += float(model(input_ids=source, labels=target).loss) * target.numel()
        count += target.numel()
    return total / count


def _recipe(tmp_path: Path, body: dict) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**body, "output": {"dir": str(tmp_path / "out")}}, sort_keys=False))
    return str(path)


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(input_ids=ids, decoder_input_ids=ids[:, :7]).logits


def test_align_writes_two_barts_in_one_basis_each_computing_what_it_did(tmp_path: Path, barts: list[Path]) -> None:
    proc = run_main(
        _recipe(tmp_path, {"job": "align", "models": [str(b) for b in barts], "strategy": "weight-matching"})
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    ids = torch.randint(3, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    for given, written in zip(barts, (out / "a", out / "b"), strict=True):
        assert (_logits(given, ids) - _logits(written, ids)).abs().max() <= 1e-4
    b, b_given = load_file(str(out / "b" / "model.safetensors")), load_file(str(barts[1] / "model.safetensors"))
    assert set(b) == set(b_given)  # the shared table stored once, as the input stored it
    moved = [k for k in b if not torch.equal(b[k], b_given[k])]
    assert any(".encoder." in k for k in moved) and any(".decoder." in k for k in moved)


def test_a_data_free_merge_of_two_barts_loads_with_the_stock_class(tmp_path: Path, barts: list[Path]) -> None:
    body = {"job": "merge", "models": [str(b) for b in barts], "strategy": "weight-matching"}
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "function preserved" in flat(proc.stdout)
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out"))
    assert type(model).__name__ == "BartForConditionalGeneration"


def test_a_barrier_on_pairs_scores_each_end_as_the_models_own_loss_does(
    tmp_path: Path, barts: list[Path], texts: dict[str, Path]
) -> None:
    data = {"dataset": "json", "data_files": str(texts["pairs"])}
    body = {
        "job": "barrier",
        "models": [str(b) for b in barts],
        "strategy": "weight-matching",
        "evaluate": {"task": "seq2seq", "data": data, "points": 3},
    }
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "`evaluate.data`: source → target pairs" in flat(proc.stdout)
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text())
    for curve in record["curves"].values():
        assert curve["loss"][-1] == pytest.approx(_stock_loss(barts[0], texts["pairs"]), abs=1e-5)  # λ = 1: A
        assert curve["loss"][0] == pytest.approx(_stock_loss(barts[1], texts["pairs"]), abs=1e-5)
        assert curve["metric"]["perplexity"][0] == pytest.approx(math.exp(curve["loss"][0]), rel=1e-6)


def test_a_transport_scored_on_plain_text_noises_it_and_writes_a_seq2seq_card(
    tmp_path: Path, barts: list[Path], texts: dict[str, Path]
) -> None:
    models = [str(b) for b in barts]
    data = {"dataset": "text", "data_files": str(texts["plain"])}
    body = {
        "job": "transport",
        "base": models[0],
        "finetuned": models[1],
        "target": models[0],
        "calibrate": False,
        "alpha": "auto",
        "evaluate": {"task": "seq2seq", "data": data, "support": data},
    }
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = flat(proc.stdout)
    assert "`evaluate.data`: BART text infilling" in said and "`evaluate.support`: BART" in said
    card = (tmp_path / "out" / "README.md").read_text()
    assert "pipeline_tag: text2text-generation" in card and "AutoModelForSeq2SeqLM.from_pretrained" in card
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out"))
    assert type(model).__name__ == "BartForConditionalGeneration"


def test_a_moved_bart_lora_adapter_loads_with_peft_and_scores_what_the_run_said(
    tmp_path: Path, barts: list[Path], texts: dict[str, Path]
) -> None:
    import peft

    tuned = tiny.bart_lora(str(barts[0]), 0.05)
    adapter = tmp_path / "lora"
    tuned.save_pretrained(str(adapter))
    data = {"dataset": "json", "data_files": str(texts["pairs"])}
    body = {
        "job": "transport",
        "base": str(barts[0]),
        "finetuned": {"model": str(adapter), "check_base": False},
        "target": str(barts[1]),
        "calibrate": False,
        "evaluate": {"task": "seq2seq", "data": data},
    }
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "SEQ_2_SEQ_LM"
    moved = peft.PeftModel.from_pretrained(T.AutoModelForSeq2SeqLM.from_pretrained(str(barts[1])), str(out))
    record = json.loads((out / "rebasin.json").read_text())
    said = record["transport"]["loss"]["transported"][0]
    merged = tmp_path / "merged"
    moved.merge_and_unload().save_pretrained(str(merged))
    char_tokenizer(TEXT, mask=True).save_pretrained(str(merged))
    assert _stock_loss(merged, texts["pairs"]) == pytest.approx(said, abs=1e-4)


def test_learned_matching_reads_a_barts_loss_on_noised_text(
    tmp_path: Path, barts: list[Path], texts: dict[str, Path]
) -> None:
    strategy = {"name": "generalized-orthogonal", "learned": True, "steps": 6, "eval_every": 3}
    body = {
        "job": "merge",
        "models": [str(b) for b in barts],
        "strategy": strategy,
        "data": {"dataset": "text", "data_files": str(texts["plain"])},
    }
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = flat(proc.stdout)
    assert "`data`: BART text infilling" in said and "learned matching (6 steps" in said
    T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out"))


def test_a_head_perm_merge_of_two_barts_reads_their_activations_on_noised_text(
    tmp_path: Path, barts: list[Path], texts: dict[str, Path]
) -> None:
    data = {"dataset": "text", "data_files": str(texts["plain"])}
    body = {"job": "merge", "models": [str(b) for b in barts], "strategy": "head-perm", "data": data}
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = flat(proc.stdout)
    assert "`data`: BART text infilling" in said and "function preserved" in said
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out"))
    assert type(model).__name__ == "BartForConditionalGeneration"


def test_a_calibrated_transport_of_an_encoder_decoder_without_data_refuses_and_writes_nothing(
    tmp_path: Path, barts: list[Path]
) -> None:
    models = [str(b) for b in barts]
    body = {"job": "transport", "base": models[0], "finetuned": models[1], "target": models[1]}
    reason = "`calibrate.data`: the fine-tune is a BartForConditionalGeneration, an encoder-decoder"
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert reason in flat(proc.stderr + proc.stdout)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # lineage and embed of encoder-decoders: covered fast by their adapter tests
def test_embed_writes_a_bart_into_wider_mlps_computing_the_same_logits(tmp_path: Path, barts: list[Path]) -> None:
    wide = tmp_path / "wide"
    config = tiny.bart(0).config
    config.encoder_ffn_dim, config.decoder_ffn_dim = 64, 56
    T.BartForConditionalGeneration(config).save_pretrained(str(wide))
    proc = run_cli("embed", str(barts[0]), "--like", str(wide), "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out"))
    assert written.config.encoder_ffn_dim == 64 and written.config.decoder_ffn_dim == 56
    ids = torch.randint(3, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    assert (_logits(barts[0], ids) - _logits(tmp_path / "out", ids)).abs().max() <= 1e-4


@pytest.mark.slow  # lineage and embed of encoder-decoders: covered fast by their adapter tests
def test_lineage_tells_a_barts_fine_tune_from_a_bart_trained_apart(tmp_path: Path, barts: list[Path]) -> None:
    model = tiny.bart(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    tuned = tmp_path / "bart-0-tuned"
    model.save_pretrained(str(tuned))
    verdicts = []
    for other in (tuned, barts[1]):
        proc = run_cli("lineage", str(barts[0]), str(other), "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        verdicts.append(json.loads(proc.stdout)["pairs"][0]["verdict"])
    assert verdicts == ["same basis", "independent"]


@pytest.mark.slow  # lineage and embed of encoder-decoders: covered fast by their adapter tests
@pytest.mark.parametrize(
    ("stack", "said"), [("decoder_layers", "2 encoder and 3 decoder"), ("encoder_layers", "3 encoder and 2 decoder")]
)
def test_barts_of_other_depths_are_mapped_per_stack_by_lineage_and_refused_by_align(
    tmp_path: Path, barts: list[Path], stack: str, said: str
) -> None:
    config = tiny.bart(0).config
    setattr(config, stack, 3)
    deeper = tmp_path / "deeper"
    T.BartForConditionalGeneration(config).save_pretrained(str(deeper))
    proc = run_cli("lineage", str(barts[0]), str(deeper), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pair = json.loads(proc.stdout)["pairs"][0]
    assert pair["verdict"] == "independent"  # a fresh model: no kin layer in either stack
    assert [m["stack"] for m in pair["stack_maps"]] == ["model.encoder.layers", "model.decoder.layers"]
    proc = run_cli("align", str(barts[0]), str(deeper), "--output", str(tmp_path / "aligned"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"has {said} layers" in flat(proc.stderr) and "hf-rebasin lineage A B" in flat(proc.stderr)


def test_lineage_with_data_fits_its_maps_on_a_barts_activations(
    tmp_path: Path, barts: list[Path], texts: dict[str, Path]
) -> None:
    data = {"dataset": "text", "data_files": str(texts["plain"])}
    proc = run_main(_recipe(tmp_path, {"job": "lineage", "models": [str(b) for b in barts], "data": data}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "out" / "lineage.json").read_text())
    assert record["pairs"][0]["verdict"] == "independent"
    said = flat(proc.stdout)
    assert "`data`: BART text infilling" in said and "maps fitted on both models' activations" in said
