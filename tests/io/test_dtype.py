"""dtypes: a bf16 model comes out bf16 (half the bytes of float32), the work runs in float32.

Inputs are tiny GPT-2 saved with ``model.to(dtype).save_pretrained``; outputs are read back with
``safetensors.safe_open`` and ``AutoModelForCausalLM.from_pretrained(dtype="auto")``, independently
of hf-rebasin. Runs go through the CLI in process (``cli.main``) to stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

import tiny
from hf_rebasin.cli import main
from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text
from hf_rebasin.io.models import load_model


@pytest.fixture(scope="module")
def text() -> str:
    return shakespeare_text(["hamlet"])[:2000].lower()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, text: str) -> dict[str, Path]:
    """Two tiny GPT-2 in bf16 and B in float32 too, with a character tokenizer, and a corpus."""
    root = tmp_path_factory.mktemp("dtype")
    tok = char_tokenizer(text)
    out: dict[str, Path] = {}
    for name, seed, dtype in (("a16", 0, torch.bfloat16), ("b16", 1, torch.bfloat16), ("b32", 1, torch.float32)):
        folder = root / name
        tiny.gpt2(seed).to(dtype).save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
        out[name] = folder
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    out["root"] = root
    return out


def _run(
    root: Path, name: str, models: list[Path], capsys: Any, evaluated: bool = True, **output: Any
) -> tuple[int, str, Path]:
    """A vanilla merge recipe of ``models`` evaluated on the corpus (or not: the streamed path);
    (exit code, stderr, output folder)."""
    body: dict[str, Any] = {
        "job": "merge",
        "models": [str(m) for m in models],
        "strategy": {"name": "vanilla"},
        "output": {"dir": f"out/{name}", **output},
        "cache": False,
    }
    if evaluated:
        body["evaluate"] = {"task": "causal-lm", "data": {"dataset": "text", "data_files": "corpus.txt"}, "points": 2}
    recipe = root / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(body), encoding="utf-8")
    capsys.readouterr()
    code = main([str(recipe)])
    captured = capsys.readouterr()
    return code, " ".join(captured.err.split()), root / "out" / name


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """A folder's weights in float32 (exactly the values a bf16 file holds), loaded by transformers."""
    model = T.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return dict(model.state_dict())


def _stored(folder: Path) -> set[str]:
    """The dtypes in model.safetensors, read without hf-rebasin."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as h:
        return {str(h.get_slice(k).get_dtype()) for k in h.keys()}


def test_bf16_merge_is_written_in_bf16_at_half_the_size(folders: dict[str, Path], capsys: Any) -> None:
    root, a, b = folders["root"], folders["a16"], folders["b16"]
    code, err, out = _run(root, "bf16", [a, b], capsys)
    assert code == 0, err
    assert _stored(out) == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = T.AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    record = json.loads((out / "rebasin.json").read_text())
    assert record["dtype"] == {
        "inputs": {"A": "bfloat16", "B": "bfloat16"},
        "output": "bfloat16",
        "from": "A",
        "compute": "float32",
        "kept": {},
    }
    card = (out / "README.md").read_text()
    assert "stored as bfloat16 (model A's dtype)" in card and "rounded to bfloat16" in card

    # the merged model is scored as written: the loss of the bf16 weights (computed in float32)
    sd_a, sd_b, sd_out = _weights(a), _weights(b), _weights(out)
    assert sd_out.keys() == sd_a.keys()
    for k, v in sd_out.items():  # (a + b) / 2 is exact in float32 for bf16 values; then rounded once
        assert torch.equal(v, ((sd_a[k] + sd_b[k]) / 2).to(torch.bfloat16).float()), k

    code, err, out32 = _run(root, "f32", [a, b], capsys, dtype="float32")
    assert code == 0, err
    assert _stored(out32) == {"F32"}
    size16, size32 = ((o / "model.safetensors").stat().st_size for o in (out, out32))
    assert 0.45 < size16 / size32 < 0.55, (size16, size32)
    record32 = json.loads((out32 / "rebasin.json").read_text())
    assert record32["dtype"]["output"] == "float32" and record32["dtype"]["from"] == "output.dtype"
    # the float32 output is scored unrounded; the bf16 one after rounding: close, not equal
    loss16, loss32 = record["merged"]["vanilla"]["loss"], record32["merged"]["vanilla"]["loss"]
    assert loss16 != loss32 and abs(loss16 - loss32) < 0.05


def test_float16_output_and_mixed_inputs(folders: dict[str, Path], capsys: Any) -> None:
    root, a16, b32 = folders["root"], folders["a16"], folders["b32"]
    code, err, out = _run(root, "f16", [a16, b32], capsys, dtype="float16")
    assert code == 0, err
    assert _stored(out) == {"F16"}
    model = T.AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.float16}

    # A bf16, B float32: the output takes the reference A's dtype, and a note says so
    code, err, out = _run(root, "mixed", [a16, b32], capsys)
    assert code == 0, err
    assert _stored(out) == {"BF16"}
    record = json.loads((out / "rebasin.json").read_text())
    assert record["dtype"]["inputs"] == {"A": "bfloat16", "B": "float32"}
    assert any("different dtypes (A bfloat16, B float32)" in n and "output.dtype" in n for n in record["notes"])


def test_stored_dtype_is_read_from_the_checkpoint(folders: dict[str, Path]) -> None:
    """The header's dtype, not config.json's (which may say float32 for bf16 weights); loaded as float32."""
    folder = folders["root"] / "lying-config"
    tiny.gpt2(0).to(torch.bfloat16).save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(folder)
    assert loaded.stored_dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    pickled = folders["root"] / "pickled"  # a pickle: the dtype of its tensors
    model = tiny.gpt2(0).to(torch.float16)
    model.save_pretrained(str(pickled))
    (pickled / "model.safetensors").unlink()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    assert load_model(pickled, allow_pickle=True).stored_dtype == torch.float16


def _mixed(folder: Path, seed: int) -> dict[str, str]:
    """A tiny GPT-2 as mixed-precision checkpoints are stored: bf16 matrices, float32 norms and
    biases (every 1-D tensor), written with safetensors itself; returns tensor -> dtype as stored."""
    model = tiny.gpt2(seed)
    model.save_pretrained(str(folder))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state = {k: v if v.dim() == 1 else v.to(torch.bfloat16) for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return _dtypes(folder)


def _dtypes(folder: Path) -> dict[str, str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as h:
        return {k: str(h.get_slice(k).get_dtype()) for k in h.keys()}


@pytest.mark.parametrize("evaluated", [True, False], ids=["in-memory", "streamed"])
def test_mixed_dtypes_are_kept_per_tensor(folders: dict[str, Path], text: str, capsys: Any, evaluated: bool) -> None:
    """float32 norms beside bf16 matrices: each output tensor keeps its stored dtype (read back with
    safetensors), its value is the float32 mean rounded once to that dtype; `output.dtype` flattens."""
    root = folders["root"]
    a, b = root / f"mixed-a-{evaluated}", root / f"mixed-b-{evaluated}"
    stored = _mixed(a, 0)
    assert _mixed(b, 1) == stored and {"F32", "BF16"} == set(stored.values())
    for folder in (a, b):
        char_tokenizer(text).save_pretrained(str(folder))
    floats = sorted(k for k, d in stored.items() if d == "F32")
    assert len(floats) == 18  # per layer: ln_1, ln_2 (weight, bias), 4 linear biases; ln_f's weight and bias
    name = f"mixed-out-{evaluated}"
    code, err, out = _run(root, name, [a, b], capsys, evaluated)
    assert code == 0, err
    assert _dtypes(out) == stored
    record = json.loads((out / "rebasin.json").read_text())
    assert record["dtype"]["output"] == "bfloat16" and record["dtype"]["kept"] == {k: "float32" for k in floats}
    assert any("18 tensors in float32" in n for n in record["notes"]), record["notes"]
    with safe_open(str(a / "model.safetensors"), "pt") as ha, safe_open(str(b / "model.safetensors"), "pt") as hb:
        with safe_open(str(out / "model.safetensors"), "pt") as ho:
            for k in stored:
                mean = (ha.get_tensor(k).float() + hb.get_tensor(k).float()) / 2
                assert torch.equal(ho.get_tensor(k), mean.to(ho.get_tensor(k).dtype)), k
    model = T.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)  # the stock class loads it
    with safe_open(str(out / "model.safetensors"), "pt") as ho:
        assert torch.equal(model.transformer.ln_f.weight, ho.get_tensor("transformer.ln_f.weight"))

    flat = f"mixed-flat-{evaluated}"
    code, err, out = _run(root, flat, [a, b], capsys, evaluated, dtype="bfloat16")
    assert code == 0, err
    assert set(_dtypes(out).values()) == {"BF16"}


def test_unknown_output_dtype_is_a_user_error(folders: dict[str, Path], capsys: Any) -> None:
    root = folders["root"]
    code, err, out = _run(root, "int8", [folders["a16"], folders["b16"]], capsys, dtype="int8")
    assert code == 2, err
    assert err.startswith("error:") and "output.dtype" in err, err
    assert all(name in err for name in ("float32", "bfloat16", "float16")), err
    assert "Traceback" not in err and not out.exists()


def test_verify_a_bf16_model_compares_in_float32(folders: dict[str, Path], capsys: Any) -> None:
    capsys.readouterr()
    code = main(["verify", str(folders["a16"]), "--class", "orthogonal"])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    assert "stored as bfloat16, compared in float32" in printed
    diff = float(printed.split("max |Δ| = ")[1].split()[0])
    assert diff < 1e-4  # a bf16 comparison would be off by ~1e-2


def test_align_output_keeps_each_model_dtype(folders: dict[str, Path], capsys: Any) -> None:
    out = folders["root"] / "aligned"
    capsys.readouterr()
    code = main(
        ["align", str(folders["a16"]), str(folders["b16"]), "--strategy", "weight-matching", "--output", str(out)]
    )
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    assert _stored(out / "a") == _stored(out / "b") == {"BF16"}
    assert "each as its input is stored" in printed
    assert json.loads((out / "alignment.json").read_text())["models"]["B"]["dtype"] == "bfloat16"


def test_transported_adapter_is_written_in_its_own_dtype(tmp_path: Path) -> None:
    """Factors moved in float64 and biases computed from the float32 target go back to the adapter's bf16."""
    from hf_rebasin.merging.lora import LoraAdapter, LoraModule, save_adapter

    prefix = "base_model.model.transformer.h.0.mlp.c_fc"
    a, b = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8, 2, dtype=torch.bfloat16)
    keys = (f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight")
    module = LoraModule("transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_fc.weight", "conv1d", *keys, a, b, 1.0)
    adapter = LoraAdapter(tmp_path, {"peft_type": "LORA"}, {module.module: module})
    assert adapter.dtype == torch.bfloat16
    moved = {module.key_a: a.double(), module.key_b: b.double(), f"{prefix}.base_layer.bias": torch.zeros(8)}
    save_adapter(adapter, moved, tmp_path, base_model="target", dtype=adapter.dtype)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as h:
        assert {str(h.get_slice(k).get_dtype()) for k in h.keys()} == {"BF16"}
