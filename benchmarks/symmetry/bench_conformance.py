"""The checkpoint conformance table: family × layout → loaded like stock transformers, verify, merge.

    python benchmarks/symmetry/bench_conformance.py                 # every case (~5 min on 2 cores)
    python benchmarks/symmetry/bench_conformance.py --families gpt2 bert-base --layouts legacy-buffers base-class

Each case writes a tiny model of the family in the layout (`tests/checkpoints.py`: how repositories
store checkpoints, written with safetensors and torch.save, not with hf-rebasin), then measures:
- ``stock``: hf-rebasin's loaded tensors, in memory and streamed, equal ``from_pretrained``'s
  (``torch.equal`` on every tensor): yes / no;
- ``ignored``: how many tensors of the files loading dropped (legacy buffers);
- ``verify``: max |Δ outputs| under a random allowed permutation (`hf_rebasin.alignment.verify.verify_model`);
- ``merge``: a weight-matching merge (``hf-rebasin RECIPE``) of the checkpoint with a copy whose MLP
  units are permuted (written in the same layout): max |Δ| between the output and the original,
  both read with the stock class.
Prints a Markdown table per measure (rows: layouts, columns: families; ``—`` where a layout does not
exist for a family) and the worst value of each.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import checkpoints as C
from hf_rebasin.alignment.verify import verify_model
from hf_rebasin.cli import main
from hf_rebasin.io.models import load_model


def _stock(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    return dict(type(model).from_pretrained(str(folder), dtype=torch.float32).state_dict())


def measure(family: str, layout: str, root: Path) -> dict[str, object]:
    """The four measures of one case."""
    model = C.FAMILIES[family](0)
    a, b = root / f"{family}-{layout}-a", root / f"{family}-{layout}-b"
    a.mkdir()
    b.mkdir()
    C.LAYOUTS[layout](model, a)
    C.LAYOUTS[layout](C.permuted_mlp(model), b)
    stock = _stock(model, a)
    ours = load_model(a, allow_pickle=True)
    streamed = load_model(a, allow_pickle=True, stream=True)
    same = all(
        torch.equal(ours.model.state_dict()[k], v) and torch.equal(streamed.weights[k].to(v.dtype), v)
        for k, v in stock.items()
    )
    verify = verify_model(ours.model, "permutation", seed=0).max_abs_diff
    out = root / f"{family}-{layout}-out"
    recipe = root / f"{family}-{layout}.yaml"
    body = {"job": "merge", "models": [str(a), str(b)], "strategy": {"name": "weight-matching"}, "cache": False}
    body |= {"allow_pickle": layout.startswith("pickle"), "output": {"dir": str(out)}}
    recipe.write_text(yaml.safe_dump(body))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main([str(recipe)])
    merge: object = f"exit {code}"
    if code == 0:
        merged = _stock(model, out)
        merge = max(float((merged[k] - v).abs().max()) for k, v in stock.items() if v.numel())
    return {"stock": "yes" if same else "no", "ignored": len(ours.ignored), "verify": verify, "merge": merge}


def _cell(value: object) -> str:
    return f"{value:.1e}" if isinstance(value, float) else str(value)


def main_(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", default=list(C.FAMILIES), choices=list(C.FAMILIES))
    parser.add_argument("--layouts", nargs="*", default=list(C.LAYOUTS), choices=list(C.LAYOUTS))
    args = parser.parse_args(argv)
    results: dict[tuple[str, str], dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            for layout in args.layouts:
                if C.applies(family, layout):
                    results[family, layout] = measure(family, layout, Path(tmp))
                    print(f"{family:12s} {layout:15s} {results[family, layout]}", file=sys.stderr)
    for key in ("stock", "ignored", "verify", "merge"):
        print(f"\n{key}\n")
        print("| layout | " + " | ".join(args.families) + " |")
        print("|---|" + "---:|" * len(args.families))
        for layout in args.layouts:
            cells = [_cell(results[f, layout][key]) if (f, layout) in results else "—" for f in args.families]
            print(f"| {layout} | " + " | ".join(cells) + " |")
        values = [r[key] for r in results.values()]
        floats = [v for v in values if isinstance(v, float)]
        if floats:
            print(
                f"\nworst {key}: {max(floats):.2e} over {len(floats)} cases; not measured: {len(values) - len(floats)}"
            )
    print(f"\n{len(results)} cases")


if __name__ == "__main__":
    main_()
