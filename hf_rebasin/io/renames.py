"""Checkpoint tensor names as transformers loads them, read from its own rules without loading a weight.

Transformers 5 renames legacy names while loading, adds or strips the base-model prefix, stacks
the experts of a mixture of experts stored one by one, and drops legacy buffers: the same rules,
applied here to the names alone, let every tensor be checked (`io.checks`), streamed
(`io.models`) and written back as transformers saves it (`io.export`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def expert_pieces(model: PreTrainedModel, keys: Iterable[str]) -> dict[str, tuple[str, int, int, int]]:
    """The checkpoint ``keys`` that hold one expert's part of a 3-D expert tensor of ``model``
    (``save_pretrained`` writes them so, loading stacks them): key -> (model tensor, part, parts,
    expert)."""
    renamer = Renamer(model)
    expected = dict.fromkeys(model.state_dict())
    found = {key: renamer.stacked(key, expected) for key in keys}
    return {key: (p.name, p.part, p.parts, p.expert) for key, p in found.items() if p is not None}


def _stacks_experts(converter: Any) -> bool:
    """Whether a transformers ``WeightConverter`` stacks tensors stored one per expert into one
    3-D tensor, as every MoE of transformers 5 loads: ``MergeModulelist(dim=0)`` over the experts,
    then (with two parts, gate and up) ``Concatenate(dim=1)``; the layouts `StackedKeys` reads."""
    try:
        from transformers.core_model_loading import Concatenate, MergeModulelist
    except ImportError:  # pragma: no cover
        return False
    ops = list(getattr(converter, "operations", []))
    patterns = list(getattr(converter, "source_patterns", []))
    if len(getattr(converter, "target_patterns", [])) != 1 or not patterns or not all("*" in p for p in patterns):
        return False
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return False
    if len(ops) == 1:
        return len(patterns) == 1
    return len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim == 1


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor of an expert stored alone: part ``part`` (of ``parts``) of expert
    ``expert`` of model tensor ``name``; ``span``: where the expert number is in ``key``."""

    name: str
    part: int
    parts: int
    expert: int
    key: str
    pattern: str
    span: tuple[int, int] | None

    def sibling(self, expert: int) -> str:
        """The key expert ``expert``'s same part has (as stored)."""
        if self.span is None:
            return f"{self.pattern.replace('*', str(expert))} (of {self.name})"
        return f"{self.key[: self.span[0]]}{expert}{self.key[self.span[1] :]}"


class Renamer:
    """Checkpoint tensor names as the model names them: transformers 5 renames legacy names while
    loading (ViT `encoder.layer.N.attention.attention.query` -> `layers.N.attention.q_proj`) and adds
    or strips the base-model prefix. The same conversion mapping, applied here to the names alone,
    lets every tensor be compared before a weight is loaded."""

    def __init__(self, skeleton: PreTrainedModel) -> None:
        self.prefix: str | None = getattr(skeleton, "base_model_prefix", None) or None
        self.renamings: list[Any] = []
        self.converters: list[Any] = []
        # source pattern of a converter that stacks experts -> (its part, its number of parts, expert number regex)
        self.stacking: dict[str, tuple[int, int, re.Pattern[str]]] = {}
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming

            for t in get_model_conversion_mapping(skeleton):
                if isinstance(t, WeightConverter):
                    self.converters.append(t)
                    if _stacks_experts(t):
                        for part, pattern in enumerate(t.source_patterns):
                            expert = re.compile(re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)"))
                            self.stacking[pattern] = (part, len(t.source_patterns), expert)
                elif isinstance(t, WeightRenaming):
                    self.renamings.append(t)
        except ImportError:  # pragma: no cover - another transformers layout: names as stored
            pass

    def __call__(self, key: str, expected: dict[str, Any] | None = None) -> str:
        try:
            from transformers.core_model_loading import rename_source_key
        except ImportError:  # pragma: no cover
            return key
        renamed, _ = rename_source_key(key, self.renamings, self.converters, self.prefix, expected)
        return str(renamed)

    def converts(self, keys: Iterable[str]) -> bool:
        """Whether transformers converts (not only renames) any of the checkpoint ``keys`` while
        loading in a way not followed here: DINOv2's converter splits a legacy ``mlp.weights_in``
        into gate and up, but a checkpoint with today's names loads as stored. Experts stored one
        by one, which transformers stacks (`stacked`), are followed."""
        if not self.converters:
            return False
        try:
            from transformers.core_model_loading import rename_source_key
        except ImportError:  # pragma: no cover
            return True
        for k in keys:
            pattern = rename_source_key(k, self.renamings, self.converters, self.prefix)[1]
            if pattern is not None and pattern not in self.stacking:
                return True
        return False

    def stacked(self, key: str, expected: dict[str, Any] | None = None) -> Piece | None:
        """Where checkpoint ``key`` goes when transformers stacks experts stored one by one
        (Mixtral's ``experts.3.w1.weight``, Qwen-MoE's ``experts.3.gate_proj.weight``): the model
        tensor, the part of each expert it is, and the expert; None for any other key."""
        if not self.stacking:
            return None
        from transformers.core_model_loading import apply_renamings, rename_source_key

        name, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, expected)
        if pattern is None or pattern not in self.stacking:
            return None
        part, parts, expert = self.stacking[pattern]
        found = expert.search(apply_renamings(key, self.renamings)) or expert.search(key)
        if found is None:  # pragma: no cover - the converter matched, so its pattern does
            return None
        own = expert.search(key)  # the expert number in the key as stored, to name a sibling key
        span = own.span(1) if own is not None else None
        return Piece(str(name), part, parts, int(found.group(1)), key, pattern, span)


# GPT-2's `attn.masked_bias`: the constant -1e4 that transformers 2.x-4.x GPT-2 classes stored in
# every layer. Transformers 5 still loads such files (its GPT-J and GPT-NeoX classes list the same buffer
# among their keys to ignore); for GPT-2 it only names it in its load report. A constant, never a weight.
_LEGACY_CONSTANTS = (r"(^|\.)attn\.masked_bias$",)


def _adjusted(skeleton: PreTrainedModel, missing: set[str], unexpected: set[str]) -> tuple[set[str], set[str]]:
    """``(missing, unexpected)`` less what stock ``from_pretrained`` forgives: the class's
    ``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected`` (gathered over its
    submodules when it is built) and the legacy buffers its loader forgives."""
    adjust = getattr(skeleton, "_adjust_missing_and_unexpected_keys", None)
    try:
        from transformers.utils.loading_report import LoadStateDictInfo

        info = LoadStateDictInfo(
            missing_keys=set(missing),
            unexpected_keys=set(unexpected),
            mismatched_keys=set(),
            error_msgs=[],
            conversion_errors={},
            skipped_pp_keys=set(),
        )
        adjust(info)  # type: ignore[misc]
        return set(info.missing_keys), set(info.unexpected_keys)
    except (ImportError, TypeError):  # pragma: no cover - another transformers: the class's own lists
        lists = ("_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected")
        kept = []
        for keys, attr in zip((missing, unexpected), lists, strict=True):
            patterns = getattr(skeleton, attr, None) or []
            kept.append({k for k in keys if not any(re.search(p, k) for p in patterns)})
        return kept[0], kept[1]


def dropped_on_load(skeleton: PreTrainedModel, keys: Iterable[str]) -> dict[str, str]:
    """Which of ``keys`` (tensor names the model does not have) stock ``from_pretrained`` drops,
    by transformers' own rules, with the reason: the class's ``_keys_to_ignore_on_load_unexpected``
    (gathered over its submodules when it is built) and the legacy buffers its loader forgives
    (``position_ids``, per-layer ``rotary_emb.inv_freq``: buffers that became non-persistent)."""
    keys = set(keys)
    _, kept = _adjusted(skeleton, set(), keys)
    out = {k: "dropped by transformers when it loads this class (legacy buffer)" for k in sorted(keys - kept)}
    for key in sorted(kept):
        if any(re.search(p, key) for p in _LEGACY_CONSTANTS):
            out[key] = "legacy constant buffer (GPT-2 masked_bias); transformers loads the file and ignores it"
    return out


def initialised_on_load(skeleton: PreTrainedModel, keys: Iterable[str]) -> dict[str, str]:
    """Which of ``keys`` (tensors the model has and the files lack, none made on load) stock
    ``from_pretrained`` initialises with a warning and no harm to the rest, with the reason: a
    pooler (a checkpoint saved without it, as sentence-embedding models often are) or a task head
    outside the base model (a classifier over a bare model's weights). A missing tensor of the body
    is not among them: initialised at random, it would silently change what the model computes."""
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    has_base = bool(prefix) and getattr(skeleton, prefix, None) is not None
    lm_head = _output_embedding_names(skeleton)  # a language model's head is what it computes with
    out = {}
    for key in sorted(set(keys) - lm_head):
        if "pooler" in key.split("."):
            out[key] = "a pooler"
        elif has_base and not key.startswith(f"{prefix}."):
            out[key] = f"the {type(skeleton).__name__} task head"
    return out


def _output_embedding_names(skeleton: PreTrainedModel) -> set[str]:
    """The parameter names of the model's output embeddings (an LM head), if it has any."""
    try:
        head = skeleton.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return set()
    if head is None:
        return set()
    ids = {id(p) for p in head.parameters()}
    return {name for name, p in skeleton.named_parameters(remove_duplicate=False) if id(p) in ids}


def made_on_load(skeleton: PreTrainedModel, keys: Iterable[str]) -> set[str]:
    """Which of ``keys`` (tensors the model has and the files lack) stock ``from_pretrained`` lets be
    missing and makes itself, by the class's ``_keys_to_ignore_on_load_missing``: MarianMTModel's
    sinusoidal position tables (never saved) and its ``final_logits_bias`` (zeros)."""
    keys = set(keys)
    missing, _ = _adjusted(skeleton, keys, set())
    return keys - missing
