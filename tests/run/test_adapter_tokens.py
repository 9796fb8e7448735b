"""LoRA adapters trained with new tokens (the PEFT guide's "LoRA with additional tokens": the base
resized, the embedding and LM head saved whole in ``modules_to_save``, or the new rows as trainable
tokens) moved onto the base permuted, and written back as PEFT adapters for it.

Each output is loaded as the guide loads an adapter with new tokens (the target from its folder,
``resize_token_embeddings(len(tokenizer))`` with the output's tokenizer, ``PeftModel.from_pretrained``)
and checked against what it was computed from by other means: the full model the same transport
writes when the fine-tune is given merged (PEFT's own ``merge_and_unload``, saved whole), and, the
target being the base permuted and α = 1, the fine-tune itself on the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

import tiny
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.recipe import load_recipe
from hf_rebasin.run.pipeline import run_recipe
from hf_rebasin.symmetry.adapters import graph_for
from lm_folders import write_recipe
from vocab_models import CHATML, tiny_llama, vocab_tokenizer

peft = pytest.importorskip("peft")

# per architecture: the base model, its LoRA targets, its embedding and LM head modules
ARCH = {
    "gpt2": (lambda: tiny.gpt2(0), ["c_attn", "c_fc"], ["transformer.wte", "lm_head"]),  # LM head tied
    "llama": (lambda: tiny_llama(64, 0), ["q_proj", "v_proj", "down_proj"], ["model.embed_tokens", "lm_head"]),
}
TOKENS = ["<s>", "<|im_start|>", "_tok_5", "_tok_7", "<|im_end|>", "_tok_9", "<|im_start|>", "_tok_3", "_tok_11"]


def _bases(root: Path, arch: str) -> dict[str, Path]:
    """base/ (64 tokens) and target/ (the base with its units and residual features permuted)."""
    model = ARCH[arch][0]()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    moved = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(3)))
    for name, state in (("base", sd), ("target", moved)):
        rebuild(model, dict(state)).save_pretrained(str(root / name))
        vocab_tokenizer(64).save_pretrained(str(root / name))
    return {"base": root / "base", "target": root / "target"}


def _resized(folder: Path, rows: int) -> T.PreTrainedModel:
    """The model of ``folder`` resized to ``rows`` rows, the new ones at the mean of the old (so the
    rows an adapter does not give are known)."""
    model = T.AutoModelForCausalLM.from_pretrained(str(folder))
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows)
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            layer.weight[old:] = layer.weight[:old].mean(0)
    return model.eval()


def _adapter(root: Path, arch: str, mode: str, folders: dict[str, Path]) -> Path:
    """adapter/: LoRA on the resized base with its new rows trained (its tokenizer beside it)."""
    _, targets, (embedding, head) = ARCH[arch]
    short = embedding.rsplit(".", 1)[-1]
    extra = (
        {"modules_to_save": [short, head]}  # on GPT-2, PEFT trains a copy of each: the head parts from wte
        if mode == "modules_to_save"
        else {"trainable_token_indices": {short: [64, 65]}}  # PEFT ties GPT-2's head rows to them
    )
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=arch == "gpt2", **extra)
    model = peft.get_peft_model(_resized(folders["base"], 66), config)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(root / "adapter"))  # base_model_name_or_path: base/, so PEFT saves the resized layers
    vocab_tokenizer(64, CHATML).save_pretrained(str(root / "adapter"))
    return root / "adapter"


def _merged(root: Path, folders: dict[str, Path]) -> Path:
    """merged/: PEFT's own merge of the adapter on its resized base, saved whole (untied where PEFT's
    copies of a tied head parted)."""
    model = peft.PeftModel.from_pretrained(_resized(folders["base"], 66), str(folders["adapter"]))
    merged = model.merge_and_unload().eval()
    emb, head = merged.get_input_embeddings().weight, merged.get_output_embeddings().weight
    if emb.data_ptr() != head.data_ptr():
        merged.config.tie_word_embeddings = False
    merged.save_pretrained(str(root / "merged"))
    vocab_tokenizer(64, CHATML).save_pretrained(str(root / "merged"))
    return root / "merged"


def _transport(root: Path, folders: dict[str, Path], ft: str, out: str, **extra: object) -> Path:
    body = {
        "job": "transport",
        "base": str(folders["base"]),
        "finetuned": str(folders[ft]),
        "target": str(folders["target"]),
        "strategy": "weight-matching",
        "calibrate": False,
        "output": {"dir": out},
        **extra,
    }
    run_recipe(load_recipe(write_recipe(root, body)))
    return root / out


def _loaded(target: Path, adapter: Path) -> tuple[T.PreTrainedModel, T.PreTrainedTokenizerBase]:
    """The adapter loaded as the PEFT guide loads one with new tokens."""
    tokenizer = T.AutoTokenizer.from_pretrained(str(adapter))
    model = T.AutoModelForCausalLM.from_pretrained(str(target))
    model.resize_token_embeddings(len(tokenizer))
    return peft.PeftModel.from_pretrained(model, str(adapter)).eval(), tokenizer


def _logits(model: T.PreTrainedModel, tokenizer: T.PreTrainedTokenizerBase) -> torch.Tensor:
    """Logits on `TOKENS`, as ``tokenizer`` encodes them, its columns in the order of its tokens."""
    ids = torch.tensor([tokenizer.convert_tokens_to_ids(TOKENS)])
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("mode", ["modules_to_save", "trainable_tokens"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_an_adapter_with_new_tokens_is_written_back_as_an_adapter_for_the_target(
    arch: str, mode: str, tmp_path: Path
) -> None:
    folders = _bases(tmp_path, arch)
    folders["adapter"] = _adapter(tmp_path, arch, mode, folders)
    folders["merged"] = _merged(tmp_path, folders)
    (tmp_path / "task.txt").write_text("<|im_start|>a b<|im_end|>\n" * 8, encoding="utf-8")
    data = {"task": "causal-lm", "data": {"dataset": "text", "data_files": str(tmp_path / "task.txt")}}
    out = _transport(tmp_path, folders, "adapter", "out", evaluate=data)
    full = _transport(tmp_path, folders, "merged", "full")  # the same fine-tune, given whole: a full model
    assert not (out / "model.safetensors").exists() and (full / "model.safetensors").is_file()
    modules = ARCH[arch][2]
    config = json.loads((out / "adapter_config.json").read_text(encoding="utf-8"))
    assert config["modules_to_save"] == modules and config["base_model_name_or_path"] == str(folders["target"])
    assert not config.get("trainable_token_indices")
    tensors, whole = load_file(str(out / "adapter_model.safetensors")), load_file(str(full / "model.safetensors"))
    for module in modules:  # stored as PEFT stores a module_to_save: under the module's own key
        written = tensors[f"base_model.model.{module}.weight"]
        if f"{module}.weight" in whole:  # a tied head is written once in the full model
            assert written.shape == (66, whole[f"{module}.weight"].shape[1])
            assert float((written - whole[f"{module}.weight"]).abs().max()) < 1e-6
    ours, tok = _loaded(folders["target"], out)
    assert tok.convert_tokens_to_ids(CHATML) == [64, 65]  # each added token reads the row carried for it
    # (a) the full model the transport writes from the merged fine-tune
    a = (_logits(ours, tok) - _logits(T.AutoModelForCausalLM.from_pretrained(str(full)).eval(), tok)).abs().max()
    assert float(a) <= 1e-4
    # (b) the target is the base permuted: the fine-tune's own function, on every token
    ft_tok = T.AutoTokenizer.from_pretrained(str(folders["adapter"]))
    original = peft.PeftModel.from_pretrained(_resized(folders["base"], 66), str(folders["adapter"])).eval()
    b = (_logits(ours, tok) - _logits(original, ft_tok)).abs().max()
    assert float(b) <= 1e-4
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    summary = record["transport"]["adapter"]
    assert summary["modules_to_save"] == modules and summary["embedding_rows"] == 66
    assert summary["trainable_tokens"] is (mode == "trainable_tokens")
    assert any("the output is a LoRA adapter for the target" in n for n in record["notes"])
    assert not any("not an adapter" in n for n in record["notes"])
    loss = record["transport"]["loss"]  # scored as the full model: the fine-tune's own loss
    assert loss["transported"][0] == pytest.approx(loss["finetuned"], abs=1e-4)
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "library_name: peft" in card and "resize_token_embeddings(66)" in card
    assert f"`{modules[1]}` (stored whole, `modules_to_save`, 66 rows)" in card


def test_alpha_scales_the_adapters_factors_and_its_rows_as_the_full_model(tmp_path: Path) -> None:
    folders = _bases(tmp_path, "gpt2")
    folders["adapter"] = _adapter(tmp_path, "gpt2", "modules_to_save", folders)
    folders["merged"] = _merged(tmp_path, folders)
    out = _transport(tmp_path, folders, "adapter", "out", alpha=0.5)
    full = _transport(tmp_path, folders, "merged", "full", alpha=0.5)
    ours, tok = _loaded(folders["target"], out)
    gap = (_logits(ours, tok) - _logits(T.AutoModelForCausalLM.from_pretrained(str(full)).eval(), tok)).abs().max()
    assert float(gap) <= 1e-4


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_generalized_orthogonal_matches_such_an_adapter_by_permutation_and_says_why(arch: str, tmp_path: Path) -> None:
    """The alignment works in canonical form (GPT-2's norm scales folded into its LM head), while the
    embedding and head are written as the target stores them."""
    folders = _bases(tmp_path, arch)
    folders["adapter"] = _adapter(tmp_path, arch, "modules_to_save", folders)
    out = _transport(tmp_path, folders, "adapter", "out", strategy="generalized-orthogonal")
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert any("cannot follow the canonical form" in n and "modules_to_save" in n for n in record["notes"])
    ours, tok = _loaded(folders["target"], out)
    original = peft.PeftModel.from_pretrained(_resized(folders["base"], 66), str(folders["adapter"])).eval()
    ft_tok = T.AutoTokenizer.from_pretrained(str(folders["adapter"]))
    assert float((_logits(ours, tok) - _logits(original, ft_tok)).abs().max()) <= 1e-4


def test_a_target_wider_than_the_adapters_base_gets_a_full_model_and_the_reason(tmp_path: Path) -> None:
    folders = _bases(tmp_path, "llama")
    folders["adapter"] = _adapter(tmp_path, "llama", "modules_to_save", folders)
    config = tiny_llama(64, 1).config
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 32, 8, 4
    config.head_dim, config.intermediate_size = 4, 48
    torch.manual_seed(1)
    T.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "wide"))
    vocab_tokenizer(64).save_pretrained(str(tmp_path / "wide"))
    out = _transport(tmp_path, {**folders, "target": tmp_path / "wide"}, "adapter", "out")
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    record = json.loads((out / "rebasin.json").read_text(encoding="utf-8"))
    assert any("the output is a full model: its base is embedded" in n for n in record["notes"])
    model = T.AutoModelForCausalLM.from_pretrained(str(out))
    assert (model.config.hidden_size, model.config.vocab_size) == (32, 66)


def test_trainable_tokens_on_the_bases_own_rows_need_no_new_vocabulary(tmp_path: Path) -> None:
    """Trainable tokens of tokens the base has (no resizing, one vocabulary everywhere): the output is
    an adapter with the target's 64 rows, loaded on the target as it is."""
    folders = _bases(tmp_path, "llama")
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [5, 7]})
    model = peft.get_peft_model(T.AutoModelForCausalLM.from_pretrained(str(folders["base"])), config)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    model.save_pretrained(str(tmp_path / "adapter"))
    vocab_tokenizer(64).save_pretrained(str(tmp_path / "adapter"))
    out = _transport(tmp_path, {**folders, "adapter": tmp_path / "adapter"}, "adapter", "out")
    assert load_file(str(out / "adapter_model.safetensors"))["base_model.model.lm_head.weight"].shape == (64, 16)
    ours, tok = _loaded(folders["target"], out)
    original = peft.PeftModel.from_pretrained(
        T.AutoModelForCausalLM.from_pretrained(str(folders["base"])), str(tmp_path / "adapter")
    ).eval()
    assert float((_logits(ours, tok) - _logits(original, tok)).abs().max()) <= 1e-4  # one vocabulary
