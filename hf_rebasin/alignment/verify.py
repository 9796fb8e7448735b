"""Function preservation: a random allowed transform must leave the model's outputs unchanged.

This is the proof that an adapter is right, and what ``hf-rebasin verify`` runs on a user's model.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hf_rebasin.core.errors import AdapterError, FunctionNotPreservedError
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import get_adapter
from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, as_choices, image_inputs, token_inputs
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import TransformClass
from hf_rebasin.symmetry.transforms import Transform

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TOLERANCE = 1e-4


@dataclass
class VerifyReport:
    max_abs_diff: float
    compared: list[str]
    transform_class: TransformClass
    classes: dict[str, str]
    fallbacks: list[str] = field(default_factory=list)
    untied: list[str] = field(default_factory=list)
    tolerance: float = TOLERANCE
    # spaces that keep the identity whatever the class (a stream written by positions regenerated on load)
    pinned: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Within tolerance; NaN or Inf is a failure (a NaN compares false with every bound)."""
        return math.isfinite(self.max_abs_diff) and self.max_abs_diff <= self.tolerance


def tolerance(scale: float) -> float:
    """The preservation tolerance for logits of magnitude ``scale``: 1e-4 up to |logits| of 1,
    relative beyond, since float32 rounding of a transformed model grows with its outputs; 0 when
    the outputs are not finite (nothing passes)."""
    return TOLERANCE * max(1.0, scale) if math.isfinite(scale) else 0.0


@torch.no_grad()
def logits_gap(
    model: PreTrainedModel,
    rewritten: PreTrainedModel,
    inputs: dict[str, torch.Tensor],
    basis: tuple[SymmetryGraph, Transform] | None = None,
) -> tuple[float, float]:
    """max |Δ logits| between ``model`` and ``rewritten`` on ``inputs``, and max |logits| of ``model``
    (the scale float32 rounding grows with).

    A model without a head (``BertModel``, ``LlamaModel``: a sentence encoder) has no logits: its
    hidden states are compared, mapped into the rewritten model's basis by ``basis`` (graph,
    transform; None: the same basis)."""
    spec = get_adapter(model.config.model_type)
    model.eval()
    before = outputs_of(model, spec, inputs)
    after = outputs_of(rewritten, spec, inputs)
    heads = {k: v for k, v in before.items() if spec.outputs.get(k) is None}  # the same in every basis
    if heads:
        before = heads
    if basis is None:
        graph = spec.graph(model.config, model.state_dict().keys())
        basis = graph, graph.identity()
    gap = compare(spec, *basis, {k: v.float() for k, v in before.items()}, {k: after[k].float() for k in before})
    scale = max((float(v.float().abs().max()) for v in before.values() if v.numel()), default=0.0)
    return gap, scale


def example_gap(
    model: PreTrainedModel, rewritten: PreTrainedModel, basis: tuple[SymmetryGraph, Transform] | None = None
) -> tuple[float, float]:
    """`logits_gap` of ``model`` and ``rewritten`` (in ``basis``) on `example_inputs` of ``model``'s
    family (seed 0), on ``model``'s device: the fixed check of a rewrite when no data is at hand."""
    spec = get_adapter(model.config.model_type)
    device = next(model.parameters()).device
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(0))
    return logits_gap(model, rewritten, {k: v.to(device) for k, v in inputs.items()}, basis)


def check_preserved(gap: float, scale: float, what: str) -> None:
    """A function-preserving rewrite that changed the outputs (or made them NaN/Inf) is a bug:
    raised before anything is written, never reported as a result. ``what`` names the model."""
    tol = tolerance(scale)
    if not (math.isfinite(gap) and gap <= tol):
        raise FunctionNotPreservedError(
            f"function not preserved: {what} gives outputs that differ from its own by "
            f"max |Δ logits| = {gap:.3g} (tolerance {tol:.3g}: 1e-4 × max(1, max |logits| = {scale:.3g})); "
            "nothing was written"
        )


def example_inputs(spec: ArchitectureSpec, config: Any, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A small fixed batch the model accepts (token ids with one padded row, and/or pixels)."""
    inputs: dict[str, torch.Tensor] = {}
    if spec.inputs in ("text", "text-image", "seq2seq"):
        t = getattr(config, "text_config", None) or config
        max_len = int(getattr(t, "max_position_embeddings", None) or getattr(t, "n_positions", None) or 64)
        # RoBERTa reserves padding_idx + 1 positions
        inputs.update(token_inputs(t.vocab_size, max_len - 2, generator))
    if spec.inputs == "seq2seq" and getattr(config, "eos_token_id", None) is not None:
        ids, eos = inputs["input_ids"], int(config.eos_token_id)
        ids[ids == eos] = (eos + 1) % config.vocab_size  # one end per row, the last token (BART's classifier reads it)
        ids[:, -1] = eos
    if spec.inputs == "seq2seq":  # T5 needs the decoder's ids; BART would shift the source alike
        start = getattr(config, "decoder_start_token_id", None)
        start = int(start if start is not None else getattr(config, "pad_token_id", None) or 0)
        ids = inputs["input_ids"]
        # Marian with ``share_encoder_decoder_embeddings: false`` has a smaller target vocabulary
        ids = ids % int(getattr(config, "decoder_vocab_size", None) or config.vocab_size)
        inputs["decoder_input_ids"] = torch.cat([torch.full_like(ids[:, :1], start), ids[:, :-1]], dim=1)
    if spec.inputs in ("image", "text-image"):
        v = getattr(config, "vision_config", None) or config
        inputs.update(image_inputs(v.num_channels, v.image_size, generator))
    if spec.inputs == "speech-seq2seq":
        inputs.update(speech_inputs(config, generator))
    return inputs


def speech_inputs(config: Any, generator: torch.Generator, batch: int = 2) -> dict[str, torch.Tensor]:
    """Log-mel features of the one length Whisper's encoder accepts (2·max_source_positions frames:
    it refuses any other) and decoder ids after the start token, one row padded at its end."""
    frames = 2 * int(config.max_source_positions)
    features = torch.randn(batch, int(config.num_mel_bins), frames, generator=generator)
    text = token_inputs(config.vocab_size, int(config.max_target_positions) - 1, generator, batch, length=10)
    ids = text["input_ids"]
    start = int(config.decoder_start_token_id)
    decoder_ids = torch.cat([torch.full_like(ids[:, :1], start), ids[:, :-1]], dim=1)
    return {
        "input_features": features,
        "decoder_input_ids": decoder_ids,
        "decoder_attention_mask": text["attention_mask"],
    }


# the modality of each input `example_inputs` draws
_MODALITY = {"input_ids": "text", "attention_mask": "text", "pixel_values": "image", "input_features": "audio"}


def accepted_inputs(model: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` less those of a modality ``model`` does not read (its ``input_modalities``): a
    model type with text and images has one-tower classes (``SiglipForImageClassification`` takes
    pixels only, and passes other keyword arguments on into its encoder)."""
    if "decoder_input_ids" in inputs and "decoder_input_ids" not in inspect.signature(model.forward).parameters:
        inputs = {k: v for k, v in inputs.items() if not k.startswith("decoder_")}  # an encoder alone (T5EncoderModel)
    modalities = getattr(model, "input_modalities", None)
    if not modalities:
        return inputs
    read = {modalities} if isinstance(modalities, str) else set(modalities)
    return {k: v for k, v in inputs.items() if k not in _MODALITY or _MODALITY[k] in read}


@torch.no_grad()
def outputs_of(
    model: PreTrainedModel, spec: ArchitectureSpec, inputs: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    inputs = as_choices(model, inputs)
    out = model(
        **(accepted_inputs(model, inputs) if spec.inputs in ("text-image", "seq2seq", "speech-seq2seq") else inputs)
    )
    found = {
        k: v for k, v in out.items() if isinstance(v, torch.Tensor) and (k in spec.outputs or k.endswith("logits"))
    }
    if not found:  # a check that compares nothing would pass whatever the rewrite did
        raise AdapterError(
            f"a {type(model).__name__} returned none of the outputs hf-rebasin compares ({', '.join(spec.outputs)}, "
            f"or any *logits); it returned {', '.join(out.keys()) or 'nothing'}. Please report it."
        )
    return found


def compare(
    spec: ArchitectureSpec,
    graph: SymmetryGraph,
    transform: Transform,
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
) -> float:
    """Max |Δ| between outputs, mapping outputs that live in a space (hidden states) through it.

    NaN anywhere makes the result NaN (Python's ``max`` would drop it: ``max(0.0, nan)`` is 0.0).
    """
    worst = 0.0
    for key, ref in before.items():
        expected = ref
        space = spec.outputs.get(key)  # every *logits output is the same in every basis
        if space is not None:
            if space not in graph.spaces:
                continue
            m = graph.axis_map(transform, space)
            if m is not None:
                expected = m.apply(ref, ref.dim() - 1)
        diff = float((after[key] - expected).abs().max().item())
        if not math.isfinite(diff):
            return diff
        worst = max(worst, diff)
    return worst


def transformed_model(
    model: PreTrainedModel, transform_class: TransformClass, seed: int
) -> tuple[PreTrainedModel, SymmetryGraph, Transform, list[str]]:
    """``model`` under a random allowed transform (after canonical form when orthogonal)."""
    spec = get_adapter(model.config.model_type)
    sd = model.state_dict()
    graph = spec.graph(model.config, sd.keys())
    untied: list[str] = []
    if transform_class == "orthogonal":
        sd, graph, untied = canonicalize(graph, sd)
    transform = graph.random_transform(transform_class, torch.Generator().manual_seed(seed))
    new = rebuild(model, graph.apply(sd, transform), untie=bool(untied))
    return new, graph, transform, untied


def verify_model(
    model: PreTrainedModel, transform_class: TransformClass = "permutation", seed: int = 0
) -> VerifyReport:
    spec = get_adapter(model.config.model_type)
    model.eval()
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(seed + 1))
    before = outputs_of(model, spec, inputs)
    new, graph, transform, untied = transformed_model(model, transform_class, seed)
    after = outputs_of(new, spec, inputs)
    return VerifyReport(
        max_abs_diff=compare(spec, graph, transform, before, after),
        compared=sorted(before),
        transform_class=transform_class,
        classes=graph.classes(transform_class),
        fallbacks=graph.fallbacks(transform_class),
        untied=untied,
        pinned=graph.pinned(),
    )
