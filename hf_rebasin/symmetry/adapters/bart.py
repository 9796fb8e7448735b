"""BART: a post-LayerNorm encoder-decoder. One embedding table (``shared``) feeds both stacks and the
LM head, so the encoder's and the decoder's residual streams meet at it: one stream map serves
both, and cross-attention's keys and values (which read the encoder's output) and its queries
(which read the decoder's stream) all read it. The LayerNorms sit on the residual path (after each
sublayer, and on the embeddings), so the stream admits permutations only; heads and hidden units
are free in every layer of both stacks, cross-attention's heads included."""

from __future__ import annotations

from typing import Any

from hf_rebasin.symmetry.adapters.base import SHARED_TABLE_TIES, ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.spaces import AxisRef

POST_NORM = "post-norm: LayerNorm sits on the residual path"
ENC = "{base}encoder.layers.{i}"
DEC = "{base}decoder.layers.{j}"
ENC_SELF, ENC_MLP = "enc.{i}.self", "enc.{i}.mlp"
DEC_SELF, DEC_CROSS, DEC_MLP = "dec.{j}.self", "dec.{j}.cross", "dec.{j}.mlp"

_SPACES = (
    SpaceT("res", "d", kind="residual", reason=POST_NORM),
    HeadsT(ENC_SELF, heads="enc_heads", kv_heads="enc_heads", head_dim="enc_head_dim"),
    HeadsT(DEC_SELF, heads="dec_heads", kv_heads="dec_heads", head_dim="dec_head_dim"),
    HeadsT(DEC_CROSS, heads="dec_heads", kv_heads="dec_heads", head_dim="dec_head_dim"),
    SpaceT(ENC_MLP, "enc_ff", kind="mlp"),
    SpaceT(DEC_MLP, "dec_ff", kind="mlp"),
    SpaceT("head", "d", kind="pooler"),
)


def _attention(prefix: str, heads: str) -> dict[str, tuple[AxisRef, ...]]:
    """q/k/v/out projections with biases; every input reads the one residual stream (cross-attention's
    keys and values read the encoder's output, which is that stream too)."""
    out: dict[str, tuple[AxisRef, ...]] = {}
    for role in ("q", "k", "v"):
        out[f"{prefix}.{role}_proj.weight"] = (f"{heads}:{role}", "res")
        out[f"{prefix}.{role}_proj.bias"] = (f"{heads}:{role}",)
    out[f"{prefix}.out_proj.weight"] = ("res", f"{heads}:o")
    out[f"{prefix}.out_proj.bias"] = ("res",)
    return out


def _mlp(layer: str, space: str) -> dict[str, tuple[AxisRef, ...]]:
    return {
        f"{layer}.fc1.weight": (space, "res"),
        f"{layer}.fc1.bias": (space,),
        f"{layer}.fc2.weight": ("res", space),
        f"{layer}.fc2.bias": ("res",),
    }


_TENSORS: dict[str, tuple[AxisRef, ...]] = {
    "{base}shared.weight": (None, "res"),
    "{base}encoder.embed_tokens.weight": (None, "res"),
    "{base}decoder.embed_tokens.weight": (None, "res"),
    "lm_head.weight": (None, "res"),
    "{base}encoder.embed_positions.weight": (None, "res"),
    "{base}decoder.embed_positions.weight": (None, "res"),
    **_attention(f"{ENC}.self_attn", ENC_SELF),
    **_mlp(ENC, ENC_MLP),
    **_attention(f"{DEC}.self_attn", DEC_SELF),
    **_attention(f"{DEC}.encoder_attn", DEC_CROSS),
    **_mlp(DEC, DEC_MLP),
    "qa_outputs.weight": (None, "res"),
    # BartClassificationHead (dense → tanh → out_proj) reads the decoder's last state at the
    # end-of-sentence token: the stream
    "classification_head.dense.weight": ("head", "res"),
    "classification_head.dense.bias": ("head",),
    "classification_head.out_proj.weight": (None, "head"),
}

_NORMS = (
    NormT("{base}encoder.layernorm_embedding", "res"),
    NormT("{base}decoder.layernorm_embedding", "res"),
    NormT(f"{ENC}.self_attn_layer_norm", "res"),
    NormT(f"{ENC}.final_layer_norm", "res"),
    NormT(f"{DEC}.self_attn_layer_norm", "res"),
    NormT(f"{DEC}.encoder_attn_layer_norm", "res"),
    NormT(f"{DEC}.final_layer_norm", "res"),
)


# post-norm: a sublayer's LayerNorm normalizes the stream it writes, so it joins the writers; the
# encoder's sublayers come before the decoder's (cross-attention reads the encoder's last output)
def _attention_sublayer(prefix: str, norm: str) -> SublayerT:
    return SublayerT(tuple(f"{prefix}.{r}_proj" for r in "qkv"), (f"{prefix}.out_proj", norm))


_SUBLAYERS = (
    _attention_sublayer(f"{ENC}.self_attn", f"{ENC}.self_attn_layer_norm"),
    SublayerT((f"{ENC}.fc1",), (f"{ENC}.fc2", f"{ENC}.final_layer_norm")),
    _attention_sublayer(f"{DEC}.self_attn", f"{DEC}.self_attn_layer_norm"),
    _attention_sublayer(f"{DEC}.encoder_attn", f"{DEC}.encoder_attn_layer_norm"),
    SublayerT((f"{DEC}.fc1",), (f"{DEC}.fc2", f"{DEC}.final_layer_norm")),
)


def _dims(c: Any) -> dict[str, int]:
    return {
        "d": c.d_model,
        "enc_layers": c.encoder_layers,
        "dec_layers": c.decoder_layers,
        "enc_heads": c.encoder_attention_heads,
        "dec_heads": c.decoder_attention_heads,
        "enc_head_dim": c.d_model // c.encoder_attention_heads,
        "dec_head_dim": c.d_model // c.decoder_attention_heads,
        "enc_ff": c.encoder_ffn_dim,
        "dec_ff": c.decoder_ffn_dim,
    }


BART = ArchitectureSpec(
    family="bart",
    model_types=("bart",),
    base_prefix="model.",
    dims=_dims,
    loops={"i": "enc_layers", "j": "dec_layers"},
    spaces=_SPACES,
    tensors=_TENSORS,
    norms=_NORMS,
    ties=SHARED_TABLE_TIES,
    invariant=("final_logits_bias", "classification_head.out_proj.bias", "qa_outputs.bias"),
    outputs={"logits": None, "last_hidden_state": "res", "encoder_last_hidden_state": "res"},
    sublayers=_SUBLAYERS,
    embeddings=tuple(
        f"{{base}}{stack}.{part}"
        for stack in ("encoder", "decoder")
        for part in ("embed_tokens", "embed_positions", "layernorm_embedding")
    ),
    last_hidden={"res": "{base}encoder"},
    inputs="seq2seq",
    stacks=("{base}encoder", "{base}decoder"),
)
