"""job: transport: align the old base A to the target B, move the task vector τ = A_ft − A into
B's basis and save B + α·π(τ); for a LoRA fine-tune, the adapter with its factors moved (with new
tokens, its embedding and LM head beside them: `run.lora_output`).

In the alignment the target B is the reference (`Pair`'s first model): A is brought into B's basis.
With support data the run weighs each α's task gain against its support cost (``tradeoff.png``),
and ``alpha: auto`` saves the α that `choose_alpha` picks from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from hf_rebasin.alignment.strategies import Alignment, Pair, align
from hf_rebasin.core.errors import IncompatibleModelsError
from hf_rebasin.core.lazy import LazyState
from hf_rebasin.core.roles import TransportRoles
from hf_rebasin.evaluation.record import Findings
from hf_rebasin.evaluation.report import plot_tradeoff, tradeoff, tradeoff_table
from hf_rebasin.evaluation.scores import Calibration, Choice, Transport
from hf_rebasin.io.export import copy_support_files, save_merged_model
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.io.output import write_text
from hf_rebasin.merging.initialised import fill_transport, left_out
from hf_rebasin.merging.transport import add_task_vector, move_finetune
from hf_rebasin.recipe.jobs.transport import TransportRecipe
from hf_rebasin.run.auto_alpha import choose_alpha
from hf_rebasin.run.calibrate import calibrated
from hf_rebasin.run.calibrate_adapter import calibrated_adapter
from hf_rebasin.run.data import BatchSpec, batches
from hf_rebasin.run.jobs.barrier import save_diagnostics
from hf_rebasin.run.load import Workspace, weights
from hf_rebasin.run.lora_output import (
    MovedAdapter,
    adapter_graph,
    adapter_input,
    move_adapter,
    save_moved_adapter,
)
from hf_rebasin.run.result import JobOutput
from hf_rebasin.run.stages import check_inputs, job_result, options_as_run, preservation, timed_align, writing
from hf_rebasin.symmetry.graph import SymmetryGraph

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Choice", "run"]


def own(ws: Workspace) -> TransportRecipe:
    """The run's recipe, as this job's own model."""
    recipe = ws.recipe
    assert isinstance(recipe, TransportRecipe)  # the pipeline runs a job on its own recipes
    return recipe


@dataclass
class Moved:
    """A task vector in the target's basis and what it takes to build ``B + α·τ`` as a model."""

    target: Mapping[str, Tensor]  # B's state dict, in the alignment's form
    tau: Mapping[str, Tensor]  # π(τ) on the tensors base and fine-tune share
    carried: Mapping[str, Tensor]  # tensors only the fine-tune has, moved whole
    names: Sequence[str]  # the output model's tensors, in order (the fine-tune's when its head is new)
    template: PreTrainedModel  # the class and config to build
    untie: bool
    expert_layout: str | None = None  # how the template's input stores its experts (`LoadedModel.expert_layout`)

    def theta(self, alpha: float) -> Mapping[str, Tensor]:
        """The weights of ``B + α·τ`` (with the fine-tune's own tensors when its head is new)."""
        body = add_task_vector(self.target, self.tau, alpha)
        if not self.carried:
            return body
        return {n: self.carried[n] if n in self.carried else body[n] for n in self.names}


def run(ws: Workspace) -> JobOutput:
    """B + α·π(τ) for each α of the recipe; the first α is saved, or with ``alpha: auto`` the one
    `choose_alpha` picks from the trade-off."""
    models = ws.models
    assert isinstance(models, TransportRoles)  # the recipe's job
    if ws.adapter is not None and ws.rows is not None:
        raise IncompatibleModelsError(
            "`finetuned.model`: a LoRA adapter moves onto a target whose vocabulary is its base's; this target's "
            "differs (see the notes). Merge the adapter into its base (`model.merge_and_unload()`) and transport the "
            "full fine-tune"
        )
    lora = adapter_input(ws, models)  # None: a full model is written
    graph = adapter_graph(ws, models, lora)
    alignment = _align_base_to_target(ws, models, graph)
    with ws.clock.stage("align"):
        moved = filled(ws, move_task_vector(models, alignment, graph), alignment)
    _note_carried(ws, models, moved)
    naive = _naive(ws, models)
    inputs = check_inputs(models.target, [ws.eval_batches if not moved.carried else None, ws.align_batches], ws.device)
    real = bool(ws.eval_batches or ws.align_batches)
    with ws.clock.stage("check"):
        preserved = preservation(
            ws.recipe.strategy.name, [models.base], [alignment], [alignment.aligned_b()], inputs, real=real
        )
    scores = _scores(ws, models, moved, naive)
    saved_alpha, chosen = _saved_alpha(ws, scores.get("tradeoff"))
    adapter = move_adapter(ws, models, alignment, graph, lora)
    fitted, adapter, calibration = _calibrate(ws, models, moved, saved_alpha, adapter)
    transport = Transport(
        **scores,
        carried=sorted(moved.carried) or None,
        chosen=chosen,
        adapter=adapter.summary if adapter is not None else None,  # the card reads it (library_name: peft)
        calibration=calibration,
    )
    saved_model = adapter is None
    canonical = alignment.canonical and saved_model
    untied = list(alignment.untied) if saved_model else []  # an adapter stores no head
    findings = Findings(
        strategy=ws.recipe.strategy.name,
        strategy_options=options_as_run(ws, alignment),
        task=ws.task,
        speech=ws.speech,
        canonical=canonical,
        untied=untied,
        function_preserved=preserved,
        transport=transport,
        diagnostics=dict(alignment.diagnostics),
    )
    written = (
        "transported model and report"
        if adapter is None
        else "transported LoRA adapter (for the target) and report"
        if not adapter.vocab
        else "transported LoRA adapter (for the target; embedding and LM head in modules_to_save), tokenizer and report"
    )
    result = job_result(ws, findings, {}, saved_model=saved_model, written=written)
    return JobOutput(
        result, lambda folder: _save(ws, alignment, moved, adapter, transport, saved_alpha, folder, fitted)
    )


def _calibrate(
    ws: Workspace, models: TransportRoles[LoadedModel], moved: Moved, alpha: float, adapter: MovedAdapter | None
) -> tuple[Mapping[str, Tensor] | None, MovedAdapter | None, Calibration | None]:
    """Where the recipe calibrates, the saved θ fitted to the fine-tune (`run.calibrate`), or the
    moved adapter's own factors (`run.calibrate_adapter`)."""
    if own(ws).calibrate is None:
        return None, adapter, None
    with ws.clock.stage("calibrate"):
        if adapter is not None:
            fitted_adapter, record = calibrated_adapter(ws, models, adapter, alpha)
            return None, fitted_adapter, record
        state, record = calibrated(ws, models, moved.template, moved.theta(alpha), moved.untie)
        return state, None, record


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
    # a head A ties that the fine-tune stores apart (PEFT trains a copy of each module it saves): its own τ
    apart = set(a.graph.ties) - set(a_ft.graph.ties) if not new_head else set()
    ft_graph = a_ft.graph if new_head or apart else None
    tau, carried = move_finetune(alignment, graph, sd_ft, ft_graph)  # carried: empty unless the head is new
    target = alignment.sd_a  # B's tensors: B is the alignment's reference
    if apart and not isinstance(target, LazyState):  # one tensor under two names would take one τ
        target = {n: t.clone() if n in apart else t for n, t in target.items()}
    return Moved(
        target,
        tau,
        carried,
        list(sd_ft) if new_head else list(alignment.sd_a),
        a_ft.model if new_head else b.model,
        (bool(alignment.untied) or bool(apart)) and not new_head,
        (a_ft if new_head else b).expert_layout,
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
    naive = ev.plain if ev is not None else []
    if not naive:
        return None
    b, a = models.target, models.base
    plain = align(naive[0], Pair(b.graph, weights(b), weights(a)))
    return filled(ws, move_task_vector(models, plain, b.graph), plain)


def filled(ws: Workspace, moved: Moved, alignment: Alignment) -> Moved:
    """``moved`` with the rows a model lacks settled, where the vocabularies differ: a token the
    base lacks carries no task vector (the target's row stays, or the fine-tune's comes whole), a
    token the target lacks starts from the moved base's row (`merging.vocabulary.fill`)."""
    models = ws.models
    assert isinstance(models, TransportRoles)  # the recipe's job
    lacked = tuple(set(lm.initialised) for lm in (models.target, models.base, models.finetune))
    if ws.rows is None and not any(lacked):
        return moved
    target, tau, moved_base = moved.target, moved.tau, alignment.aligned_b()
    if ws.rows is not None:
        target, tau = ws.rows.fill_transport(target, tau, moved_base)
    if any(lacked):  # tensors transformers initialised on load: from the models that have them
        target, tau = fill_transport(target, tau, moved_base, (lacked[0], lacked[1], lacked[2]))
    return dataclasses.replace(moved, target=target, tau=tau)


def _scores(ws: Workspace, models: TransportRoles[LoadedModel], moved: Moved, naive: Moved | None) -> dict[str, Any]:
    """``rebasin.json``'s ``transport`` but what the fine-tune carried, the α chosen and the adapter:
    the α, and the scores on the task (and support) data with their trade-off."""
    record: dict[str, Any] = {"alphas": own(ws).alphas}
    ev = ws.recipe.evaluate
    if ev is not None and ws.eval_batches is not None:
        with ws.clock.stage("evaluate"):
            record.update(_scores_on(ws, models, ws.eval_batches, moved, naive))
            if ev.support is not None:
                spec = BatchSpec(ws.task, ev.batch_size, ev.support.max_tokens, ev.support.max_examples, ev.seed)
                config = models.finetune.model.config
                where = "evaluate.support"
                support = batches(ev.support, spec, ws.base_dir, ws.processor, config, where=where, notes=ws.notes)
                record["support"] = _scores_on(ws, models, support, moved, naive)
                record["tradeoff"] = tradeoff(record)
    return record


def _scores_on(
    ws: Workspace,
    models: TransportRoles[LoadedModel],
    data: Sequence[Mapping[str, Tensor]],
    moved: Moved,
    naive: Moved | None,
) -> dict[str, Any]:
    """Loss and metric of target B, old base A, fine-tune A_ft, B + α·π(τ) per α and (``naive``)
    B + α·τ per α. A's scores set against A_ft's are what the fine-tune itself forgot.

    When the fine-tune has a head its base lacks, "target" is B carrying that head (moved, α = 0)
    and "base" A carrying it (as the fine-tune has it): neither base alone has such a head to score.
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
    put("base", _base_score(ws, models, moved, data), False)
    put("finetuned", finetuned, False)
    for alpha in own(ws).alphas:
        put("transported", scored(moved, alpha), True)
    if naive is not None:
        for alpha in own(ws).alphas:
            put("naive", scored(naive, alpha), True)
    return out


def _base_score(
    ws: Workspace, models: TransportRoles[LoadedModel], moved: Moved, data: Sequence[Mapping[str, Tensor]]
) -> dict[str, Any]:
    """The old base A on ``data``; with a head only the fine-tune has, A carrying that head."""
    if not moved.carried:
        return ws.score.model(models.base.model, data, ws.task)
    sd_a, sd_ft = weights(models.base), weights(models.finetune)
    sd = {n: sd_ft[n] if n in moved.carried else sd_a[n] for n in moved.names}
    return ws.score(moved.template, sd, False, data, ws.task)


def _saved_alpha(ws: Workspace, points: Mapping[str, Any] | None) -> tuple[float, Choice | None]:
    """The α written: the first of the recipe's, or with ``alpha: auto`` the one `choose_alpha` picks
    from the transported trade-off ``points`` (recorded as ``transport.chosen``; a fallback is noted too)."""
    auto = own(ws).auto_alpha
    alphas = own(ws).alphas
    if auto is None:
        return alphas[0], None
    moved = (points or {}).get("transported")
    if moved is None:  # the recipe asks for support data: only a run without scores lands here
        ws.notes.append(f"alpha: auto had no support scores to choose from: saved the first α, {alphas[0]:g}")
        return alphas[0], None
    chosen = choose_alpha(alphas, moved["gain"], moved["cost"], auto.support_budget)
    if chosen.rule == "fallback":
        ws.notes.append(f"alpha: auto: {chosen.reason}")
    return chosen.alpha, chosen


def _save(
    ws: Workspace,
    alignment: Alignment,
    moved: Moved,
    adapter: MovedAdapter | None,
    transport: Transport,
    alpha: float,
    folder: Path,
    fitted: Mapping[str, Tensor] | None = None,
) -> None:
    """B + α·π(τ) for the saved α (or the moved adapter), then B's files (and the output's
    tokenizer, where the vocabularies differ), the alignment's plots
    and, with support data, the trade-off (tradeoff.png, tradeoff.md). Writes only: every finding
    was made before."""
    recipe = own(ws)
    rows = ws.rows
    if adapter is None:
        theta = fitted if fitted is not None else moved.theta(alpha)
        save_merged_model(
            rows.output_template(moved.template) if rows is not None else moved.template,
            rows.output_state(theta) if rows is not None else theta,
            folder,
            untie=moved.untie,
            max_shard_size=recipe.output.max_shard_size,
            dtype=ws.output_dtype.dtype,
            dtypes=ws.output_dtype.kept,
            progress=writing(ws.progress),
            expert_layout=moved.expert_layout,
            leave_out=left_out([m.initialised for m in ws.models.all]),
        )
    else:
        save_moved_adapter(ws, adapter, alpha, str(recipe.target), folder)
    copy_support_files(ws.inputs.reference.path, folder)  # after save_pretrained: B's files as they were
    if rows is not None:
        rows.write(folder)
    save_diagnostics(folder, alignment.diagnostics)
    save_tradeoff(ws, transport, alpha, folder)


def save_tradeoff(ws: Workspace, transport: Transport, alpha: float, folder: Path) -> None:
    """tradeoff.png (task gain against support cost per α) and tradeoff.md, when support was scored."""
    table = tradeoff_table(transport.to_json(), alpha)
    if transport.tradeoff is None or table is None:
        return
    points = transport.tradeoff.to_json()
    inputs = ws.inputs
    assert isinstance(inputs, TransportRoles)
    ft, b = (Path(m.ref.model).name or m.ref.model for m in (inputs.finetune, inputs.target))
    auto = own(ws).auto_alpha
    title = f"{ft} moved onto {b}: task gain against support cost"
    budget = auto.support_budget if auto is not None else None
    plot_tradeoff(points, folder / "tradeoff.png", title=title, saved=alpha, budget=budget)
    write_text(folder / "tradeoff.md", table)
