"""Speech-to-text data (Whisper): WAV files read with the standard library, resampled to 16 kHz,
turned into the log-mel features the encoder takes, and scored as transcripts; checked against a
synthetic tone, WhisperFeatureExtractor itself and the model's own loss."""

from __future__ import annotations

import json
import math
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T
import yaml

import tiny
from helpers import flat, run_main
from hf_rebasin.core.errors import DataError
from hf_rebasin.evaluation.data import char_tokenizer
from hf_rebasin.evaluation.speech import SpeechProcessor, read_wav, resample, speech_batches

ALSA = Path("/usr/share/sounds/alsa")
CLIPS = (
    "Front_Center",
    "Front_Left",
    "Front_Right",
    "Rear_Center",
    "Rear_Left",
    "Rear_Right",
    "Side_Left",
    "Side_Right",
)


def _tone(path: Path, rate: int = 48000, seconds: float = 0.5, channels: int = 2) -> np.ndarray:
    """A 440 Hz tone at amplitude 0.5 written as 16-bit PCM (the same in every channel); the samples."""
    t = np.arange(int(rate * seconds)) / rate
    tone = 0.5 * np.sin(2 * math.pi * 440 * t)
    pcm = np.round(tone * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(np.repeat(pcm, channels).tobytes())
    return tone


def test_a_stereo_48khz_wav_reads_as_the_mono_tone_at_16khz(tmp_path: Path) -> None:
    tone = _tone(tmp_path / "tone.wav")
    samples, rate = read_wav(tmp_path / "tone.wav")
    assert rate == 48000 and samples.shape == tone.shape
    assert np.abs(samples - tone).max() < 1e-4  # PCM16 rounding only
    down = resample(samples, rate, 16000)
    assert down.shape == (len(tone) // 3,)
    t = np.arange(len(down)) / 16000
    middle = slice(100, -100)  # the filter's edges aside
    assert np.abs(down[middle] - 0.5 * np.sin(2 * math.pi * 440 * t[middle])).max() < 1e-2


def test_a_file_that_is_no_wav_is_refused_with_what_to_do(tmp_path: Path) -> None:
    bad = tmp_path / "clip.mp3"
    bad.write_bytes(b"ID3\x04\x00 not a wav")
    with pytest.raises(DataError, match=r"PCM WAV file.*ffmpeg"):
        read_wav(bad)


def _speech_folder(folder: Path, texts: list[str], seed: int = 0) -> SpeechProcessor:
    """A tiny Whisper with a character tokenizer of ``texts`` and a 16-mel feature extractor beside it."""
    tiny.whisper(seed).save_pretrained(str(folder))
    tokenizer = char_tokenizer("".join(texts))
    assert len(tokenizer) <= tiny.V
    tokenizer.save_pretrained(str(folder))
    extractor = T.WhisperFeatureExtractor(feature_size=tiny._whisper_config().num_mel_bins)
    extractor.save_pretrained(str(folder))
    return SpeechProcessor(extractor, tokenizer)


def test_speech_batches_hold_the_feature_extractors_features_and_the_transcripts(tmp_path: Path) -> None:
    import datasets

    _tone(tmp_path / "tone.wav", seconds=0.2)
    proc = _speech_folder(tmp_path / "model", ["a tone"])
    records = datasets.Dataset.from_dict({"audio": ["tone.wav"], "target": ["a tone"]})
    config = tiny._whisper_config()
    frames = 2 * config.max_source_positions
    (batch,) = speech_batches(records, proc, start_id=config.decoder_start_token_id, frames=frames, base_dir=tmp_path)
    samples, rate = read_wav(tmp_path / "tone.wav")
    expected = proc.feature_extractor(
        resample(samples, rate, 16000), sampling_rate=16000, return_tensors="pt"
    ).input_features[..., :frames]  # 30 s padded, then the frames the tiny encoder takes
    assert batch["input_features"].shape == (1, config.num_mel_bins, frames)
    assert torch.allclose(batch["input_features"], expected, atol=1e-5)
    ids = proc.tokenizer("a tone")["input_ids"]
    assert batch["labels"].tolist() == [ids]
    assert batch["decoder_input_ids"].tolist() == [[config.decoder_start_token_id, *ids[:-1]]]


def _stock_loss(folder: Path, batches: list[dict[str, torch.Tensor]]) -> float:
    """The token-mean loss the stock class computes from the features and labels alone (it shifts the
    labels after its decoder start token itself)."""
    model = T.AutoModelForSpeechSeq2Seq.from_pretrained(str(folder)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"] != -100).sum())
            total += float(model(input_features=b["input_features"], labels=b["labels"]).loss) * n
            count += n
    return total / count


@pytest.mark.skipif(not ALSA.is_dir(), reason=f"{ALSA} is absent: `apt-get install alsa-utils` ships its spoken clips")
def test_real_speech_loss_of_an_aligned_whisper_is_its_own(tmp_path: Path) -> None:
    """alsa-utils' eight recorded channel names, the transcripts their file names: a barrier between
    two tiny Whispers scored on them ends at each model's own loss (the stock class's), and the
    aligned copy B's loss equals B's within 1e-4."""
    texts = [c.replace("_", " ") for c in CLIPS]
    folders = [tmp_path / f"whisper-{s}" for s in (0, 1)]
    procs = [_speech_folder(f, texts, seed) for seed, f in enumerate(folders)]
    pairs = tmp_path / "speech.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"wav": str(ALSA / f"{c}.wav"), "text": t}) + "\n" for c, t in zip(CLIPS, texts, strict=True)
        )
    )
    data = {"dataset": "json", "data_files": str(pairs), "audio_column": "wav", "target_column": "text"}
    body = {
        "job": "barrier",
        "models": [str(f) for f in folders],
        "strategy": "weight-matching",
        "evaluate": {"task": "seq2seq", "data": data, "points": 3, "batch_size": 4},
        "output": {"dir": str(tmp_path / "out")},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
    proc = run_main(str(tmp_path / "recipe.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WAV clips → transcripts (32 feature frames)" in flat(proc.stdout)
    config = tiny._whisper_config()
    import datasets

    records = datasets.load_dataset("json", data_files=str(pairs), split="train")
    kw = {"start_id": config.decoder_start_token_id, "frames": 32, "audio_column": "wav", "target_column": "text"}
    batches = speech_batches(records, procs[0], batch_size=4, **kw)
    own = [_stock_loss(f, batches) for f in folders]
    curves = json.loads((tmp_path / "out" / "rebasin.json").read_text())["curves"]
    assert set(curves) == {"vanilla", "weight-matching"}, set(curves)
    for curve in curves.values():
        assert curve["loss"][-1] == pytest.approx(own[0], abs=1e-5)  # λ = 1 is A
        assert curve["loss"][0] == pytest.approx(own[1], abs=1e-4)  # λ = 0 is B (aligned): B's own loss
    assert abs(own[0] - own[1]) > 1e-3  # two models, two losses: the comparison means something
