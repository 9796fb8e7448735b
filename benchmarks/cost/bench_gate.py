"""What the file gate costs on a folder shaped like a real release: `gate.check_folder` timed on a
Llama-3-sized tokenizer.json (128 256 tokens, 280 000 merges, ~9 MB), a shard index and four
safetensors shards of 291 tensors (headers only: the tensors are tiny), cold and again (a run passes
a folder through the gate at plan time and at load time).

    python benchmarks/cost/bench_gate.py [--tokens 128256] [--merges 280000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf_rebasin.io import files, gate


def _folder(root: Path, tokens: int, merges: int) -> Path:
    folder = root / "model"
    folder.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096}
    config |= {"vocab_size": tokens, "num_hidden_layers": 32, "intermediate_size": 14336}
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"tok{i}": i for i in range(tokens)}
    model = {"type": "BPE", "vocab": vocab, "merges": [[f"a{i}", f"b{i}"] for i in range(merges)]}
    added = [{"id": tokens - 1 - i, "content": f"<|special_{i}|>", "special": True} for i in range(256)]
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": model, "added_tokens": added}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    weight_map: dict[str, str] = {}
    for shard in range(4):
        name = f"model-{shard + 1:05d}-of-00004.safetensors"
        tensors = {f"model.layers.{shard * 8 + j}.w{k}": torch.zeros(4, 4) for j in range(8) for k in range(9)}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128_256)
    parser.add_argument("--merges", type=int, default=280_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = _folder(Path(tmp), args.tokens, args.merges)
        size = (folder / "tokenizer.json").stat().st_size
        start = time.perf_counter()
        gate.check_folder(folder)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        gate.check_folder(folder)
        warm = time.perf_counter() - start
        start = time.perf_counter()
        files.read_json(folder / "tokenizer.json")
        parse = time.perf_counter() - start
    print(f"tokenizer.json {size / 1e6:.1f} MB, 4 shards, 288 tensors")
    print(f"check_folder, first pass: {cold:.2f} s")
    print(f"check_folder, again (files unchanged): {warm:.3f} s")
    print(f"tokenizer.json alone, read, depth-checked, parsed and typed: {parse:.2f} s")


if __name__ == "__main__":
    main()
