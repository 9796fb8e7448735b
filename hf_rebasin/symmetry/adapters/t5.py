"""T5 and mT5: pre-RMSNorm encoder-decoders with relative position biases.

One embedding table (``shared``) feeds both stacks, so, as in BART, one residual map serves the
encoder's and the decoder's streams, and cross-attention's queries (the decoder's stream) and its
keys and values (the encoder's output) all read it. Every norm is a T5LayerNorm (RMS, no bias, not
centred) with linear readers, so the stream admits orthogonal maps once their γ is folded:
the encoder's final norm into every decoder layer's cross-attention keys and values, the decoder's
into the LM head (T5's ``d_model**-0.5`` rescale before it, ``scale_decoder_outputs``, is a scalar:
it commutes with every map) or the classification head. In ``T5EncoderModel`` the encoder's final
norm is the output, so its stream keeps signed permutations only.

Only block 0 of a stack holds ``relative_attention_bias`` ([buckets, heads]), and every layer of
the stack adds it to its scores: the heads of a stack's self-attention share one order, so each
stack has one head space (``enc.self``, ``dec.self``) and the bias columns follow it (role ``h``).
The Q/K inner maps are free (T5 does not scale its scores by 1/√d_kv and has no rotary
embedding). Cross-attention has no position bias: its heads are free per layer. ``inner_dim =
num_heads · d_kv`` need not equal ``d_model``. The feed-forward is ReLU (``wi``, original T5) or
gated (``wi_0`` the gate, ``wi_1`` the up projection: v1.1, Flan-T5, mT5); transformers keeps
``wo`` in float32. v1.1, Flan-T5 and mT5 store ``lm_head`` apart from ``shared`` while the
stacks' ``embed_tokens`` stay tied to it (T5Config forces that tie).

umT5 is left out: each of its layers has a relative attention bias of its own, so its head spaces
would be per layer and its layout differs; it is not registered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_rebasin.symmetry.adapters.base import (
    SHARED_TABLE_TIES,
    ArchitectureSpec,
    GluT,
    HeadsT,
    NormT,
    SpaceT,
    SublayerT,
)
from hf_rebasin.symmetry.spaces import AxisRef

ENC = "{base}encoder.block.{i}"
DEC = "{base}decoder.block.{j}"
ENC_SELF, DEC_SELF = "enc.self", "dec.self"  # one head order per stack: the position bias is shared
DEC_CROSS = "dec.{j}.cross"
ENC_MLP, DEC_MLP = "enc.{i}.mlp", "dec.{j}.mlp"
_FF = ("wi", "wi_0", "wi_1")

_SPACES = (
    SpaceT("res", "d", "orthogonal", kind="residual"),
    HeadsT(ENC_SELF, kv_heads="heads", head_dim="d_kv", scores_scaled=False),
    HeadsT(DEC_SELF, kv_heads="heads", head_dim="d_kv", scores_scaled=False),
    HeadsT(DEC_CROSS, kv_heads="heads", head_dim="d_kv", scores_scaled=False),
    SpaceT(ENC_MLP, "ff", kind="mlp"),
    SpaceT(DEC_MLP, "ff", kind="mlp"),
    SpaceT("head", "d", kind="pooler"),
)


def _attention(prefix: str, heads: str) -> dict[str, tuple[AxisRef, ...]]:
    """q/k/v/o without biases; every input reads the one stream."""
    out: dict[str, tuple[AxisRef, ...]] = {f"{prefix}.{r}.weight": (f"{heads}:{r}", "res") for r in "qkv"}
    out[f"{prefix}.o.weight"] = ("res", f"{heads}:o")
    return out


def _ff(prefix: str, space: str) -> dict[str, tuple[AxisRef, ...]]:
    """ReLU (``wi``) or gated (``wi_0``, ``wi_1``): the model has one or the other."""
    out: dict[str, tuple[AxisRef, ...]] = {f"{prefix}.DenseReluDense.{w}.weight": (space, "res") for w in _FF}
    out[f"{prefix}.DenseReluDense.wo.weight"] = ("res", space)
    return out


def _bias(stack: str, heads: str) -> dict[str, tuple[AxisRef, ...]]:
    """Block 0's relative position bias, [buckets, heads]: one column per head of the stack."""
    return {f"{{base}}{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight": (None, f"{heads}:h")}


_TENSORS: dict[str, tuple[AxisRef, ...]] = {
    "{base}shared.weight": (None, "res"),
    "{base}encoder.embed_tokens.weight": (None, "res"),
    "{base}decoder.embed_tokens.weight": (None, "res"),
    "lm_head.weight": (None, "res"),
    **_attention(f"{ENC}.layer.0.SelfAttention", ENC_SELF),
    **_bias("encoder", ENC_SELF),
    **_ff(f"{ENC}.layer.1", ENC_MLP),
    **_attention(f"{DEC}.layer.0.SelfAttention", DEC_SELF),
    **_bias("decoder", DEC_SELF),
    **_attention(f"{DEC}.layer.1.EncDecAttention", DEC_CROSS),
    **_ff(f"{DEC}.layer.2", DEC_MLP),
    # T5ClassificationHead (dense → tanh → out_proj) reads the decoder's last state at the end token
    "classification_head.dense.weight": ("head", "res"),
    "classification_head.dense.bias": ("head",),
    "classification_head.out_proj.weight": (None, "head"),
}


def _reads(prefix: str, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"{prefix}.{n}.weight" for n in names)


_NORMS = (
    NormT(f"{ENC}.layer.0.layer_norm", "res", _reads(f"{ENC}.layer.0.SelfAttention", ("q", "k", "v")), bias=False),
    NormT(f"{ENC}.layer.1.layer_norm", "res", _reads(f"{ENC}.layer.1.DenseReluDense", _FF), bias=False),
    # the encoder's output: read by every decoder layer's cross-attention keys and values
    NormT(
        "{base}encoder.final_layer_norm",
        "res",
        _reads(f"{DEC}.layer.1.EncDecAttention", ("k", "v")),
        bias=False,
        final=True,
    ),
    NormT(f"{DEC}.layer.0.layer_norm", "res", _reads(f"{DEC}.layer.0.SelfAttention", ("q", "k", "v")), bias=False),
    NormT(f"{DEC}.layer.1.layer_norm", "res", (f"{DEC}.layer.1.EncDecAttention.q.weight",), bias=False),
    NormT(f"{DEC}.layer.2.layer_norm", "res", _reads(f"{DEC}.layer.2.DenseReluDense", _FF), bias=False),
    NormT(
        "{base}decoder.final_layer_norm",
        "res",
        ("lm_head.weight", "classification_head.dense.weight"),
        bias=False,
        final=True,
    ),
)


def _sublayer(layer: str, module: str, reads: tuple[str, ...], writes: str) -> SublayerT:
    return SublayerT(
        (f"{layer}.layer_norm", *(f"{layer}.{module}.{r}" for r in reads)), (f"{layer}.{module}.{writes}",)
    )


_SUBLAYERS = (
    _sublayer(f"{ENC}.layer.0", "SelfAttention", ("q", "k", "v"), "o"),
    _sublayer(f"{ENC}.layer.1", "DenseReluDense", _FF, "wo"),
    _sublayer(f"{DEC}.layer.0", "SelfAttention", ("q", "k", "v"), "o"),
    _sublayer(f"{DEC}.layer.1", "EncDecAttention", ("q", "k", "v"), "o"),
    _sublayer(f"{DEC}.layer.2", "DenseReluDense", _FF, "wo"),
)


def _glu(layer: str, space: str) -> GluT:
    ff = f"{layer}.DenseReluDense"
    return GluT(space, f"{ff}.wi_0.weight", f"{ff}.wi_1.weight", f"{ff}.wo.weight")


def _dims(c: Any) -> dict[str, int]:
    return {
        "d": c.d_model,
        "enc_layers": c.num_layers,
        "dec_layers": getattr(c, "num_decoder_layers", None) or c.num_layers,
        "heads": c.num_heads,
        "d_kv": c.d_kv,
        "ff": c.d_ff,
    }


# units (d_ff), heads (num_heads: an added head's position-bias column is read by nothing its zero
# output projection passes on) and head widths (d_kv: T5 divides its scores by nothing) grow; the
# stream (d_model) only where no rescale reads it
_FIXED = {"d_model": "the head's d_model**-0.5 rescale (scale_decoder_outputs) changes with it"}


def _configured(config: Any) -> dict[str, Any]:
    """T5 v1.1, Flan-T5 and mT5 put no rescale before the head: their stream can grow (zeros, each
    RMSNorm's γ rescaled); the original T5's tied head reads the stream times d_model**-0.5."""
    if getattr(config, "scale_decoder_outputs", False):
        return {}
    return {"fixed_widths": {}}


T5 = ArchitectureSpec(
    family="t5",
    model_types=("t5",),
    base_prefix="transformer.",
    dims=_dims,
    loops={"i": "enc_layers", "j": "dec_layers"},
    spaces=_SPACES,
    tensors=_TENSORS,
    norms=_NORMS,
    ties=SHARED_TABLE_TIES,
    forced_ties=("{base}encoder.embed_tokens.weight", "{base}decoder.embed_tokens.weight"),
    invariant=("classification_head.out_proj.bias",),
    norm_type="rmsnorm",
    # the encoder's last state is left out: canonical form folds its norm's γ into cross-attention
    outputs={"logits": None, "last_hidden_state": "res"},
    sublayers=_SUBLAYERS,
    embeddings=("{base}shared", "{base}encoder.embed_tokens", "{base}decoder.embed_tokens"),
    last_hidden={"res": "{base}encoder"},
    inputs="seq2seq",
    stacks=("{base}encoder", "{base}decoder"),
    glus=(_glu(f"{ENC}.layer.1", ENC_MLP), _glu(f"{DEC}.layer.2", DEC_MLP)),
    head_tensors=("lm_head.weight", "classification_head.dense.weight"),
    fixed_widths=_FIXED,
    configured=_configured,
)

# mT5: T5 v1.1's layout under its own model type (MT5Config forces the tie; it never rescales)
MT5 = dataclasses.replace(T5, family="mt5", model_types=("mt5",))
