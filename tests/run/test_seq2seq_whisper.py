"""Whisper through the jobs that need no data, checked with stock transformers
(``AutoModelForSpeechSeq2Seq``, not hf-rebasin's loader): what the project writes loads with the stock
class and computes the logits plain transformers computes from the inputs, or from a/ and b/ averaged
here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T
import yaml
from safetensors.torch import load_file

import tiny
from helpers import flat, run_main


@pytest.fixture
def whispers(tmp_path: Path) -> list[Path]:
    folders = []
    for seed in (0, 1):
        folder = tmp_path / f"whisper-{seed}"
        tiny.whisper(seed).save_pretrained(str(folder))
        folders.append(folder)
    return folders


def _recipe(tmp_path: Path, body: dict, out: str = "out") -> str:
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump({**body, "output": {"dir": str(tmp_path / out)}}, sort_keys=False))
    return str(path)


def _inputs() -> dict[str, torch.Tensor]:
    """Features of the one length the tiny encoder takes, and decoder ids after the start token."""
    config = tiny._whisper_config()
    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, config.num_mel_bins, 2 * config.max_source_positions, generator=g)
    ids = torch.randint(3, tiny.V, (2, 9), generator=g)
    ids[:, 0] = config.decoder_start_token_id
    return {"input_features": features, "decoder_input_ids": ids}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**_inputs()).logits


def _stock_logits(folder: Path) -> torch.Tensor:
    model = T.AutoModelForSpeechSeq2Seq.from_pretrained(str(folder))
    assert type(model).__name__ == "WhisperForConditionalGeneration"
    return _logits(model)


@pytest.mark.parametrize("cls", ["permutation", "orthogonal"])
def test_verify_a_saved_whisper(whispers: list[Path], cls: str) -> None:
    proc = run_main("verify", str(whispers[0]), "--class", cls)
    out = flat(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compared outputs: encoder_last_hidden_state, logits" in out and "OK: outputs unchanged" in out
    assert "dec.{i}.cross" in out and "enc.conv" in out
    # the encoder's stream is written through GELU: a rotation is asked for and refused there only
    assert ("GELU after conv2" in out) == (cls == "orthogonal")


@pytest.mark.parametrize("strategy", ["weight-matching", "generalized-orthogonal"])
def test_align_writes_two_whispers_that_compute_what_they_did(
    tmp_path: Path, whispers: list[Path], strategy: str
) -> None:
    body = {"job": "align", "models": [str(w) for w in whispers], "strategy": strategy}
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    for given, written in zip(whispers, (out / "a", out / "b"), strict=True):
        assert (_stock_logits(given) - _stock_logits(written)).abs().max() <= 1e-4
    stored = set(load_file(str(out / "b" / "model.safetensors")))
    # the head stays tied to the decoder's table unless canonical form folded the final norm into it
    assert ("proj_out.weight" in stored) == (strategy == "generalized-orthogonal")
    # checked with mergekit 0.1.5 (benchmarks/alignment/mergekit_seq2seq.py)
    assert "mergekit 0.1.5's Whisper definition gives the decoder the prefix 'model.decoder'" in flat(proc.stdout)
    assert (out / "mergekit.yaml").exists()


def test_a_whisper_merge_is_the_average_of_the_aligned_pair(tmp_path: Path, whispers: list[Path]) -> None:
    """The merged folder loads with the stock class and computes what a WhisperForConditionalGeneration
    holding the tensor-wise average of the aligned a/ and b/ (averaged here) computes."""
    models = [str(w) for w in whispers]
    align = run_main(_recipe(tmp_path, {"job": "align", "models": models, "strategy": "weight-matching"}, "aligned"))
    assert align.returncode == 0, align.stdout + align.stderr
    merge = run_main(_recipe(tmp_path, {"job": "merge", "models": models, "strategy": "weight-matching"}, "merged"))
    assert merge.returncode == 0, merge.stdout + merge.stderr
    a, b = (load_file(str(tmp_path / "aligned" / d / "model.safetensors")) for d in ("a", "b"))
    assert set(a) == set(b)
    midpoint = T.WhisperForConditionalGeneration(tiny._whisper_config())
    missing, unexpected = midpoint.load_state_dict({k: (a[k] + b[k]) / 2 for k in a}, strict=False)
    assert missing == ["proj_out.weight"] and not unexpected  # tied to the decoder's table
    gap = (_stock_logits(tmp_path / "merged") - _logits(midpoint)).abs().max()
    assert gap <= 1e-4
    assert (_stock_logits(tmp_path / "merged") - _stock_logits(whispers[0])).abs().max() > 1e-2  # a real merge
    # the card loads it with the speech classes, and tags it as speech recognition
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "pipeline_tag: automatic-speech-recognition" in card
    assert "AutoModelForSpeechSeq2Seq.from_pretrained" in card and "AutoModelForSeq2SeqLM" not in card
    assert json.loads((tmp_path / "merged" / "rebasin.json").read_text())["speech"] is True
