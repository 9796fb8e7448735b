"""DINOv2 (``Dinov2Model``, ``Dinov2ForImageClassification``): a pre-LayerNorm ViT whose sublayers
end in a LayerScale, ``layer_scale{1,2}.lambda1``: a per-feature diagonal on what the attention
output projection (MLP ``fc2``, or SwiGLU ``down_proj``) writes to the residual stream. It permutes
with the stream; canonical form folds it into that writer's weight rows and bias (λ = 1) before any
rotation. The embeddings (``cls_token`` [1,1,d], ``mask_token`` [1,d], ``position_embeddings``
[1,N+1,d], bicubically interpolated over positions only) live on the last axis, the patch conv
[d,C,p,p] on axis 0. The classifier reads [CLS, mean of patch tokens] (2·d inputs): its input axis
is two copies of the stream."""

from __future__ import annotations

from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, ScaleT, SpaceT, SublayerT
from hf_rebasin.symmetry.spaces import Fused

ATTN = "layers.{i}.attn"
MLP = "layers.{i}.mlp"
L = "{base}encoder.layer.{i}"


def _ff(c: Any) -> int:
    hidden = int(c.hidden_size * c.mlp_ratio)
    if getattr(c, "use_swiglu_ffn", False):  # two thirds, rounded up to a multiple of 8
        return (int(hidden * 2 / 3) + 7) // 8 * 8
    return hidden


SPEC = ArchitectureSpec(
    family="dinov2",
    model_types=("dinov2",),
    base_prefix="dinov2.",
    dims=lambda c: {
        "d": c.hidden_size,
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "ff": _ff(c),
    },
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", "orthogonal", centered=True, kind="residual"),
        HeadsT(ATTN),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        "{base}embeddings.cls_token": (None, None, "res"),
        "{base}embeddings.mask_token": (None, "res"),
        "{base}embeddings.position_embeddings": (None, None, "res"),
        "{base}embeddings.patch_embeddings.projection.weight": ("res", None, None, None),
        "{base}embeddings.patch_embeddings.projection.bias": ("res",),
        **{f"{L}.attention.{p}_proj.weight": (f"{ATTN}:{p}", "res") for p in "qkv"},
        **{f"{L}.attention.{p}_proj.bias": (f"{ATTN}:{p}",) for p in "qkv"},
        f"{L}.attention.o_proj.weight": ("res", f"{ATTN}:o"),
        f"{L}.attention.o_proj.bias": ("res",),
        f"{L}.mlp.fc1.weight": (MLP, "res"),
        f"{L}.mlp.fc1.bias": (MLP,),
        f"{L}.mlp.fc2.weight": ("res", MLP),
        f"{L}.mlp.fc2.bias": ("res",),
        **{f"{L}.mlp.{p}_proj.weight": (MLP, "res") for p in ("gate", "up")},
        **{f"{L}.mlp.{p}_proj.bias": (MLP,) for p in ("gate", "up")},
        f"{L}.mlp.down_proj.weight": ("res", MLP),
        f"{L}.mlp.down_proj.bias": ("res",),
        "classifier.weight": (None, Fused(("res", "res"))),  # [CLS, mean of patches]
    },
    norms=(
        NormT(f"{L}.norm1", "res", tuple(f"{L}.attention.{p}_proj.weight" for p in "qkv")),
        NormT(f"{L}.norm2", "res", (f"{L}.mlp.fc1.weight", f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight")),
        NormT("{base}layernorm", "res", ("classifier.weight",), final=True),
    ),
    scales=(
        ScaleT(f"{L}.layer_scale1.lambda1", "res", (f"{L}.attention.o_proj.weight", f"{L}.attention.o_proj.bias")),
        ScaleT(
            f"{L}.layer_scale2.lambda1",
            "res",
            tuple(f"{L}.mlp.{p}.{w}" for p in ("fc2", "down_proj") for w in ("weight", "bias")),
        ),
    ),
    invariant=("classifier.bias",),
    sublayers=(
        SublayerT(
            (f"{L}.norm1", *(f"{L}.attention.{p}_proj" for p in "qkv")),
            (f"{L}.attention.o_proj", f"{L}.layer_scale1"),
        ),
        SublayerT(
            (f"{L}.norm2", f"{L}.mlp.fc1", f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj"),
            (f"{L}.mlp.fc2", f"{L}.mlp.down_proj", f"{L}.layer_scale2"),
        ),
    ),
    embeddings=("{base}embeddings",),
    last_hidden={"res": "{base}layernorm"},
    inputs="image",
    outputs={"logits": None, "last_hidden_state": "res", "pooler_output": "res"},
)
