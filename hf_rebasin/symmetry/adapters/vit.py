"""ViT (transformers 5 names: ``vit.layers.N.attention.q_proj``, ``mlp.fc1``): pre-LayerNorm
encoder on patches. ``cls_token`` [1,1,d] and ``position_embeddings`` [1,N+1,d] live on the last
axis, the patch conv [d,C,p,p] on axis 0."""

from __future__ import annotations

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT

ATTN = "layers.{i}.attn"
MLP = "layers.{i}.mlp"
L = "{base}layers.{i}"

SPEC = ArchitectureSpec(
    family="vit",
    model_types=("vit",),
    base_prefix="vit.",
    dims=lambda c: {
        "d": c.hidden_size,
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,  # ViTAttention reads it
        "ff": c.intermediate_size,
        "pooler": getattr(c, "pooler_output_size", None) or c.hidden_size,
    },
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", "orthogonal", centered=True, kind="residual"),
        HeadsT(ATTN),
        SpaceT(MLP, "ff", kind="mlp"),
        SpaceT("pooler", "pooler", kind="pooler"),
    ),
    tensors={
        "{base}embeddings.cls_token": (None, None, "res"),
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
        "{base}pooler.dense.weight": ("pooler", "res"),
        "{base}pooler.dense.bias": ("pooler",),
        "classifier.weight": (None, "res"),
    },
    norms=(
        NormT(f"{L}.layernorm_before", "res", tuple(f"{L}.attention.{p}_proj.weight" for p in "qkv")),
        NormT(f"{L}.layernorm_after", "res", (f"{L}.mlp.fc1.weight",)),
        NormT("{base}layernorm", "res", ("classifier.weight", "{base}pooler.dense.weight"), final=True),
    ),
    invariant=("classifier.bias",),
    sublayers=(
        SublayerT((f"{L}.layernorm_before", *(f"{L}.attention.{p}_proj" for p in "qkv")), (f"{L}.attention.o_proj",)),
        SublayerT((f"{L}.layernorm_after", f"{L}.mlp.fc1"), (f"{L}.mlp.fc2",)),
    ),
    embeddings=("{base}embeddings",),
    last_hidden={"res": "{base}layernorm"},
    inputs="image",
    outputs={"logits": None, "last_hidden_state": "res", "pooler_output": "pooler"},
)
