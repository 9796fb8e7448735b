"""SigLIP (``SiglipModel``): a text tower and a vision tower whose attention-pooling head writes the
space the text head writes into.

Both towers are pre-LayerNorm encoders without CLIP's ``pre_layrnorm``. The text tower's residual
admits orthogonal maps fixing 1 after canonical form (γ/β of every LayerNorm folded into its
readers, writers centered); its ``head`` reads ``final_layer_norm`` at the last token.

The vision tower ends in ``post_layernorm`` and the attention-pooling head
(``vision_model.head``): a ``torch.nn.MultiheadAttention`` whose fused ``in_proj_weight`` rows are
q | k | v of one head space, then ``layernorm`` → ``mlp`` with a residual around the mlp. Its
query is the learned ``probe``, fed through the same in_proj columns as the normalized patches, so
the probe lives in the vision residual basis. Two limits follow from canonical form as
`hf_rebasin.canonical` defines it, so both spaces below are permutation-only:

* ``vision.res``: folding ``post_layernorm``'s γ/β into ``in_proj`` also scales the probe's path
  (the probe would have to become (probe − β)/γ), and centering the stream's writers would center
  the probe, which reaches ``in_proj`` without a LayerNorm.
* ``joint``: the pooled stream (out_proj rows, ``head.mlp.fc2`` rows) and the text head's rows
  share one space, because the logits are dot products of the two L2-normalised embeddings.
  ``head.layernorm`` reads it, so a rotation must fix 1; but the pooled stream *is* the image
  embedding, read raw, so canonical form may not center its writers, and a centered space's
  canonical form always does.

``logit_scale`` and ``logit_bias`` carry no hidden axis. Nested ``last_hidden_state`` /
``pooler_output`` of the towers are not compared: canonical form changes the text tower's
(γ of ``final_layer_norm`` moves into ``head``), as CLIP's.
"""

from __future__ import annotations

from typing import Any

from ..symmetry import Fused
from .base import ArchitectureSpec, HeadsT, NormT, SpaceT
from .clip import tower, tower_norms, tower_sublayers

TA, TM, TL = "text.{t}.attn", "text.{t}.mlp", "text_model.encoder.layers.{t}"
VA, VM, VL = "vision.{v}.attn", "vision.{v}.mlp", "vision_model.encoder.layers.{v}"
PA, PM, HEAD = "vision.pool.attn", "vision.pool.mlp", "vision_model.head"
IN_PROJ = Fused((f"{PA}:q", f"{PA}:k", f"{PA}:v"))  # nn.MultiheadAttention in_proj rows: q | k | v


def _dims(c: Any) -> dict[str, int]:
    t, v = c.text_config, c.vision_config
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
    # the text head writes the pooled vision stream: SiglipModel needs projection_size == vision width
    out["joint"] = getattr(t, "projection_size", None) or v.hidden_size
    return out


SPEC = ArchitectureSpec(
    family="siglip",
    model_types=("siglip",),
    base_prefix="",
    dims=_dims,
    loops={"t": "t_layers", "v": "v_layers"},
    spaces=(
        SpaceT("text.res", "t_d", "orthogonal", centered=True, kind="residual"),
        HeadsT(TA, heads="t_heads", kv_heads="t_heads", head_dim="t_head_dim"),
        SpaceT(TM, "t_ff", kind="mlp"),
        SpaceT(
            "vision.res",
            "v_d",
            kind="residual",
            reason="the pooling probe reaches in_proj without post_layernorm, so its γ/β cannot be folded",
        ),
        HeadsT(VA, heads="v_heads", kv_heads="v_heads", head_dim="v_head_dim"),
        SpaceT(VM, "v_ff", kind="mlp"),
        HeadsT(PA, heads="v_heads", kv_heads="v_heads", head_dim="v_head_dim"),
        SpaceT(PM, "v_ff", kind="mlp"),
        SpaceT(
            "joint",
            "joint",
            kind="joint",
            reason="head.layernorm reads the pooled stream, which is the image embedding itself: not centerable",
        ),
    ),
    tensors={
        "text_model.embeddings.token_embedding.weight": (None, "text.res"),
        "text_model.embeddings.position_embedding.weight": (None, "text.res"),
        **tower(TA, TM, TL, "text.res"),
        "text_model.head.weight": ("joint", "text.res"),
        "text_model.head.bias": ("joint",),
        "vision_model.embeddings.patch_embedding.weight": ("vision.res", None, None, None),
        "vision_model.embeddings.patch_embedding.bias": ("vision.res",),
        "vision_model.embeddings.position_embedding.weight": (None, "vision.res"),
        **tower(VA, VM, VL, "vision.res"),
        f"{HEAD}.probe": (None, None, "vision.res"),  # [1, 1, d]: the query, read by in_proj's q rows
        f"{HEAD}.attention.in_proj_weight": (IN_PROJ, "vision.res"),
        f"{HEAD}.attention.in_proj_bias": (IN_PROJ,),
        f"{HEAD}.attention.out_proj.weight": ("joint", f"{PA}:o"),
        f"{HEAD}.attention.out_proj.bias": ("joint",),
        f"{HEAD}.mlp.fc1.weight": (PM, "joint"),
        f"{HEAD}.mlp.fc1.bias": (PM,),
        f"{HEAD}.mlp.fc2.weight": ("joint", PM),
        f"{HEAD}.mlp.fc2.bias": ("joint",),
    },
    norms=(
        *tower_norms(TL, "text.res"),
        NormT("text_model.final_layer_norm", "text.res", ("text_model.head.weight",)),
        *tower_norms(VL, "vision.res"),
        # its output is read by in_proj's k and v rows; the q rows read the probe instead
        NormT("vision_model.post_layernorm", "vision.res", (f"{HEAD}.attention.in_proj_weight",)),
        NormT(f"{HEAD}.layernorm", "joint", (f"{HEAD}.mlp.fc1.weight",)),
    ),
    invariant=("logit_scale", "logit_bias"),
    sublayers=(*tower_sublayers(TL), *tower_sublayers(VL)),
    embeddings=("text_model.embeddings", "vision_model.embeddings"),
    last_hidden={"text.res": "text_model.final_layer_norm", "vision.res": "vision_model.post_layernorm"},
    inputs="text-image",
    outputs={"logits_per_image": None, "text_embeds": "joint", "image_embeds": "joint"},
)
