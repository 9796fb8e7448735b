"""MPNet: BERT's post-LayerNorm encoder with a relative position bias shared by all layers.

The LayerNorms sit on the residual path, so the stream admits permutations only. The encoder holds
one ``relative_attention_bias`` ([buckets, heads]) and adds it to every layer's scores, as T5's
block 0 does: the self-attention heads of all layers share one order, so there is one head space
(``attn``) for the whole depth and the bias columns follow it (role ``h``). Its Q/K inner maps are
free (no rotary embedding; the 1/√head_dim scale is a scalar). The MLM head (dense → GELU →
``layer_norm`` → ``decoder``, tied to the word embeddings) reads and writes the stream itself, as
RoBERTa's does; positions come from the ids (padding index 1), as in RoBERTa, and there is no
token-type table. sentence-transformers' all-mpnet-base-v2 is a bare ``MPNetModel``."""

from __future__ import annotations

from collections.abc import Collection

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.adapters.bert import POST_NORM
from hf_rebasin.symmetry.adapters.bert import _dims as _bert_dims
from hf_rebasin.symmetry.spaces import AxisRef

ATTN = "attn"  # one head order for every layer: the position bias is shared
MLP = "layer.{i}.mlp"
L = "{base}encoder.layer.{i}"
A = f"{L}.attention.attn"

_TENSORS: dict[str, tuple[AxisRef, ...]] = {
    "{base}embeddings.word_embeddings.weight": (None, "res"),
    "{base}embeddings.position_embeddings.weight": (None, "res"),
    "{base}encoder.relative_attention_bias.weight": (None, f"{ATTN}:h"),
    f"{A}.q.weight": (f"{ATTN}:q", "res"),
    f"{A}.q.bias": (f"{ATTN}:q",),
    f"{A}.k.weight": (f"{ATTN}:k", "res"),
    f"{A}.k.bias": (f"{ATTN}:k",),
    f"{A}.v.weight": (f"{ATTN}:v", "res"),
    f"{A}.v.bias": (f"{ATTN}:v",),
    f"{A}.o.weight": ("res", f"{ATTN}:o"),
    f"{A}.o.bias": ("res",),
    f"{L}.intermediate.dense.weight": (MLP, "res"),
    f"{L}.intermediate.dense.bias": (MLP,),
    f"{L}.output.dense.weight": ("res", MLP),
    f"{L}.output.dense.bias": ("res",),
    "{base}pooler.dense.weight": ("pooler", "res"),
    "{base}pooler.dense.bias": ("pooler",),
    "lm_head.dense.weight": ("res", "res"),
    "lm_head.dense.bias": ("res",),
    "lm_head.decoder.weight": (None, "res"),
    "qa_outputs.weight": (None, "res"),
}


def _classifier(keys: Collection[str]) -> dict[str, tuple[AxisRef, ...]]:
    """MPNetClassificationHead (dense → tanh → out_proj on the first token's state); else one
    linear layer, on the pooler (multiple choice) or on the stream (token classification)."""
    if "classifier.dense.weight" in keys:
        return {
            "classifier.dense.weight": ("head", "res"),
            "classifier.dense.bias": ("head",),
            "classifier.out_proj.weight": (None, "head"),
        }
    pooled = any(k.endswith("pooler.dense.weight") for k in keys)
    return {"classifier.weight": (None, "pooler" if pooled else "res")}


# post-norm: a sublayer's LayerNorm normalizes the stream it writes, so it joins the writers
_SUBLAYERS = (
    SublayerT((A + ".q", A + ".k", A + ".v"), (A + ".o", f"{L}.attention.LayerNorm")),
    SublayerT((f"{L}.intermediate",), (f"{L}.output",)),
)

SPEC = ArchitectureSpec(
    family="mpnet",
    model_types=("mpnet",),
    base_prefix="mpnet.",
    dims=_bert_dims,
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", kind="residual", reason=POST_NORM),
        HeadsT(ATTN),
        SpaceT(MLP, "ff", kind="mlp"),
        SpaceT("pooler", "d", kind="pooler"),
        SpaceT("head", "d", kind="pooler"),
    ),
    tensors=_TENSORS,
    norms=(
        NormT("{base}embeddings.LayerNorm", "res"),
        NormT(f"{L}.attention.LayerNorm", "res"),
        NormT(f"{L}.output.LayerNorm", "res"),
        NormT("lm_head.layer_norm", "res"),
    ),
    ties={"lm_head.decoder.weight": "{base}embeddings.word_embeddings.weight"},
    invariant=(
        "lm_head.bias",
        "lm_head.decoder.bias",
        "classifier.bias",
        "classifier.out_proj.bias",
        "qa_outputs.bias",
    ),
    # question answering's logits are start_logits / end_logits
    outputs={
        "logits": None,
        "start_logits": None,
        "end_logits": None,
        "last_hidden_state": "res",
        "pooler_output": "pooler",
    },
    sublayers=_SUBLAYERS,
    embeddings=("{base}embeddings",),
    last_hidden={"res": "{base}encoder"},
    alternatives=_classifier,
    fixed_widths={
        # the post-norm stream cannot grow either, so more heads would also mean a smaller head_dim
        "num_attention_heads": "the encoder's relative position bias holds one column per head, shared by all layers",
    },
)
