"""DistilBERT: a post-LayerNorm encoder like BERT, with its own names
(``distilbert.transformer.layer.N.attention.{q,k,v,out}_lin``, ``ffn.lin1/lin2``).

``sa_layer_norm`` and ``output_layer_norm`` normalize the stream itself (``LN(x + sublayer(x))``),
so the residual stream admits permutations only. No token types. The MLM head is
``vocab_transform`` → activation → ``vocab_layer_norm`` → ``vocab_projector``, and the projector is
tied to the word embeddings: as with BERT's ``cls.predictions.transform``, the transform's output
space *is* the residual space, so its rows and LayerNorm take the residual permutation and the tie
stays exact. Sequence classification (and multiple choice) read ``pre_classifier`` → ReLU →
``classifier`` on the first token: ``pre_classifier``'s output is a plain space of its own.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.spaces import AxisRef

ATTN = "layer.{i}.attn"
MLP = "layer.{i}.mlp"
L = "{base}transformer.layer.{i}"
POST_NORM = "post-norm: sa_layer_norm and output_layer_norm sit on the residual path"


def _dims(c: Any) -> dict[str, int]:
    return {
        "d": c.dim,
        "layers": c.n_layers,
        "heads": c.n_heads,
        "head_dim": c.dim // c.n_heads,
        "ff": c.hidden_dim,
    }


def _classifier(keys: Collection[str]) -> dict[str, tuple[AxisRef, ...]]:
    # sequence classification / multiple choice read pre_classifier; token classification the stream
    return {"classifier.weight": (None, "pooler" if "pre_classifier.weight" in keys else "res")}


SPEC = ArchitectureSpec(
    family="distilbert",
    model_types=("distilbert",),
    base_prefix="distilbert.",
    dims=_dims,
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", kind="residual", reason=POST_NORM),
        HeadsT(ATTN),
        SpaceT(MLP, "ff", kind="mlp"),
        SpaceT("pooler", "d", kind="pooler"),
    ),
    tensors={
        "{base}embeddings.word_embeddings.weight": (None, "res"),
        "{base}embeddings.position_embeddings.weight": (None, "res"),
        **{f"{L}.attention.{p}_lin.weight": (f"{ATTN}:{p}", "res") for p in "qkv"},
        **{f"{L}.attention.{p}_lin.bias": (f"{ATTN}:{p}",) for p in "qkv"},
        f"{L}.attention.out_lin.weight": ("res", f"{ATTN}:o"),
        f"{L}.attention.out_lin.bias": ("res",),
        f"{L}.ffn.lin1.weight": (MLP, "res"),
        f"{L}.ffn.lin1.bias": (MLP,),
        f"{L}.ffn.lin2.weight": ("res", MLP),
        f"{L}.ffn.lin2.bias": ("res",),
        "vocab_transform.weight": ("res", "res"),
        "vocab_transform.bias": ("res",),
        "vocab_projector.weight": (None, "res"),
        "pre_classifier.weight": ("pooler", "res"),
        "pre_classifier.bias": ("pooler",),
        "qa_outputs.weight": (None, "res"),
    },
    norms=(
        NormT("{base}embeddings.LayerNorm", "res"),
        NormT(f"{L}.sa_layer_norm", "res"),
        NormT(f"{L}.output_layer_norm", "res"),
        NormT("vocab_layer_norm", "res"),
    ),
    ties={"vocab_projector.weight": "{base}embeddings.word_embeddings.weight"},
    invariant=("vocab_projector.bias", "classifier.bias", "qa_outputs.bias"),
    outputs={"logits": None, "last_hidden_state": "res"},
    # post-norm: a sublayer's LayerNorm normalizes the stream it writes, so it joins the writers
    sublayers=(
        SublayerT(tuple(f"{L}.attention.{p}_lin" for p in "qkv"), (f"{L}.attention.out_lin", f"{L}.sa_layer_norm")),
        SublayerT((f"{L}.ffn.lin1",), (f"{L}.ffn.lin2", f"{L}.output_layer_norm")),
    ),
    embeddings=("{base}embeddings",),
    last_hidden={"res": "{base}transformer"},
    alternatives=_classifier,
)
