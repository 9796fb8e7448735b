"""Whisper: a pre-LayerNorm speech encoder-decoder with no shared table, so two residual streams.

The encoder's stream (``enc.res``) starts as ``gelu(conv2(gelu(conv1(x)))) + embed_positions``: its
first writer is a GELU output, which no rotation commutes with (a LayerNorm's centring cannot reach
it either), so it admits permutations only. ``conv1``'s output channels, read by ``conv2`` through a
GELU, are a unit space of their own (``enc.conv``). The encoder's positions are stored (their
columns move with the stream). Every encoder layer is pre-LN; the final ``encoder.layer_norm`` is
read by every decoder layer's cross-attention keys and values (and by the audio classifier's
projector).

The decoder's stream (``dec.res``) is pre-LN, written by ``embed_tokens`` (tied to ``proj_out``)
and ``embed_positions``; every norm has linear readers (``decoder.layer_norm`` only ``proj_out``),
so it admits orthogonal maps fixing the all-ones vector once γ and β are folded; in the bare
``WhisperModel`` the decoder's final norm is the output, so there it keeps permutations.
Cross-attention's queries and output read and write ``dec.res``, its keys and values read
``enc.res``. Heads are free in every layer (no rotary, no position bias); ``k_proj`` has no bias.
"""

from __future__ import annotations

from typing import Any

from hf_rebasin.symmetry.adapters.bart import bart_dims
from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.spaces import AxisRef

GELU_WRITES = "GELU after conv2 writes the encoder's stream: no rotation commutes with it"
ENC = "{base}encoder.layers.{i}"
DEC = "{base}decoder.layers.{j}"
ENC_SELF, ENC_MLP = "enc.{i}.self", "enc.{i}.mlp"
DEC_SELF, DEC_CROSS, DEC_MLP = "dec.{j}.self", "dec.{j}.cross", "dec.{j}.mlp"

_SPACES = (
    SpaceT("enc.res", "d", "permutation", kind="residual", reason=GELU_WRITES),
    SpaceT("dec.res", "d", "orthogonal", centered=True, kind="residual"),
    SpaceT("enc.conv", "d", kind="mlp"),
    HeadsT(ENC_SELF, heads="enc_heads", kv_heads="enc_heads", head_dim="enc_head_dim"),
    HeadsT(DEC_SELF, heads="dec_heads", kv_heads="dec_heads", head_dim="dec_head_dim"),
    HeadsT(DEC_CROSS, heads="dec_heads", kv_heads="dec_heads", head_dim="dec_head_dim"),
    SpaceT(ENC_MLP, "enc_ff", kind="mlp"),
    SpaceT(DEC_MLP, "dec_ff", kind="mlp"),
    SpaceT("head", "proj", kind="pooler"),
)


def _attention(prefix: str, heads: str, q_res: str, kv_res: str) -> dict[str, tuple[AxisRef, ...]]:
    """q/k/v/out projections; queries and the output on ``q_res``, keys and values read ``kv_res``
    (the encoder's stream in cross-attention). ``k_proj`` has no bias."""
    out: dict[str, tuple[AxisRef, ...]] = {}
    for role, res in (("q", q_res), ("k", kv_res), ("v", kv_res)):
        out[f"{prefix}.{role}_proj.weight"] = (f"{heads}:{role}", res)
        out[f"{prefix}.{role}_proj.bias"] = (f"{heads}:{role}",)
    out[f"{prefix}.out_proj.weight"] = (q_res, f"{heads}:o")
    out[f"{prefix}.out_proj.bias"] = (q_res,)
    return out


def _mlp(layer: str, space: str, res: str) -> dict[str, tuple[AxisRef, ...]]:
    return {
        f"{layer}.fc1.weight": (space, res),
        f"{layer}.fc1.bias": (space,),
        f"{layer}.fc2.weight": (res, space),
        f"{layer}.fc2.bias": (res,),
    }


_TENSORS: dict[str, tuple[AxisRef, ...]] = {
    # Conv1d weights are [out, in, kernel]
    "{base}encoder.conv1.weight": ("enc.conv", None, None),
    "{base}encoder.conv1.bias": ("enc.conv",),
    "{base}encoder.conv2.weight": ("enc.res", "enc.conv", None),
    "{base}encoder.conv2.bias": ("enc.res",),
    "{base}encoder.embed_positions.weight": (None, "enc.res"),
    **_attention(f"{ENC}.self_attn", ENC_SELF, "enc.res", "enc.res"),
    **_mlp(ENC, ENC_MLP, "enc.res"),
    "{base}decoder.embed_tokens.weight": (None, "dec.res"),
    "{base}decoder.embed_positions.weight": (None, "dec.res"),
    **_attention(f"{DEC}.self_attn", DEC_SELF, "dec.res", "dec.res"),
    **_attention(f"{DEC}.encoder_attn", DEC_CROSS, "dec.res", "enc.res"),
    **_mlp(DEC, DEC_MLP, "dec.res"),
    "proj_out.weight": (None, "dec.res"),
    # WhisperForAudioClassification: projector (linear) → mean over frames → classifier
    "projector.weight": ("head", "enc.res"),
    "projector.bias": ("head",),
    "classifier.weight": (None, "head"),
}


def _reads(prefix: str, roles: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{r}_proj.weight" for r in roles)


_NORMS = (
    NormT(f"{ENC}.self_attn_layer_norm", "enc.res", _reads(f"{ENC}.self_attn", "qkv")),
    NormT(f"{ENC}.final_layer_norm", "enc.res", (f"{ENC}.fc1.weight",)),
    # the encoder's output: read by every decoder layer's cross-attention keys and values
    NormT(
        "{base}encoder.layer_norm",
        "enc.res",
        (*_reads(f"{DEC}.encoder_attn", "kv"), "projector.weight"),
        final=True,
    ),
    NormT(f"{DEC}.self_attn_layer_norm", "dec.res", _reads(f"{DEC}.self_attn", "qkv")),
    NormT(f"{DEC}.encoder_attn_layer_norm", "dec.res", _reads(f"{DEC}.encoder_attn", "q")),
    NormT(f"{DEC}.final_layer_norm", "dec.res", (f"{DEC}.fc1.weight",)),
    NormT("{base}decoder.layer_norm", "dec.res", ("proj_out.weight",), final=True),
)


def _sublayer(layer: str, norm: str, module: str, reads: tuple[str, ...], writes: str) -> SublayerT:
    return SublayerT((f"{layer}.{norm}", *(f"{layer}.{module}{r}" for r in reads)), (f"{layer}.{module}{writes}",))


# pre-LN: each sublayer reads its norm and writes the stream through its output projection; the
# cross-attention's keys and values read the encoder's stream, not this one, so only its query is
# listed among the decoder's readers
_SUBLAYERS = (
    _sublayer(ENC, "self_attn_layer_norm", "self_attn.", ("q_proj", "k_proj", "v_proj"), "out_proj"),
    _sublayer(ENC, "final_layer_norm", "", ("fc1",), "fc2"),
    _sublayer(DEC, "self_attn_layer_norm", "self_attn.", ("q_proj", "k_proj", "v_proj"), "out_proj"),
    _sublayer(DEC, "encoder_attn_layer_norm", "encoder_attn.", ("q_proj",), "out_proj"),
    _sublayer(DEC, "final_layer_norm", "", ("fc1",), "fc2"),
)


def _dims(c: Any) -> dict[str, int]:
    return {**bart_dims(c), "proj": getattr(c, "classifier_proj_size", None) or c.d_model}


SPEC = ArchitectureSpec(
    family="whisper",
    model_types=("whisper",),
    base_prefix="model.",
    dims=_dims,
    loops={"i": "enc_layers", "j": "dec_layers"},
    spaces=_SPACES,
    tensors=_TENSORS,
    norms=_NORMS,
    ties={"proj_out.weight": "{base}decoder.embed_tokens.weight"},
    # the audio classifier's weights of the layers' outputs (use_weighted_layer_sum) carry no hidden axis
    invariant=("classifier.bias", "layer_weights"),
    outputs={"logits": None, "last_hidden_state": "dec.res", "encoder_last_hidden_state": "enc.res"},
    sublayers=_SUBLAYERS,
    embeddings=(
        "{base}encoder.conv1",
        "{base}encoder.conv2",
        "{base}encoder.embed_positions",
        "{base}decoder.embed_tokens",
        "{base}decoder.embed_positions",
    ),
    last_hidden={"enc.res": "{base}encoder.layer_norm", "dec.res": "{base}decoder.layer_norm"},
    inputs="speech-seq2seq",
    stacks=("{base}encoder", "{base}decoder"),
    head_tensors=("proj_out.weight", "projector.weight"),
    fixed_widths={
        "d_model": "the encoder's stream is written through GELU (conv2): it admits permutations only",
        "num_mel_bins": "the input features' width is set by the feature extractor",
        "max_source_positions": "the encoder takes exactly 2·max_source_positions input frames",
    },
)
