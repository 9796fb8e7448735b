"""ModernBERT: a pre-LayerNorm encoder with rotary embeddings, alternating global and
sliding-window attention, a fused ``attn.Wqkv`` (rows q | k | v) and a GeGLU MLP whose ``mlp.Wi``
rows are [input | gate]: ``Wo(act(input) · gate)``, so both halves take the same unit permutation.

The embedding LayerNorm (``embeddings.norm``) normalizes the stream itself, as CLIP's vision
``pre_layrnorm`` does: its output *is* the residual stream, with no linear reader to fold its scale
into, so the residual admits permutations only. Layer 0's ``attn_norm`` is an Identity (no tensors).
Biases are off by default (``attention_bias``, ``mlp_bias``, ``norm_bias``, ``classifier_bias``);
any that a config turns on are bound.

Every task head is ``head.dense`` → activation → ``head.norm``. The masked-LM ``decoder`` reading
it is tied to the token embeddings, so there the head's output space *is* the residual space (as
BERT's ``cls.predictions.transform``); for the classifiers (sequence: the [CLS] token or the mean,
``classifier_pooling``; token; question answering; multiple choice) it is a space of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, GluT, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import AxisRef, Fused

ATTN = "layers.{i}.attn"
MLP = "layers.{i}.mlp"
L = "{base}layers.{i}"
QKV = Fused((f"{ATTN}:q", f"{ATTN}:k", f"{ATTN}:v"))
GLU = Fused((MLP, MLP))  # [input | gate]: one unit space, twice


def _dims(c: Any) -> dict[str, int]:
    return {
        "d": c.hidden_size,
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "head_dim": c.hidden_size // c.num_attention_heads,
        "ff": c.intermediate_size,
    }


def _head(space: str, readers: tuple[str, ...], out: dict[str, tuple[AxisRef, ...]]) -> tuple[dict, NormT]:
    """``head.dense`` writing ``space``, ``head.norm`` on it (folding into ``readers``), and what reads it."""
    tensors = {"head.dense.weight": (space, "res"), "head.dense.bias": (space,), **out}
    return tensors, NormT("head.norm", space, readers)


_MLM = _head("res", (), {"decoder.weight": (None, "res")})
_CLASSIFIER = _head("head", ("classifier.weight",), {"classifier.weight": (None, "head")})


@dataclasses.dataclass(frozen=True)
class ModernBertSpec(ArchitectureSpec):
    """The spec of the encoder, completed per model by its head: the masked-LM head (a ``decoder``
    tied to the token embeddings) writes the residual space, any other head a space of its own."""

    def graph(self, config: Any, keys: Collection[str]) -> SymmetryGraph:
        tensors, norm = _MLM if "decoder.weight" in keys else _CLASSIFIER
        full = dataclasses.replace(self, tensors={**self.tensors, **tensors}, norms=(*self.norms, norm))
        return ArchitectureSpec.graph(full, config, keys)


SPEC = ModernBertSpec(
    family="modernbert",
    model_types=("modernbert",),
    base_prefix="model.",
    dims=_dims,
    loops={"i": "layers"},
    spaces=(
        SpaceT(
            "res", "d", kind="residual", reason="the embedding LayerNorm (embeddings.norm) sits on the residual path"
        ),
        HeadsT(ATTN, rotary=True),
        SpaceT(MLP, "ff", kind="mlp"),
        SpaceT("head", "d", kind="pooler"),
    ),
    tensors={
        "{base}embeddings.tok_embeddings.weight": (None, "res"),
        f"{L}.attn.Wqkv.weight": (QKV, "res"),
        f"{L}.attn.Wqkv.bias": (QKV,),
        f"{L}.attn.Wo.weight": ("res", f"{ATTN}:o"),
        f"{L}.attn.Wo.bias": ("res",),
        f"{L}.mlp.Wi.weight": (GLU, "res"),
        f"{L}.mlp.Wi.bias": (GLU,),
        f"{L}.mlp.Wo.weight": ("res", MLP),
        f"{L}.mlp.Wo.bias": ("res",),
    },
    norms=(
        NormT("{base}embeddings.norm", "res"),
        NormT(f"{L}.attn_norm", "res", (f"{L}.attn.Wqkv.weight",)),
        NormT(f"{L}.mlp_norm", "res", (f"{L}.mlp.Wi.weight",)),
        NormT("{base}final_norm", "res", ("head.dense.weight",), final=True),
    ),
    ties={"decoder.weight": "{base}embeddings.tok_embeddings.weight"},
    invariant=("decoder.bias", "classifier.bias"),
    outputs={"logits": None, "last_hidden_state": "res"},
    sublayers=(
        SublayerT((f"{L}.attn_norm", f"{L}.attn.Wqkv"), (f"{L}.attn.Wo",)),
        SublayerT((f"{L}.mlp_norm", f"{L}.mlp.Wi"), (f"{L}.mlp.Wo",)),
    ),
    embeddings=("{base}embeddings",),
    last_hidden={"res": "{base}final_norm"},
    # Wi rows [input | gate], ``Wo(act(input) * gate)``: the activated "input" is the GLU's gate
    # (occurrence 0), the linear "gate" its up (occurrence 1)
    glus=(GluT(MLP, (f"{L}.mlp.Wi.weight", 0), (f"{L}.mlp.Wi.weight", 1), f"{L}.mlp.Wo.weight"),),
)
