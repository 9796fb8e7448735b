"""Bad-input corpus rows: loading (see tests/bad_input.py).

Code from a repository must never run, a checkpoint with non-finite or extra tensors is a user error
found at load, a config over small weights is checked against the safetensors headers before any
allocation, and config.json values that cannot describe a model are user errors naming the field.
"""

from __future__ import annotations

import io
import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from bad_input import Case, Outcome, Workspace, untouched

MARKER = "REPOSITORY_CODE_RAN"
# a module that, if it is ever imported, leaves a marker file beside itself
EVIL = (
    "from pathlib import Path\n"
    f"Path(__file__).with_name({MARKER!r}).write_text('ran')\n"
    "class Evil:  # what auto_map names\n"
    "    pass\n"
)

# -- helpers ------------------------------------------------------------------------------------


def _untouched(ws: Workspace, result: Outcome) -> None:
    """Nothing written: the inputs as they were, no output folder, no leftovers, no code ran."""
    untouched(ws, result)
    assert not list(ws.root.rglob(MARKER)), "repository code ran"


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _merge(ws: Workspace, **changes: Any) -> list[str]:
    """The vanilla merge of ./a and ./b (built if missing) with top-level sections replaced."""
    body = yaml.safe_load(ws.merge_recipe().read_text(encoding="utf-8"))
    body.update(changes)
    recipe = ws.recipe(body)
    ws.snapshot()
    return [str(recipe)]


def _poison(folder: Path, name: str, value: float, *, extra: bool = False) -> None:
    """Put ``value`` into tensor ``name`` of ``folder``'s model.safetensors (or add it as a new tensor)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    if extra:
        tensors[name] = torch.full((3,), value)
    else:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[1] = value
    save_file(tensors, str(path), metadata={"format": "pt"})


def _verify(ws: Workspace, folder: str = "a") -> list[str]:
    ws.snapshot()
    return ["verify", f"./{folder}"]


# -- code from a repository ---------------------------------------------------------------------


def _auto_map_config(ws: Workspace) -> list[str]:
    a = ws.model("a", seed=0)
    _edit_json(a / "config.json", auto_map={"AutoModelForCausalLM": "evil.Evil"})
    ws.write("a/evil.py", EVIL)
    return _merge(ws)


def _digits(ws: Workspace) -> None:
    from PIL import Image

    for i in range(6):
        buf = io.BytesIO()
        Image.new("L", (8, 8), color=i * 40).save(buf, format="PNG")
        ws.write(f"digits/{i % 3}/{i}.png", buf.getvalue())


def _auto_map_preprocessor(ws: Workspace) -> list[str]:
    import transformers as T

    processor = T.ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5], image_std=[0.5])
    for name, seed in (("a", 0), ("b", 1)):
        folder = ws.model(name, kind="vit", seed=seed)
        processor.save_pretrained(str(folder))
    _edit_json(ws.root / "a" / "preprocessor_config.json", auto_map={"AutoImageProcessor": "evil.Evil"})
    ws.write("a/evil.py", EVIL)
    _digits(ws)
    evaluate = {
        "task": "image-classification",
        "data": {"dataset": "imagefolder", "data_dir": "digits"},
        "points": 3,
        "compare": [],
    }
    return _merge(ws, job="barrier", evaluate=evaluate)


def _auto_map_tokenizer(ws: Workspace) -> list[str]:
    a = ws.model("a", seed=0)
    _edit_json(a / "tokenizer_config.json", auto_map={"AutoTokenizer": ["evil.Evil", None]})
    ws.write("a/evil.py", EVIL)
    recipe = ws.merge_recipe(evaluate=True)
    ws.snapshot()
    return [str(recipe)]


def _auto_map_generation(ws: Workspace) -> list[str]:
    ws.model("a", seed=0)
    ws.write("a/generation_config.json", json.dumps({"auto_map": {"AutoModelForCausalLM": "evil.Evil"}}))
    ws.write("a/evil.py", EVIL)
    return _verify(ws)


# -- non-finite, extra and tied weights ---------------------------------------------------------

POISONED = "transformer.h.1.mlp.c_fc.weight"


def _nan_verify(ws: Workspace) -> list[str]:
    _poison(ws.model("a", seed=0), POISONED, float("nan"))
    return _verify(ws)


def _nan_merge(ws: Workspace) -> list[str]:
    ws.model("a", seed=0)
    _poison(ws.model("b", seed=1), POISONED, float("nan"))
    return _merge(ws)


def _inf_weight_matching(ws: Workspace) -> list[str]:
    ws.model("a", seed=0)
    _poison(ws.model("b", seed=1), "transformer.h.0.attn.c_attn.weight", float("inf"))
    return _merge(ws, strategy="weight-matching")


def _tied_untied(ws: Workspace) -> list[str]:
    ws.model("a", seed=0)
    ws.model("b", kind="gpt2-untied", seed=1)
    return _merge(ws, strategy="weight-matching")


def _tied_head_apart_verify(ws: Workspace) -> list[str]:
    """config.json ties the head, the file stores it with other values: transformers loads it untied."""
    from safetensors.torch import load_file, save_file

    path = ws.model("a", seed=0) / "model.safetensors"
    tensors = load_file(str(path))
    noise = torch.randn(tensors["transformer.wte.weight"].shape, generator=torch.Generator().manual_seed(7))
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 0.1 * noise
    save_file(tensors, str(path), metadata={"format": "pt"})
    return _verify(ws)


def _extra_tensor(ws: Workspace) -> list[str]:
    _poison(ws.model("a", seed=0), "transformer.h.0.mlp.backdoor", 1.0, extra=True)
    return _verify(ws)


def _quantized(ws: Workspace) -> list[str]:
    """A GPTQ repo's config (its weights would be packed int32 qweight / scales / zeros)."""
    ws.model("a", seed=0)
    _edit_json(ws.model("b", seed=1) / "config.json", quantization_config={"quant_method": "gptq", "bits": 4})
    return _merge(ws, strategy="weight-matching")


def _int8_matrix(ws: Workspace) -> list[str]:
    """One matrix stored as int8 among float ones (a hand-quantized export)."""
    from safetensors.torch import load_file, save_file

    ws.model("a", seed=0)
    path = ws.model("b", seed=1) / "model.safetensors"
    tensors = load_file(str(path))
    name = "transformer.h.1.mlp.c_fc.weight"
    tensors[name] = (tensors[name] * 100).round().clamp(-127, 127).to(torch.int8)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return _merge(ws, strategy="weight-matching")


def _n_layer_huge(ws: Workspace) -> list[str]:
    _edit_json(ws.model("a", seed=0) / "config.json", n_layer=20000)
    return _verify(ws)


_STARTED: dict[Path, tuple[float, int]] = {}


def _n_layer_huge_measured(ws: Workspace) -> list[str]:
    argv = _n_layer_huge(ws)
    _STARTED[ws.root] = (time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return argv


def _fast_and_small(ws: Workspace, result: Outcome) -> None:
    """Refused in seconds, without allocating the layers the config asks for (5.4 GB)."""
    _untouched(ws, result)
    start, rss = _STARTED.pop(ws.root)
    assert time.perf_counter() - start < 10.0, f"took {time.perf_counter() - start:.1f} s"
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024  # ru_maxrss: KiB on Linux
    assert grown_mb < 500, f"peak memory grew by {grown_mb:.0f} MiB"


# -- config.json values -------------------------------------------------------------------------


def _config(**changes: Any) -> Any:
    def build(ws: Workspace) -> list[str]:
        _edit_json(ws.model("a", seed=0) / "config.json", **changes)
        return _verify(ws)

    return build


def _config_merge(**changes: Any) -> Any:
    def build(ws: Workspace) -> list[str]:
        _edit_json(ws.model("b", seed=1) / "config.json", **changes)
        ws.model("a", seed=0)
        return _merge(ws)

    return build


# -- checkpoint files ---------------------------------------------------------------------------


def _sharded(ws: Workspace, index: str) -> list[str]:
    a = ws.model("a", seed=0)
    (a / "model.safetensors").rename(a / "model-00001-of-00001.safetensors")
    ws.write("a/model.safetensors.index.json", index)
    return _verify(ws)


def _lora_pickle(ws: Workspace) -> list[str]:
    ws.model("base", seed=0)
    ws.model("target", seed=1)
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["c_fc"],
        "fan_in_fan_out": True,
    }
    ws.write("lora/adapter_config.json", json.dumps(config))
    ws.write("lora/adapter_model.bin", b"PK\x03\x04 this is not a torch pickle" * 4)
    ws.text("task.txt")
    body = {
        "job": "transport",
        "base": "./base",
        "finetuned": "./lora",
        "target": "./target",
        "strategy": "weight-matching",
        "calibrate": False,
        "evaluate": {"task": "causal-lm", "data": {"dataset": "text", "data_files": "task.txt"}},
        "output": {"dir": "out"},
        "allow_pickle": True,
        "device": "cpu",
    }
    recipe = ws.recipe(body)
    ws.snapshot()
    return [str(recipe)]


def _pickle_only(ws: Workspace) -> list[str]:
    a = ws.model("a", seed=0)
    import transformers as T

    model = T.GPT2LMHeadModel.from_pretrained(str(a))
    torch.save(model.state_dict(), a / "pytorch_model.bin")
    (a / "model.safetensors").unlink()
    return _merge(ws)


def _lying_header(ws: Workspace) -> list[str]:
    a = ws.model("a", seed=0)
    data = (a / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"] = [0, 10**12]  # past the end of the file
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    ws.write("a/model.safetensors", len(raw).to_bytes(8, "little") + raw + data[8 + size :])
    return _verify(ws)


CASES: list[Case] = [
    # code from a repository
    Case(
        "auto-map-config",
        "repository code",
        _auto_map_config,
        2,
        needles=("models.0.model", "auto_map", "config.json", "never runs repository code"),
        check=_untouched,
    ),
    Case(
        "auto-map-preprocessor-vit",
        "repository code",
        _auto_map_preprocessor,
        2,
        needles=("preprocessor_config.json", "auto_map", "never runs repository code"),
        check=_untouched,
        subprocess=True,
        before="exit 2 'no usable image processor' with stdin closed; in a terminal transformers asks "
        "'Do you wish to run the custom code?' behind the progress bar and runs evil.py on y",
    ),
    Case(
        "auto-map-tokenizer-gpt2",
        "repository code",
        _auto_map_tokenizer,
        2,
        needles=("tokenizer_config.json", "auto_map", "never runs repository code"),
        check=_untouched,
        subprocess=True,
        before="exit 2 'no usable tokenizer' with stdin closed; in a terminal transformers asks to run evil.py",
    ),
    Case(
        "auto-map-generation-config",
        "repository code",
        _auto_map_generation,
        2,
        needles=("generation_config.json", "auto_map"),
        check=_untouched,
        before="exit 0, verify OK (auto_map in generation_config.json not looked at)",
    ),
    # non-finite, extra and tied weights
    Case(
        "nan-weight-verify",
        "weights",
        _nan_verify,
        2,
        needles=(POISONED, "model.safetensors", "NaN"),
        check=_untouched,
        before="exit 0, verify says max |Δ| = 0 … OK",
    ),
    Case(
        "nan-weight-merge",
        "weights",
        _nan_merge,
        2,
        needles=("models.1.model", POISONED, "NaN"),
        check=_untouched,
        before="exit 0, NaN written into the merged model",
    ),
    Case(
        "inf-weight-weight-matching",
        "weights",
        _inf_weight_matching,
        2,
        needles=("transformer.h.0.attn.c_attn.weight", "Inf"),
        check=_untouched,
        before="exit 1, the solver fails (internal error)",
    ),
    Case(
        "tied-a-untied-b",
        "weights",
        _tied_untied,
        2,
        needles=("lm_head.weight", "tie_word_embeddings"),
        check=_untouched,
        before="exit 0, B's lm_head dropped, function_preserved 3.8e-2 against 1e-4",
    ),
    Case(
        "tied-head-stored-apart-verify",
        "weights",
        _tied_head_apart_verify,
        0,
        needles=("OK: outputs unchanged", "lm_head.weight differs from transformer.wte.weight", "read untied"),
        check=_untouched,
        before="exit 1, 'FAILED: the transform changed the outputs' (max |Δ| = 1.83): the tie applied to a head "
        "stored with other values",
    ),
    Case(
        "extra-tensor",
        "weights",
        _extra_tensor,
        2,
        needles=("transformer.h.0.mlp.backdoor", "model.safetensors"),
        check=_untouched,
        before="exit 0, the extra tensor silently dropped",
    ),
    Case(
        "n-layer-20000",
        "bounded work",
        _n_layer_huge_measured,
        2,
        needles=("n_layer", "20000", "2 layers"),
        check=_fast_and_small,
        before="allocates the 20000 layers (5.4 GB) before the shape check is skipped (names differ)",
    ),
    # config.json values
    Case(
        "architectures-auto-tokenizer",
        "config",
        _config(architectures=["AutoTokenizer"]),
        2,
        needles=("architectures", "AutoTokenizer", "config.json"),
        check=_untouched,
        before="exit 1, AutoTokenizer(config) called (internal error)",
    ),
    Case(
        "architectures-os",
        "config",
        _config(architectures=["os"]),
        2,
        needles=("architectures", "'os'"),
        check=_untouched,
        before="exit 1, the os module is called (internal error)",
    ),
    Case(
        "architectures-bert-in-gpt2",
        "config",
        _config_merge(architectures=["BertForMaskedLM"]),
        2,
        needles=("models.1.model", "architectures", "BertForMaskedLM", "gpt2"),
        check=_untouched,
        before="exit 1, BertForMaskedLM built from a GPT2Config (internal error)",
    ),
    Case(
        "n-embd-negative",
        "config",
        _config(n_embd=-64),
        2,
        needles=("n_embd", "-64"),
        check=_untouched,
        before="exit 1 (internal error)",
    ),
    Case(
        "n-head-does-not-divide",
        "config",
        _config(n_embd=64, n_head=7),
        2,
        needles=("n_head", "7", "n_embd", "64"),
        check=_untouched,
        before="exit 1 (internal error)",
    ),
    Case(
        "n-layer-fractional",
        "config",
        _config(n_layer=2.5),
        2,
        needles=("n_layer", "2.5"),
        check=_untouched,
        before="exit 1 (internal error)",
    ),
    # checkpoint files
    Case(
        "shard-index-not-json",
        "checkpoint",
        lambda ws: _sharded(ws, "{not json"),
        2,
        needles=("model.safetensors.index.json", "JSON"),
        check=_untouched,
        before="exit 1, JSONDecodeError (internal error)",
    ),
    Case(
        "shard-index-without-weight-map",
        "checkpoint",
        lambda ws: _sharded(ws, json.dumps({"metadata": {}})),
        2,
        needles=("model.safetensors.index.json", "weight_map"),
        check=_untouched,
        before="exit 1, KeyError 'weight_map' (internal error)",
    ),
    Case(
        "shard-index-escapes-folder",
        "checkpoint",
        lambda ws: _sharded(ws, json.dumps({"weight_map": {"transformer.wte.weight": "../../etc/passwd"}})),
        2,
        needles=("model.safetensors.index.json", "../../etc/passwd"),
        check=_untouched,
    ),
    Case(
        "lora-pickle-unreadable",
        "checkpoint",
        _lora_pickle,
        2,
        needles=("finetuned.model", "adapter_model.bin"),
        check=_untouched,
        before="exit 1, UnpicklingError (internal error)",
    ),
    Case(
        "quantized-checkpoint",
        "checkpoint",
        _quantized,
        2,
        needles=("models.1.model", "quantization_config", "'gptq'", "unquantized"),
        check=_untouched,
        before="exit 1, internal error: ImportError: Loading a GPTQ quantized model requires optimum",
    ),
    Case(
        "int8-matrix",
        "checkpoint",
        _int8_matrix,
        2,
        needles=("models.1.model", "transformer.h.1.mlp.c_fc.weight", "int8", "unquantized"),
        check=_untouched,
        before="exit 1, internal error: RuntimeError: self and mat2 must have the same dtype",
    ),
    Case(
        "pickle-without-allow-pickle",
        "checkpoint",
        _pickle_only,
        2,
        needles=("pytorch_model.bin", "allow_pickle"),
        check=_untouched,
    ),
    Case(
        "safetensors-lying-header",
        "checkpoint",
        _lying_header,
        2,
        needles=("model.safetensors",),
        check=_untouched,
    ),
]
