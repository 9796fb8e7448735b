"""Runs through the streamed and the in-memory path, compared file by file with the safetensors
library (for tests of streaming)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open

from hf_rebasin.cli import main


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, read by the safetensors library."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def run_cli(recipe: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, *, stream: bool) -> tuple[int, str]:
    monkeypatch.setattr(importlib.import_module("hf_rebasin.run.plan"), "streamed", lambda _recipe, _models: stream)
    capsys.readouterr()
    code = main([str(recipe)])
    return code, " ".join(capsys.readouterr().err.split())


def both_ways(
    body: dict[str, Any], root: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, *, exact: bool = True
) -> tuple[Path, Path]:
    """The recipe ``body`` run in memory, then streamed: (memory output, streamed output), each
    checked to hold the same tensors, dtypes included (``exact=False``: within a bf16 step of each
    other, for solutions computed from sums in another order)."""
    out = []
    for stream in (False, True):
        name = "streamed" if stream else "memory"
        output = {**body.get("output", {}), "dir": str(root / name)}
        recipe = root / f"{name}.yaml"
        recipe.write_text(yaml.safe_dump({**body, "output": output, "cache": False}), encoding="utf-8")
        code, err = run_cli(recipe, capsys, monkeypatch, stream=stream)
        assert code == 0, err
        out.append(root / name)
    want, got = safetensors_of(out[0]), safetensors_of(out[1])
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype, k
        if exact:
            assert torch.equal(got[k], t), k
        else:
            step = 2**-7 * float(t.float().abs().max())  # bf16 keeps 8 significant bits
            assert float((got[k].float() - t.float()).abs().max()) <= step, k
    return out[0], out[1]


def notes_of(folder: Path) -> str:
    return " ".join(json.loads((folder / "rebasin.json").read_text())["notes"])
