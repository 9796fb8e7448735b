"""GLM-4 (GLM-4-9B-0414, GLM-Z1): Llama's pre-RMSNorm layer plus a norm after each sublayer, with
Phi-3's fused ``gate_up_proj`` (rows gate | up) and q/k/v biases (``attention_bias``, on by default).

Each layer computes ``h + post_self_attn_layernorm(attn(input_layernorm(h)))``, then
``h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))``: the post-sublayer norms write
γ ⊙ x / rms(x) into the stream, so their γ cannot be folded and no rotation of the stream is exact;
a signed permutation is (Gemma 2's sandwich, with plain RMSNorms). The rotary embedding rotates
interleaved feature pairs (2j, 2j + 1) of the first ``partial_rotary_factor`` (0.5 by default) of
each head: neither Llama's (j, j + d/2) planes nor a free map across the rotating and the passing
features keeps the scores, so Q/K inner maps are fixed; V/O stay free."""

from __future__ import annotations

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, GluT, HeadsT, NormT, SpaceT, SublayerT
from hf_rebasin.symmetry.adapters.gemma import SANDWICH
from hf_rebasin.symmetry.adapters.starcoder2 import rotary_dims
from hf_rebasin.symmetry.spaces import Fused

ATTN = "layers.{i}.attn"
MLP = "layers.{i}.mlp"
L = "{base}layers.{i}"
QKV = tuple(f"{L}.self_attn.{p}_proj" for p in "qkv")
GATE_UP, DOWN = f"{L}.mlp.gate_up_proj", f"{L}.mlp.down_proj"
INTERLEAVED = "rotary embeddings rotate interleaved feature pairs (2j, 2j + 1) of part of each head"

SPEC = ArchitectureSpec(
    family="glm4",
    model_types=("glm4",),
    base_prefix="model.",
    dims=rotary_dims,
    loops={"i": "layers"},
    spaces=(
        SpaceT("res", "d", "signed-permutation", kind="residual", reason=SANDWICH),
        HeadsT(ATTN, kv_heads="kv_heads", rotary=True, qk="fixed", reason=INTERLEAVED, rotary_dim="rotary_dim"),
        SpaceT(MLP, "ff", kind="mlp"),
    ),
    tensors={
        "{base}embed_tokens.weight": (None, "res"),
        **{f"{L}.self_attn.{p}_proj.weight": (f"{ATTN}:{p}", "res") for p in "qkv"},
        **{f"{L}.self_attn.{p}_proj.bias": (f"{ATTN}:{p}",) for p in "qkv"},
        f"{L}.self_attn.o_proj.weight": ("res", f"{ATTN}:o"),
        f"{GATE_UP}.weight": (Fused((MLP, MLP)), "res"),
        f"{DOWN}.weight": ("res", MLP),
        "lm_head.weight": (None, "res"),
        "score.weight": (None, "res"),
    },
    norms=(
        NormT(f"{L}.input_layernorm", "res", tuple(f"{q}.weight" for q in QKV), bias=False),
        NormT(f"{L}.post_self_attn_layernorm", "res", bias=False),
        NormT(f"{L}.post_attention_layernorm", "res", (f"{GATE_UP}.weight",), bias=False),
        NormT(f"{L}.post_mlp_layernorm", "res", bias=False),
        NormT("{base}norm", "res", ("lm_head.weight", "score.weight"), bias=False, final=True),
    ),
    ties={"lm_head.weight": "{base}embed_tokens.weight"},
    invariant=("score.bias",),
    sublayers=(
        SublayerT((f"{L}.input_layernorm", *QKV), (f"{L}.self_attn.o_proj", f"{L}.post_self_attn_layernorm")),
        SublayerT((f"{L}.post_attention_layernorm", GATE_UP), (DOWN, f"{L}.post_mlp_layernorm")),
    ),
    embeddings=("{base}embed_tokens",),
    last_hidden={"res": "{base}norm"},
    norm_type="rmsnorm",
    outputs={"logits": None, "last_hidden_state": "res"},
    # gate_up_proj rows: gate | up (transformers: ``up * act(gate)``)
    glus=(GluT(MLP, (f"{GATE_UP}.weight", 0), (f"{GATE_UP}.weight", 1), f"{DOWN}.weight"),),
)
