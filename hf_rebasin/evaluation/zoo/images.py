"""How the zoo's image classifiers are built and trained: the ViT (and its wider twin) and the
other vision families (DINOv2, SigLIP), on the 8×8 digits, saved with the digits' image processor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.core.names import Kind
from hf_rebasin.evaluation import data
from hf_rebasin.evaluation.zoo.catalogue import DEFAULT_CONFIGS, ImageTrainConfig, ViTTrainConfig, check_kind
from hf_rebasin.evaluation.zoo.families import image_config
from hf_rebasin.evaluation.zoo.loop import Progress, _run, default_config


def train_tiny_vit(
    seed: int,
    out_dir: Path,
    config: ViTTrainConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
    kind: Kind = "vit",
) -> Path:
    """Train a small ViTForImageClassification on the 8×8 digits and save it.

    ``seed`` sets the initialisation and the order of the training images; the train/test split
    itself is fixed (``digits_dataset`` default), so every seed is tested on the same images.
    ``kind`` (vit or a wider twin) as in `train_tiny_gpt2`.
    """
    from transformers import ViTConfig, ViTForImageClassification

    cfg = config or default_config(kind, ViTTrainConfig)
    model_config = ViTConfig(
        image_size=8,
        patch_size=cfg.patch_size,
        num_channels=1,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        id2label={i: str(i) for i in range(10)},
        label2id={str(i): i for i in range(10)},
    )
    return _run_digits(
        kind, seed, cfg, out_dir, lambda: ViTForImageClassification(model_config), progress=progress, threads=threads
    )


def _run_digits(
    kind: Kind,
    seed: int,
    cfg: ViTTrainConfig | ImageTrainConfig,
    out_dir: Path,
    build: Callable[[], Any],
    *,
    progress: Progress | None,
    threads: int | None,
) -> Path:
    """`_run` for the image kinds: the digits' training split in batches drawn per epoch, the test
    split scored 256 at a time, the digits' image processor saved beside the result."""
    images, labels = data.digits_dataset("train")
    test_images, test_labels = data.digits_dataset("test")
    return _run(
        kind,
        seed,
        cfg,
        out_dir,
        build,
        lambda s: data.image_batches(images, labels, cfg.batch_size, seed=s, drop_last=True),
        list(data.image_batches(test_images, test_labels, 256)),
        progress=progress,
        threads=threads,
        processor=digits_processor(),
    )


def train_tiny_image_classifier(
    kind: Kind,
    seed: int,
    out_dir: Path,
    config: ImageTrainConfig | None = None,
    *,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> Path:
    """Train a small image classifier of ``config.family`` on the 8×8 digits, as `train_tiny_vit`
    trains its ViT (same images, batches, schedule); save it with the digits' image processor."""
    from transformers import AutoModelForImageClassification

    default = DEFAULT_CONFIGS[check_kind(kind)]
    if not isinstance(default, ImageTrainConfig):
        raise UnsupportedArchitectureError(f"zoo kind {kind!r} is not trained by train_tiny_image_classifier")
    cfg = config or default
    model_config = image_config(cfg)
    return _run_digits(
        kind,
        seed,
        cfg,
        out_dir,
        lambda: AutoModelForImageClassification.from_config(model_config),
        progress=progress,
        threads=threads,
    )


def digits_processor() -> Any:
    """The image processor of the zoo ViT: 8×8 grayscale, scaled to [0, 1], normalised by 0.5 / 0.5.

    It maps the ``digits`` data set's PIL images (see `evaldata`) to the pixels the model was
    trained on (`data.digits_dataset`), up to the rounding of the pixels to 8 bits.
    """
    from transformers import ViTImageProcessor

    return ViTImageProcessor(
        do_resize=True,
        size={"height": 8, "width": 8},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5],
        image_std=[0.5],
    )
