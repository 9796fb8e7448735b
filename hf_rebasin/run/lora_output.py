"""How job: transport writes a fine-tune given as a PEFT LoRA adapter: back as an adapter for the
target, its factors moved by π (`merging.lora`).

An adapter trained with new tokens (embedding and LM head in ``modules_to_save``, or trainable
tokens) is moved as the fine-tune it makes of its resized base, rows matched by token, and written
back as an adapter too: its factors moved as any adapter's, its embedding and LM head whole with
the rows the full model would have (`merging.vocabulary.adapter_tokens`). Where that cannot be
exact (its base embedded into a wider target, LoRA factors on the embedding or head), the output
is a full model and the run says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from hf_rebasin.alignment.strategies import Alignment, get_strategy
from hf_rebasin.core.roles import TransportRoles
from hf_rebasin.evaluation.scores import AdapterSummary
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.merging.lora import (
    LoraAdapter,
    adapter_config,
    canonical_blocker,
    is_adapter,
    lora_graph,
    save_adapter,
)
from hf_rebasin.merging.lora import transport_adapter as move_factors
from hf_rebasin.merging.vocabulary.adapter_rows import tokens_note
from hf_rebasin.merging.vocabulary.adapter_tokens import (
    WHOLE_VOCABULARY,
    TokensAdapter,
    added,
    read_tokens_adapter,
    vocab_modules,
    vocab_task_vector,
    with_config,
    written_config,
    written_tensors,
)
from hf_rebasin.merging.vocabulary.layout import embedding_rows_of, vocab_tensors
from hf_rebasin.run.load import Workspace, weights
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.sublayers import is_per_sublayer, per_sublayer

__all__ = ["AdapterInput", "MovedAdapter", "adapter_graph", "adapter_input", "move_adapter", "save_moved_adapter"]


@dataclass(frozen=True)
class AdapterInput:
    """The adapter the output is written as: the fine-tune's own, or one trained with new tokens, split."""

    lora: LoraAdapter  # the factors (and whole tensors) moved by π
    tokens: TokensAdapter | None = None  # set for an adapter trained with new tokens


@dataclass(frozen=True)
class MovedAdapter:
    """A LoRA fine-tune's factors in B's basis, and what the record says of them."""

    written: LoraAdapter  # the adapter as written (its config: modules_to_save for new tokens)
    factors: dict[str, Tensor]
    whole: dict[str, str]  # file key → B's tensor it scales from (see lora.save_adapter)
    target: Mapping[str, Tensor]  # B's weights
    summary: AdapterSummary
    # new tokens: B's embedding and LM head tensors and π(τ) on them, as B stores them, rows settled
    vocab: tuple[Mapping[str, Tensor], Mapping[str, Tensor]] | None = None


def adapter_input(ws: Workspace, models: TransportRoles[LoadedModel]) -> AdapterInput | None:
    """The adapter the output is (None: a full model). An adapter trained with new tokens is one
    where it can be written back exactly; otherwise the run notes why the output is a full model."""
    if ws.adapter is not None:
        return AdapterInput(ws.adapter)
    inputs = ws.inputs
    assert isinstance(inputs, TransportRoles)  # the recipe's job
    folder = inputs.finetune.path
    if not is_adapter(folder) or (folder / "config.json").is_file():
        return None  # a full fine-tune
    if models.base.embedded:  # a narrower base: loading merged the adapter (and noted it)
        if _with_tokens(ws, models, folder):
            why = "its base is embedded into the target's wider shape, where its factors do not apply"
            ws.notes.append(tokens_note(folder, f"the output is a full model: {why}"))
        return None
    vocab = list(vocab_tensors(models.base.model))
    found = read_tokens_adapter(
        folder, models.base.model, vocab, allow_pickle=ws.recipe.allow_pickle, where="finetuned.model"
    )
    if found.blocker is not None:
        ws.notes.append(tokens_note(folder, f"the output is a full model: {found.blocker}"))
        return None
    rows = len(ws.rows.output.rows) if ws.rows is not None else embedding_rows_of(models.target.model)
    ws.notes.append(
        tokens_note(
            folder,
            "the output is a LoRA adapter for the target: its factors moved as any adapter's, its embedding and LM "
            f"head written whole (modules_to_save) with the output's {rows} rows"
            + (
                " (its trainable tokens are written back as modules_to_save, every row given)"
                if found.trainable
                else ""
            )
            + f". To load it, resize the target's embeddings to {rows} rows (`model.resize_token_embeddings({rows})`"
            ", with the output's tokenizer) before `PeftModel.from_pretrained`",
        )
    )
    return AdapterInput(found.lora, found)


def _with_tokens(ws: Workspace, models: TransportRoles[LoadedModel], folder: Path) -> bool:
    """Whether the adapter in ``folder`` was trained with new tokens (trainable tokens, or more
    embedding rows than its base: loading merged it into its base resized), not a plain adapter."""
    if adapter_config(folder, "finetuned.model", tokens=True).get("trainable_token_indices"):
        return True
    if ws.rows is not None:  # each model's rows as loaded, before they were matched by token
        return ws.rows.vocabularies[2].rows != ws.rows.vocabularies[1].rows
    return embedding_rows_of(models.finetune.model) != embedding_rows_of(models.base.model)


def adapter_graph(ws: Workspace, models: TransportRoles[LoadedModel], adapter: AdapterInput | None) -> SymmetryGraph:
    """B's graph; for an adapter that cannot follow the canonical form, limited to permutations."""
    graph = models.target.graph
    if adapter is None:
        return graph
    canonical = get_strategy(ws.recipe.strategy.name).canonical
    # a strategy that works in canonical form (generalized-orthogonal): an adapter follows it when
    # its factors can take the norm scales (see lora.transport_adapter); otherwise permutations only
    if not canonical:
        blocker: str | None = "permutation strategy"
    elif adapter.tokens is not None:  # whole rows of B as stored: no canonical form to write them in
        blocker = WHOLE_VOCABULARY
    else:
        blocker = canonical_blocker(adapter.lora, graph, weights(models.base))
    if blocker is None:
        return graph
    limited, demoted = lora_graph(graph)  # graph.fallbacks names the spaces limited to permutations
    if demoted and canonical:
        advice = (
            "; it is matched by permutation, which keeps less of the task than rotations: for those, merge it into its "
            "base (`merge_and_unload()`, saved with its tokenizer) and transport the full model"
            if blocker == WHOLE_VOCABULARY
            else ""
        )
        ws.notes.append(f"the adapter cannot follow the canonical form: {blocker}{advice}")
    return limited


def move_adapter(
    ws: Workspace,
    models: TransportRoles[LoadedModel],
    alignment: Alignment,
    graph: SymmetryGraph,
    adapter: AdapterInput | None,
) -> MovedAdapter | None:
    """The adapter's factors moved by π (None for a full model), before anything is written."""
    if adapter is None:
        return None
    sd_a, sd_b = weights(models.base), weights(models.target)
    canonical = alignment.graph if alignment.canonical and graph is models.target.graph else None
    if is_per_sublayer(alignment.graph):  # the adapter's factors follow their own sublayers' maps
        graph = per_sublayer(graph)
    factors, whole = move_factors(adapter.lora, graph, alignment.transform, sd_a, sd_b, canonical_graph=canonical)
    written, vocab, extra = adapter.lora, None, dict[str, Any]()
    if adapter.tokens is not None:
        modules = vocab_modules(models.target.model)
        written = with_config(adapter.lora, written_config(adapter.lora.config, list(modules)))
        names = [name for tensors in modules.values() for name in tensors]
        states = (sd_b, sd_a, weights(models.finetune))
        target, tau, moved_base = vocab_task_vector(graph, alignment.transform, names, states)
        vocab = ws.rows.fill_transport(target, tau, moved_base) if ws.rows is not None else (target, tau)
        rows = len(ws.rows.output.rows) if ws.rows is not None else embedding_rows_of(models.target.model)
        extra = {"modules_to_save": list(modules), "embedding_rows": rows, "trainable_tokens": adapter.tokens.trainable}
    summary = AdapterSummary(
        **adapter.lora.summary(),
        canonical=canonical is not None,  # factors took the norm scales (generalized-orthogonal)
        whole_biases=sorted(whole.values()),  # biases that carry a folded β's shift, stored whole
        **extra,
    )
    return MovedAdapter(written, factors, whole, sd_b, summary, vocab)


def save_moved_adapter(ws: Workspace, adapter: MovedAdapter, alpha: float, base_model: str, folder: Path) -> None:
    """The moved adapter for ``alpha`` (its B factors and whole tensors scaled), for ``base_model``;
    with new tokens, the embedding and LM head beside the factors, holding the rows the full model
    would: B + α·π(τ), in the output's vocabulary."""
    tensors = dict(adapter.factors)
    if adapter.vocab is not None:
        rows = added(*adapter.vocab, alpha)
        tensors.update(written_tensors(ws.rows.output_state(rows) if ws.rows is not None else rows))
    save_adapter(
        adapter.written,
        tensors,
        folder,
        base_model=base_model,
        alpha=alpha,
        target=adapter.target,
        whole=adapter.whole,
        dtype=ws.output_dtype.dtype,
    )
