"""EXAONE 4.0 (``exaone4``): OLMo 2's layer (norms after each sublayer only: the projections read
the raw stream, ``post_attention_layernorm`` and ``post_feedforward_layernorm`` write γ ⊙ x / rms(x)
into it, so the stream admits signed permutations, no rotation) with Qwen3's attention: ``q_norm`` /
``k_norm`` are RMSNorms over each head's features with one γ shared by every head, so a head
permutation leaves them be but no Q/K inner map commutes with γ (Q/K fixed, V/O free). Sliding-window
layers use rotary embeddings and global ones none; the q/k norms fix Q/K in both. SwiGLU MLP.

EXAONE 3.x (``exaone``) is not this class: transformers loads it as Llama from its repository's
tensor names, and it is not covered."""

from __future__ import annotations

import dataclasses

from hf_rebasin.symmetry.adapters.llama import QWEN3
from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA
from hf_rebasin.symmetry.adapters.olmo2 import SPEC as OLMO2

SPEC = dataclasses.replace(
    OLMO2,
    family="exaone4",
    model_types=("exaone4",),
    # OLMo 2's signed stream, Qwen3's heads (q/k norms over head_dim, shared by the heads)
    spaces=(OLMO2.spaces[0], *QWEN3.spaces[1:]),
    tensors=LLAMA.tensors,
    role_norms=(),
    invariant=QWEN3.invariant,
)
