"""hf-rebasin: align, merge and transport Hugging Face Transformers across their symmetries.

The package is laid out as the stages of a run (`core`, `symmetry`, `io`, `alignment`, `merging`,
`evaluation`, `lineage`, `recipe`, `run`, `cli`). The names most scripts need are importable from
here (``from hf_rebasin import align, graph_for, Pair``); each is loaded on first use from its stage,
so ``import hf_rebasin`` itself stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "graph_for": "hf_rebasin.symmetry.adapters",
    "SymmetryGraph": "hf_rebasin.symmetry.graph",
    "Transform": "hf_rebasin.symmetry.transforms",
    "canonicalize": "hf_rebasin.symmetry.canonical",
    "per_sublayer": "hf_rebasin.symmetry.sublayers",
    "embed_state": "hf_rebasin.symmetry.embed",
    "check_folder": "hf_rebasin.io.gate",
    "load_model": "hf_rebasin.io.models",
    "align": "hf_rebasin.alignment.strategies",
    "Alignment": "hf_rebasin.alignment.strategies",
    "AlignmentData": "hf_rebasin.alignment.strategies",
    "Pair": "hf_rebasin.alignment.strategies",
    "REGISTRY": "hf_rebasin.alignment.strategies",
    "Strategy": "hf_rebasin.alignment.strategies",
    "MemoryProfile": "hf_rebasin.alignment.strategies",
    "verify_model": "hf_rebasin.alignment.verify",
    "embed_model": "hf_rebasin.alignment.widths",
    "widened_config": "hf_rebasin.alignment.widths",
    "task_vector": "hf_rebasin.merging.transport",
    "add_task_vector": "hf_rebasin.merging.transport",
    "move_finetune": "hf_rebasin.merging.transport",
    "read_adapter": "hf_rebasin.merging.lora",
    "transport_adapter": "hf_rebasin.merging.lora",
    "save_adapter": "hf_rebasin.merging.lora",
    "lora_graph": "hf_rebasin.merging.lora",
    "universe_merge": "hf_rebasin.merging.universe",
    "loss_curve": "hf_rebasin.evaluation.evaluate",
    "barrier": "hf_rebasin.evaluation.evaluate",
    "Findings": "hf_rebasin.evaluation.record",
    "cached_model": "hf_rebasin.evaluation.zoo.train",
    "lineage_of": "hf_rebasin.lineage.pairs",
    "load_recipe": "hf_rebasin.recipe",
    "loads_recipe": "hf_rebasin.recipe",
    "run_recipe": "hf_rebasin.run",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    """Load a public name from its stage on first use (PEP 562): the root imports no stage itself."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_rebasin' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
