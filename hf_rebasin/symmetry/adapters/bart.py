"""BART and its relatives (mBART, Marian, M2M100/NLLB): encoder-decoders of one layout whose stacks
differ in where the LayerNorms sit and in what writes the positions.

BART is post-LayerNorm. One embedding table (``shared``) feeds both stacks and the LM head, so the
encoder's and the decoder's residual streams meet at it: one stream map serves both, and
cross-attention's keys and values (which read the encoder's output) and its queries (which read the
decoder's stream) all read it. The LayerNorms sit on the residual path (after each sublayer, and on
the embeddings), so the stream admits permutations only; heads and hidden units are free in every
layer of both stacks, cross-attention's heads included.

mBART is pre-LayerNorm with a final ``layer_norm`` per stack, but keeps ``layernorm_embedding`` on the
residual path: its stream admits permutations only too. Marian (post-LN) and M2M100 (pre-LN, no
``layernorm_embedding``) add fixed sinusoidal positions to the stream, a table regenerated on load
(Marian's ``embed_positions.weight`` is never saved; M2M100's is a buffer): a map of the stream would
have to move that table too, and the moved copy is lost on reload. Their stream is pinned; heads and
hidden units still move."""

from __future__ import annotations

from typing import Any

from hf_rebasin.symmetry.adapters.base import SHARED_TABLE_TIES, ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.spaces import AxisRef

POST_NORM = "post-norm: LayerNorm sits on the residual path"
PINNED = "sinusoidal positions are regenerated on load"
ENC = "{base}encoder.layers.{i}"
DEC = "{base}decoder.layers.{j}"
ENC_SELF, ENC_MLP = "enc.{i}.self", "enc.{i}.mlp"
DEC_SELF, DEC_CROSS, DEC_MLP = "dec.{j}.self", "dec.{j}.cross", "dec.{j}.mlp"

_SPACES = (
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


def _tensors(positions: bool) -> dict[str, tuple[AxisRef, ...]]:
    """The tensor table every relative shares; ``positions``: learned position tables on the stream
    (BART, mBART), not a sinusoidal table the model regenerates (Marian, M2M100)."""
    learned: dict[str, tuple[AxisRef, ...]] = {
        f"{{base}}{stack}.embed_positions.weight": (None, "res") for stack in ("encoder", "decoder")
    }
    return {
        "{base}shared.weight": (None, "res"),
        "{base}encoder.embed_tokens.weight": (None, "res"),
        "{base}decoder.embed_tokens.weight": (None, "res"),
        "lm_head.weight": (None, "res"),
        **(learned if positions else {}),
        **_attention(f"{ENC}.self_attn", ENC_SELF),
        **_mlp(ENC, ENC_MLP),
        **_attention(f"{DEC}.self_attn", DEC_SELF),
        **_attention(f"{DEC}.encoder_attn", DEC_CROSS),
        **_mlp(DEC, DEC_MLP),
        "qa_outputs.weight": (None, "res"),
        # the classification head (dense → tanh → out_proj) reads the decoder's last state at the
        # end-of-sentence token: the stream
        "classification_head.dense.weight": ("head", "res"),
        "classification_head.dense.bias": ("head",),
        "classification_head.out_proj.weight": (None, "head"),
    }


_LAYER_NORMS = (f"{ENC}.self_attn", f"{ENC}.final", f"{DEC}.self_attn", f"{DEC}.encoder_attn", f"{DEC}.final")


def _post_norms(embedding: bool) -> tuple[NormT, ...]:
    """Post-LN: every norm sits on the residual path, read by no linear map."""
    first = tuple(NormT(f"{{base}}{st}.layernorm_embedding", "res") for st in ("encoder", "decoder"))
    return (*(first if embedding else ()), *(NormT(f"{prefix}_layer_norm", "res") for prefix in _LAYER_NORMS))


def _qkv(prefix: str, roles: str = "qkv") -> tuple[str, ...]:
    return tuple(f"{prefix}.{r}_proj.weight" for r in roles)


def _pre_norms(embedding: bool) -> tuple[NormT, ...]:
    """Pre-LN: each sublayer's norm is read by its input projections; the encoder's final norm by
    every decoder layer's cross-attention keys and values, the decoder's by the heads."""
    first = tuple(NormT(f"{{base}}{st}.layernorm_embedding", "res") for st in ("encoder", "decoder"))
    return (
        *(first if embedding else ()),
        NormT(f"{ENC}.self_attn_layer_norm", "res", _qkv(f"{ENC}.self_attn")),
        NormT(f"{ENC}.final_layer_norm", "res", (f"{ENC}.fc1.weight",)),
        NormT(f"{DEC}.self_attn_layer_norm", "res", _qkv(f"{DEC}.self_attn")),
        NormT(f"{DEC}.encoder_attn_layer_norm", "res", _qkv(f"{DEC}.encoder_attn", "q")),
        NormT(f"{DEC}.final_layer_norm", "res", (f"{DEC}.fc1.weight",)),
        NormT("{base}encoder.layer_norm", "res", _qkv(f"{DEC}.encoder_attn", "kv")),
        NormT(
            "{base}decoder.layer_norm",
            "res",
            ("lm_head.weight", "qa_outputs.weight", "classification_head.dense.weight"),
            final=True,
        ),
    )


def _sublayers(pre_norm: bool) -> tuple[SublayerT, ...]:
    """Forward order within a layer; the encoder's sublayers come before the decoder's (cross-attention
    reads the encoder's last output). Post-norm: a sublayer's LayerNorm normalizes the stream it
    writes, so it joins the writers; pre-norm: it joins the readers."""

    def sub(reads: tuple[str, ...], write: str, norm: str) -> SublayerT:
        return SublayerT((norm, *reads), (write,)) if pre_norm else SublayerT(reads, (write, norm))

    def attention(prefix: str) -> SublayerT:
        return sub(tuple(f"{prefix}.{r}_proj" for r in "qkv"), f"{prefix}.out_proj", f"{prefix}_layer_norm")

    return (
        attention(f"{ENC}.self_attn"),
        sub((f"{ENC}.fc1",), f"{ENC}.fc2", f"{ENC}.final_layer_norm"),
        attention(f"{DEC}.self_attn"),
        attention(f"{DEC}.encoder_attn"),
        sub((f"{DEC}.fc1",), f"{DEC}.fc2", f"{DEC}.final_layer_norm"),
    )


def bart_dims(c: Any) -> dict[str, int]:
    """Sizes of a BART-layout config (its relatives and Whisper read theirs the same way)."""
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


def _marian_ties(config: Any) -> dict[str, Any]:
    """``share_encoder_decoder_embeddings: false`` gives each stack its own table (the decoder's of
    ``decoder_vocab_size`` rows) and ties the LM head to the decoder's: there is no ``shared``."""
    if getattr(config, "share_encoder_decoder_embeddings", True):
        return {}
    return {"ties": {"lm_head.weight": "{base}decoder.embed_tokens.weight"}}


def _family(
    family: str,
    res: SpaceT,
    *,
    pre_norm: bool = False,
    embedding_norm: bool = True,
    positions: bool = True,
    **kw: Any,
) -> ArchitectureSpec:
    """One relative's spec from the shared tables: ``pre_norm`` (norms read by the sublayers, a final
    norm per stack), ``embedding_norm`` (``layernorm_embedding`` on the path), ``positions`` (learned
    position tables bound to the stream)."""
    parts = (
        ("embed_tokens", "embed_positions", "layernorm_embedding")
        if embedding_norm
        else ("embed_tokens", "embed_positions")
    )
    return ArchitectureSpec(
        family=family,
        model_types=(family,),
        base_prefix="model.",
        dims=bart_dims,
        loops={"i": "enc_layers", "j": "dec_layers"},
        spaces=(res, *_SPACES),
        tensors=_tensors(positions),
        norms=_pre_norms(embedding_norm) if pre_norm else _post_norms(embedding_norm),
        ties=SHARED_TABLE_TIES,
        invariant=(
            "final_logits_bias",
            "classification_head.out_proj.bias",
            "qa_outputs.bias",
            *kw.pop("invariant", ()),
        ),
        outputs={"logits": None, "last_hidden_state": "res", "encoder_last_hidden_state": "res"},
        sublayers=_sublayers(pre_norm),
        embeddings=tuple(f"{{base}}{stack}.{part}" for stack in ("encoder", "decoder") for part in parts),
        last_hidden={"res": "{base}encoder"},
        inputs="seq2seq",
        stacks=("{base}encoder", "{base}decoder"),
        **kw,
    )


BART = _family("bart", SpaceT("res", "d", kind="residual", reason=POST_NORM))
MBART = _family(
    "mbart",
    SpaceT("res", "d", kind="residual", reason="layernorm_embedding sits on the residual path"),
    pre_norm=True,
)
MARIAN = _family(
    "marian",
    SpaceT("res", "d", kind="residual", reason=PINNED, pinned=True),
    embedding_norm=False,
    positions=False,
    invariant=tuple(f"{{base}}{stack}.embed_positions.weight" for stack in ("encoder", "decoder")),
    configured=_marian_ties,
)
M2M100 = _family(
    "m2m_100",
    SpaceT("res", "d", kind="residual", reason=PINNED, pinned=True),
    pre_norm=True,
    embedding_norm=False,
    positions=False,
)
