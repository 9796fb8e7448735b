"""Speech-to-text batches (Whisper): WAV files and their transcripts → log-mel features, decoder ids, labels.

The audio is read with the standard library's ``wave`` and resampled with
``scipy.signal.resample_poly`` to the feature extractor's rate (16 kHz for Whisper): no decoder
library (torchcodec, soundfile, librosa) is needed, so only uncompressed PCM WAV files are read.
Whisper's encoder takes exactly ``2·max_source_positions`` frames (3000, 30 s, for the released
checkpoints), so every clip is padded or cut to that many samples. ``decoder_input_ids`` are the
labels shifted right after the decoder's start token, built once here as for text pairs.
"""

from __future__ import annotations

import math
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from hf_rebasin.core.errors import DataError
from hf_rebasin.evaluation.evaldata import check_column

if TYPE_CHECKING:
    import datasets

__all__ = ["SpeechProcessor", "read_wav", "resample", "speech_batches"]

_PCM = {1: np.uint8, 2: np.int16, 4: np.int32}  # sample width in bytes -> numpy type


@dataclass(frozen=True)
class SpeechProcessor:
    """A speech model's feature extractor with its tokenizer (which every text consumer reads:
    attributes it lacks come from the tokenizer, so special ids and padding read as for text)."""

    feature_extractor: Any
    tokenizer: Any

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "tokenizer" not in self.__dict__:  # copy and pickle probe before init
            raise AttributeError(name)
        return getattr(self.__dict__["tokenizer"], name)


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """(mono samples in [-1, 1] as float32, sampling rate) of an uncompressed PCM WAV file; channels
    are averaged."""
    try:
        with wave.open(str(path), "rb") as f:
            width, channels, rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
            raw = f.readframes(f.getnframes())
    except (OSError, EOFError, wave.Error) as e:
        raise DataError(
            f"cannot read {str(path)!r} as a PCM WAV file ({type(e).__name__}: {e}); "
            "convert it first, e.g. `ffmpeg -i in.mp3 -ar 16000 -ac 1 out.wav`"
        ) from None
    if width not in _PCM:
        raise DataError(f"{str(path)!r}: {8 * width}-bit samples are not read; save it as 16-bit PCM")
    samples = np.frombuffer(raw, dtype=_PCM[width]).astype(np.float32)
    if width == 1:
        samples = samples - 128.0  # 8-bit WAV is unsigned
    samples /= float(2 ** (8 * width - 1))
    return samples.reshape(-1, channels).mean(axis=1), rate


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``samples`` at ``rate`` Hz resampled to ``target`` Hz (polyphase filtering: 48 → 16 kHz is 1/3)."""
    if rate == target:
        return samples
    from scipy.signal import resample_poly

    g = math.gcd(rate, target)
    return np.asarray(resample_poly(samples, target // g, rate // g), dtype=np.float32)


def _labels(tokenizer: Any, text: str, start_id: int, max_length: int) -> list[int]:
    """The transcript's ids as the decoder predicts them: a leading start token (Whisper's tokenizer
    writes ``<|startoftranscript|>`` first) is dropped, since the decoder reads it as its first input."""
    ids = list(tokenizer(text, truncation=True, max_length=max_length)["input_ids"])
    return ids[1:] if ids and ids[0] == start_id else ids


def _features(processor: SpeechProcessor, clips: Sequence[np.ndarray], frames: int) -> Tensor:
    """Log-mel features of ``clips``, each padded or cut to ``frames`` frames."""
    fe = processor.feature_extractor
    samples = frames * int(fe.hop_length)
    out = fe(
        list(clips),
        sampling_rate=int(fe.sampling_rate),
        padding="max_length",
        max_length=samples,
        truncation=True,
        return_tensors="pt",
    )["input_features"]
    return out[..., :frames]


def _collate(features: Tensor, labels: Sequence[list[int]], pad_id: int, start_id: int) -> dict[str, Tensor]:
    width = max(len(r) for r in labels)
    target = torch.full((len(labels), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(target)
    for i, r in enumerate(labels):
        target[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    decoder = torch.full_like(target, pad_id)
    decoder[:, 0] = start_id
    decoder[:, 1:] = target[:, :-1]
    return {
        "input_features": features,
        "decoder_input_ids": decoder,
        "decoder_attention_mask": mask,
        "labels": target.masked_fill(mask == 0, -100),
    }


def _clip(path: Any, base_dir: Path, rate: int, row: int, column: str) -> np.ndarray:
    """One clip at ``rate`` Hz; a relative path is read from ``base_dir`` (the recipe's folder)."""
    if not isinstance(path, str) or not path:
        raise DataError(f"record {row}: `{column}` must hold the path of a WAV file, got {type(path).__name__}")
    samples, found = read_wav(base_dir / path)
    return resample(samples, found, rate)


def speech_batches(
    records: datasets.Dataset,
    processor: Any,
    *,
    start_id: int,
    frames: int,
    audio_column: str = "audio",
    target_column: str = "target",
    max_length: int = 128,
    batch_size: int = 8,
    base_dir: Path = Path(),
) -> list[dict[str, Tensor]]:
    """Batches of (WAV path, transcript) records: ``frames`` log-mel frames per clip (what the
    encoder takes) and the transcripts, at most ``max_length`` tokens each, as labels; relative
    paths are read from ``base_dir``."""
    if not isinstance(processor, SpeechProcessor):
        raise DataError(
            "speech data need the model's feature extractor: save it beside the model "
            "(preprocessor_config.json, e.g. `WhisperFeatureExtractor(...).save_pretrained(folder)`)"
        )
    check_column(records, audio_column, "audio_column")
    check_column(records, target_column, "target_column")
    rate = int(processor.feature_extractor.sampling_rate)
    tokenizer = processor.tokenizer
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    out: list[dict[str, Tensor]] = []
    for start in range(0, len(records), batch_size):
        rows = records[start : start + batch_size]
        texts = rows[target_column]
        if any(not isinstance(t, str) or not t for t in texts):
            raise DataError(f"records {start}…: `{target_column}` must hold non-empty transcripts")
        clips = [_clip(p, base_dir, rate, start + i, audio_column) for i, p in enumerate(rows[audio_column])]
        labels = [_labels(tokenizer, t, start_id, max_length) for t in texts]
        out.append(_collate(_features(processor, clips, frames), labels, int(pad_id), start_id))
    if not out:
        raise DataError(f"columns {audio_column!r} and {target_column!r} gave no example: add data")
    return out
