"""The plan a recipe stands for, in words: what ``--dry-run`` prints before any check that needs
the network or weights (`run.plan` adds those). The shared lines are here; each job adds its own
(`Job.describe`). Torch-free."""

from __future__ import annotations

from pathlib import Path

from hf_rebasin.core.errors import DataError
from hf_rebasin.core.names import BUILTIN_DATASETS
from hf_rebasin.evaluation.zoo.catalogue import is_trained, zoo_folder
from hf_rebasin.io.datafiles import check_files
from hf_rebasin.recipe.data import DataSpec
from hf_rebasin.recipe.evaluate import Evaluate
from hf_rebasin.recipe.sections import AlignedRecipe
from hf_rebasin.recipe.strategy import yamlish

__all__ = ["curve_lines", "data_line", "describe", "describe_auto"]


def describe(recipe: AlignedRecipe, output: Path | None = None) -> list[str]:
    """The plan of ``recipe``, one line each; ``output`` is ``--output`` when given (nothing is loaded)."""
    from hf_rebasin.recipe.jobs import get_job  # the jobs' modules import this one

    roles = recipe.roles()
    out = [f"recipe: {recipe.source}", f"job: {recipe.job}", "models:"]
    for label, (_, ref) in zip(roles.labels, roles.all, strict=True):
        if ref.zoo is not None:
            folder = zoo_folder(*ref.zoo)
            where = f"zoo model, cached in {folder}" if is_trained(folder) else "zoo model, trained now (first use)"
        elif ref.source == "local":
            where = "local folder" + ("" if Path(ref.model).is_dir() else ", MISSING")
        else:
            where = "Hub"
        revision = f" @ {ref.revision or 'main'}" if ref.source == "hub" else ""
        out.append(f"  {label}: {ref.model}{revision} ({where})")
    spec = recipe.strategy
    out.append(f"strategy: {spec.name} — {spec.strategy.paper}")
    explicit = spec.model_fields_set
    for key, value in spec.options.model_dump().items():
        out.append(f"  {key}: {yamlish(value)}{'' if key in explicit else ' (default)'}")
    out.append(f"  needs alignment data: {'yes' if spec.needs_data else 'no'}")
    if not spec.strategy.exact(spec.options):
        out.append("  note: these options do not preserve B's function (reported as such)")
    out.append(f"data: {data_line(recipe.data)}" if recipe.data else "data: none (data-free)")
    out.extend(get_job(recipe.job).describe(recipe))
    if output is not None:
        out.append(f"output: {output} (from --output)")
    else:
        out.append(f"output: {recipe.output.dir}" + (" (overwrite)" if recipe.output.overwrite else ""))
    push = recipe.output.push_to_hub
    if push is not None:
        vis = {True: "private", False: "public", None: "account default visibility"}[push.private]
        out.append(f"  push to hub: {push.repo}@{push.revision or 'main'} ({vis})")
    out.append(
        f"device: {recipe.device}; allow_pickle: {str(recipe.allow_pickle).lower()}; "
        f"trust_remote_code: {str(recipe.trust_remote_code).lower()}"
        + ("; allow_different_tokenizers: true" if recipe.allow_different_tokenizers else "")
    )
    return out


def data_line(spec: DataSpec) -> str:
    """A data set in one line, and whether its local files are there."""
    parts = [spec.dataset + (" (built in)" if spec.dataset in BUILTIN_DATASETS else "")]
    for key in ("name", "revision", "data_files", "data_dir"):
        if getattr(spec, key) is not None:
            parts.append(f"{key}={getattr(spec, key)}")
    parts.append(f"split={spec.split}")
    for key in ("column", "image_column", "label_column", "max_tokens", "max_examples", "sample_by"):
        if getattr(spec, key) is not None:
            parts.append(f"{key}={getattr(spec, key)}")
    try:
        check_files(spec.data_files, spec.data_dir, Path.cwd())
    except DataError as e:
        parts.append(f"MISSING: {e}")
    return ", ".join(parts)


def curve_lines(recipe: AlignedRecipe) -> list[str]:
    """The evaluation of a job that draws loss curves between A and B (merge, barrier)."""
    ev: Evaluate | None = recipe.evaluate
    if ev is None:
        return ["evaluate: no"]
    return [
        f"evaluate: {ev.task}, {ev.points} points λ ∈ [0, 1], batch size {ev.batch_size}, seed {ev.seed}",
        f"  data: {data_line(ev.data)}",
        f"  curves: {', '.join(dict.fromkeys([recipe.strategy.name, *ev.compare]))}",
    ]


def describe_auto(budget: float | None) -> str:
    """What `alpha: auto` saves, in words (the plan, the card and the README say it alike)."""
    if budget is not None:
        return (
            f"the α with the largest task gain whose support cost is at most {budget:g} nats "
            "(none within it: the α of the smallest support cost, and a note)"
        )
    return (
        "the α with the largest task gain per nat of support cost; an α that gains at no support cost beats "
        "any that costs (the largest gain among them); none gains: the α of the smallest support cost, and a note"
    )
