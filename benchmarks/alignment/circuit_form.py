"""GPT-2 models merged in *circuit form*, the form Theus et al.'s reference code interpolates.

The reference code (`github:antoniohonsell/Generalized-LMC-for-Transformers`, ``merger.py``)
rewrites each head as its QK circuit (W_Qᵀ W_K on ``[x; 1]``) and its OV circuit (W_O W_V), and
folds each norm's scale into the layer after it. Its merged model interpolates those products:
per head, the attention scores are ``λ·s_A + (1−λ)·s_B`` under one softmax, the values
``λ·OV_A + (1−λ)·OV_B``. Such a head has rank up to twice the parents' head_dim, so it is not a
GPT-2 of the parents' shape: the reference's merged model keeps heads of width d + 1 and RMS
norms. A merge that users push as a GPT-2 interpolates the factors (W_Q, W_K, W_V, W_O) instead.

This module computes the loss of a circuit-form merge of any GPT-2 state dicts (standard, or
canonical as hf-rebasin's strategies leave them), so that one set of maps can be scored in both
forms. Each model's norm scale and shift are folded into the matrices that read the norm, per model,
and every product is interpolated: attention circuits, the MLP's first layer, the output head.
``tests/symmetry/test_circuit_form.py`` checks it against the stock ``GPT2LMHeadModel``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Shape:
    """What the forward pass needs of a GPT-2 config."""

    layers: int
    heads: int
    eps: float

    @classmethod
    def of(cls, config: object) -> Shape:
        return cls(int(config.n_layer), int(config.n_head), float(config.layer_norm_epsilon))  # type: ignore[attr-defined]


def _norm(x: Tensor, eps: float) -> Tensor:
    """LayerNorm without its affine part (each model's scale and shift are folded downstream)."""
    return F.layer_norm(x, x.shape[-1:], eps=eps)


def _folded(sd: Mapping[str, Tensor], norm: str, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``norm``'s scale and shift folded into the Conv1D-style ``weight`` [d, n] that reads it."""
    g, b = sd[f"{norm}.weight"], sd[f"{norm}.bias"]
    out_bias = b @ weight + (bias if bias is not None else 0.0)
    return g[:, None] * weight, out_bias


def _attention(h: Tensor, parts: Sequence[tuple[float, Mapping[str, Tensor]]], i: int, shape: Shape) -> Tensor:
    """The circuit-form attention sublayer: scores and OV outputs interpolated, one softmax."""
    n, t, d = h.shape
    nh = shape.heads
    hd = d // nh
    scores = torch.zeros(n, nh, t, t, dtype=h.dtype)
    values = []
    out_bias = torch.zeros(d, dtype=h.dtype)
    for w, sd in parts:
        p = f"transformer.h.{i}"
        wq, bq = _folded(sd, f"{p}.ln_1", sd[f"{p}.attn.c_attn.weight"], sd[f"{p}.attn.c_attn.bias"])
        qkv = (h @ wq + bq).view(n, t, 3, nh, hd).permute(2, 0, 3, 1, 4)  # [3, n, heads, t, hd]
        scores = scores + w * (qkv[0] @ qkv[1].transpose(-1, -2)) / math.sqrt(hd)
        values.append((w, qkv[2], sd[f"{p}.attn.c_proj.weight"].view(nh, hd, d)))
        out_bias = out_bias + w * sd[f"{p}.attn.c_proj.bias"]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = out_bias.expand(n, t, d).clone()
    for w, v, o in values:  # per head: pattern · v · W_O, summed over heads
        out = out + w * torch.einsum("nhts,nhsk,hkd->ntd", pattern, v, o)
    return out


def _mlp(h: Tensor, parts: Sequence[tuple[float, Mapping[str, Tensor]]], i: int) -> Tensor:
    p = f"transformer.h.{i}"
    folded = [(w, _folded(sd, f"{p}.ln_2", sd[f"{p}.mlp.c_fc.weight"], sd[f"{p}.mlp.c_fc.bias"])) for w, sd in parts]
    up = sum(w * f[0] for w, f in folded)
    up_bias = sum(w * f[1] for w, f in folded)
    down = sum(w * sd[f"{p}.mlp.c_proj.weight"] for w, sd in parts)
    down_bias = sum(w * sd[f"{p}.mlp.c_proj.bias"] for w, sd in parts)
    return F.gelu(h @ up + up_bias, approximate="tanh") @ down + down_bias


def _head(sd: Mapping[str, Tensor]) -> Tensor:
    return sd["lm_head.weight"] if "lm_head.weight" in sd else sd["transformer.wte.weight"]


@torch.no_grad()
def logits(parts: Sequence[tuple[float, Mapping[str, Tensor]]], ids: Tensor, shape: Shape) -> Tensor:
    """Logits of ``Σ wᵢ·θᵢ`` merged in circuit form (``parts``: (weight, float state dict))."""
    t = ids.shape[1]
    x = sum(w * (sd["transformer.wte.weight"][ids] + sd["transformer.wpe.weight"][:t]) for w, sd in parts)
    assert isinstance(x, Tensor)
    for i in range(shape.layers):
        x = x + _attention(_norm(x, shape.eps), parts, i, shape)
        x = x + _mlp(_norm(x, shape.eps), parts, i)
    h = _norm(x, shape.eps)
    heads = [(w, _folded(sd, "transformer.ln_f", _head(sd).t(), None)) for w, sd in parts]
    return h @ sum(w * f[0] for w, f in heads) + sum(w * f[1] for w, f in heads)


def loss(parts: Sequence[tuple[float, Mapping[str, Tensor]]], blocks: Sequence[Tensor], shape: Shape) -> float:
    """Mean next-token loss of the circuit-form merge over token ``blocks`` ([n, t] each)."""
    total, count = 0.0, 0
    for ids in blocks:
        out = logits(parts, ids, shape)
        scored = F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total, count = total + float(scored), count + ids[:, 1:].numel()
    return total / count


def curve(
    sd_a: Mapping[str, Tensor], sd_b: Mapping[str, Tensor], blocks: Sequence[Tensor], shape: Shape, points: int = 11
) -> tuple[list[float], list[float]]:
    """(λ, loss) of the circuit-form path ``λ·A + (1−λ)·B``, λ = A's weight from 0 to 1."""
    a = {k: v.float() for k, v in sd_a.items() if v.is_floating_point()}
    b = {k: v.float() for k, v in sd_b.items() if v.is_floating_point()}
    lams = [k / (points - 1) for k in range(points)]
    return lams, [loss([(lam, a), (1.0 - lam, b)], blocks, shape) for lam in lams]
