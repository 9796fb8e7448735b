"""CLIP: a text tower and a vision tower joined by two projections.

The text tower is pre-LayerNorm, so its residual admits orthogonal maps after canonical form. The
vision tower's ``pre_layrnorm`` sits on the residual path, so that tower admits permutations only.
The joint embedding space is read only through L2-normalised dot products: both projections may
share any orthogonal map of their rows. ``logit_scale`` is untouched.
"""

from __future__ import annotations

from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT

TA, TM, TL = "text.{t}.attn", "text.{t}.mlp", "text_model.encoder.layers.{t}"
VA, VM, VL = "vision.{v}.attn", "vision.{v}.mlp", "vision_model.encoder.layers.{v}"


def _dims(c: Any) -> dict[str, int]:
    t = getattr(c, "text_config", None) or c
    v = getattr(c, "vision_config", None) or c
    out = {}
    for p, sub in (("t", t), ("v", v)):
        out.update(
            {
                f"{p}_d": sub.hidden_size,
                f"{p}_layers": sub.num_hidden_layers,
                f"{p}_heads": sub.num_attention_heads,
                f"{p}_head_dim": sub.hidden_size // sub.num_attention_heads,
                f"{p}_ff": sub.intermediate_size,
            }
        )
    out["proj"] = getattr(c, "projection_dim", None) or 1
    return out


def tower(a: str, m: str, layer: str, res: str) -> dict:
    """The tensors of one CLIP-style encoder layer (SigLIP's are the same)."""
    return {
        **{f"{layer}.self_attn.{p}_proj.weight": (f"{a}:{p}", res) for p in "qkv"},
        **{f"{layer}.self_attn.{p}_proj.bias": (f"{a}:{p}",) for p in "qkv"},
        f"{layer}.self_attn.out_proj.weight": (res, f"{a}:o"),
        f"{layer}.self_attn.out_proj.bias": (res,),
        f"{layer}.mlp.fc1.weight": (m, res),
        f"{layer}.mlp.fc1.bias": (m,),
        f"{layer}.mlp.fc2.weight": (res, m),
        f"{layer}.mlp.fc2.bias": (res,),
    }


def tower_sublayers(layer: str) -> tuple[SublayerT, ...]:
    return (
        SublayerT(
            (f"{layer}.layer_norm1", *(f"{layer}.self_attn.{p}_proj" for p in "qkv")), (f"{layer}.self_attn.out_proj",)
        ),
        SublayerT((f"{layer}.layer_norm2", f"{layer}.mlp.fc1"), (f"{layer}.mlp.fc2",)),
    )


def tower_norms(layer: str, res: str) -> tuple[NormT, ...]:
    return (
        NormT(f"{layer}.layer_norm1", res, tuple(f"{layer}.self_attn.{p}_proj.weight" for p in "qkv")),
        NormT(f"{layer}.layer_norm2", res, (f"{layer}.mlp.fc1.weight",)),
    )


SPEC = ArchitectureSpec(
    family="clip",
    model_types=("clip",),
    base_prefix="",
    dims=_dims,
    loops={"t": "t_layers", "v": "v_layers"},
    spaces=(
        SpaceT("text.res", "t_d", "orthogonal", centered=True, kind="residual"),
        HeadsT(TA, heads="t_heads", kv_heads="t_heads", head_dim="t_head_dim"),
        SpaceT(TM, "t_ff", kind="mlp"),
        SpaceT("vision.res", "v_d", kind="residual", reason="pre_layrnorm sits on the residual path"),
        HeadsT(VA, heads="v_heads", kv_heads="v_heads", head_dim="v_head_dim"),
        SpaceT(VM, "v_ff", kind="mlp"),
        SpaceT("joint", "proj", "orthogonal", kind="joint"),
    ),
    tensors={
        "text_model.embeddings.token_embedding.weight": (None, "text.res"),
        "text_model.embeddings.position_embedding.weight": (None, "text.res"),
        **tower(TA, TM, TL, "text.res"),
        "text_projection.weight": ("joint", "text.res"),
        "vision_model.embeddings.class_embedding": ("vision.res",),
        "vision_model.embeddings.patch_embedding.weight": ("vision.res", None, None, None),
        "vision_model.embeddings.position_embedding.weight": (None, "vision.res"),
        **tower(VA, VM, VL, "vision.res"),
        "visual_projection.weight": ("joint", "vision.res"),
    },
    norms=(
        *tower_norms(TL, "text.res"),
        NormT("text_model.final_layer_norm", "text.res", ("text_projection.weight",)),
        NormT("vision_model.pre_layrnorm", "vision.res"),
        *tower_norms(VL, "vision.res"),
        NormT("vision_model.post_layernorm", "vision.res", ("visual_projection.weight",)),
    ),
    invariant=("logit_scale",),
    sublayers=(*tower_sublayers(TL), *tower_sublayers(VL)),
    embeddings=("text_model.embeddings", "vision_model.embeddings", "vision_model.pre_layrnorm"),
    # the vision tower normalizes its class token only: its encoder output is the stream at every patch
    last_hidden={"text.res": "text_model.final_layer_norm", "vision.res": "vision_model.encoder"},
    inputs="text-image",
    outputs={"logits_per_image": None, "text_embeds": "joint", "image_embeds": "joint"},
)
