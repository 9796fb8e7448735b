"""The alignment cache: an alignment is computed once per (A, B) pair and reused.

Transporting many task vectors, or re-running a recipe to change its evaluation, asks for the same
alignment again; solving it can take minutes. An entry is one safetensors file,
``<root>/<key>.safetensors`` (root: ``$HF_REBASIN_CACHE/alignments``, default
``~/.cache/hf-rebasin/alignments``), holding only what cannot be recomputed cheaply: the transform's
tensors and B's gated-unit scales where the strategy set them (``Alignment.glu_scales``: learned ones
cannot be recomputed), plus the strategy, flags, notes and original timings as JSON metadata. State dicts and
canonical forms are rebuilt from the live models on load, and anything that does not fit the live
graph is a miss, never an error. No pickle is written or read.

The key (:func:`alignment_key`) is a sha256 over :func:`key_fields`: the identities of the
reference model and the aligned model (a Hub commit, else a sha256 of ``config.json`` and the weight
files), the strategy and its full options (defaults included), the alignment data when the strategy
reads data (the recipe's ``data`` section, hashes of its local files, A's tokenizer files and how the
data are batched), the symmetry graph it runs on, the cache format, the hf-rebasin version and the
transformers major version.
``HF_REBASIN_NO_CACHE=1`` (or ``cache: false`` in a recipe) turns the cache off.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from hf_rebasin import __version__
from hf_rebasin.core.names import BUILTIN_DATASETS, LOCAL_BUILDERS
from hf_rebasin.core.resources import cache_root
from hf_rebasin.io.datafiles import check_files, has_glob
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.spaces import ExpertSpace, HeadSpace, Space
from hf_rebasin.symmetry.transforms import AxisMap, ExpertMap, HeadMap, Transform

if TYPE_CHECKING:
    from hf_rebasin.alignment.strategies import Alignment, Options, Pair

__all__ = [
    "CACHE_FORMAT",
    "NO_CACHE_ENV",
    "CacheMiss",
    "ModelLike",
    "alignment_key",
    "cache_dir",
    "data_identity",
    "enabled",
    "entry_path",
    "file_sha256",
    "files_identity",
    "graph_fingerprint",
    "key_fields",
    "load_alignment",
    "model_identity",
    "read_alignment",
    "save_alignment",
]

CACHE_FORMAT = 1  # bump when the entry layout or the key's fields change: old entries become misses
NO_CACHE_ENV = "HF_REBASIN_NO_CACHE"
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".index.json")  # weights and shard indexes
_CHUNK = 8 << 20  # bytes per read while hashing
_META = "hf_rebasin"  # the safetensors metadata key holding the entry's JSON

Progress = Callable[[str, int, int], None]
HASH_STAGE = "hashing model files (alignment cache)"


class ModelLike(Protocol):
    """Where a model is (``run.ResolvedModel`` fits): a folder, a Hub commit, or both."""

    @property
    def folder(self) -> Path | None: ...

    @property
    def commit(self) -> str | None: ...


class CacheMiss(Exception):
    """No usable entry; ``reason`` is empty when there is none at all, else why it was refused."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason or "no entry")
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# Where, and whether


def enabled(recipe_flag: bool = True) -> bool:
    """Whether alignments are cached: the recipe's ``cache`` flag and no ``HF_REBASIN_NO_CACHE``."""
    off = os.environ.get(NO_CACHE_ENV, "").strip().lower() not in ("", "0", "false", "no")
    return recipe_flag and not off


def cache_dir(root: Path | None = None) -> Path:
    """``root``, else ``<HF_REBASIN_CACHE or ~/.cache/hf-rebasin>/alignments`` (the zoo's root)."""
    if root is not None:
        return Path(root)
    return cache_root() / "alignments"


def entry_path(key: str, root: Path | None = None) -> Path:
    """The file that holds (or would hold) the entry of ``key``."""
    return cache_dir(root) / f"{key}.safetensors"


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` to a temporary sibling, then rename onto ``path``: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Identities and the key


def file_sha256(path: Path, root: Path | None = None) -> str:
    """sha256 of a file's bytes, remembered by (resolved path, size, mtime_ns) so a re-run does not
    read a multi-gigabyte checkpoint again. The memo is best effort: failing to write it is ignored."""
    path = Path(path).resolve()
    stat = path.stat()
    memo = cache_dir(root) / "hashes" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    stamp = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        known = json.loads(memo.read_text(encoding="utf-8"))
        if (
            isinstance(known, dict)
            and {k: known.get(k) for k in stamp} == stamp
            and isinstance(known.get("sha256"), str)
        ):
            return str(known["sha256"])
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    sha = digest.hexdigest()
    try:
        text = json.dumps({**stamp, "sha256": sha})
        _atomic_write(memo, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    except OSError:
        pass
    return sha


def files_identity(
    paths: Iterable[Path], *, base: Path | None = None, root: Path | None = None, progress: Progress | None = None
) -> dict[str, str]:
    """``{name: sha256}`` of the files that exist among ``paths`` (names relative to ``base``)."""
    files = sorted({Path(p) for p in paths if Path(p).is_file()})
    out: dict[str, str] = {}
    for i, f in enumerate(files):
        if progress is not None:
            progress(HASH_STAGE, i, len(files))
        out[str(f.relative_to(base)) if base is not None else str(f)] = file_sha256(f, root)
    if progress is not None and files:
        progress(HASH_STAGE, len(files), len(files))
    return out


def model_identity(model: ModelLike, *, root: Path | None = None, progress: Progress | None = None) -> str:
    """``hub:<commit>`` for a Hub model, else ``files:<sha256>`` over the folder's ``config.json``
    and weight files (name and content): a copy of a folder is the same model, an edit is not."""
    if model.commit is not None:
        return f"hub:{model.commit}"
    if model.folder is None:
        raise ValueError("a model with neither a folder nor a commit has no identity")
    from hf_rebasin.io.files import checked, model_root
    from hf_rebasin.io.gate import read_files

    folder = Path(model.folder)
    names = ["config.json", *(n for n in read_files(folder, allow_pickle=True) if n.endswith(MODEL_FILE_SUFFIXES))]
    root = model_root(folder.resolve())
    paths = [checked(folder / n, root) for n in names if (folder / n).exists()]  # through the gate first
    hashes = files_identity(paths, base=folder, root=root, progress=progress)
    return "files:" + hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def _data_paths(spec: Mapping[str, Any], base_dir: Path) -> list[Path]:
    """The local files a data section reads: ``data_files`` (globs expanded), ``data_dir`` and a
    local dataset folder, walked recursively. Built-in and Hub data sets have none."""
    dataset = str(spec.get("dataset") or "")
    if dataset in BUILTIN_DATASETS:
        return []
    paths: list[Path] = []
    folders: list[Path] = []
    if dataset not in LOCAL_BUILDERS and (base_dir / dataset).is_dir():
        folders.append(base_dir / dataset)
    resolved = check_files(spec.get("data_files"), spec.get("data_dir"), base_dir)
    files = resolved.get("data_files")
    entries = (
        [files]
        if isinstance(files, str)
        else [f for v in files.values() for f in v]
        if isinstance(files, dict)
        else list(files or [])
    )
    for entry in entries:
        matches = sorted(glob.glob(entry, recursive=True)) if has_glob(entry) else [entry]
        paths.extend(Path(p) for p in matches)
    if resolved.get("data_dir"):
        folders.append(Path(resolved["data_dir"]))
    for folder in folders:
        paths.extend(p for p in sorted(folder.rglob("*")) if p.is_file() and ".cache" not in p.parts)
    return paths


def data_identity(
    spec: Mapping[str, Any], base_dir: Path, *, root: Path | None = None, **batching: Any
) -> dict[str, Any]:
    """What alignment data a strategy reads: the data section as JSON, the sha256 of every local
    file it names, and ``batching`` (task, batch size, seed, tokenizer hashes: JSON values).

    A Hub dataset is keyed by its name and ``revision``: pin a revision when it may change."""
    files = files_identity(_data_paths(spec, Path(base_dir)), root=root)
    return {"spec": dict(spec), "files": files, **batching}


def graph_fingerprint(graph: SymmetryGraph) -> str:
    """sha256 of a symmetry graph (spaces, bindings, ties, norms): a graph the runner rewrites (a LoRA
    adapter's, say) gets alignments of its own."""
    fields = dataclasses.asdict(graph)
    fields["invariant"] = sorted(graph.invariant)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _transformers_major() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers").split(".")[0]
    except PackageNotFoundError:
        return "none"


def key_fields(
    reference: ModelLike,
    aligned: ModelLike,
    strategy: str,
    options: Options | Mapping[str, Any] | None = None,
    *,
    data: Mapping[str, Any] | None = None,
    graph: SymmetryGraph | None = None,
    root: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Everything an alignment depends on, as JSON: see :func:`alignment_key`."""
    from hf_rebasin.alignment.strategies import get_strategy

    parsed = get_strategy(strategy).parse(options)
    return {
        "format": CACHE_FORMAT,
        "hf_rebasin": __version__,
        "transformers": _transformers_major(),
        "reference": model_identity(reference, root=root, progress=progress),
        "aligned": model_identity(aligned, root=root, progress=progress),
        "strategy": strategy,
        "options": parsed.model_dump(mode="json"),
        "data": None if data is None else json.loads(json.dumps(data, sort_keys=True, default=str)),
        "graph": None if graph is None else graph_fingerprint(graph),
    }


def alignment_key(
    reference: ModelLike,
    aligned: ModelLike,
    strategy: str,
    options: Options | Mapping[str, Any] | None = None,
    *,
    data: Mapping[str, Any] | None = None,
    graph: SymmetryGraph | None = None,
    root: Path | None = None,
    progress: Progress | None = None,
) -> str:
    """64 hex digits naming the alignment of ``aligned`` into ``reference``'s basis.

    Keyed: both model identities in their roles (Hub commit, else content hash of config.json and
    weights), the strategy, its options with defaults filled in (sorted JSON), ``data`` (pass
    :func:`data_identity` when the strategy reads data, else None), the symmetry graph the alignment
    runs on (:func:`graph_fingerprint`, when given), the cache format, the hf-rebasin version and the
    transformers major version. Not keyed: the device."""
    fields = key_fields(reference, aligned, strategy, options, data=data, graph=graph, root=root, progress=progress)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Entries


def _encode(transform: Transform) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The transform's tensors by opaque name, and per space its kind and which names hold what."""
    tensors: dict[str, Tensor] = {}
    spaces: dict[str, Any] = {}

    def put(t: Tensor | None) -> str | None:
        if t is None:
            return None
        name = f"t{len(tensors)}"
        tensors[name] = t.detach().cpu().contiguous().clone()
        return name

    for space, m in transform.items():
        if isinstance(m, HeadMap):
            names = {k: put(getattr(m, k)) for k in ("kv_perm", "q_perm", "qk", "vo")}
            spaces[space] = {"kind": "head", **names, "invertible": m.invertible}
        elif isinstance(m, ExpertMap):
            spaces[space] = {"kind": "experts", **{k: put(getattr(m, k)) for k in ("perm", "inner", "shift")}}
        else:
            spaces[space] = {"kind": "axis", "size": m.size, "index": put(m.index), "blocks": put(m.blocks)}
    return tensors, spaces


def _digest(tensors: Mapping[str, Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes: safetensors has no checksum of its own."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_alignment(key: str, alignment: Alignment, pair: Pair, *, root: Path | None = None) -> Path | None:
    """Store ``alignment`` (computed on ``pair``) under ``key``, atomically; its path, or None when
    it cannot be rebuilt from a pair (a strategy that rewrote the graph from data, such as head-perm's
    ``ignore-heads`` or ``residual: separate``). Raises OSError when the cache cannot be written."""
    from hf_rebasin.symmetry.sublayers import is_per_sublayer

    if not alignment.canonical and alignment.graph is not pair.graph and not is_per_sublayer(alignment.graph):
        return None
    from safetensors.torch import save_file

    tensors, spaces = _encode(alignment.transform)
    scales: dict[str, str] = {}  # unit space → tensor name, float64 as applied
    for i, (space, s) in enumerate((alignment.glu_scales or {}).items()):
        scales[space] = f"g{i}"
        tensors[f"g{i}"] = s.detach().cpu().to(torch.float64).contiguous().clone()
    meta = {
        "format": CACHE_FORMAT,
        "key": key,
        "strategy": alignment.strategy,
        "exact": alignment.exact,
        "canonical": alignment.canonical,
        "glu": alignment.glu_matched,
        "glu_scales": scales if alignment.glu_scales is not None else None,
        "untied": list(alignment.untied),
        "notes": list(alignment.notes),
        "timings": {k: float(v) for k, v in alignment.timings.items()},
        "diagnostics": alignment.diagnostics,
        "resolved": alignment.resolved,
        "spaces": spaces,
        "digest": _digest(tensors),
    }
    path = entry_path(key, root)
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={_META: json.dumps(meta)}))
    return path


def _expert_map(
    name: str, space: ExpertSpace, entry: Mapping[str, Any], get: Callable[[Any], Tensor | None]
) -> ExpertMap:
    """An expert map read back from an entry, checked against the expert space it is for."""
    if entry.get("kind") != "experts":
        raise CacheMiss(f"space {name!r} needs an expert map")
    E, f = space.num_experts, space.units
    perm, inner, shift = (get(entry.get(k)) for k in ("perm", "inner", "shift"))
    if perm is None or inner is None or not (perm.shape == (E,) and _long_perm(perm, E)):
        raise CacheMiss(f"expert permutation of {name!r} does not fit {E} experts")
    if not (inner.shape == (E, f) and _long_perm(inner, f)):
        raise CacheMiss(f"unit permutations of {name!r} do not fit {E} experts of {f} units")
    if shift is not None and not (shift.dim() == 1 and shift.is_floating_point() and bool(shift.isfinite().all())):
        raise CacheMiss(f"router shift of {name!r} is not a finite vector")
    return ExpertMap(perm, inner, shift)


def _long_perm(t: Tensor, n: int) -> bool:
    """``t`` is ``[..., n]`` int64 and every last-axis row is a permutation of 0..n-1."""
    return (
        t.dtype == torch.long
        and t.shape[-1] == n
        and torch.equal(t.sort(dim=-1).values, torch.arange(n).expand_as(t) if t.numel() else t)
    )


def _decode(graph: SymmetryGraph, spaces: Mapping[str, Any], tensors: Mapping[str, Tensor]) -> Transform:
    """The stored transform, checked against ``graph``: space names, kinds, sizes, permutations."""

    def get(name: Any) -> Tensor | None:
        if name is None:
            return None
        if name not in tensors:
            raise CacheMiss(f"tensor {name!r} is missing")
        return tensors[name]

    out: Transform = {}
    for name, entry in spaces.items():
        space = graph.spaces.get(name)
        if space is None:
            raise CacheMiss(f"space {name!r} is not in the model's graph")
        if isinstance(space, HeadSpace):
            if entry.get("kind") != "head":
                raise CacheMiss(f"space {name!r} needs a head map")
            g, r, dh = space.num_kv_heads, space.group_size, space.head_dim
            kv, q, qk, vo = (get(entry.get(k)) for k in ("kv_perm", "q_perm", "qk", "vo"))
            if kv is None or q is None or qk is None or vo is None:
                raise CacheMiss(f"head map of {name!r} is incomplete")
            if not (kv.shape == (g,) and _long_perm(kv, g) and q.shape == (g, r) and _long_perm(q, r)):
                raise CacheMiss(f"head permutation of {name!r} does not fit {g} KV heads × {r}")
            for inner in (qk, vo):
                ok = (
                    inner.shape == (g, dh) and _long_perm(inner, dh)
                    if inner.dtype == torch.long
                    else inner.shape == (g, dh, dh) and inner.is_floating_point() and bool(inner.isfinite().all())
                )
                if not ok:
                    raise CacheMiss(f"inner map of {name!r} does not fit {g} heads of size {dh}")
            out[name] = HeadMap(kv, q, qk, vo, invertible=bool(entry.get("invertible", False)))
            continue
        if isinstance(space, ExpertSpace):
            out[name] = _expert_map(name, space, entry, get)
            continue
        assert isinstance(space, Space)
        index, blocks = get(entry.get("index")), get(entry.get("blocks"))
        n = space.size
        if entry.get("kind") != "axis" or entry.get("size") != n:
            raise CacheMiss(f"space {name!r} has size {n}, the entry {entry.get('size')!r}")
        if index is not None and not (index.shape == (n,) and _long_perm(index, n)):
            raise CacheMiss(f"index of {name!r} is not a permutation of {n}")
        if blocks is not None:
            nb, bs = (blocks.shape[0], blocks.shape[1]) if blocks.dim() == 3 else (0, 0)
            if not (blocks.dim() == 3 and blocks.shape[2] == bs and nb * bs == n and blocks.is_floating_point()):
                raise CacheMiss(f"blocks of {name!r} do not tile {n} features")
            if not bool(blocks.isfinite().all()):
                raise CacheMiss(f"blocks of {name!r} are not finite")
        out[name] = AxisMap(n, index=index, blocks=blocks)
    return out


def _tensor(tensors: Mapping[str, Tensor], name: Any) -> Tensor:
    """The entry's tensor ``name``; a miss when it is not there."""
    if not isinstance(name, str) or name not in tensors:
        raise CacheMiss(f"tensor {name!r} is missing")
    return tensors[name]


def _scales(graph: SymmetryGraph, space: Any, s: Tensor) -> Tensor:
    """Stored unit scales of ``space``, checked against ``graph``: a gated MLP, its size, float64,
    finite and nonzero."""
    units = {u.space for u in graph.glus}
    if space not in units:
        raise CacheMiss(f"unit scales of {space!r}, which is not a gated MLP of the model")
    n = graph.ref_size(space)
    if s.dtype != torch.float64 or s.shape != (n,) or not bool(s.isfinite().all()) or bool((s == 0).any()):
        raise CacheMiss(f"unit scales of {space!r} are not {n} finite nonzero float64 numbers")
    return s


def _read_entry(key: str, strategy: str | None, root: Path | None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The entry of ``key`` as stored: its metadata and tensors, checked against the key, the
    strategy and the checksum before anything is rebuilt; raises :class:`CacheMiss` saying why."""
    from safetensors import safe_open

    path = entry_path(key, root)
    if not path.is_file():
        raise CacheMiss()
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {})[_META])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own types for a broken header or truncated data
        raise CacheMiss(f"unreadable entry ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT or meta.get("key") != key:
        raise CacheMiss("entry of another format or key")
    if strategy is not None and meta.get("strategy") != strategy:
        raise CacheMiss(f"entry of strategy {meta.get('strategy')!r}")
    if meta.get("digest") != _digest(tensors):
        raise CacheMiss("checksum mismatch")
    return meta, tensors


def read_alignment(key: str, pair: Pair, strategy: str | None = None, *, root: Path | None = None) -> Alignment:
    """The cached alignment of ``key``, rebuilt on ``pair`` (canonical forms recomputed from its
    state dicts); raises :class:`CacheMiss` saying why when there is none or it does not fit."""
    from hf_rebasin.alignment.strategies import Alignment
    from hf_rebasin.symmetry.canonical import canonicalize
    from hf_rebasin.symmetry.sublayers import is_stream, per_sublayer

    meta, tensors = _read_entry(key, strategy, root)
    try:
        graph, sd_a, sd_b = pair.graph, pair.sd_a, pair.sd_b
        untied: list[str] = []
        if meta["canonical"]:
            sd_a, graph, untied = canonicalize(pair.graph, pair.sd_a)
            sd_b, _, _ = canonicalize(pair.graph, pair.sd_b)
        if any(is_stream(n) for n in meta["spaces"]):  # rebuilt as the strategy split it
            graph = per_sublayer(graph)
        if untied != list(meta["untied"]):
            raise CacheMiss(f"untied tensors {untied} differ from the entry's {meta['untied']}")
        transform = _decode(graph, meta["spaces"], tensors)
        norms = {k: sd_b[k] for k, b in graph.bindings.items() if b.norm_scale and k in sd_b}
        graph.apply(norms, transform)  # the class checks: orthogonal maps only where they are exact
        glu_scales: dict[str, Tensor] | None = None
        if meta.get("glu_scales") is not None:  # B's gated units scaled as the strategy left them
            from hf_rebasin.symmetry.glu import apply_unit_scales

            stored = meta["glu_scales"]
            glu_scales = {str(space): _scales(graph, space, _tensor(tensors, name)) for space, name in stored.items()}
            sd_b = apply_unit_scales(graph, sd_b, glu_scales)
        elif meta.get("glu"):  # B's gated units in A's scaling: recomputed as the strategy did
            from hf_rebasin.symmetry.glu import match_scales

            sd_b = match_scales(graph, sd_a, sd_b, transform)
        return Alignment(
            str(meta["strategy"]),
            graph,
            sd_a,
            sd_b,
            transform,
            exact=bool(meta["exact"]),
            canonical=bool(meta["canonical"]),
            glu_matched=bool(meta.get("glu")),
            glu_scales=glu_scales,
            untied=untied,
            notes=[str(n) for n in meta["notes"]],
            timings={str(k): float(v) for k, v in meta["timings"].items()},
            diagnostics=dict(meta.get("diagnostics") or {}),
            resolved=dict(meta.get("resolved") or {}),
        )
    except CacheMiss:
        raise
    except Exception as e:  # a malformed field or a transform the graph refuses: recompute instead
        raise CacheMiss(f"entry does not fit the models ({type(e).__name__}: {e})") from None


def load_alignment(key: str, pair: Pair, strategy: str | None = None, *, root: Path | None = None) -> Alignment | None:
    """:func:`read_alignment`, with None for a miss of any kind."""
    try:
        return read_alignment(key, pair, strategy, root=root)
    except CacheMiss:
        return None
