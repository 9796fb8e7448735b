"""Gemma (1): Llama-like pre-RMSNorm decoder (rotary embeddings, multi-/grouped-query attention
with an explicit ``head_dim``, GeGLU MLP, LM head tied to the embeddings by default), but its
RMSNorm computes x·(1 + w): every norm has offset 1, so γ = 1 + w and canonical form leaves w = 0.
The embeddings are multiplied by √d (a non-persistent buffer): a scalar, which commutes with every
map of the residual stream."""

from __future__ import annotations

import dataclasses

from .llama import SPEC as LLAMA

# Llama's layout (Gemma has no MLP biases: templates of tensors a model lacks bind nothing), with
# every norm multiplying by 1 + w
SPEC = dataclasses.replace(
    LLAMA,
    family="gemma",
    model_types=("gemma",),
    norms=tuple(dataclasses.replace(norm, offset=1.0) for norm in LLAMA.norms),
)
