"""T5 through the jobs that need no data, checked with stock transformers (``AutoModelForSeq2SeqLM``,
not hf-rebasin's loader): the outputs compute the inputs' logits, store the vocabulary table as the
inputs store it (one ``shared`` table and, for T5 v1.1, a head apart), and keep ``wo`` in float32
in a float16 output, as ``from_pretrained`` does (not in bfloat16)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import transformers as T
import yaml
from safetensors import safe_open

import tiny
from helpers import flat, run_cli, run_main
from hf_rebasin.evaluation.data import char_tokenizer

TEXT = "".join(tiny.HAMLET.splitlines(keepends=True)[:3])


def _save(tmp_path: Path, name: str, factory: str = "t5", seeds: int = 2) -> list[Path]:
    folders = []
    for seed in range(seeds):
        folder = tmp_path / f"{name}-{seed}"
        tiny.FACTORIES[factory](seed).save_pretrained(str(folder))
        folders.append(folder)
    return folders


@pytest.fixture
def t5s(tmp_path: Path) -> list[Path]:
    return _save(tmp_path, "t5")


def _recipe(tmp_path: Path, body: dict, **output: object) -> str:
    path = tmp_path / "recipe.yaml"
    section = {"dir": str(tmp_path / "out"), **output}
    path.write_text(yaml.safe_dump({**body, "output": section}, sort_keys=False))
    return str(path)


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(folder)).eval().float()
    with torch.no_grad():
        return model(input_ids=ids, decoder_input_ids=ids[:, :7]).logits


def _stored(folder: Path) -> dict[str, str]:
    """Each tensor of the folder's safetensors file, with the dtype it is stored in ("F32", "BF16")."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


@pytest.mark.parametrize("cls", ["permutation", "orthogonal"])
def test_verify_a_saved_t5(t5s: list[Path], cls: str) -> None:
    proc = run_main("verify", str(t5s[0]), "--class", cls)
    out = flat(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max |Δ| = " in out and "compared outputs: logits" in out
    assert "enc.self" in out and "dec.{i}.cross" in out
    assert ("orthogonal" in out) == (cls == "orthogonal") and "fall back" not in out


@pytest.mark.parametrize("strategy", ["weight-matching", "transfusion", "generalized-orthogonal"])
def test_align_writes_two_t5s_in_one_basis_each_computing_what_it_did(
    tmp_path: Path, t5s: list[Path], strategy: str
) -> None:
    proc = run_main(_recipe(tmp_path, {"job": "align", "models": [str(b) for b in t5s], "strategy": strategy}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    ids = torch.randint(3, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    for given, written in zip(t5s, (out / "a", out / "b"), strict=True):
        assert (_logits(given, ids) - _logits(written, ids)).abs().max() <= 1e-4
        # one vocabulary table and the head apart, as the input: never three tables
        assert set(_stored(written)) == set(_stored(given))
        assert "lm_head.weight" in _stored(written) and "encoder.embed_tokens.weight" not in _stored(written)


def test_a_tied_t5_aligned_with_rotations_stores_its_head_apart_and_nothing_else(tmp_path: Path) -> None:
    """The original T5 (tied head, scaled by d_model**-0.5): canonical form folds the decoder's final
    norm into the head, which then comes apart from ``shared``; the stacks' tables stay tied."""
    models = _save(tmp_path, "t5-relu", "t5-relu")
    body = {"job": "align", "models": [str(m) for m in models], "strategy": "generalized-orthogonal"}
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = tmp_path / "out" / "b"
    ids = torch.randint(3, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    assert (_logits(models[1], ids) - _logits(written, ids)).abs().max() <= 1e-4
    assert set(_stored(written)) == set(_stored(models[1])) | {"lm_head.weight"}
    reloaded = T.AutoModelForSeq2SeqLM.from_pretrained(str(written))
    assert reloaded.config.scale_decoder_outputs
    assert reloaded.encoder.embed_tokens.weight is reloaded.shared.weight


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_t5_merge_stores_each_tensor_as_from_pretrained_loads_it(
    tmp_path: Path, t5s: list[Path], dtype: str
) -> None:
    """transformers keeps ``wo`` in float32 under float16 only (``_keep_in_fp32_modules``); the oracle is
    the stock class loading the input in that dtype and saving it."""
    body = {"job": "merge", "models": [str(b) for b in t5s], "strategy": "weight-matching"}
    proc = run_main(_recipe(tmp_path, body, dtype=dtype))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "function preserved" in flat(proc.stdout)
    stock = tmp_path / "stock"
    T.AutoModelForSeq2SeqLM.from_pretrained(str(t5s[0]), dtype=getattr(torch, dtype)).save_pretrained(str(stock))
    stored = _stored(tmp_path / "out")
    assert stored == _stored(stock)
    wo = {d for k, d in stored.items() if k.endswith(".wo.weight")}
    assert wo == ({"F32"} if dtype == "float16" else {"BF16"})
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out"))
    assert type(model).__name__ == "T5ForConditionalGeneration"


def _tokenizer() -> T.PreTrainedTokenizerFast:
    """Characters and T5's sentinels (``<extra_id_0>`` …), inside the tiny vocabulary."""
    tokenizer = char_tokenizer(TEXT)
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_id_{i}>" for i in range(8)]})
    assert len(tokenizer) <= tiny.V
    return tokenizer


def test_a_t5_barrier_on_pairs_scores_each_end_as_the_models_own_loss_does(tmp_path: Path, t5s: list[Path]) -> None:
    for folder in t5s:
        _tokenizer().save_pretrained(str(folder))
    lines = TEXT.splitlines()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"source": a, "target": b}) + "\n" for a, b in itertools.pairwise(lines)))
    data = {"dataset": "json", "data_files": str(pairs)}
    evaluate = {"task": "seq2seq", "data": data, "points": 3}
    body = {
        "job": "barrier",
        "models": [str(b) for b in t5s],
        "strategy": "generalized-orthogonal",
        "evaluate": evaluate,
    }
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tokenizer = T.AutoTokenizer.from_pretrained(str(t5s[0]))
    for curve in json.loads((tmp_path / "out" / "rebasin.json").read_text())["curves"].values():
        for folder, loss in zip(t5s, (curve["loss"][-1], curve["loss"][0]), strict=True):  # λ = 1 is A
            model = T.AutoModelForSeq2SeqLM.from_pretrained(str(folder)).eval()
            total, count = 0.0, 0
            for a, b in itertools.pairwise(lines):
                source = torch.tensor([tokenizer(a)["input_ids"]])
                target = torch.tensor([tokenizer(b)["input_ids"]])
                with torch.no_grad():  # T5 shifts the labels after its decoder start token itself
                    total += float(model(input_ids=source, labels=target).loss) * target.numel()
                count += target.numel()
            assert loss == pytest.approx(total / count, abs=1e-5)


def test_a_t5_transport_scored_on_plain_text_reads_it_by_span_corruption(tmp_path: Path, t5s: list[Path]) -> None:
    for folder in t5s:
        _tokenizer().save_pretrained(str(folder))
    plain = tmp_path / "plain.txt"
    plain.write_text(TEXT * 4)
    models = [str(b) for b in t5s]
    evaluate = {"task": "seq2seq", "data": {"dataset": "text", "data_files": str(plain)}}
    body = {"job": "transport", "base": models[0], "finetuned": models[1], "target": models[0], "calibrate": False}
    proc = run_main(_recipe(tmp_path, {**body, "evaluate": evaluate}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "`evaluate.data`: T5 span corruption of plain text" in flat(proc.stdout)
    model = T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out"))
    assert type(model).__name__ == "T5ForConditionalGeneration"


def test_a_calibrated_t5_transport_without_data_refuses_naming_calibrate_data(tmp_path: Path, t5s: list[Path]) -> None:
    models = [str(b) for b in t5s]
    body = {"job": "transport", "base": models[0], "finetuned": models[1], "target": models[1]}
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "`calibrate.data`: the fine-tune is a T5ForConditionalGeneration, an encoder-decoder" in flat(proc.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # lineage and embed of encoder-decoders: covered fast by their adapter tests
def test_embed_writes_a_t5_into_a_wider_stream_feed_forwards_and_heads_computing_the_same_logits(
    tmp_path: Path, t5s: list[Path]
) -> None:
    wide = tmp_path / "wide"
    config = tiny.t5(0).config
    config.d_ff, config.d_model = 64, 48  # v1.1: no rescale before the head, so the stream grows too
    config.d_kv, config.num_heads = config.d_kv + 4, config.num_heads + 2
    T.T5ForConditionalGeneration(config).save_pretrained(str(wide))
    proc = run_cli("embed", str(t5s[0]), "--like", str(wide), "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = T.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "out"))
    got = (written.config.d_ff, written.config.d_model, written.config.d_kv, written.config.num_heads)
    assert got == (64, 48, config.d_kv, config.num_heads)
    ids = torch.randint(3, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    assert (_logits(t5s[0], ids) - _logits(tmp_path / "out", ids)).abs().max() <= 1e-4
    assert set(_stored(tmp_path / "out")) == set(_stored(t5s[0]))


@pytest.mark.slow  # lineage and embed of encoder-decoders: covered fast by their adapter tests
def test_lineage_tells_a_t5s_fine_tune_from_a_t5_trained_apart(tmp_path: Path, t5s: list[Path]) -> None:
    model = tiny.t5(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    tuned = tmp_path / "t5-0-tuned"
    model.save_pretrained(str(tuned))
    verdicts = []
    for other in (tuned, t5s[1]):
        proc = run_cli("lineage", str(t5s[0]), str(other), "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        verdicts.append(json.loads(proc.stdout)["pairs"][0]["verdict"])
    assert verdicts == ["same basis", "independent"]


def test_aligning_a_relu_t5_says_that_mergekit_refuses_it(tmp_path: Path) -> None:
    folders = _save(tmp_path, "relu", "t5-relu")
    body = {"job": "align", "models": [str(f) for f in folders], "strategy": "weight-matching"}
    proc = run_main(_recipe(tmp_path, body))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # checked with mergekit 0.1.5 (benchmarks/alignment/mergekit_seq2seq.py): its t5 definition requires wi_0
    assert "mergekit 0.1.5's T5 definition lists only the gated feed-forward" in flat(proc.stdout)
    assert (tmp_path / "out" / "mergekit.yaml").exists()


def test_a_stock_loaded_t5_v1_1_rebuilt_keeps_its_head_apart(tmp_path: Path, t5s: list[Path]) -> None:
    """transformers 5 loads the head apart by value and leaves the config saying tied: a model built
    from that config must not tie the head again (it would read the embeddings as its head)."""
    from hf_rebasin.io.rebuild import rebuild

    stock = T.AutoModelForSeq2SeqLM.from_pretrained(str(t5s[0])).eval()
    assert stock.config.tie_word_embeddings and stock.lm_head.weight is not stock.shared.weight
    again = rebuild(stock, stock.state_dict())
    assert again.lm_head.weight is not again.shared.weight and again.encoder.embed_tokens.weight is again.shared.weight
    ids = torch.randint(3, tiny.V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = stock(input_ids=ids, decoder_input_ids=ids).logits - again(input_ids=ids, decoder_input_ids=ids).logits
    assert gap.abs().max() <= 1e-5


@pytest.mark.parametrize("strategy", ["weight-matching", "generalized-orthogonal"])
def test_per_sublayer_residual_maps_fall_back_to_one_map_for_t5_and_say_so(strategy: str) -> None:
    from hf_rebasin.alignment.strategies import Pair, align
    from hf_rebasin.symmetry.adapters import graph_for

    a, b = tiny.t5(0), tiny.t5(1)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    pair = Pair(graph_for(a.config, sd_a.keys()), sd_a, sd_b, a, b)
    alignment = align(strategy, pair, {"residual_maps": "per-sublayer"})
    assert any("one global residual map is used" in n for n in alignment.notes) and alignment.exact


@pytest.mark.slow  # lineage of encoder-decoders: covered fast by their adapter tests
def test_a_t5_of_another_decoder_depth_is_mapped_by_lineage_and_refused_by_align(
    tmp_path: Path, t5s: list[Path]
) -> None:
    config = tiny.t5(0).config
    config.num_decoder_layers = 2
    shallower = tmp_path / "shallower"
    T.T5ForConditionalGeneration(config).save_pretrained(str(shallower))
    proc = run_cli("lineage", str(t5s[0]), str(shallower), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pair = json.loads(proc.stdout)["pairs"][0]
    assert [m["stack"] for m in pair["stack_maps"]] == ["encoder.block", "decoder.block"]
    proc = run_cli("align", str(t5s[0]), str(shallower), "--output", str(tmp_path / "aligned"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = flat(proc.stderr)
    assert f"has {config.num_layers} encoder and 2 decoder layers" in said and "hf-rebasin lineage A B" in said


def test_a_t5s_memory_footprint_counts_the_layers_of_both_stacks(t5s: list[Path]) -> None:
    from hf_rebasin.run.memory import footprint

    config = tiny.t5(0).config
    found = footprint(t5s[0])
    assert found is not None and found.layers == config.num_layers + config.num_decoder_layers
