"""Where a model reference leads: a zoo model (trained on first use), a Hub commit, a local folder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hf_rebasin.core.errors import ModelNotFoundError, named
from hf_rebasin.evaluation.zoo import train
from hf_rebasin.io.files import probe, resolve_folder
from hf_rebasin.io.hub.client import offline
from hf_rebasin.io.hub.download import Download, download_model, plan_download
from hf_rebasin.io.hub.resolve import cached_model, resolve_revision
from hf_rebasin.merging.lora import is_adapter
from hf_rebasin.recipe import ModelRef
from hf_rebasin.run.clock import Progress, noop

__all__ = ["PlannedModel", "ResolvedModel", "resolve_model"]


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model reference leads: its folder (None: a Hub model not downloaded yet) and commit."""

    folder: Path | None
    commit: str | None = None
    files: tuple[str, ...] | None = None  # a Hub model resolved without download: the files of its commit
    cached: bool = False  # a Hub model taken from the local Hugging Face cache (HF_HUB_OFFLINE=1)
    download: Download | None = None  # a Hub model resolved without download: what the run fetches


@dataclass(frozen=True)
class PlannedModel:
    """One model of a run: the recipe field naming it, its reference, and where that led."""

    where: str  # e.g. ``models.1.model``, ``finetuned.model``
    ref: ModelRef
    resolved: ResolvedModel

    @property
    def folder(self) -> Path | None:
        return self.resolved.folder

    @property
    def named(self) -> str:
        """How notes and refusals name it: as the recipe gives it, with its field."""
        return f"{self.ref.label or self.ref.model} (`{self.where}`)"

    @property
    def path(self) -> Path:
        """The folder, once known (a fetched model, or a local one)."""
        if self.resolved.folder is None:
            raise RuntimeError(f"{self.ref} has no folder yet: it is downloaded when the run loads")
        return self.resolved.folder

    @property
    def ready(self) -> bool:
        """Whether its folder holds the model already (not a Hub model to download or a zoo model to train)."""
        folder = self.resolved.folder
        if folder is None:
            return False
        return train.is_trained(folder) if self.ref.zoo is not None else folder.is_dir()


def resolve_model(
    ref: ModelRef,
    where: str = "models.0.model",
    *,
    progress: Progress | None = None,
    fetch: bool = True,
    allow_pickle: bool = False,
    checked: ResolvedModel | None = None,
) -> ResolvedModel:
    """The local folder of a model reference, trained (zoo) or downloaded (Hub) when ``fetch``.

    Without ``fetch`` (a dry run) nothing is trained or downloaded: a zoo model says where it will
    be, a Hub model is resolved to its commit from metadata alone. ``checked`` is that earlier
    resolution: the download then takes its commit. A PEFT adapter is accepted only as a
    transport's ``finetuned``, or by ``hf-rebasin zoo`` (``where`` "zoo"), which lists folders.
    """
    resolved = _resolve(ref, where, progress=progress, fetch=fetch, allow_pickle=allow_pickle, checked=checked)
    if resolved.folder is not None and not where.startswith("finetuned") and where != "zoo":
        if is_adapter(resolved.folder) and not (resolved.folder / "config.json").is_file():
            raise ModelNotFoundError(
                f"`{where}`: {ref} is a PEFT adapter, not a model; an adapter can only be the `finetuned` of a "
                "job: transport (its base model goes in `base`). To compare it with other models, give it to "
                "`hf-rebasin lineage` (compared as its base with the adapter merged in) or merge it into its base "
                "(`model.merge_and_unload()`, then `save_pretrained`) and name that folder"
            )
    return resolved


def _resolve(
    ref: ModelRef,
    where: str,
    *,
    progress: Progress | None,
    fetch: bool,
    allow_pickle: bool,
    checked: ResolvedModel | None = None,
) -> ResolvedModel:
    adapter_ok = where.startswith("finetuned")
    where = f"`{where}`"
    if ref.zoo is not None:
        return ResolvedModel(_zoo(ref, fetch, progress or noop))
    if ref.source == "hub":
        if offline():  # no network: the snapshot the cache holds, in a dry run too
            snap = cached_model(ref.model, ref.revision, allow_pickle=allow_pickle, where=where)
            return ResolvedModel(snap.folder, snap.commit, cached=True)
        if not fetch:
            commit, files = resolve_revision(ref.model, ref.revision, where=where)
            # the exact files and their advertised bytes; a sharded repo's small index JSON is read
            # (into the cache) to list its shards, the only file a dry run downloads
            download = plan_download(ref.model, ref.revision, commit, files, allow_pickle=allow_pickle, where=where)
            return ResolvedModel(None, commit, tuple(files), download=download)
        pinned = (checked.commit, checked.files) if checked and checked.commit and checked.files is not None else None
        snap = download_model(ref.model, ref.revision, allow_pickle=allow_pickle, where=where, resolved=pinned)
        return ResolvedModel(snap.folder, snap.commit)
    folder = Path(ref.model)
    if probe(folder, where) is None and not folder.is_symlink():  # a name too long, no permission: named
        raise ModelNotFoundError(f"{where}: the model folder {str(folder)!r} does not exist")
    if folder.is_file():
        raise ModelNotFoundError(f"{where}: {str(folder)!r} is a file; give the folder that holds config.json")
    with named(where):
        resolve_folder(folder)  # a link loop or a link to nothing, named as such
    if not any(os.path.lexists(folder / name) for name in ("config.json", "adapter_config.json")):
        raise ModelNotFoundError(
            f"{where}: {str(folder)!r} has no config.json; a model folder is what `save_pretrained` writes"
            + (" (or, for `finetuned`, a PEFT adapter folder with adapter_config.json)" if adapter_ok else "")
        )
    return ResolvedModel(folder)


def _zoo(ref: ModelRef, fetch: bool, report: Progress) -> Path:
    """A zoo model's folder, trained first when ``fetch`` and not cached yet."""
    assert ref.zoo is not None
    kind, seed = ref.zoo
    folder = train.zoo_folder(kind, seed)
    if fetch and not train.is_trained(folder):
        stage = f"training {ref.model} (first use; cached after)"
        steps = train.train_steps(kind)
        report(stage, 0, steps)
        folder = train.cached_model(kind, seed, progress=lambda step, _loss: report(stage, step + 1, steps))
    return folder
