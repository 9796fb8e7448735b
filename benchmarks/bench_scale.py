"""Time and measure streamed merges of random models of real Hub shapes, nothing downloaded.

    python benchmarks/bench_scale.py --shape small --strategies vanilla weight-matching transfusion generalized-orthogonal
    python benchmarks/bench_scale.py --shape tinyllama --strategies vanilla weight-matching --json tinyllama.json
    python benchmarks/bench_scale.py --shape mistral7b --strategies weight-matching --max-iter 1 --timeout 7200
    python benchmarks/bench_scale.py --shape tinyllama --make-only      # only write the two models

``make``: two models (seeds 0 and 1) of the shape are written under ``--root`` as stock
transformers folders in bfloat16 (``config.json``, ~2 GB safetensors shards and their
``model.safetensors.index.json``) without ever holding a model in memory: names and shapes come
from the class built on the meta device (`hf_rebasin.offload.empty_model`), and each tensor is
drawn from its own seeded generator just before `hf_rebasin.tensors.write_safetensors` writes it.
Weights are ``randn · fan_in^-½``, norms ``1 + 0.1 · randn``. A folder is written under a
temporary name and renamed when complete, so an existing folder is complete and is reused. At
``small`` size the folder is also loaded with ``AutoModelForCausalLM.from_pretrained`` (an
independent check that it is a valid checkpoint); at every size the dtype is read back with
``safetensors.safe_open``.

``run``: for each strategy, a ``job: merge`` recipe of the two models (``cache: false``, no
``evaluate`` or ``data``: the streamed path) runs as ``/usr/bin/time -v hf-rebasin RECIPE``.
Prints wall seconds, the stage seconds of ``rebasin.json``, peak RSS (in GB and as a multiple of
one model's bytes on disk), the output's bytes and the dtypes in its safetensors headers, as a
Markdown table (and JSON with ``--json``). ``--max-iter`` caps the passes of weight-matching and
transfusion (``max_iter``) and the rounds of generalized-orthogonal (``iterations``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers as T
import yaml

from hf_rebasin.offload import empty_model
from hf_rebasin.tensors import write_safetensors

GB = 1e9
SHARD_BYTES = 2 * 10**9  # ~2 GB per file, as `save_pretrained` shards big models
STRATEGIES = ("vanilla", "weight-matching", "transfusion", "generalized-orthogonal")
ITERATION_OPTION = {"weight-matching": "max_iter", "transfusion": "max_iter", "generalized-orthogonal": "iterations"}
SEEDS = (0, 1)
STAGES = ("load", "align", "evaluate", "save")  # rebasin.json's timings, in the order a run does them

# Hub shapes (tie_word_embeddings=False, as both checkpoints ship a separate LM head)
SHAPES: dict[str, tuple[type[T.PreTrainedConfig], type[T.PreTrainedModel], dict[str, Any]]] = {
    "small": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=688,
            vocab_size=1000,
            max_position_embeddings=512,
        ),
    ),
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T: ≈1.1B parameters, ≈2.2 GB in bf16
    "tinyllama": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        dict(
            hidden_size=2048,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            intermediate_size=5632,
            vocab_size=32000,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
        ),
    ),
    # mistralai/Mistral-7B-v0.1: ≈7.2B parameters, ≈14.5 GB in bf16
    "mistral7b": (
        T.MistralConfig,
        T.MistralForCausalLM,
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=32000,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=4096,
        ),
    ),
}

Entry = tuple[str, tuple[int, ...], torch.dtype]


# --------------------------------------------------------------------------------------------
# make
# --------------------------------------------------------------------------------------------


def config_of(shape: str) -> T.PreTrainedConfig:
    config_cls, model_cls, kwargs = SHAPES[shape]
    config = config_cls(**{**kwargs, "tie_word_embeddings": False})
    config.dtype = "bfloat16"
    config.architectures = [model_cls.__name__]  # as `model.save_pretrained` writes it: the head's class
    return config


def planned_entries(shape: str) -> list[Entry]:
    """(name, shape, bf16) of every tensor of the shape's model, from meta tensors (no memory)."""
    _, model_cls, _ = SHAPES[shape]
    model = empty_model(model_cls, config_of(shape))
    return [(name, tuple(t.shape), torch.bfloat16) for name, t in model.state_dict().items()]


def shards(entries: list[Entry], limit: int = SHARD_BYTES) -> list[list[Entry]]:
    """Entries split in order into files of at most ``limit`` bytes (a bigger tensor alone)."""
    out: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = math.prod(entry[1]) * 2
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += n
    return out


def producer(entries: list[Entry], seed: int) -> Callable[[str], torch.Tensor]:
    """``produce(name)``: the tensor ``name`` of the model of ``seed``, each from its own generator
    (seeded by the model's seed and the tensor's index), so the order of writing does not matter."""
    index = {name: (i, shape) for i, (name, shape, _) in enumerate(entries)}

    def produce(name: str) -> torch.Tensor:
        i, shape = index[name]
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) == 1:  # RMSNorm γ
            return t.mul_(0.1).add_(1.0)
        return t.mul_(shape[-1] ** -0.5)

    return produce


def make_model(shape: str, folder: Path, seed: int) -> None:
    """Write a random bf16 model of ``shape`` to ``folder`` (skipped when it exists: a folder
    appears only once complete, renamed from ``folder.partial``)."""
    if (folder / "config.json").is_file():
        print(f"make: {folder} exists, reused")
        return
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    entries = planned_entries(shape)
    produce = producer(entries, seed)
    groups = shards(entries)
    weight_map: dict[str, str] = {}
    total = 0
    start = time.perf_counter()
    for k, group in enumerate(groups, 1):
        file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(partial / file, group, produce)
        for name, dims, _ in group:
            weight_map[name] = file
            total += math.prod(dims) * 2
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config_of(shape).save_pretrained(partial)
    partial.rename(folder)
    n_params = sum(math.prod(dims) for _, dims, _ in entries)
    print(
        f"make: {folder}  {n_params / 1e9:.3f}B parameters, {total / GB:.2f} GB in {len(groups)} shard(s), "
        f"{time.perf_counter() - start:.1f}s"
    )


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in safetensors_files(folder))


def stored_dtypes(folder: Path) -> list[str]:
    """The dtypes in the headers of a folder's safetensors files, read with `safetensors` itself."""
    from safetensors import safe_open

    found: set[str] = set()
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            found.update(f.get_slice(name).get_dtype() for name in f.keys())
    return sorted(found)


def check_small(folder: Path, shape: str) -> None:
    """Independent checks: transformers loads the folder, and the files hold what we wrote."""
    from safetensors import safe_open

    model = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    entries = planned_entries(shape)
    produce = producer(entries, int(folder.name.rsplit("seed", 1)[1]))
    loaded = model.state_dict()
    worst = 0.0
    for name, _, _ in entries:
        want = produce(name).to(torch.bfloat16)
        worst = max(worst, (loaded[name].to(torch.bfloat16).float() - want.float()).abs().max().item())
    with torch.no_grad():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    with safe_open(str(safetensors_files(folder)[0]), framework="pt") as f:
        read_dtype = f.get_tensor(next(iter(f.keys()))).dtype
    print(
        f"check: from_pretrained({folder.name}) loaded {type(model).__name__} ({model.dtype}); "
        f"max |loaded - written| {worst:.1e}; logits finite {bool(torch.isfinite(logits).all())}; "
        f"safe_open dtype {read_dtype}"
    )
    if worst != 0.0 or read_dtype != torch.bfloat16 or not torch.isfinite(logits).all():
        raise SystemExit(f"check failed for {folder}")


def make(shape: str, root: Path) -> list[Path]:
    folders = [root / f"{shape}-seed{seed}" for seed in SEEDS]
    for seed, folder in zip(SEEDS, folders, strict=True):
        make_model(shape, folder, seed)
        dtypes = stored_dtypes(folder)
        print(f"check: {folder.name}: {disk_bytes(folder) / GB:.3f} GB on disk, stored dtypes {dtypes}")
        if dtypes != ["BF16"]:
            raise SystemExit(f"{folder}: expected only BF16 tensors, found {dtypes}")
    if shape == "small":
        check_small(folders[0], shape)
    return folders


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    shape: str
    strategy: str
    exit_code: int
    streamed: bool
    wall_s: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_gb: float | None = None
    rss_per_model: float | None = None
    above_base_per_model: float | None = None  # (peak RSS - RSS of the imports alone) / one model
    model_gb: float = 0.0
    output_gb: float | None = None
    output_dtypes: list[str] = field(default_factory=list)
    error: str | None = None


def write_recipe(root: Path, shape: str, strategy: str, folders: list[Path], max_iter: int | None) -> Path:
    spec: dict[str, Any] = {"name": strategy}
    if max_iter is not None and strategy in ITERATION_OPTION:
        spec[ITERATION_OPTION[strategy]] = max_iter
    recipe = {
        "job": "merge",
        "models": [str(f) for f in folders],
        "strategy": spec,
        "merge": {"weight": 0.5},
        "cache": False,
        "device": "cpu",
        "output": {"dir": str(root / "out" / f"{shape}-{strategy}"), "overwrite": True},
    }
    path = root / "recipes" / f"{shape}-{strategy}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def parse_elapsed(text: str) -> float:
    """``/usr/bin/time`` wall clock, ``h:mm:ss`` or ``m:ss.ss``, in seconds."""
    seconds = 0.0
    for part in text.strip().split(":"):
        seconds = seconds * 60 + float(part)
    return seconds


def time_v(stderr: str) -> tuple[int | None, float | None, int | None]:
    """Peak RSS (bytes), wall seconds and exit status from ``/usr/bin/time -v``'s report."""
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", stderr)
    status = re.search(r"Exit status: (\d+)", stderr)
    return (
        int(rss.group(1)) * 1024 if rss else None,
        parse_elapsed(wall.group(1)) if wall else None,
        int(status.group(1)) if status else None,
    )


def baseline_rss(shape: str) -> int | None:
    """Peak RSS of a process that only imports what a run imports (torch, transformers, the
    model's class, hf-rebasin): the fixed cost under every run's peak, whatever the model size."""
    model_cls = SHAPES[shape][1].__name__
    code = f"import torch, safetensors, transformers, hf_rebasin.cli, hf_rebasin.run.load; transformers.{model_cls}"
    command = ["/usr/bin/time", "-v", sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return time_v(done.stderr)[0]


def run_one(
    shape: str, strategy: str, root: Path, folders: list[Path], args: argparse.Namespace, base: int | None
) -> Result:
    from hf_rebasin.recipe import load_recipe
    from hf_rebasin.run.plan import streams

    recipe_path = write_recipe(root, shape, strategy, folders, args.max_iter)
    model_bytes = disk_bytes(folders[0])
    result = Result(shape, strategy, -1, streams(load_recipe(recipe_path)), model_gb=model_bytes / GB)
    log = root / "logs" / f"{shape}-{strategy}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = ["/usr/bin/time", "-v", "hf-rebasin", str(recipe_path)]
    print(f"run: {' '.join(command)}  (streamed: {result.streamed}; log {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: time and hf-rebasin
            _, stderr = proc.communicate()
            result.error = f"timeout after {args.timeout}s"
    with open(log, "a") as out:
        out.write(stderr)
    result.exit_code = proc.returncode
    peak, wall, status = time_v(stderr)
    result.wall_s = wall if wall is not None else time.perf_counter() - start
    if peak is not None:
        result.peak_rss_gb = peak / GB
        result.rss_per_model = peak / model_bytes
        if base is not None:
            result.above_base_per_model = (peak - base) / model_bytes
    if status is not None:
        result.exit_code = status
    output = root / "out" / f"{shape}-{strategy}"
    record = output / "rebasin.json"
    if result.exit_code == 0 and record.is_file():
        result.timings = {k: float(v) for k, v in json.loads(record.read_text()).get("timings", {}).items()}
        result.output_gb = disk_bytes(output) / GB
        result.output_dtypes = stored_dtypes(output)
    elif result.error is None:
        tail = [line for line in stderr.splitlines() if line.strip() and not line.startswith("\t")]
        result.error = " | ".join(tail[-3:]) or f"exit {result.exit_code}"
    print(f"run: {strategy} done in {result.wall_s:.1f}s, exit {result.exit_code}", flush=True)
    return result


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table(results: list[Result]) -> str:
    stages = [s for s in STAGES if any(r.timings.get(s, 0) > 0 for r in results)]
    for r in results:
        stages += [k for k, v in r.timings.items() if k not in stages and k not in STAGES and v > 0]
    head = [
        "shape",
        "strategy",
        "exit",
        "streamed",
        "wall s",
        *(f"{s} s" for s in stages),
        "peak RSS GB",
        "RSS / model",
        "(RSS − base) / model",
        "model GB",
        "output GB",
        "output dtype",
    ]
    rows = [head, ["---"] * len(head)]
    for r in results:
        rows.append(
            [
                r.shape,
                r.strategy,
                str(r.exit_code),
                "yes" if r.streamed else "no",
                _num(r.wall_s, ".1f"),
                *(_num(r.timings.get(s), ".1f") for s in stages),
                _num(r.peak_rss_gb, ".2f"),
                _num(r.rss_per_model, ".2f") + ("×" if r.rss_per_model is not None else ""),
                _num(r.above_base_per_model, ".2f") + ("×" if r.above_base_per_model is not None else ""),
                f"{r.model_gb:.3f}",
                _num(r.output_gb, ".3f"),
                ",".join(r.output_dtypes) or "—",
            ]
        )
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines += [f"\n{r.strategy}: {r.error}" for r in results if r.error]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument("--strategies", nargs="+", default=["vanilla"], choices=STRATEGIES)
    p.add_argument("--root", type=Path, default=Path("/tmp/hf-rebasin-bench"), help="models, recipes, outputs")
    p.add_argument("--max-iter", type=int, default=None, help="passes (max_iter / iterations) of iterative strategies")
    p.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per run (default 3 hours)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--make-only", action="store_true", help="write the models, run nothing")
    args = p.parse_args()
    root = args.root.expanduser().absolute()
    folders = make(args.shape, root)
    if args.make_only:
        return
    base = baseline_rss(args.shape)
    results = [run_one(args.shape, s, root, folders, args, base) for s in args.strategies]
    print()
    if base is not None:
        print(f"base = {base / GB:.2f} GB (imports alone); model = one input model's safetensors bytes\n")
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    if any(r.exit_code != 0 for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
