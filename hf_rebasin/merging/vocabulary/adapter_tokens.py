"""A LoRA adapter trained with new tokens, written back as a PEFT adapter for the target.

The adapter is read twice: as the fine-tune it makes of its resized base (`adapter_rows`), which the
transport moves like any full fine-tune, rows matched by token; and here, split in two. Its LoRA
factors (and the tensors outside the vocabulary it stores whole) are an adapter of the base's other
modules, moved factor by factor as any adapter (`lora.transport_adapter`). Its embedding and LM head
are written whole, as PEFT's ``modules_to_save``, holding the output's rows: the target's rows plus
α·π(τ), in the output's vocabulary, exactly what the full model written instead would hold.

Trainable tokens are written back the same way (``modules_to_save``), not as trainable tokens: the
rows a trainable-tokens adapter does not list are left to the target's resizing, which starts new
rows at random (transformers' ``mean_resizing`` samples them), while the output defines every row
(a new token's LM-head row included, where the head is not tied). The whole embedding and head make
the adapter exact at the price of their size.

A tied LM head (GPT-2) is written as two modules, embedding and head, each with its tensor: PEFT
trains and loads a copy of each, so the pair computes what the tied (or parted) full model does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.merging.lora import PREFIX, LoraAdapter, adapter_config, adapter_from, read_tensors
from hf_rebasin.merging.vocabulary.adapter_rows import saved_tensors, state_name, trainable_tokens

if TYPE_CHECKING:
    from torch import nn

    from hf_rebasin.symmetry.graph import SymmetryGraph
    from hf_rebasin.symmetry.transforms import Transform

__all__ = [
    "WHOLE_VOCABULARY",
    "TokensAdapter",
    "added",
    "read_tokens_adapter",
    "vocab_modules",
    "vocab_task_vector",
    "with_config",
    "written_config",
    "written_tensors",
]

# why such an adapter is matched by permutation under a canonical-form strategy (see `lora.canonical_blocker`)
WHOLE_VOCABULARY = "it stores its embedding and LM head whole (modules_to_save)"
_FACTOR = re.compile(r"(.+)\.(?:lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.[^.]+)?")


@dataclass(frozen=True)
class TokensAdapter:
    """An adapter trained with new tokens, split as it is written back (module docstring)."""

    lora: LoraAdapter  # its factors, and the tensors outside the vocabulary it stores whole
    trainable: bool  # it trained token rows (trainable tokens) rather than saving the modules whole
    blocker: str | None = None  # why the output is a full model instead (None: an adapter)


def vocab_modules(model: nn.Module) -> dict[str, list[str]]:
    """The modules written whole for the output's vocabulary: the input embedding and the LM head,
    each with the state-dict names of its own tensors (a head's bias too)."""
    wanted = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]  # type: ignore[operator]
    return {
        name: [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
        for name, module in model.named_modules()
        if any(module is w for w in wanted)
    }


def read_tokens_adapter(
    folder: Path, base: nn.Module, vocabulary: Sequence[str], *, allow_pickle: bool = False, where: str = "finetuned"
) -> TokensAdapter:
    """The adapter in ``folder`` split for writing back: its factors and other whole tensors checked
    against ``base`` (the run's base, whose vocabulary rows may differ from the adapter's), the
    tensors of ``vocabulary`` (state-dict names: embedding, LM head) and trainable tokens set apart."""
    config = adapter_config(folder, where, tokens=True)
    tensors = saved_tensors(read_tensors(folder, allow_pickle, where))
    trained = trainable_tokens(config, tensors)
    vocab = set(vocabulary)
    rest: dict[str, Tensor] = {}
    on_vocab: list[str] = []
    for key, t in tensors.items():
        m = _FACTOR.fullmatch(state_name(key))
        if m is not None and f"{m.group(1)}.weight" in vocab:
            on_vocab.append(m.group(1))
        elif m is not None or not (state_name(key) in vocab or key.endswith("trainable_tokens_delta")):
            rest[key] = t
    lora_config = {k: v for k, v in config.items() if k != "trainable_token_indices"}
    elsewhere = sorted(m for m in trained if f"{m}.weight" not in vocab)
    if on_vocab or elsewhere:
        blocker = (
            f"its LoRA factors adapt {sorted(set(on_vocab))[0]!r}, whose whole tensor the output's vocabulary rows "
            "replace"
            if on_vocab
            else f"its trainable tokens are rows of {elsewhere[0]!r}, neither the embedding nor the LM head"
        )
        return TokensAdapter(LoraAdapter(folder, lora_config, {}), bool(trained), blocker)
    lora = adapter_from(folder, lora_config, rest, base, where) if rest else LoraAdapter(folder, lora_config, {})
    return TokensAdapter(lora, bool(trained))


def written_config(config: Mapping[str, Any], modules: Sequence[str]) -> dict[str, Any]:
    """The adapter's config as written back: ``modules`` (embedding and LM head) in
    ``modules_to_save`` beside the modules it saved whole already, no trainable tokens, and no
    weight tying (each module loads its own tensor: a tied pair holds equal ones)."""
    kept = [
        m
        for m in (config.get("modules_to_save") or [])
        if not any(name == m or name.endswith(f".{m}") for name in modules)
    ]
    return {
        **config,
        "modules_to_save": [*kept, *modules],
        "trainable_token_indices": None,
        "ensure_weight_tying": False,
    }


def vocab_task_vector(
    graph: SymmetryGraph,
    transform: Transform,
    names: Sequence[str],
    states: tuple[Mapping[str, Tensor], Mapping[str, Tensor], Mapping[str, Tensor]],
) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """``(B, π(τ), π(A))`` on ``names`` from ``states`` (B, A, A_ft), as the models store them:
    the whole tensors an adapter writes load onto B as stored, whatever form the alignment worked in
    (a canonical form folds norm scales into the LM head). Each name has its own τ (a head the
    fine-tune stores apart from its embedding keeps its own)."""
    target, base, finetuned = states
    cache: dict[str, Any] = {}

    def moved(name: str, t: Tensor) -> Tensor:
        source = graph.ties.get(name, name)
        t = t.to(torch.float32)
        return graph.map_tensor(source, t, transform, cache=cache) if source in graph.bindings else t

    moved_base = {n: moved(n, base[n]) for n in names}
    tau = {n: moved(n, finetuned[n]) - moved_base[n] for n in names}
    return {n: target[n] for n in names}, tau, moved_base


def added(target: Mapping[str, Tensor], tau: Mapping[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """``target + α·τ`` name by name, in the target's dtypes (names tied in ``target`` each get their own τ)."""
    return {n: (t.to(torch.float32) + alpha * tau[n].to(torch.float32)).to(t.dtype) for n, t in target.items()}


def written_tensors(rows: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The output's vocabulary tensors (state-dict names) under the keys PEFT saves a
    module_to_save's tensors with: ``base_model.model.<module>.<tensor>``; a tied pair as two
    tensors (safetensors stores no shared storage, and PEFT loads each module its own)."""
    return {PREFIX + name: t.clone() for name, t in rows.items()}


def with_config(adapter: LoraAdapter, config: Mapping[str, Any]) -> LoraAdapter:
    """``adapter`` to be written with ``config``."""
    return dataclasses.replace(adapter, config=dict(config))
