"""Granite (IBM Granite 3): Llama's layout (pre-RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP, optional biases) with four scalars from the config. ``embedding_multiplier`` scales the
embeddings, ``residual_multiplier`` every sublayer's output before it joins the stream,
``attention_multiplier`` replaces 1/√head_dim on the scores and ``logits_scaling`` divides the
logits. Each is one number, the same for every feature: it commutes with every map of the stream,
the heads and the MLP units, so Granite keeps Llama's classes (orthogonal stream, rotary planes for
Q/K, free V/O). A head_dim that grows is refused for every rotary family, so the fixed
``attention_multiplier`` never meets a wider head."""

from __future__ import annotations

import dataclasses

from hf_rebasin.symmetry.adapters.llama import SPEC as LLAMA

SPEC = dataclasses.replace(LLAMA, family="granite", model_types=("granite",))
