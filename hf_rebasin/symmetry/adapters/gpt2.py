"""GPT-2: pre-LayerNorm decoder. Conv1D stores [in, out]; ``c_attn`` columns are q | k | v."""

from __future__ import annotations

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.spaces import Fused

ATTN = "h.{i}.attn"
MLP = "h.{i}.mlp"

SPEC = ArchitectureSpec(
    family="gpt2",
    model_types=("gpt2",),
    base_prefix="transformer.",
    dims=lambda c: {
        "d": c.n_embd,
        "layers": c.n_layer,
        "heads": c.n_head,
        "head_dim": c.n_embd // c.n_head,
        "ff": c.n_inner or 4 * c.n_embd,
    },
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", "orthogonal", centered=True, kind="residual"),
        HeadsT(ATTN),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        "{base}wte.weight": (None, "res"),
        "{base}wpe.weight": (None, "res"),
        "{base}h.{i}.attn.c_attn.weight": ("res", Fused((f"{ATTN}:q", f"{ATTN}:k", f"{ATTN}:v"))),
        "{base}h.{i}.attn.c_attn.bias": (Fused((f"{ATTN}:q", f"{ATTN}:k", f"{ATTN}:v")),),
        "{base}h.{i}.attn.c_proj.weight": (f"{ATTN}:o", "res"),
        "{base}h.{i}.attn.c_proj.bias": ("res",),
        "{base}h.{i}.mlp.c_fc.weight": ("res", MLP),
        "{base}h.{i}.mlp.c_fc.bias": (MLP,),
        "{base}h.{i}.mlp.c_proj.weight": (MLP, "res"),
        "{base}h.{i}.mlp.c_proj.bias": ("res",),
        "lm_head.weight": (None, "res"),
        "score.weight": (None, "res"),
    },
    norms=(
        NormT("{base}h.{i}.ln_1", "res", ("{base}h.{i}.attn.c_attn.weight",)),
        NormT("{base}h.{i}.ln_2", "res", ("{base}h.{i}.mlp.c_fc.weight",)),
        NormT("{base}ln_f", "res", ("lm_head.weight", "score.weight"), final=True),
    ),
    ties={"lm_head.weight": "{base}wte.weight"},
    sublayers=(
        SublayerT(("{base}h.{i}.ln_1", "{base}h.{i}.attn.c_attn"), ("{base}h.{i}.attn.c_proj",)),
        SublayerT(("{base}h.{i}.ln_2", "{base}h.{i}.mlp.c_fc"), ("{base}h.{i}.mlp.c_proj",)),
    ),
    embeddings=("{base}wte", "{base}wpe"),
    last_hidden={"res": "{base}ln_f"},
    # causal-mask buffers of old checkpoints: never transform them
    invariant=("{base}h.{i}.attn.bias", "{base}h.{i}.attn.masked_bias", "score.bias"),
    outputs={"logits": None, "last_hidden_state": "res"},
)
