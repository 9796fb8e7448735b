"""BERT and RoBERTa (XLM-RoBERTa: RoBERTa's layout): post-LayerNorm encoders. The LayerNorms sit on
the residual path, so the residual stream admits permutations only. The MLM decoder is tied to the
word embeddings and reads ``transform`` (dense → GELU → LayerNorm): that output space *is* the
residual space, so its rows and LayerNorm take the residual permutation and the tie stays exact."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.spaces import AxisRef

ATTN = "layer.{i}.attn"
MLP = "layer.{i}.mlp"
L = "{base}encoder.layer.{i}"
POST_NORM = "post-norm: LayerNorm sits on the residual path"

_SPACES = (
    SpaceT("res", "d", kind="residual", reason=POST_NORM),
    HeadsT(ATTN),
    SpaceT(MLP, "ff", kind="mlp"),
    SpaceT("pooler", "d", kind="pooler"),
    SpaceT("head", "d", kind="pooler"),
)

_ENCODER: dict[str, tuple[AxisRef, ...]] = {
    "{base}embeddings.word_embeddings.weight": (None, "res"),
    "{base}embeddings.position_embeddings.weight": (None, "res"),
    "{base}embeddings.token_type_embeddings.weight": (None, "res"),
    f"{L}.attention.self.query.weight": (f"{ATTN}:q", "res"),
    f"{L}.attention.self.query.bias": (f"{ATTN}:q",),
    f"{L}.attention.self.key.weight": (f"{ATTN}:k", "res"),
    f"{L}.attention.self.key.bias": (f"{ATTN}:k",),
    f"{L}.attention.self.value.weight": (f"{ATTN}:v", "res"),
    f"{L}.attention.self.value.bias": (f"{ATTN}:v",),
    f"{L}.attention.output.dense.weight": ("res", f"{ATTN}:o"),
    f"{L}.attention.output.dense.bias": ("res",),
    f"{L}.intermediate.dense.weight": (MLP, "res"),
    f"{L}.intermediate.dense.bias": (MLP,),
    f"{L}.output.dense.weight": ("res", MLP),
    f"{L}.output.dense.bias": ("res",),
    "{base}pooler.dense.weight": ("pooler", "res"),
    "{base}pooler.dense.bias": ("pooler",),
    "qa_outputs.weight": (None, "res"),
}

_NORMS = (
    NormT("{base}embeddings.LayerNorm", "res"),
    NormT(f"{L}.attention.output.LayerNorm", "res"),
    NormT(f"{L}.output.LayerNorm", "res"),
)


# post-norm: a sublayer's LayerNorm normalizes the stream it writes, so it joins the writers
_SUBLAYERS = (
    SublayerT((f"{L}.attention.self",), (f"{L}.attention.output",)),
    SublayerT((f"{L}.intermediate",), (f"{L}.output",)),
)


def _dims(c: Any) -> dict[str, int]:
    return {
        "d": c.hidden_size,
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "head_dim": c.hidden_size // c.num_attention_heads,
        "ff": c.intermediate_size,
    }


def _bert_classifier(keys: Collection[str]) -> dict[str, tuple[AxisRef, ...]]:
    # Sequence classification reads the pooler; token classification reads the residual stream.
    pooled = any(k.endswith("pooler.dense.weight") for k in keys)
    return {"classifier.weight": (None, "pooler" if pooled else "res")}


def _roberta_classifier(keys: Collection[str]) -> dict[str, tuple[AxisRef, ...]]:
    if "classifier.dense.weight" in keys:  # RobertaClassificationHead: dense → tanh → out_proj
        return {
            "classifier.dense.weight": ("head", "res"),
            "classifier.dense.bias": ("head",),
            "classifier.out_proj.weight": (None, "head"),
        }
    return _bert_classifier(keys)  # multiple choice reads the pooler, token classification the stream


_OUTPUTS = {"logits": None, "last_hidden_state": "res", "pooler_output": "pooler"}

BERT = ArchitectureSpec(
    family="bert",
    model_types=("bert",),
    base_prefix="bert.",
    dims=_dims,
    loops={"i": "layers"},
    spaces=_SPACES,
    tensors={
        **_ENCODER,
        "cls.predictions.transform.dense.weight": ("res", "res"),
        "cls.predictions.transform.dense.bias": ("res",),
        "cls.predictions.decoder.weight": (None, "res"),
        "cls.seq_relationship.weight": (None, "pooler"),
    },
    norms=(*_NORMS, NormT("cls.predictions.transform.LayerNorm", "res")),
    ties={"cls.predictions.decoder.weight": "{base}embeddings.word_embeddings.weight"},
    invariant=(
        "cls.predictions.bias",
        "cls.predictions.decoder.bias",
        "cls.seq_relationship.bias",
        "classifier.bias",
        "qa_outputs.bias",
    ),
    outputs=_OUTPUTS,
    sublayers=_SUBLAYERS,
    embeddings=("{base}embeddings",),
    last_hidden={"res": "{base}encoder"},
    alternatives=_bert_classifier,
)

ROBERTA = ArchitectureSpec(
    family="roberta",
    # XLM-RoBERTa is RoBERTa's module tree and names (prefix `roberta.`), with a larger vocabulary
    model_types=("roberta", "xlm-roberta"),
    base_prefix="roberta.",
    dims=_dims,
    loops={"i": "layers"},
    spaces=_SPACES,
    tensors={
        **_ENCODER,
        "lm_head.dense.weight": ("res", "res"),
        "lm_head.dense.bias": ("res",),
        "lm_head.decoder.weight": (None, "res"),
    },
    norms=(*_NORMS, NormT("lm_head.layer_norm", "res")),
    ties={"lm_head.decoder.weight": "{base}embeddings.word_embeddings.weight"},
    invariant=(
        "lm_head.bias",
        "lm_head.decoder.bias",
        "classifier.bias",
        "classifier.out_proj.bias",
        "qa_outputs.bias",
    ),
    outputs=_OUTPUTS,
    sublayers=_SUBLAYERS,
    embeddings=("{base}embeddings",),
    last_hidden={"res": "{base}encoder"},
    alternatives=_roberta_classifier,
)
