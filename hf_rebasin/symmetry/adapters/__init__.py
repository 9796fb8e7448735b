"""Architecture adapters, keyed by ``config.model_type``.

One explicit registry (no registration by import side effect); it refuses duplicate model types.
"""

from __future__ import annotations

from typing import Any

from hf_rebasin.core.errors import UnsupportedArchitectureError
from hf_rebasin.symmetry.adapters import (
    albert,
    apertus,
    arcee,
    bart,
    bert,
    clip,
    cohere,
    deberta_v2,
    dinov2,
    distilbert,
    electra,
    exaone4,
    falcon,
    gemma,
    glm4,
    gpt2,
    gpt_bigcode,
    gpt_neox,
    granite,
    llama,
    modernbert,
    moe,
    mpnet,
    olmo2,
    phi,
    phi3,
    siglip,
    stablelm,
    starcoder2,
    t5,
    vit,
    whisper,
)
from hf_rebasin.symmetry.adapters.base import ArchitectureSpec
from hf_rebasin.symmetry.graph import SymmetryGraph


class AdapterRegistry:
    def __init__(self) -> None:
        self._by_type: dict[str, ArchitectureSpec] = {}

    def register(self, spec: ArchitectureSpec) -> None:
        for model_type in spec.model_types:
            if not model_type or model_type != model_type.strip():
                raise ValueError(f"bad model_type {model_type!r} in adapter {spec.family!r}")
            if model_type in self._by_type:
                raise ValueError(
                    f"model_type {model_type!r} is registered twice "
                    f"({self._by_type[model_type].family!r} and {spec.family!r})"
                )
            self._by_type[model_type] = spec

    @property
    def model_types(self) -> list[str]:
        return sorted(self._by_type)

    def get(self, model_type: str | None) -> ArchitectureSpec:
        spec = self._by_type.get(model_type or "")
        if spec is None:
            raise UnsupportedArchitectureError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(self.model_types)}. "
                "Adding one is a small declarative file in hf_rebasin/symmetry/adapters/: see "
                "docs/contributing.md, 'Adding an architecture', and docs/adapters.md in the repository."
            )
        return spec


REGISTRY = AdapterRegistry()
for _spec in (
    bert.BERT,
    bert.ROBERTA,
    gpt2.SPEC,
    vit.SPEC,
    llama.SPEC,
    clip.SPEC,
    distilbert.SPEC,
    modernbert.SPEC,
    gemma.SPEC,
    dinov2.SPEC,
    llama.QWEN3,
    phi3.SPEC,
    gpt_neox.SPEC,
    siglip.SPEC,
    gemma.GEMMA2,
    gemma.GEMMA3,
    olmo2.SPEC,
    moe.SPEC,
    moe.QWEN2_MOE,
    moe.QWEN3_MOE,
    bart.BART,
    t5.T5,
    t5.MT5,
    whisper.SPEC,
    granite.SPEC,
    starcoder2.SPEC,
    stablelm.SPEC,
    phi.SPEC,
    cohere.SPEC,
    cohere.COHERE2,
    falcon.SPEC,
    bart.MBART,
    bart.MARIAN,
    bart.M2M100,
    electra.SPEC,
    deberta_v2.SPEC,
    albert.SPEC,
    mpnet.SPEC,
    gpt_bigcode.SPEC,
    glm4.SPEC,
    arcee.SPEC,
    exaone4.SPEC,
    apertus.SPEC,
):
    REGISTRY.register(_spec)


def get_adapter(model_type: str | None) -> ArchitectureSpec:
    return REGISTRY.get(model_type)


def graph_for(config: Any, keys: Any) -> SymmetryGraph:
    """The symmetry graph of a model given its config and its state-dict keys."""
    return get_adapter(getattr(config, "model_type", None)).graph(config, keys)


__all__ = ["REGISTRY", "AdapterRegistry", "ArchitectureSpec", "get_adapter", "graph_for"]
