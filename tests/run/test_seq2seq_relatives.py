"""BART's relatives (mBART; Marian and M2M100, whose stream is pinned) through align, barrier and a
learned merge, checked with stock transformers (``AutoModelForSeq2SeqLM``): the written models compute
what they did, a pinned stream's tables come out as they went in, and the barrier's ends are the
models' own losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file
from test_seq2seq_jobs import TEXT, _logits, _recipe, _stock_loss, texts  # noqa: F401 (texts: a fixture)

import tiny
from helpers import flat, run_main
from hf_rebasin.evaluation.data import char_tokenizer

CASES = ["mbart", "marian", "m2m100"]


def _saved(tmp_path: Path, case: str) -> list[Path]:
    tokenizer = char_tokenizer(TEXT, mask=True)
    assert len(tokenizer) <= tiny.V
    folders = []
    for seed in range(2):
        folder = tmp_path / f"{case}-{seed}"
        tiny.FACTORIES[case](seed).save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        folders.append(folder)
    return folders


@pytest.mark.parametrize("case", CASES)
def test_align_keeps_each_models_logits_and_leaves_a_pinned_stream_alone(tmp_path: Path, case: str) -> None:
    models = _saved(tmp_path, case)
    proc = run_main(
        _recipe(tmp_path, {"job": "align", "models": [str(m) for m in models], "strategy": "weight-matching"})
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    ids = torch.randint(3, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    for given, written in zip(models, (out / "a", out / "b"), strict=True):
        assert (_logits(given, ids) - _logits(written, ids)).abs().max() <= 1e-4
    b, b_given = load_file(str(out / "b" / "model.safetensors")), load_file(str(models[1] / "model.safetensors"))
    assert set(b) == set(b_given)
    moved = {k for k in b if not torch.equal(b[k], b_given[k])}
    assert any(".encoder.layers." in k for k in moved) and any(".decoder.layers." in k for k in moved)
    pinned = case != "mbart"
    assert ("model.shared.weight" in moved) is not pinned  # the table's columns are the stream
    if pinned:
        assert not {k for k in moved if "layer_norm" in k or k.endswith(("fc2.bias", "out_proj.bias"))}


@pytest.mark.parametrize("case", ["marian", "m2m100"])
def test_a_barrier_on_pairs_ends_at_each_models_own_loss(
    tmp_path: Path,
    case: str,
    texts: dict[str, Path],  # noqa: F811 (the fixture)
) -> None:
    models = _saved(tmp_path, case)
    data = {"dataset": "json", "data_files": str(texts["pairs"])}
    body = {
        "job": "barrier",
        "models": [str(m) for m in models],
        "strategy": "weight-matching",
        "evaluate": {"task": "seq2seq", "data": data, "points": 3},
    }
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "out" / "rebasin.json").read_text())
    for curve in record["curves"].values():
        assert curve["loss"][-1] == pytest.approx(_stock_loss(models[0], texts["pairs"]), abs=1e-5)
        assert curve["loss"][0] == pytest.approx(_stock_loss(models[1], texts["pairs"]), abs=1e-5)


def test_learned_matching_of_marians_keeps_the_stream_pinned(
    tmp_path: Path,
    texts: dict[str, Path],  # noqa: F811 (the fixture)
) -> None:
    models = _saved(tmp_path, "marian")
    strategy = {"name": "generalized-orthogonal", "learned": True, "steps": 4, "eval_every": 2}
    body = {
        "job": "merge",
        "models": [str(m) for m in models],
        "strategy": strategy,
        "data": {"dataset": "text", "data_files": str(texts["plain"])},
        "output": {"align": True},
    }
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "residual stream pinned" in flat(proc.stdout)
    merged = T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out"))
    assert type(merged).__name__ == "MarianMTModel"


@pytest.mark.slow  # embed of encoder-decoders: covered fast by their adapter and widths tests
@pytest.mark.parametrize("case", ["marian", "m2m100"])
def test_embed_grows_mlps_of_a_pinned_family_and_refuses_its_stream(tmp_path: Path, case: str) -> None:
    """Wider MLPs keep the logits (stock class); a wider d_model is refused, naming the pin: the wider
    model makes its own sinusoidal table of that width."""
    from helpers import run_cli

    model = _saved(tmp_path, case)[0]
    config = T.AutoConfig.from_pretrained(str(model))
    config.encoder_ffn_dim, config.decoder_ffn_dim = 64, 56
    wide = tmp_path / "wide-mlp"
    T.AutoModelForSeq2SeqLM.from_config(config).save_pretrained(str(wide))
    proc = run_cli("embed", str(model), "--like", str(wide), "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = torch.randint(3, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    assert (_logits(model, ids) - _logits(tmp_path / "out", ids)).abs().max() <= 1e-4

    config.d_model = 48
    wider = tmp_path / "wide-stream"
    T.AutoModelForSeq2SeqLM.from_config(config).save_pretrained(str(wider))
    proc = run_cli("embed", str(model), "--like", str(wider), "--output", str(tmp_path / "out2"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the stream is pinned (sinusoidal positions are regenerated on load)" in flat(proc.stderr + proc.stdout)
    assert not (tmp_path / "out2").exists()


@pytest.mark.slow  # lineage of encoder-decoders: BART's twin in test_seq2seq_jobs.py is slow too
def test_lineage_tells_a_marians_fine_tune_from_a_marian_trained_apart(tmp_path: Path) -> None:
    """With the stream pinned, lineage still reads the heads and units: a perturbed copy is in the
    same basis, a model of another seed independent."""
    from helpers import run_cli

    models = _saved(tmp_path, "marian")
    model = tiny.marian(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    tuned = tmp_path / "marian-0-tuned"
    tiny._sinusoids_back(model).save_pretrained(str(tuned))
    verdicts = []
    for other in (tuned, models[1]):
        proc = run_cli("lineage", str(models[0]), str(other), "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        verdicts.append(json.loads(proc.stdout)["pairs"][0]["verdict"])
    assert verdicts == ["same basis", "independent"]
