"""job: transport: align the old base A to the target B, move the task vector τ = A_ft − A into
B's basis and save B + α·π(τ); for a LoRA fine-tune, the adapter with its factors moved.

In the alignment the target B is the reference (`Pair`'s first model): A is brought into B's basis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ...export import copy_support_files, save_merged_model
from ...lora import canonical_blocker, lora_graph, save_adapter, transport_adapter
from ...models import LoadedModel
from ...record import Findings
from ...strategies import Alignment, Pair, align
from ...sublayers import is_per_sublayer, per_sublayer
from ...symmetry import SymmetryGraph
from ...transport import add_task_vector, move_finetune
from ..data import BatchSpec, batches
from ..load import Workspace, weights
from ..result import JobOutput
from ..roles import TransportRoles
from ..stages import check_inputs, job_result, preservation, timed_align, writing
from .barrier import save_diagnostics

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["run"]


@dataclass
class Moved:
    """A task vector in the target's basis and what it takes to build ``B + α·τ`` as a model."""

    target: Mapping[str, Tensor]  # B's state dict, in the alignment's form
    tau: Mapping[str, Tensor]  # π(τ) on the tensors base and fine-tune share
    carried: Mapping[str, Tensor]  # tensors only the fine-tune has, moved whole
    names: Sequence[str]  # the output model's tensors, in order (the fine-tune's when its head is new)
    template: PreTrainedModel  # the class and config to build
    untie: bool

    def theta(self, alpha: float) -> Mapping[str, Tensor]:
        """The weights of ``B + α·τ`` (with the fine-tune's own tensors when its head is new)."""
        body = add_task_vector(self.target, self.tau, alpha)
        if not self.carried:
            return body
        return {n: self.carried[n] if n in self.carried else body[n] for n in self.names}


def run(ws: Workspace) -> JobOutput:
    """B + α·π(τ) for each α of the recipe; the first α is saved."""
    models = ws.models
    assert isinstance(models, TransportRoles)  # the recipe's job
    graph = _graph(ws, models)
    alignment = _align_base_to_target(ws, models, graph)
    with ws.clock.stage("align"):
        moved = move_task_vector(models, alignment, graph)
    _note_carried(ws, models, moved)
    naive = _naive(ws, models)
    inputs = check_inputs(models.target, [ws.eval_batches if not moved.carried else None, ws.align_batches], ws.device)
    real = bool(ws.eval_batches or ws.align_batches)
    with ws.clock.stage("check"):
        preserved = preservation(
            ws.recipe.strategy.name, [models.base], [alignment], [alignment.aligned_b()], inputs, real=real
        )
    record = _scores(ws, models, moved, naive)
    saved_model = ws.adapter is None
    canonical = alignment.canonical and saved_model
    untied = list(alignment.untied) if saved_model else []  # an adapter stores no head
    findings = Findings(
        strategy=ws.recipe.strategy.name,
        strategy_options=ws.recipe.strategy.options.model_dump(mode="json"),
        task=ws.task,
        canonical=canonical,
        untied=untied,
        function_preserved=preserved,
        transport=record,
        diagnostics=dict(alignment.diagnostics),
    )
    result = job_result(ws, findings, {}, saved_model=saved_model)
    return JobOutput(result, lambda folder: _save(ws, models, alignment, graph, moved, record, folder))


def _graph(ws: Workspace, models: TransportRoles[LoadedModel]) -> SymmetryGraph:
    """B's graph; for an adapter that cannot follow the canonical form, limited to permutations."""
    graph = models.target.graph
    if ws.adapter is None:
        return graph
    name = ws.recipe.strategy.name
    # generalized-orthogonal works in canonical form: an adapter follows it when its factors can
    # take the norm scales (see lora.transport_adapter); otherwise permutations only
    blocker = (
        canonical_blocker(ws.adapter, graph, weights(models.base))
        if name == "generalized-orthogonal"
        else "permutation strategy"
    )
    if blocker is None:
        return graph
    limited, demoted = lora_graph(graph)  # graph.fallbacks names the spaces limited to permutations
    if demoted and name == "generalized-orthogonal":
        ws.notes.append(f"the adapter cannot follow the canonical form: {blocker}")
    return limited


def _align_base_to_target(ws: Workspace, models: TransportRoles[LoadedModel], graph: SymmetryGraph) -> Alignment:
    """The old base A in the target B's basis (cached; the alignment's notes join the run's)."""
    b, a = models.target, models.base
    name, options = ws.recipe.strategy.name, ws.recipe.strategy.options
    pair = Pair(graph, weights(b), weights(a), b.model, a.model, ws.data)  # B is the pair's reference
    inputs = ws.inputs
    assert isinstance(inputs, TransportRoles)
    cached = ws.cache.use(
        (inputs.target.resolved, b),
        inputs.base.resolved,
        name,
        options,
        label="A to B",
        batching=ws.align.spec if ws.align is not None else None,
        graph=graph,
    )
    alignment = timed_align(ws, name, options, pair, cache=cached)
    ws.notes.extend(alignment.notes)
    return alignment


def move_task_vector(models: TransportRoles[LoadedModel], alignment: Alignment, graph: SymmetryGraph) -> Moved:
    """π(τ) (and the fine-tune's own tensors) for ``alignment`` of A to B."""
    b, a, a_ft = models.target, models.base, models.finetune
    sd_ft = weights(a_ft)
    new_head = type(a_ft.model) is not type(a.model)
    ft_graph = a_ft.graph if new_head else None
    tau, carried = move_finetune(alignment, graph, sd_ft, ft_graph)  # carried: empty unless the head is new
    return Moved(
        alignment.sd_a,  # B's tensors: B is the alignment's reference
        tau,
        carried,
        list(sd_ft) if new_head else list(alignment.sd_a),
        a_ft.model if new_head else b.model,
        bool(alignment.untied) and not new_head,
    )


def _note_carried(ws: Workspace, models: TransportRoles[LoadedModel], moved: Moved) -> None:
    if moved.carried:
        ws.notes.append(
            "only in the fine-tune, carried over in B's basis: "
            + ", ".join(sorted(moved.carried))
            + f"; the result is a {type(models.finetune.model).__name__}"
        )


def _naive(ws: Workspace, models: TransportRoles[LoadedModel]) -> Moved | None:
    """B + α·τ (``compare: [vanilla]``): the transport of an identity alignment."""
    ev = ws.recipe.evaluate
    if ev is None or "vanilla" not in ev.compare:
        return None
    b, a = models.target, models.base
    plain = align("vanilla", Pair(b.graph, weights(b), weights(a)))
    return move_task_vector(models, plain, b.graph)


def _scores(ws: Workspace, models: TransportRoles[LoadedModel], moved: Moved, naive: Moved | None) -> dict[str, Any]:
    """``rebasin.json``'s ``transport``: the α, and the scores on the task (and support) data."""
    record: dict[str, Any] = {"alphas": ws.recipe.alphas}
    ev = ws.recipe.evaluate
    if ev is not None and ws.eval_batches is not None:
        with ws.clock.stage("evaluate"):
            record.update(_scores_on(ws, models, ws.eval_batches, moved, naive))
            if ev.support is not None:
                spec = BatchSpec(ws.task, ev.batch_size, ev.support.max_tokens, ev.support.max_examples, ev.seed)
                config = models.finetune.model.config
                support = batches(ev.support, spec, ws.base_dir, ws.processor, config, where="evaluate.support")
                record["support"] = _scores_on(ws, models, support, moved, naive)
    if moved.carried:
        record["carried"] = sorted(moved.carried)
    return record


def _scores_on(
    ws: Workspace,
    models: TransportRoles[LoadedModel],
    data: Sequence[Mapping[str, Tensor]],
    moved: Moved,
    naive: Moved | None,
) -> dict[str, Any]:
    """Loss and metric of target B, fine-tune A_ft, B + α·π(τ) per α and (``naive``) B + α·τ per α.

    When the fine-tune has a head its base lacks, "target" is B carrying that head (moved, α = 0):
    B alone has no such head to score.
    """
    out: dict[str, Any] = {"loss": {}, "metric": {}}

    def put(key: str, score: dict[str, Any], many: bool) -> None:
        if many:
            out["loss"].setdefault(key, []).append(score["loss"])
            out["metric"].setdefault(key, []).append(score["metric"])
        else:
            out["loss"][key], out["metric"][key] = score["loss"], score["metric"]

    def scored(m: Moved, alpha: float) -> dict[str, Any]:
        return ws.score(m.template, m.theta(alpha), m.untie, data, ws.task)

    finetuned = ws.score.model(models.finetune.model, data, ws.task)
    put("target", scored(moved, 0.0) if moved.carried else ws.score.model(models.target.model, data, ws.task), False)
    put("finetuned", finetuned, False)
    for alpha in ws.recipe.alphas:
        put("transported", scored(moved, alpha), True)
    if naive is not None:
        for alpha in ws.recipe.alphas:
            put("naive", scored(naive, alpha), True)
    return out


def _save(
    ws: Workspace,
    models: TransportRoles[LoadedModel],
    alignment: Alignment,
    graph: SymmetryGraph,
    moved: Moved,
    record: dict[str, Any],
    folder: Path,
) -> None:
    """B + α·π(τ) for the first α (or the moved adapter, whose summary joins ``record``), then B's files."""
    recipe = ws.recipe
    if ws.adapter is None:
        save_merged_model(
            moved.template,
            moved.theta(recipe.alphas[0]),
            folder,
            untie=moved.untie,
            max_shard_size=recipe.output.max_shard_size,
            dtype=ws.score.dtype,
            dtypes=ws.score.dtypes,
            progress=writing(ws.progress),
        )
    else:
        sd_a, sd_b = weights(models.base), weights(models.target)
        canonical = alignment.graph if alignment.canonical and graph is models.target.graph else None
        if is_per_sublayer(alignment.graph):  # the adapter's factors follow their own sublayers' maps
            graph = per_sublayer(graph)
        factors, whole = transport_adapter(
            ws.adapter, graph, alignment.transform, sd_a, sd_b, canonical_graph=canonical
        )
        save_adapter(
            ws.adapter,
            factors,
            folder,
            base_model=str(recipe.target),
            alpha=recipe.alphas[0],
            target=sd_b,
            whole=whole,
            dtype=ws.score.dtype,
        )
        record["adapter"] = {
            **ws.adapter.summary(),
            "canonical": canonical is not None,  # factors took the norm scales (generalized-orthogonal)
            "whole_biases": sorted(whole.values()),  # biases that carry a folded β's shift, stored whole
        }
    copy_support_files(ws.inputs.reference.path, folder)  # after save_pretrained: B's files as they were
    save_diagnostics(folder, alignment.diagnostics)
