"""The lineage verdict a merge's or a transport's ``--dry-run`` prints, when it is cheap.

Whether the models share a basis decides what the recipe should do: a plain average or a naive
task vector when they do, an alignment when they do not. A wrong choice costs a whole run, and a
fine-tune that does not descend from the transport's ``base`` makes its task vector meaningless. So
the dry run compares the pairs that matter (the reference with each other model; a transport's base
with its fine-tune and with the target), data-free, when every model is on disk and small enough to
take seconds (`PREVIEW_PARAMS`); otherwise it says why not and which command gives the verdict.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from hf_rebasin.core.errors import RebasinUserError, named
from hf_rebasin.core.roles import MergeRoles, TransportRoles
from hf_rebasin.lineage.record import PairRecord
from hf_rebasin.lineage.table import p_text
from hf_rebasin.merging.lora import is_adapter
from hf_rebasin.recipe.jobs import get_job
from hf_rebasin.recipe.sections import AlignedRecipe
from hf_rebasin.run.memory import footprint
from hf_rebasin.run.plan import Plan
from hf_rebasin.run.resolve import PlannedModel

__all__ = ["PREVIEW_PARAMS", "preview_lines", "preview_pairs"]

# a model this large or smaller (parameters) is compared in a dry run, in seconds (the zoo's take 3 s
# with the imports); a GPT-2-small-sized pair (124M) takes about 2 minutes on 2 cores, so a larger
# model prints the `hf-rebasin lineage` command instead
PREVIEW_PARAMS = 20_000_000
IDENTITY_ADVICE = "generalized-orthogonal (data-free) or another strategy that aligns"


def preview_pairs(models: MergeRoles[PlannedModel] | TransportRoles[PlannedModel]) -> list[tuple[int, int, bool]]:
    """The pairs (indices into ``models.all``) whose verdict decides the run, each with whether it
    is a transport's base and fine-tune (their difference is the task vector): a merge's reference
    with each other model; a transport's base with its fine-tune, and the target with the base."""
    if isinstance(models, TransportRoles):
        return [(1, 2, True), (0, 1, False)]  # all = (target, base, fine-tune)
    return [(0, k, False) for k in range(1, len(models.all))]


def _not_cheap(planned: Plan) -> str | None:
    """Why the dry run does not compare the models (None: it does)."""
    for label, m in zip(planned.models.labels, planned.all, strict=True):
        if not m.ready:
            how = "trained on first use" if m.ref.zoo is not None else "downloaded when the run loads it"
            return f"{label} ({m.ref}) is not on disk yet ({how})"
        if is_adapter(m.path):
            return f"{label} ({m.ref}) is a LoRA adapter (the run merges it into its base first)"
        fp = footprint(m.path)
        if fp is None:
            return f"{label} ({m.ref}) has no safetensors files to read"
        if fp.params > PREVIEW_PARAMS:
            return f"{label} has {fp.params / 1e6:,.0f}M parameters, more than the dry run compares ({PREVIEW_PARAMS / 1e6:,.0f}M)"
    return None


def preview_lines(planned: Plan) -> list[str]:
    """The dry run's lineage lines for a job that combines models (`Job.lineage_preview`: merge,
    transport); none for other jobs."""
    recipe = planned.recipe
    if not get_job(recipe.job).lineage_preview:
        return []
    models = planned.models
    pairs = preview_pairs(models)
    labels = models.labels
    command = "hf-rebasin lineage " + " ".join(shlex.quote(str(models.all[i].ref)) for i in _chosen(pairs))
    why = _not_cheap(planned)
    if why is not None:
        return [f"lineage: not compared in a dry run: {why}; `{command}` gives the verdict"]
    start = time.perf_counter()
    try:
        records = _compare(planned, pairs)
    except RebasinUserError as e:
        return [f"lineage: not compared: {e}"]
    lines = [f"lineage (data-free, {time.perf_counter() - start:.1f} s; `{command}` shows the evidence per layer):"]
    for (a, b, task), record in zip(pairs, records, strict=True):
        lines.append(
            f"  {labels[a]} vs {labels[b]}: {record.verdict} (bulk similarity {record.statistic:.3f} aligned, "
            f"{record.raw_statistic:.3f} as stored; p {p_text(record.log10_p)})"
        )
        advice = _finetune_advice(record.verdict) if task else _advice(recipe, models, record.verdict)
        lines.extend(f"    {line}" for line in advice)
    return lines


def _chosen(pairs: list[tuple[int, int, bool]]) -> list[int]:
    """The models the pairs name, in the recipe's order."""
    return sorted({k for a, b, _ in pairs for k in (a, b)})


def _compare(planned: Plan, pairs: list[tuple[int, int, bool]]) -> list[PairRecord]:
    """Each pair's record; every model loaded once, streamed (whole when their widths differ)."""
    from hf_rebasin.alignment.widths import differ_in_width
    from hf_rebasin.io.models import load_model
    from hf_rebasin.lineage.pairs import lineage_of

    recipe = planned.recipe
    chosen = _chosen(pairs)
    stream = not differ_in_width([Path(planned.all[i].path) for i in chosen])
    loaded = {}
    for i in chosen:
        m = planned.all[i]
        with named(m.where):
            loaded[i] = load_model(
                m.path, allow_pickle=recipe.allow_pickle, trust_remote_code=recipe.trust_remote_code, stream=stream
            )
    names = [str(m.ref) for m in planned.all]
    return [lineage_of([loaded[a], loaded[b]], [names[a], names[b]]).pairs[0] for a, b, _ in pairs]


def _advice(
    recipe: AlignedRecipe, models: MergeRoles[PlannedModel] | TransportRoles[PlannedModel], verdict: str
) -> list[str]:
    """What the verdict means for this recipe: fine as it is, or a warning naming what to change."""
    strategy = recipe.strategy.name
    aligns = not recipe.strategy.strategy.identity
    target = "naive transport (B + τ)" if isinstance(models, TransportRoles) else "a plain average"
    if verdict == "same basis":
        if aligns:
            return [f"{target} is right (`strategy: vanilla`); {strategy} should find maps near the identity"]
        return [f"{target} is right: the recipe's {strategy} is the right choice"]
    if verdict == "related up to symmetry":
        if aligns:
            return [f"kin in another basis: the recipe's {strategy} aligns them first, as it should"]
        return [
            f"warning: kin in another basis, and {strategy} aligns nothing: {target} of them mixes two bases; "
            f"use {IDENTITY_ADVICE}"
        ]
    apart = "trained apart" if verdict == "independent" else "one origin but no layer in common (embeddings shared)"
    if aligns:
        return [f"{apart}: {strategy} aligns them; expect a barrier (`job: barrier` measures it)"]
    return [
        f"warning: {apart}, and {strategy} aligns nothing: {target} of models in two bases is a baseline "
        f"at best; {IDENTITY_ADVICE} aligns them first"
    ]


def _finetune_advice(verdict: str) -> list[str]:
    """A transport's task vector is the fine-tune minus its base: only kin in one basis give one."""
    if verdict == "same basis":
        return ["the fine-tune descends from `base` in its basis: its task vector τ = fine-tune − base is sound"]
    if verdict == "related up to symmetry":
        return [
            "warning: the fine-tune is `base`'s kin in another basis, so fine-tune − base mixes the task with that "
            "change of basis: align the fine-tune to `base` first (`hf-rebasin align`) and transport that"
        ]
    apart = "trained apart" if verdict == "independent" else "no layer in common, only its embeddings"
    return [
        f"warning: the fine-tune does not descend from `base` ({apart}): fine-tune − base is no task vector; "
        "check `base`, it should be the model the fine-tune was trained from"
    ]
