"""Memory and time of a streamed merge whose vocabularies differ, at a real Hub shape.

    python benchmarks/vocabularies/bench_vocab_scale.py --shape tinyllama
    python benchmarks/vocabularies/bench_vocab_scale.py --shape mistral7b --timeout 7200

Two random bf16 models of the shape (`bench_scale.make_model`, 2 GB shards): seed 0 with the
shape's 32,000 rows and a tokenizer of 32,000 tokens, and seed 1 as an *extended release* (as
Mistral-7B v0.3 grew v0.1's 32,000 ids to 32,768 and kept the first 32,000): 32,768 rows, the same
32,000 tokens at the same ids, then 768 control tokens of its own. A ``job: merge`` recipe
(``vanilla``, ``tokenizer: {source: union}``, no ``evaluate`` or ``data``: the streamed path) runs
as ``/usr/bin/time -v hf-rebasin RECIPE``. Printed: wall seconds, the stages of ``rebasin.json``,
peak RSS in GB and as a multiple of one model's bytes on disk, and the dry run's estimate.

Checked independently of hf-rebasin, from the files with ``safetensors.safe_open``: the output's
embedding and LM head have 32,768 rows; the 32,000 shared rows are the mean of the two models'
(within one bf16 rounding); the 768 rows only the extended release has are its rows exactly
(mergekit's rule for a token one model has). ``AutoTokenizer`` and ``AutoConfig`` load the output
with 32,768 tokens and ``vocab_size`` 32,768, and every control token encodes to its row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import tokenizers
import torch
import transformers as T
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scale"))
import bench_scale  # the benchmark's own model writer, from its folder

GB = 1e9
EXTRA = 768  # tokens the extended release adds (Mistral v0.3: 32,000 → 32,768)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tokenizer(tokens: int, extra: int = 0) -> T.PreTrainedTokenizerFast:
    """A BPE vocabulary of ``tokens`` ids (``<unk> <s> </s> ▁t3 …``), then ``extra`` control tokens."""
    vocab = ["<unk>", "<s>", "</s>"] + [f"▁t{i}" for i in range(3, tokens)]
    data = {
        "version": "1.0",
        "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab)}, "merges": []},
        "added_tokens": [],
    }
    backend = tokenizers.Tokenizer.from_str(json.dumps(data))
    tok = T.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_tokens([f"[control_{i}]" for i in range(extra)], special_tokens=True)
    return tok


def make(shape: str, root: Path) -> tuple[Path, Path]:
    """Seed 0 of ``shape`` and seed 1 as its extended release, each with its tokenizer."""
    config_cls, model_cls, kwargs = bench_scale.SHAPES[shape]
    rows = int(kwargs["vocab_size"])
    extended = f"{shape}-extended"
    bench_scale.SHAPES[extended] = (config_cls, model_cls, {**kwargs, "vocab_size": rows + EXTRA})
    a = bench_scale.model_folder(root, shape, "2gb", 0)
    b = bench_scale.model_folder(root, extended, "2gb", 1)
    bench_scale.make_model(shape, "2gb", a, 0)
    bench_scale.make_model(extended, "2gb", b, 1)
    for folder, extra in ((a, 0), (b, EXTRA)):
        if not (folder / "tokenizer.json").is_file():
            tokenizer(rows, extra).save_pretrained(str(folder))
    return a, b


def run(a: Path, b: Path, root: Path, timeout: float) -> dict[str, object]:
    """The merge under ``/usr/bin/time -v``: wall, stages, peak RSS, the dry run's estimate."""
    out = root / f"out-{a.name}-{b.name}"
    recipe = root / f"recipe-{a.name}-{b.name}.yaml"
    body = {
        "job": "merge",
        "models": [str(a), str(b)],
        "strategy": "vanilla",
        "tokenizer": {"source": "union"},
        "output": {"dir": str(out), "overwrite": True},
        "cache": False,
    }
    recipe.write_text(yaml.safe_dump(body, sort_keys=False))
    estimate, _ = bench_scale.dry_run_estimate(recipe)
    start = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-v", "hf-rebasin", str(recipe)], capture_output=True, text=True, timeout=timeout, check=False
    )
    peak, wall, status = bench_scale.time_v(done.stderr)
    if status != 0:
        raise SystemExit(f"the run failed (exit {status}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    record = json.loads((out / "rebasin.json").read_text())
    one = bench_scale.disk_bytes(a)
    return {
        "out": out,
        "wall_s": wall if wall is not None else time.perf_counter() - start,
        "stages": {k: round(float(v), 1) for k, v in (record.get("timings") or {}).items()},
        "peak_gb": (peak or 0) / GB,
        "times_one_model": (peak or 0) / one,
        "one_model_gb": one / GB,
        "estimate_gb": estimate,
        "streamed": any("weights streamed" in n for n in record.get("notes", [])),
        "rows": int(json.loads((a / "config.json").read_text())["vocab_size"]),
    }


def check(a: Path, b: Path, out: Path) -> dict[str, object]:
    """The output's rows, tokenizer and config against the inputs' files (module docstring)."""
    from safetensors import safe_open

    def tensor(folder: Path, name: str) -> torch.Tensor:
        for file in bench_scale.safetensors_files(folder):
            with safe_open(str(file), framework="pt") as f:
                if name in f.keys():
                    return f.get_tensor(name)
        raise SystemExit(f"{folder}: no tensor {name}")

    worst_shared, worst_own = 0.0, 0.0
    rows = 0
    for name in (EMBED, HEAD):
        ta, tb, to = (tensor(f, name).float() for f in (a, b, out))
        rows = ta.shape[0]
        if to.shape[0] != tb.shape[0]:
            raise SystemExit(f"{name}: {to.shape[0]} rows written, the extended release has {tb.shape[0]}")
        mean = ((ta + tb[:rows]) / 2).to(torch.bfloat16).float()
        worst_shared = max(worst_shared, float(((to[:rows] - mean).abs() / mean.abs().clamp(min=1e-3)).max()))
        worst_own = max(worst_own, float((to[rows:] - tb[rows:]).abs().max()))
    tok = T.AutoTokenizer.from_pretrained(str(out))
    config = T.AutoConfig.from_pretrained(str(out))
    ids = tok.convert_tokens_to_ids([f"[control_{i}]" for i in range(EXTRA)])
    encodes = ids == list(range(rows, rows + EXTRA)) and tok("[control_5]")["input_ids"][-1] == rows + 5
    result = {
        "shared rows: max relative |Δ| to the mean (bf16)": worst_shared,
        "extended rows: max |Δ| to the release's": worst_own,
        "tokenizer tokens": len(tok),
        "config vocab_size": config.vocab_size,
        "control tokens at their rows": encodes,
    }
    if worst_shared > 2**-7 or worst_own != 0.0 or len(tok) != rows + EXTRA or not encodes:
        raise SystemExit(f"check failed: {result}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tinyllama", choices=["small", "tinyllama", "mistral7b"])
    p.add_argument("--root", type=Path, default=Path("/tmp/hf-rebasin-bench"))
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args()
    a, b = make(args.shape, args.root)
    found = run(a, b, args.root, args.timeout)
    checked = check(a, b, Path(str(found["out"])))
    stages = " / ".join(f"{k} {v}" for k, v in found["stages"].items())  # type: ignore[attr-defined]
    print(
        "\n| shape | pair | path | wall | stages (s) | peak RSS | × one model | dry-run estimate |\n"
        "|---|---|---|---:|---|---:|---:|---:|\n"
        f"| {args.shape} ({found['one_model_gb']:.2f} GB) | {found['rows']:,} → {found['rows'] + EXTRA:,} rows, union | "
        f"{'streamed' if found['streamed'] else 'in memory'} | {found['wall_s']:.0f} s | {stages} | "
        f"{found['peak_gb']:.2f} GB | {found['times_one_model']:.2f}× | {found['estimate_gb'] or 0:.2f} GB |"
    )
    for k, v in checked.items():
        print(f"check: {k}: {v}")


if __name__ == "__main__":
    main()
