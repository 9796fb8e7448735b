"""SigLIP (``SiglipModel``, ``SiglipForImageClassification``; model type ``siglip``): a text tower
and a vision tower whose attention-pooling head writes the space the text head writes into, or the
vision tower alone under a linear classifier.

Both towers are pre-LayerNorm encoders without CLIP's ``pre_layrnorm``, so after canonical form (γ/β
of every LayerNorm folded into its readers, writers centered) each residual stream admits
orthogonal maps fixing 1. The text tower's ``head`` reads ``final_layer_norm`` at the last token.

The vision tower ends in ``post_layernorm`` and the attention-pooling head (``vision_model.head``):
a ``torch.nn.MultiheadAttention`` whose fused ``in_proj_weight`` rows are q | k | v of one head
space, then ``layernorm`` → ``mlp`` with a residual around the mlp. Who reads and writes what:

* ``vision.res``: written by the patch and position embeddings and every layer's ``out_proj`` and
  ``fc2``; read through ``layer_norm1``/``layer_norm2`` and, at the end, ``post_layernorm``, whose
  output only the k and v rows of ``in_proj`` read (and the classifier, below). The q rows read the
  learned ``probe`` instead, through the same ``in_proj`` columns: the probe lives in the vision
  basis but bypasses the norm (a `BypassedNorm`). Folding γ/β into ``in_proj`` rewrites it as
  (probe − β)/γ, and it is never centered (it writes nothing to the stream); any orthogonal map
  keeps ``W_q·probe``.
* ``joint``: the pooling head's own stream, written by ``attention.out_proj`` and ``mlp.fc2``, read
  by ``head.layernorm`` (→ ``mlp.fc1``), so its rotations fix 1; its value at the probe *is* the
  image embedding (``pooler_output``), and the text ``head``'s rows write the same space, because
  the logits are dot products of the two L2-normalised embeddings. That reader sees the stream raw,
  so canonical form leaves its writers uncentered (a `RawStream`): maps fixing 1 commute with
  LayerNorm whatever the mean, so nothing needs the centering.

``SiglipForImageClassification`` (transformers 5: the vision tower's names as in ``SiglipModel``,
``vision_model.*``, and ``classifier.*``; no text weights) has logits = ``classifier``(mean over all
tokens of ``post_layernorm``'s output): the classifier is one more reader of that norm, which
canonical form folds γ/β into like any other (the mean over tokens is linear), so the vision
residual stays orthogonal fixing 1. Where ``vision_use_head`` is true the pooling head is still in
the checkpoint and the forward pass, but its output (``pooler_output``) never reaches the logits: it
is described as in ``SiglipModel`` (the probe, ``in_proj`` and the joint stream move with the
vision stream), so the tower's ``pooler_output`` is kept up to the joint map. Its inputs are pixels
only (`verify.outputs_of` gives a model only the inputs of its ``input_modalities``).

``logit_scale``, ``logit_bias`` and ``classifier.bias`` carry no hidden axis. Nested
``last_hidden_state`` / ``pooler_output`` of the towers are not compared: canonical form changes the
text tower's (γ of ``final_layer_norm`` moves into ``head``), as CLIP's. The bare towers are model
types of their own (``siglip_vision_model``, ``siglip_text_model``) and, like CLIP's
(``clip_vision_model``, ``clip_text_model``), are not registered: their configs are one tower's
(no ``text_config`` / ``vision_config`` to size this spec by), and their outputs are hidden states in
the stream's basis (``post_layernorm``'s or ``final_layer_norm``'s output), which no residual map
other than the identity leaves as they are. Compared through the map, as for a bare
``Dinov2Model``, that norm's output is itself an output, so its γ cannot be folded away and the
stream would admit permutations only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from hf_rebasin.symmetry.adapters.base import ArchitectureSpec, HeadsT, NormT, SpaceT
from hf_rebasin.symmetry.adapters.clip import tower, tower_norms, tower_sublayers
from hf_rebasin.symmetry.canonical import BypassedNorm, RawStream
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import Fused, Space

TA, TM, TL = "text.{t}.attn", "text.{t}.mlp", "text_model.encoder.layers.{t}"
VA, VM, VL = "vision.{v}.attn", "vision.{v}.mlp", "vision_model.encoder.layers.{v}"
PA, PM, HEAD = "vision.pool.attn", "vision.pool.mlp", "vision_model.head"
PROBE, POST = f"{HEAD}.probe", "vision_model.post_layernorm"
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
    # the pooling head's stream, as wide as the vision tower; the text head writes it too (SiglipModel
    # needs projection_size == vision width; SiglipForImageClassification has no text weights)
    out["joint"] = v.hidden_size
    return out


@dataclasses.dataclass(frozen=True)
class SiglipSpec(ArchitectureSpec):
    """The spec's graph, with what a template cannot say: the probe bypasses ``post_layernorm``
    (its readers read it in the norm's place), and the joint space is read raw (its writers keep
    their mean)."""

    def graph(self, config: Any, keys: Collection[str]) -> SymmetryGraph:
        graph = ArchitectureSpec.graph(self, config, keys)
        if PROBE in graph.bindings:
            graph.norms = [
                BypassedNorm(n.weight, n.bias, n.space, n.readers, n.offset, bypass=(PROBE,))
                if n.weight == f"{POST}.weight"
                else n
                for n in graph.norms
            ]
        joint = graph.spaces.get("joint")
        if isinstance(joint, Space):
            graph.spaces["joint"] = RawStream(**{f.name: getattr(joint, f.name) for f in dataclasses.fields(joint)})
        return graph


SPEC = SiglipSpec(
    family="siglip",
    model_types=("siglip",),
    base_prefix="",
    dims=_dims,
    loops={"t": "t_layers", "v": "v_layers"},
    spaces=(
        SpaceT("text.res", "t_d", "orthogonal", centered=True, kind="residual"),
        HeadsT(TA, heads="t_heads", kv_heads="t_heads", head_dim="t_head_dim"),
        SpaceT(TM, "t_ff", kind="mlp"),
        SpaceT("vision.res", "v_d", "orthogonal", centered=True, kind="residual"),
        HeadsT(VA, heads="v_heads", kv_heads="v_heads", head_dim="v_head_dim"),
        SpaceT(VM, "v_ff", kind="mlp"),
        HeadsT(PA, heads="v_heads", kv_heads="v_heads", head_dim="v_head_dim"),
        SpaceT(PM, "v_ff", kind="mlp"),
        SpaceT("joint", "joint", "orthogonal", centered=True, kind="joint"),
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
        PROBE: (None, None, "vision.res"),  # [1, 1, d]: the query, read by in_proj's q rows (a bypass)
        f"{HEAD}.attention.in_proj_weight": (IN_PROJ, "vision.res"),
        f"{HEAD}.attention.in_proj_bias": (IN_PROJ,),
        f"{HEAD}.attention.out_proj.weight": ("joint", f"{PA}:o"),
        f"{HEAD}.attention.out_proj.bias": ("joint",),
        f"{HEAD}.mlp.fc1.weight": (PM, "joint"),
        f"{HEAD}.mlp.fc1.bias": (PM,),
        f"{HEAD}.mlp.fc2.weight": ("joint", PM),
        f"{HEAD}.mlp.fc2.bias": ("joint",),
        "classifier.weight": (None, "vision.res"),  # SiglipForImageClassification: the mean of post_layernorm's output
    },
    norms=(
        *tower_norms(TL, "text.res"),
        NormT("text_model.final_layer_norm", "text.res", ("text_model.head.weight",)),
        *tower_norms(VL, "vision.res"),
        # its output is read by in_proj's k and v rows (the q rows read the probe in its place) and,
        # averaged over the tokens, by an image classifier
        NormT(POST, "vision.res", (f"{HEAD}.attention.in_proj_weight", "classifier.weight")),
        NormT(f"{HEAD}.layernorm", "joint", (f"{HEAD}.mlp.fc1.weight",)),
    ),
    invariant=("logit_scale", "logit_bias", "classifier.bias"),
    sublayers=(*tower_sublayers(TL), *tower_sublayers(VL)),
    embeddings=("text_model.embeddings", "vision_model.embeddings"),
    last_hidden={"text.res": "text_model.final_layer_norm", "vision.res": POST},
    inputs="text-image",
    outputs={"logits_per_image": None, "text_embeds": "joint", "image_embeds": "joint", "logits": None},
)
