"""Streamed runs: models read tensor by tensor from their safetensors files, outputs written the same
way, forward passes with one submodule's weights in memory at a time.

Every streamed result is compared with the in-memory path on the same inputs (``torch.equal``, file
by file) and read back without hf-rebasin: ``safetensors.safe_open``, ``from_pretrained`` of the
stock class, logits of the stock model.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import yaml
from safetensors.torch import save_file

import tiny
from hf_rebasin.alignment.verify import example_inputs
from hf_rebasin.core import lazy
from hf_rebasin.core.errors import CheckpointError
from hf_rebasin.io import export, tensors
from hf_rebasin.io.models import load_model
from hf_rebasin.io.offload import offloaded
from hf_rebasin.symmetry.adapters import get_adapter
from streamed import both_ways, notes_of, run_cli, safetensors_of

STRATEGIES = ("vanilla", "weight-matching", "transfusion", "generalized-orthogonal")
ARCHS = ("llama", "gpt2", "vit")  # rotary + GQA; Conv1D, fused q|k|v and a tied head; LayerNorm encoder


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Two seeds of each architecture saved in bf16, sharded (several files and an index)."""
    root = tmp_path_factory.mktemp("pairs")
    out = {}
    for arch in ARCHS:
        folders = tuple(root / f"{arch}-{seed}" for seed in (0, 1))
        for seed, folder in enumerate(folders):
            getattr(tiny, arch)(seed).to(torch.bfloat16).save_pretrained(str(folder), max_shard_size=20_000)
        out[arch] = folders
    return out


# ---------------------------------------------------------------------------------------------
# Reading and writing safetensors


def test_checkpoint_source_reads_what_safetensors_reads(pairs: dict[str, tuple[Path, Path]]) -> None:
    folder = pairs["gpt2"][0]
    assert (folder / "model.safetensors.index.json").is_file()  # sharded
    loaded = load_model(folder, stream=True)
    source = loaded.source
    assert source is not None
    stored = safetensors_of(folder)
    model = T.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert list(source) == list(model.state_dict())  # the module's names, tied head included
    assert source.aliases == {"lm_head.weight": "transformer.wte.weight"}
    for name, t in model.state_dict().items():
        got = source[name]
        assert got.dtype == torch.float32 and torch.equal(got, t), name
        assert source.shape(name) == t.shape
        if name in stored:
            assert source.stored_dtypes[name] == torch.bfloat16 and torch.equal(got, stored[name].float())
    assert source.nbytes == sum(f.stat().st_size for f in folder.glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in folder.glob("*.safetensors")
    )
    assert all(p.device.type == "meta" for p in loaded.model.parameters())  # no weight loaded


def test_written_safetensors_are_read_by_the_safetensors_library(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    made = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f32": torch.randn(7, generator=g),
        "f16": torch.randn(2, 2, 2, generator=g).half(),
        "ids": torch.arange(6).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    entries = [(k, tuple(v.shape), v.dtype) for k, v in made.items()]
    produced: list[str] = []
    tensors.write_safetensors(
        tmp_path / "x.safetensors", entries, lambda k: made[k].float() if k == "bf16" else made[k], done=produced.append
    )
    assert produced == list(made)
    back = safetensors_of(tmp_path)
    assert back.keys() == made.keys()
    for k, v in made.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # and read back by hf-rebasin's reader, as float32 for floating tensors
    entries_read = tensors.read_safetensors_header(tmp_path / "x.safetensors")
    assert {k: e.shape for k, e in entries_read.items()} == {k: tuple(v.shape) for k, v in made.items()}


def test_a_produced_tensor_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="planned"):
        tensors.write_safetensors(tmp_path / "x.safetensors", [("w", (2, 2), torch.float32)], lambda _k: torch.zeros(3))


def test_non_finite_weights_are_refused_when_streamed(tmp_path: Path) -> None:
    model = tiny.llama(0)
    model.save_pretrained(str(tmp_path))
    sd = safetensors_of(tmp_path)
    sd["model.layers.1.mlp.up_proj.weight"][3, 4] = math.nan
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*NaN"):
        load_model(tmp_path, stream=True)


# ---------------------------------------------------------------------------------------------
# Forward passes with one submodule in memory


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "vit", "bert_mlm", "clip", "siglip", "gemma2", "olmo2"])
def test_offloaded_forward_gives_the_stock_models_outputs(arch: str, tmp_path: Path) -> None:
    """Every submodule's weights read when it runs (SigLIP's pooling nn.MultiheadAttention reads
    its out_proj without running it: loaded as one)."""
    model = getattr(tiny, arch)(0).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    stock = T.AutoModel.from_pretrained(str(tmp_path), dtype=torch.float32) if arch in ("clip", "siglip") else None
    stock = stock or type(model).from_pretrained(str(tmp_path), dtype=torch.float32)
    streamed = load_model(tmp_path, stream=True)
    assert streamed.source is not None
    inputs = example_inputs(get_adapter(model.config.model_type), model.config, torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = stock.eval()(**inputs)
        with offloaded(streamed.model, streamed.source) as m:
            got = m(**inputs)
    key = "logits_per_image" if arch in ("clip", "siglip") else "logits"
    if arch == "siglip":  # 8e-8 apart (its nn.MultiheadAttention pooling head): float rounding only
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
    else:
        assert torch.equal(got[key], want[key])
    assert all(p.device.type == "meta" for p in streamed.model.parameters())  # put back after the block


# ---------------------------------------------------------------------------------------------
# Runs: streamed = in memory


def _recipe(root: Path, name: str, models: tuple[Path, Path], strategy: str, **output: Any) -> Path:
    body = {
        "job": "merge",
        "models": [str(m) for m in models],
        "strategy": {"name": strategy},
        "output": {"dir": str(root / name), "max_shard_size": 15_000, **output},
        "cache": False,
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body), encoding="utf-8")
    return path


# every strategy on Llama and the rotation on every architecture in the fast suite; the rest slow
STREAMED_MERGES = [
    pytest.param(arch, strategy, id=f"{arch}-{strategy}", marks=() if fast else pytest.mark.slow)
    for arch in ARCHS
    for strategy in STRATEGIES
    for fast in [arch == "llama" or strategy == "generalized-orthogonal"]
]


@pytest.mark.parametrize(("arch", "strategy"), STREAMED_MERGES)
def test_streamed_merge_writes_what_the_in_memory_merge_writes(
    arch: str, strategy: str, pairs: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    body = {"job": "merge", "models": [str(m) for m in pairs[arch]], "strategy": strategy}
    memory, streamed = both_ways({**body, "output": {"max_shard_size": 15_000}}, tmp_path, capsys, monkeypatch)
    files = sorted(p.name for p in memory.iterdir() if p.name not in ("README.md", "rebasin.json"))
    assert sorted(p.name for p in streamed.iterdir() if p.name not in ("README.md", "rebasin.json")) == files
    assert "model.safetensors.index.json" in files  # sharded like save_pretrained shards
    assert {t.dtype for t in safetensors_of(streamed).values()} == {torch.bfloat16}
    for f in ("config.json", "model.safetensors.index.json"):
        assert json.loads((streamed / f).read_text()) == json.loads((memory / f).read_text()), f
    record = json.loads((streamed / "rebasin.json").read_text())
    assert "weights streamed" in notes_of(streamed) and "weights streamed" not in notes_of(memory)
    assert record["function_preserved"]["max_abs_diff"] <= record["function_preserved"]["tolerance"]
    # the stock class loads it, in bf16, with the merged weights
    cls = T.AutoModelForImageClassification if arch == "vit" else T.AutoModelForCausalLM
    loaded = cls.from_pretrained(str(streamed), dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_streamed_preservation_check_catches_a_broken_alignment(
    pairs: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    """The function-preservation gate runs offloaded when streamed: a wrong aligned B is refused."""
    from hf_rebasin.alignment.strategies.base import Alignment

    real = Alignment.aligned_b

    def broken(self: Alignment) -> Any:
        aligned = real(self)
        name = "model.layers.0.mlp.down_proj.weight"
        return aligned.derive(lambda k: aligned[k] * 1.5 if k == name else aligned[k])

    monkeypatch.setattr(Alignment, "aligned_b", broken)
    code, err = run_cli(_recipe(tmp_path, "out", pairs["llama"], "weight-matching"), capsys, monkeypatch, stream=True)
    assert code == 1 and "function not preserved" in err, err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_interrupted_streamed_write_leaves_no_partial_output(
    pairs: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    """Ctrl-C after the first shard: no output folder, no temporary folder; with ``overwrite`` the
    previous result stays as it was."""
    recipe = _recipe(tmp_path, "out", pairs["gpt2"], "vanilla", overwrite=True)
    real = export.write_safetensors  # patched where the streamed save calls it
    calls: list[Path] = []

    def interrupted(path: Path, *args: Any, **kwargs: Any) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(path, *args, **kwargs)

    monkeypatch.setattr(export, "write_safetensors", interrupted)
    code, err = run_cli(recipe, capsys, monkeypatch, stream=True)
    assert code == 130 and "nothing was written" in err, err
    assert len(calls) == 2 and calls[0].name.startswith("model-00001-of-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.yaml"]

    monkeypatch.setattr(export, "write_safetensors", real)
    code, err = run_cli(recipe, capsys, monkeypatch, stream=True)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    calls.clear()
    monkeypatch.setattr(export, "write_safetensors", interrupted)
    code, err = run_cli(recipe, capsys, monkeypatch, stream=True)
    assert code == 130 and "unchanged" in err, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.yaml"]


def test_merge_recipes_without_evaluation_stream() -> None:
    """Which runs stream: a data-free merge with nothing that needs whole models."""
    from hf_rebasin.recipe import loads_recipe
    from hf_rebasin.run.memory import streams

    base = {"job": "merge", "models": ["org/a", "org/b"], "strategy": "weight-matching", "output": {"dir": "o"}}
    evaluate = {"task": "causal-lm", "data": {"dataset": "shakespeare"}}
    assert streams(loads_recipe(yaml.safe_dump(base)))
    assert not streams(loads_recipe(yaml.safe_dump({**base, "evaluate": evaluate})))
    assert not streams(loads_recipe(yaml.safe_dump({**base, "job": "barrier", "evaluate": evaluate})))
    assert not streams(loads_recipe(yaml.safe_dump({**base, "merge": {"universe": {}}})))
    data = {"data": {"dataset": "shakespeare"}}
    assert streams(loads_recipe(yaml.safe_dump({**base, "strategy": "head-perm", **data})))
    learned = {"name": "generalized-orthogonal", "learned": True}
    assert not streams(loads_recipe(yaml.safe_dump({**base, "strategy": learned, **data})))


@pytest.fixture(scope="module")
def text_pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tiny Llama (rotary, GQA) and GPT-2 (fused q|k|v, tied head) pairs in bf16 with a character
    tokenizer, and a corpus."""
    from hf_rebasin.evaluation.data import char_tokenizer, shakespeare_text

    root = tmp_path_factory.mktemp("text")
    text = shakespeare_text(["hamlet"])[:3000].lower()
    tok = char_tokenizer(text)
    assert len(tok) <= tiny.V
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    out: dict[str, Any] = {"root": root}
    for arch in ("llama", "gpt2"):
        folders = []
        for seed in (0, 1):
            folder = root / f"{arch}-{seed}"
            getattr(tiny, arch)(seed).to(torch.bfloat16).save_pretrained(str(folder))
            tok.save_pretrained(str(folder))
            folders.append(folder)
        out[arch] = tuple(folders)
    return out


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {"residual": "identity"}),
        ("gpt2", {"residual": "identity"}),
        ("llama", {"heads": "monotonic", "special_tokens": False, "residual": "identity"}),
        ("gpt2", {"residual": "first"}),  # residual statistics: whole offloaded forwards, not layer by layer
        ("llama", {}),  # unset: `all` on a model this small, streamed or not
    ],
)
def test_streamed_head_perm_writes_what_the_in_memory_head_perm_writes(
    arch: str, options: dict[str, Any], text_pairs: dict[str, Any], tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    """Statistics collected layer by layer (A and B in lockstep) give the very same alignment."""
    corpus = text_pairs["root"] / "corpus.txt"
    body = {
        "job": "merge",
        "models": [str(f) for f in text_pairs[arch]],
        "strategy": {"name": "head-perm", **options},
        "data": {"dataset": "text", "data_files": str(corpus), "max_tokens": 1500},
    }
    memory, streamed = both_ways(body, tmp_path, capsys, monkeypatch)
    assert ("collected layer by layer" in notes_of(streamed)) == (options.get("residual") == "identity"), notes_of(
        streamed
    )
    assert "layer by layer" not in notes_of(memory)


@pytest.fixture(scope="module")
def transport_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama base A, its fine-tune A + τ (every weight nudged), and B of another seed, in bf16."""
    root = tmp_path_factory.mktemp("transport")
    base, target = tiny.llama(0), tiny.llama(1)
    finetuned = tiny.llama(0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in finetuned.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    out = {}
    for name, model in (("base", base), ("finetuned", finetuned), ("target", target)):
        model.to(torch.bfloat16).save_pretrained(str(root / name))
        out[name] = root / name
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_streamed_transport_writes_what_the_in_memory_transport_writes(
    strategy: str, transport_folders: dict[str, Path], tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    body = {
        "job": "transport",
        **{role: str(folder) for role, folder in transport_folders.items()},
        "strategy": strategy,
        "alpha": 0.8,
        "calibrate": False,
    }
    memory, streamed = both_ways(body, tmp_path, capsys, monkeypatch)
    got = safetensors_of(streamed)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert json.loads((streamed / "config.json").read_text()) == json.loads((memory / "config.json").read_text())
    assert "weights streamed" in notes_of(streamed)
    if strategy == "vanilla":  # B + α·τ, computed here from the files with plain torch
        sd = {role: safetensors_of(folder) for role, folder in transport_folders.items()}
        for k, t in got.items():
            tau = sd["finetuned"][k].float() - sd["base"][k].float()
            assert torch.equal(t, (sd["target"][k].float() + 0.8 * tau).to(torch.bfloat16)), k


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert_mlm"])
def test_lockstep_statistics_equal_the_whole_model_statistics(arch: str) -> None:
    """Layer by layer, with padded batches and special tokens dropped: the same moments, bit for bit."""
    from hf_rebasin.alignment.features import activation_stats
    from hf_rebasin.alignment.features.lockstep import lockstep_plan, lockstep_stats
    from hf_rebasin.symmetry.adapters import graph_for

    model_a, model_b = getattr(tiny, arch)(0), getattr(tiny, arch)(1)
    graph = graph_for(model_a.config, model_a.state_dict().keys())
    g = torch.Generator().manual_seed(3)
    batches = []
    for i in range(3):
        ids = torch.randint(0, tiny.V, (2, 12), generator=g)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 12 - 2 - i :] = 0
        batches.append({"input_ids": ids, "attention_mask": mask})
    spaces = [n for n, s in graph.spaces.items() if s.kind != "residual"]
    whole = activation_stats(model_a, model_b, graph, batches, spaces=spaces, residual="none", special_ids={0, 1})
    plan = lockstep_plan(graph, model_a, spaces)
    assert not isinstance(plan, str), plan
    layered = {}
    for layer in lockstep_stats(
        model_a, model_b, model_a.state_dict(), model_b.state_dict(), graph, plan, batches, special_ids={0, 1}
    ):
        layered.update(layer.stats.moments)
        assert layer.stats.tokens == whole.tokens
    assert layered.keys() == whole.moments.keys() and layered
    for key, m in whole.moments.items():
        for f in ("count", "sum_a", "sum_b", "sq_a", "sq_b", "cross"):
            assert torch.equal(getattr(layered[key], f), getattr(m, f)), (key, f)


TRIM_PROBE = """
import ctypes, torch
from hf_rebasin.io.tensors import give_back_freed
def rss():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
libc = ctypes.CDLL(None)
assert libc.mallopt(-3, 64 << 20) == 1  # M_MMAP_THRESHOLD: 8 MB tensors come from the heap
assert libc.mallopt(-1, 1 << 30) == 1   # M_TRIM_THRESHOLD: free() alone never shrinks the heap
spans = [torch.ones(2**21) for _ in range(64)]  # 512 MB, touched
del spans
before = rss(); give_back_freed(); after = rss()
print(before, after)
"""


@pytest.mark.skipif(lazy._malloc_trim() is None, reason="glibc's malloc_trim only")
def test_freed_heap_is_given_back() -> None:
    """Freed tensors that glibc keeps in its heap leave the resident set (read from /proc) when
    `give_back_freed` runs: what bounds a streamed run's peak between stages and spaces."""
    done = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True)
    before, after = map(int, done.stdout.split())
    assert before - after > 400 * 2**20, (before, after)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_weight_similarity_reads_in_blocks_and_gives_the_heap_back(
    arch: str, pairs: dict[str, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``check`` stage's weight cosine of matched features (`diagnostics.feature_similarity`)
    works on blocks of features, never on a float64 copy of a whole tensor (of TinyLlama's
    embedding, that copy moved axis first was 1 GB more, the peak of every streamed run), and
    gives the heap back as it streams: the same numbers, bit for bit, as in one block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_rebasin.alignment import diagnostics

    class Float64Sizes(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                    self.largest = max(self.largest, t.numel())
            return out

    a, b = (load_model(folder, stream=True) for folder in pairs[arch])
    graph = a.graph
    transform = graph.random_transform("permutation", torch.Generator().manual_seed(0))
    whole = diagnostics.feature_similarity(graph, a.weights, b.weights, transform)  # every tensor in one block
    widest = max(a.weights.numel(n) for n in graph.bindings if n in a.weights)
    bound = [
        (n, axis)
        for n, binding in graph.bindings.items()
        if n in a.weights
        for axis, ref in enumerate(binding.axes)
        if ref is not None
    ]
    rows = max(a.weights.numel(n) // a.weights.shape(n)[axis] for n, axis in bound)  # one feature's values
    features = max(a.weights.shape(n)[axis] for n, axis in bound)  # the sums: one value per feature
    trims: list[int] = []
    monkeypatch.setattr(diagnostics, "BLOCK_ELEMENTS", 16)
    monkeypatch.setattr(diagnostics, "GIVE_BACK_BYTES", 8 * widest)
    monkeypatch.setattr(diagnostics, "give_back_freed", lambda: trims.append(1))
    accumulate, seen = diagnostics._accumulate, Float64Sizes()

    def watched(*args: Any) -> Any:
        with seen:
            return accumulate(*args)

    monkeypatch.setattr(diagnostics, "_accumulate", watched)
    blocked = diagnostics.feature_similarity(graph, a.weights, b.weights, transform)
    assert blocked == whole
    assert seen.largest <= max(16, rows, features) < widest, (seen.largest, rows, features, widest)
    assert trims


# ---------------------------------------------------------------------------------------------
# Large tensors in blocks of rows


def _embedding_reads(monkeypatch: pytest.MonkeyPatch, folders: tuple[Path, Path], key: str) -> list[int]:
    """Rows of every read of tensor ``key`` from the safetensors files of ``folders``."""
    where = {}
    for folder in folders:
        entry = tensors.checkpoint_entries(sorted(folder.glob("*.safetensors")))[key]
        where[entry.file] = (entry.offset, entry.offset + entry.nbytes, entry.nbytes // entry.shape[0])
    reads: list[int] = []
    real = tensors._read_entry

    def spy(entry: tensors.SafetensorsEntry) -> torch.Tensor:
        span = where.get(entry.file)
        if span is not None and span[0] <= entry.offset < span[1]:
            reads.append(entry.nbytes // span[2])
        return real(entry)

    monkeypatch.setattr(tensors, "_read_entry", spy)
    return reads


@pytest.mark.parametrize(
    ("arch", "strategy"), [("llama", "vanilla"), ("gpt2", "weight-matching"), ("gpt2", "generalized-orthogonal")]
)
def test_an_embedding_is_read_merged_and_written_in_blocks_of_rows(
    arch: str, strategy: str, pairs: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    """With blocks of a few rows (`lazy.ROW_BLOCK_ELEMENTS`), a streamed run reads the
    embeddings (vocabulary × d: the largest tensor of a Qwen3 or Gemma, whose vocabulary axis no
    symmetry maps) a block of rows at a time where it merges, saves, sums the similarity
    diagnostic and the weight views' anchor terms, and writes the same files as the in-memory run
    (merging is element-wise; a view's sum over blocks moves its last bits only)."""
    vocab = T.AutoConfig.from_pretrained(str(pairs[arch][0])).vocab_size
    monkeypatch.setattr(lazy, "ROW_BLOCK_ELEMENTS", 7 * 32)  # 7 rows of width 32
    body = {"job": "merge", "models": [str(m) for m in pairs[arch]], "strategy": strategy}
    key = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    reads = _embedding_reads(monkeypatch, pairs[arch], key)
    exact = strategy != "generalized-orthogonal"  # its Procrustes solutions move with a view's last bits
    both_ways({**body, "output": {"max_shard_size": 15_000}}, tmp_path, capsys, monkeypatch, exact=exact)
    blocks = [n for n in reads if n < vocab]
    assert blocks and max(blocks) <= 7, reads
    whole_blocked = reads.count(vocab)
    reads.clear()
    monkeypatch.setattr(lazy, "ROW_BLOCK_ELEMENTS", 1 << 30)  # never in blocks
    (tmp_path / "whole").mkdir()
    both_ways({**body, "output": {"max_shard_size": 15_000}}, tmp_path / "whole", capsys, monkeypatch)
    assert reads and all(n == vocab for n in reads)
    # what stays whole: the forward passes of the check (an embedding lookup reads its table)
    assert whole_blocked < reads.count(vocab), (whole_blocked, reads.count(vocab))


@pytest.mark.parametrize("cls", ["permutation", "orthogonal"])
def test_row_blocks_equal_the_whole_tensor_through_every_stage(cls: str, pairs: dict[str, tuple[Path, Path]]) -> None:
    """Rows computed alone through canonical form, a transform, a merge and a transport's sum are
    the rows of the whole tensor: bit for bit under a permutation; under a rotation, a product of
    fewer rows may round its last bit otherwise (BLAS blocks the product by its shape). A stage
    that mixes rows (a map of the first axis) refuses them (`LazyState.rows` None) and
    `row_blocks` falls back to the whole tensor."""
    from hf_rebasin.merging import interpolate as merge
    from hf_rebasin.merging import transport
    from hf_rebasin.symmetry import canonical

    a, b = (load_model(folder, stream=True) for folder in pairs["gpt2"])
    sd_a, graph, _ = canonical.canonicalize(a.graph, a.weights)
    sd_b, _, _ = canonical.canonicalize(a.graph, b.weights)
    transform = graph.random_transform(cls, torch.Generator().manual_seed(0))
    moved = graph.apply(sd_b, transform)
    merged = merge.merge_state_dicts([sd_a, moved], [0.3, 0.7])
    shifted = transport.add_task_vector(merged, moved, 0.5)
    emb = "transformer.wte.weight"
    for i, state in enumerate((a.weights, sd_a, moved, merged, shifted)):
        read = state.rows(emb)
        assert read is not None
        whole = state[emb]
        two = torch.cat([read(0, 5), read(5, whole.shape[0])])
        blocks = torch.cat([blk for (blk,) in lazy.row_blocks([state], emb, elements=3 * 32)])
        assert blocks.shape[0] == whole.shape[0] > 3
        for got in (two, blocks):
            if cls == "permutation" or i < 2:  # as stored, in canonical form: no product
                assert torch.equal(got, whole)
            else:
                torch.testing.assert_close(got, whole, rtol=0, atol=1e-6)
    mixed = next(n for n, bd in graph.bindings.items() if bd.axes[0] is not None and n in moved and moved.numel(n) > 1)
    assert moved.rows(mixed) is None
    assert [len(x) for x in lazy.row_blocks([moved], mixed, elements=1)] == [1]
