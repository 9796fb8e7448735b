"""Models whose vocabularies differ, as Hub relatives' do (added chat tokens, an extended release,
padding rows, placeholders past the embedding), through every job that writes a model.

Each result is checked against a computation that does not use hf-rebasin: mergekit 0.1.5's merge
of the same models (stored by benchmarks/vocabularies/bench_vocab_mergekit.py --golden), rows read back from the
safetensors of the inputs by token, and the output loaded with stock ``AutoTokenizer`` and
``AutoModelForCausalLM``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from helpers import run_main
from hf_rebasin.recipe import load_recipe
from hf_rebasin.run.pipeline import run_recipe
from lm_folders import write_recipe
from vocab_models import CHATML, mergekit_cases, save_chat_transport, tiny_llama, vocab_tokenizer

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "vocab_mergekit"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _merge(root: Path, cases: dict[str, Path], source: str, strategy: str = "vanilla") -> Path:
    body = {
        "job": "merge",
        "models": [str(cases[k]) for k in ("base", "padded", "chatml")],
        "strategy": strategy,
        "merge": {"weight": [1 / 3, 1 / 3, 1 / 3]},
        "tokenizer": {"source": source},
        "output": {"dir": f"out-{source}"},
    }
    run_recipe(load_recipe(write_recipe(root, body)))
    return root / f"out-{source}"


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return mergekit_cases(tmp_path_factory.mktemp("cases"))


@pytest.mark.parametrize("source", ["union", "base"])
def test_merges_agree_with_mergekit_on_its_own_cases(source: str, cases: dict[str, Path], tmp_path: Path) -> None:
    meta = json.loads((GOLDEN / "mergekit.json").read_text(encoding="utf-8"))
    digest = hashlib.sha256(
        b"".join((cases[k] / "model.safetensors").read_bytes() for k in ("base", "padded", "chatml"))
    )
    assert digest.hexdigest() == meta["inputs_sha256"], (
        "the test models changed: store mergekit's merges again with `python benchmarks/vocabularies/bench_vocab_mergekit.py --golden`"
    )
    out = _merge(tmp_path, cases, source)
    tok = T.AutoTokenizer.from_pretrained(str(out))
    expected = meta["sources"][source]
    assert dict(tok.get_vocab()) == expected["vocab"]
    assert sorted(str(t.content) for t in tok.added_tokens_decoder.values()) == expected["added"]
    assert T.AutoConfig.from_pretrained(str(out)).vocab_size == expected["vocab_size"]
    theirs, ours = load_file(str(GOLDEN / f"{source}.safetensors")), _tensors(out)
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=1e-6, msg=name)


def test_a_token_only_one_model_has_keeps_that_models_row(cases: dict[str, Path], tmp_path: Path) -> None:
    out = _merge(tmp_path, cases, "union")
    chat, base, padded, merged = (_tensors(p) for p in (cases["chatml"], cases["base"], cases["padded"], out))
    tok = T.AutoTokenizer.from_pretrained(str(out))
    for token in CHATML:  # only the ChatML model has them: its row, whatever the weights
        i = tok.convert_tokens_to_ids(token)
        assert i in (64, 65)
        for name in (EMBED, HEAD):
            assert torch.equal(merged[name][i], chat[name][i])
    mean = (base[EMBED][:64] + padded[EMBED][:64] + chat[EMBED][:64]) / 3  # shared tokens: the plain mean
    torch.testing.assert_close(merged[EMBED][:64], mean, rtol=0, atol=1e-6)
    model = T.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert tok("<|im_start|><|im_end|>")["input_ids"] == [64, 65]  # the added tokens encode to their rows
    ids = torch.tensor([tok.convert_tokens_to_ids(["<|im_start|>", "_tok_5", "_tok_9", "<|im_end|>"])])
    assert ids.tolist() == [[64, 5, 9, 65]]
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=2)
    assert generated.shape == (1, 8) and int(generated.max()) < model.config.vocab_size == len(tok) == 66


def test_the_tokenizer_of_a_model_of_the_recipe(cases: dict[str, Path], tmp_path: Path) -> None:
    out = _merge(tmp_path, cases, "models[2]")
    assert (out / "tokenizer.json").read_bytes() == (cases["chatml"] / "tokenizer.json").read_bytes()
    assert _tensors(out)[EMBED].shape == (66, 16)


def _chat_transport(root: Path, target_rows: int, target_added: list[str], rows: int = 64) -> dict[str, Path]:
    """base (64 tokens in ``rows`` rows), its ChatML fine-tune (at least 66 rows, trained rows moved
    a little) and a target that is the base with its units and residual features permuted
    (``target_rows`` rows: extra rows are new tokens of the target's own, ``target_added``)."""
    ft = tiny_llama(rows, 0)
    ft.resize_token_embeddings(max(rows, 66))
    return save_chat_transport(root, tiny_llama(rows, 0), ft, tiny_llama(target_rows, 7), target_added)


def _transport(root: Path, folders: dict[str, Path], **extra: object) -> Path:
    body = {
        "job": "transport",
        "base": str(folders["base"]),
        "finetuned": str(folders["ft"]),
        "target": str(folders["target"]),
        "strategy": "weight-matching",
        "calibrate": False,
        "output": {"dir": "out"},
        **extra,
    }
    run_recipe(load_recipe(write_recipe(root, body)))
    return root / "out"


def test_a_chat_fine_tune_moves_onto_a_permuted_base_with_its_chat_tokens(tmp_path: Path) -> None:
    folders = _chat_transport(tmp_path, 64, [])
    out = _transport(tmp_path, folders)
    tok = T.AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_tokens_to_ids(CHATML) == [64, 65]
    model = T.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ft = T.AutoModelForCausalLM.from_pretrained(str(folders["ft"])).eval()
    ids = torch.tensor([[1, 64, 5, 7, 65, 9, 64, 3]])
    with torch.no_grad():  # the target is the base permuted, so B + τ is the fine-tune permuted: same function
        gap = (model(ids).logits - ft(ids).logits).abs().max()
    assert float(gap) < 1e-4
    assert model.config.vocab_size == 66 == len(tok)


def test_an_extended_release_keeps_its_new_rows_and_gets_the_task_vector_on_the_shared_ones(tmp_path: Path) -> None:
    new = ["<ctl_0>", "<ctl_1>", "<ctl_2>", "<ctl_3>"]
    folders = _chat_transport(tmp_path, 68, new)
    out = _transport(tmp_path, folders)
    tok = T.AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_tokens_to_ids(new) == [64, 65, 66, 67]  # the target's ids stay
    assert tok.convert_tokens_to_ids(CHATML) == [68, 69]  # the fine-tune's tokens come after them
    written, target, ft = _tensors(out), _tensors(folders["target"]), _tensors(folders["ft"])
    assert written[EMBED].shape[0] == 70
    assert torch.equal(written[EMBED][64:68], target[EMBED][64:68])  # its own new rows, untouched
    model = T.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ft_model = T.AutoModelForCausalLM.from_pretrained(str(folders["ft"])).eval()
    ours = torch.tensor([[1, 68, 5, 7, 69, 9]])
    theirs = torch.tensor([[1, 64, 5, 7, 65, 9]])  # the same text in the fine-tune's ids
    with torch.no_grad():
        a, b = model(ours).logits, ft_model(theirs).logits
    torch.testing.assert_close(a[..., :64], b[..., :64], rtol=0, atol=1e-4)  # shared tokens: B + τ is A_ft
    torch.testing.assert_close(a[..., 68:], b[..., 64:], rtol=0, atol=1e-4)  # chat tokens: carried whole
    assert ft[EMBED].shape[0] == 66


def test_padding_rows_past_the_tokens_merge_and_load(tmp_path: Path) -> None:
    """Qwen2's shape: more embedding rows than tokens (here 72 rows for 64), merged with a model of
    64 rows: the output keeps the reference's rows and its tokens' rows are the plain mean."""
    padded = tiny_llama(72, 0)
    padded.save_pretrained(str(tmp_path / "a"))
    vocab_tokenizer(64).save_pretrained(str(tmp_path / "a"))
    plain = tiny_llama(64, 1)
    plain.save_pretrained(str(tmp_path / "b"))
    vocab_tokenizer(64).save_pretrained(str(tmp_path / "b"))
    body = {"job": "merge", "models": ["./a", "./b"], "strategy": "vanilla", "output": {"dir": "out"}}
    run_recipe(load_recipe(write_recipe(tmp_path, body)))
    a, b, out = _tensors(tmp_path / "a"), _tensors(tmp_path / "b"), _tensors(tmp_path / "out")
    assert out[EMBED].shape == (72, 16)
    torch.testing.assert_close(out[EMBED][:64], (a[EMBED][:64] + b[EMBED][:64]) / 2, rtol=0, atol=1e-6)
    assert torch.equal(out[EMBED][64:], a[EMBED][64:])  # padding only A has: A's rows
    model = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert model.generate(torch.tensor([[1, 5]]), max_new_tokens=3, do_sample=False, pad_token_id=2).shape == (1, 5)


def test_the_dry_run_reports_the_vocabularies_before_any_weight_is_read(cases: dict[str, Path], tmp_path: Path) -> None:
    body = {
        "job": "merge",
        "models": [str(cases["base"]), str(cases["chatml"])],
        "strategy": "vanilla",
        "tokenizer": {"source": "union"},
        "output": {"dir": "out"},
    }
    proc = run_main(str(write_recipe(tmp_path, body)), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "has 2 tokens that" in text and "'<|im_start|>', '<|im_end|>'" in text
    assert "output vocabulary (tokenizer.source: union): 66 tokens in 66 embedding rows" in text
    assert not (tmp_path / "out").exists()


def test_a_reference_whose_tokens_have_no_rows_is_refused_and_nothing_is_written(
    cases: dict[str, Path], tmp_path: Path
) -> None:
    body = {"job": "merge", "models": [str(cases["padded"]), str(cases["base"])], "output": {"dir": "out"}}
    proc = run_main(str(write_recipe(tmp_path, {**body, "strategy": "vanilla"})))
    assert proc.returncode == 2
    assert "'<UNUSED_3>' with id 67" in proc.stderr and "64 rows" in proc.stderr
    assert "not trained from this base" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode", ["modules_to_save", "trainable_tokens"])
def test_a_lora_adapter_trained_with_new_tokens_moves_as_peft_merges_it(mode: str, tmp_path: Path) -> None:
    """The PEFT guide's "LoRA with additional tokens": the base resized, the adapter saving the
    embedding and LM head whole (or the new rows as trainable tokens). Moved onto the base permuted,
    the output (an adapter for the target, loaded on it resized as the guide does) computes what
    PEFT's own ``merge_and_unload`` of the adapter computes (more in test_adapter_tokens.py)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    folders = _chat_transport(tmp_path, 64, [])  # base and target (the base permuted); ft replaced below
    model = tiny_llama(64, 0)
    model.resize_token_embeddings(66)
    extra = (
        {"modules_to_save": ["embed_tokens", "lm_head"]}
        if mode == "modules_to_save"
        else {"trainable_token_indices": {"embed_tokens": [64, 65]}}
    )
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **extra))
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter))
    vocab_tokenizer(64, CHATML).save_pretrained(str(adapter))
    out = _transport(tmp_path, {**folders, "ft": adapter})
    resized = T.AutoModelForCausalLM.from_pretrained(str(folders["base"]))
    resized.resize_token_embeddings(66)
    merged = PeftModel.from_pretrained(resized, str(adapter)).merge_and_unload().eval()
    target = T.AutoModelForCausalLM.from_pretrained(str(folders["target"]))
    target.resize_token_embeddings(len(T.AutoTokenizer.from_pretrained(str(out))))
    ours = PeftModel.from_pretrained(target, str(out)).eval()
    ids = torch.tensor([[1, 64, 5, 7, 65, 9]])
    with torch.no_grad():
        gap = (ours(ids).logits[..., :64] - merged(ids).logits[..., :64]).abs().max()
    assert float(gap) < 1e-4
    assert T.AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids(CHATML) == [64, 65]
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert any("trained with new tokens" in n for n in record["notes"])


def test_an_adapter_with_new_rows_but_no_tokenizer_is_refused_with_the_reason(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    _chat_transport(tmp_path, 64, [])  # base and target folders
    model = tiny_llama(64, 0)
    model.resize_token_embeddings(66)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"]))
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    body = {
        "job": "transport",
        "base": "./base",
        "finetuned": "./adapter",
        "target": "./target",
        "calibrate": False,
        "output": {"dir": "o"},
    }
    proc = run_main(str(write_recipe(tmp_path, {**body, "strategy": "weight-matching"})))
    assert proc.returncode == 2
    assert "66 embedding rows" in proc.stderr and "tokenizer.save_pretrained" in proc.stderr
    assert "not trained from this base" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_universe_merge_fills_the_rows_a_model_lacks_before_every_mean(tmp_path: Path) -> None:
    """Three relatives in one basis (a base, its ChatML fine-tune with two more rows, a copy with
    placeholders past its rows): weight matching finds the identity between them, so the universe
    merge is the plain mean with rows filled as mergekit fills them, computed here from the files."""
    g = torch.Generator().manual_seed(4)

    def nudged(rows: int) -> torch.nn.Module:
        model = tiny_llama(64, 0)
        model.resize_token_embeddings(rows, mean_resizing=False)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.002 * torch.randn(p.shape, generator=g))
        return model

    for name, rows, added in (
        ("base", 64, []),
        ("chat", 66, CHATML),
        ("padded", 64, [f"<UNUSED_{i}>" for i in range(4)]),
    ):
        nudged(rows).save_pretrained(str(tmp_path / name))
        vocab_tokenizer(64, added).save_pretrained(str(tmp_path / name))
    body = {
        "job": "merge",
        "models": ["./base", "./chat", "./padded"],
        "strategy": "weight-matching",
        "merge": {"weight": [1 / 3, 1 / 3, 1 / 3], "universe": {"iterations": 2}},
        "tokenizer": {"source": "union"},
        "output": {"dir": "out"},
    }
    run_recipe(load_recipe(write_recipe(tmp_path, body)))
    base, chat, padded, out = (_tensors(tmp_path / n) for n in ("base", "chat", "padded", "out"))
    for name in (EMBED, HEAD):
        torch.testing.assert_close(out[name][:64], (base[name] + chat[name][:64] + padded[name]) / 3, rtol=0, atol=1e-6)
        torch.testing.assert_close(out[name][64:], chat[name][64:], rtol=0, atol=1e-6)  # only the chat model has them


def test_a_chat_fine_tune_of_a_padded_base_moves_onto_a_padded_target(tmp_path: Path) -> None:
    """Qwen2's shape: 72 embedding rows for 64 tokens. The fine-tune's two chat tokens take two of
    the padding rows (ids 64, 65); the output keeps the target's 72 rows, loads and generates."""
    folders = _chat_transport(tmp_path, 72, [], rows=72)
    out = _transport(tmp_path, folders)
    model = T.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = T.AutoTokenizer.from_pretrained(str(out))
    assert model.config.vocab_size == 72 and tok.convert_tokens_to_ids(CHATML) == [64, 65]
    ft_model = T.AutoModelForCausalLM.from_pretrained(str(folders["ft"])).eval()
    ids = torch.tensor([[1, 64, 5, 7, 65, 9]])
    with torch.no_grad():
        gap = (model(ids).logits[..., :66] - ft_model(ids).logits[..., :66]).abs().max()
    assert float(gap) < 1e-4  # the target is the base moved: the fine-tune's function on every token
    assert model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=2).shape == (1, 9)


def test_models_of_other_widths_and_vocabularies_merge_into_the_wide_shape_and_the_union(tmp_path: Path) -> None:
    narrow = tiny_llama(64, 0)
    narrow.save_pretrained(str(tmp_path / "n"))
    vocab_tokenizer(64).save_pretrained(str(tmp_path / "n"))
    config = tiny_llama(66, 1).config
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 32, 8, 4
    config.head_dim, config.intermediate_size = 4, 48
    torch.manual_seed(1)
    T.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "w"))
    vocab_tokenizer(64, CHATML).save_pretrained(str(tmp_path / "w"))
    body = {"job": "merge", "models": ["./n", "./w"], "strategy": "weight-matching", "tokenizer": {"source": "union"}}
    result = run_recipe(load_recipe(write_recipe(tmp_path, {**body, "output": {"dir": "out"}})))
    assert any("embedded into the shape of" in n for n in result.notes)
    model = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert (model.config.hidden_size, model.config.vocab_size) == (32, 66)
    wide, out = _tensors(tmp_path / "w"), _tensors(tmp_path / "out")
    # the chat rows only the wide model has: its own, its residual features permuted into A's basis
    assert torch.equal(out[EMBED][64:].sort(-1).values, wide[EMBED][64:].sort(-1).values)
