"""A tied head stored with other values is read as transformers 5 reads it: untied, with a note.

The oracle is the stock class: ``from_pretrained`` keeps an LM head apart from the embeddings when
config.json ties them but the file stores both with different values. hf-rebasin must load the
same values on both paths (whole and streamed), build its symmetry graph without the tie, verify
the model, merge it, and write a folder that stock transformers loads with the same logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import tiny
from hf_rebasin.alignment.verify import transformed_model
from hf_rebasin.cli import main
from hf_rebasin.io.models import load_model

# a tiny model whose config ties the head to the embeddings, and the pair (head, embeddings)
FAMILIES = {
    "gpt2": ("lm_head.weight", "transformer.wte.weight"),
    "llama-tied-bias": ("lm_head.weight", "model.embed_tokens.weight"),
}
TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])


def _apart(folder: Path, head: str, embeddings: str, seed: int = 0) -> Path:
    """``folder``'s file rewritten with ``head`` stored beside ``embeddings``, other values; the config still ties them."""
    state = load_file(str(folder / "model.safetensors"))
    noise = torch.randn(state[embeddings].shape, generator=torch.Generator().manual_seed(seed + 7))
    state[head] = state[embeddings] + 0.1 * noise
    save_file(
        {k: v.contiguous().clone() for k, v in state.items()}, str(folder / "model.safetensors"), {"format": "pt"}
    )
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _written(root: Path, family: str, seed: int = 0) -> Path:
    """The family's tiny model saved with its head stored apart (once per module)."""
    folder = root / f"{family}-{seed}"
    if not folder.exists():
        tiny.FACTORIES[family](seed).save_pretrained(str(folder))
        _apart(folder, *FAMILIES[family], seed=seed)
    return folder


def _permuted(root: Path, family: str) -> Path:
    """A random allowed permutation of the family's model (residual stream, heads, MLP), written
    with its head apart and a config that still ties it: the same function, other tensors."""
    folder = root / f"{family}-permuted"
    if not folder.exists():
        lm = load_model(_written(root, family))
        moved, *_ = transformed_model(lm.model, "permutation", seed=3)
        moved.save_pretrained(str(folder))  # its config says false: both tensors written
        head, embeddings = FAMILIES[family]
        assert not torch.equal(moved.state_dict()[head], lm.model.state_dict()[head])
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}, indent=2))
        assert set(load_file(str(folder / "model.safetensors"))) >= {head, embeddings}
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tied-apart")


def _stock(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_transformers_keeps_the_head_apart(root: Path, family: str) -> None:
    """The rule hf-rebasin follows, checked on the installed transformers: the stored head, its own tensor."""
    folder = _written(root, family)
    head, _ = FAMILIES[family]
    stored = load_file(str(folder / "model.safetensors"))
    stock = _stock(folder)
    assert torch.equal(stock.lm_head.weight, stored[head])
    assert not torch.equal(stock.lm_head.weight, stock.get_input_embeddings().weight)
    assert stock.lm_head.weight is not stock.get_input_embeddings().weight


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_both_paths_read_it_untied(root: Path, family: str, stream: bool) -> None:
    folder = _written(root, family)
    head, embeddings = FAMILIES[family]
    stock = _stock(folder).state_dict()
    lm = load_model(folder, stream=stream)
    assert (lm.source is not None) == stream
    assert lm.untied == {head: embeddings}
    assert lm.graph.ties == {}
    assert lm.model.config.tie_word_embeddings is False
    assert not dict(getattr(lm.model, "all_tied_weights_keys", None) or {})
    for name in (head, embeddings):
        assert torch.equal(lm.weights[name], stock[name]), name


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_equal_values_stored_twice_stay_tied(tmp_path: Path, stream: bool) -> None:
    """A legacy export that stores the head as well, with the embeddings' values: tied, as before."""
    folder = tmp_path / "gpt2"
    tiny.gpt2(0).save_pretrained(str(folder))
    state = load_file(str(folder / "model.safetensors"))
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    save_file(state, str(folder / "model.safetensors"), {"format": "pt"})
    lm = load_model(folder, stream=stream)
    assert lm.untied == {}
    assert lm.graph.ties == {"lm_head.weight": "transformer.wte.weight"}
    assert lm.model.config.tie_word_embeddings is True


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_passes_and_names_the_tensor(root: Path, family: str, capsys: Any) -> None:
    folder = _written(root, family)
    capsys.readouterr()
    code = main(["verify", str(folder)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert "OK: outputs unchanged" in out
    assert "lm_head.weight differs from" in out and "read untied, as transformers 5 loads it" in out


def _merge(root: Path, name: str, models: list[Path], strategy: str, **extra: Any) -> tuple[Path, dict[str, Any]]:
    out = root / "out" / name
    recipe = root / f"{name}.yaml"
    body = {"job": "merge", "models": [str(m) for m in models], "strategy": strategy, "output": {"dir": str(out)}}
    recipe.write_text(yaml.safe_dump(body | {"cache": False, "device": "cpu"} | extra))
    code = main([str(recipe)])
    assert code == 0
    return out, json.loads((out / "rebasin.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_merge_with_itself_is_the_model_as_stock_loads_it(root: Path, family: str, capsys: Any) -> None:
    """Vanilla, the model with itself (streamed): the output, loaded by the stock class, gives the
    input's stock logits, its head stored apart under tie_word_embeddings: false."""
    folder = _written(root, family)
    out, record = _merge(root, f"{family}-self", [folder, folder], "vanilla")
    capsys.readouterr()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    head, _ = FAMILIES[family]
    written = load_file(str(out / "model.safetensors"))
    assert torch.allclose(written[head], load_file(str(folder / "model.safetensors"))[head], atol=1e-6)
    gap = float((_logits(_stock(out)) - _logits(_stock(folder))).abs().max())
    assert gap <= 1e-4, gap
    assert any("lm_head.weight differs from" in n for n in record["notes"]), record["notes"]


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_matching_undoes_a_permutation(root: Path, family: str, capsys: Any) -> None:
    """Aligned merge of the model with a permuted copy, both stored apart: the output computes the
    model (the stock class reading both folders), and hf-rebasin's own check agrees."""
    a, b = _written(root, family), _permuted(root, family)
    out, record = _merge(root, f"{family}-wm", [a, b], "weight-matching")
    capsys.readouterr()
    assert record["function_preserved"]["max_abs_diff"] <= 1e-4
    merged, original = _stock(out), _stock(a)
    gap = float((_logits(merged) - _logits(original)).abs().max())
    assert gap <= 1e-4, gap
    # the stored head, not the embeddings
    assert torch.allclose(merged.lm_head.weight, original.lm_head.weight, atol=1e-5)
    assert merged.lm_head.weight is not merged.get_input_embeddings().weight


def test_beside_a_tied_model_the_refusal_says_why(root: Path, capsys: Any) -> None:
    """Merged with a model that ties its head, the one read untied is named with the reason (exit 2,
    as for any pair tied differently), not blamed on its config.json."""
    tied = root / "gpt2-tied"
    if not tied.exists():
        tiny.gpt2(2).save_pretrained(str(tied))
    recipe = root / "mixed.yaml"
    body = {"job": "merge", "models": [str(tied), str(_written(root, "gpt2"))], "strategy": "weight-matching"}
    recipe.write_text(yaml.safe_dump(body | {"output": {"dir": str(root / "out" / "mixed")}, "cache": False}))
    capsys.readouterr()
    assert main([str(recipe)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "its files store the two with other values, so it loads untied" in err, err
    assert not (root / "out" / "mixed").exists()


def test_a_merge_read_whole_agrees_with_the_stock_class(root: Path, capsys: Any) -> None:
    """The in-memory path (an evaluation loads the models whole): the output's stock logits are those
    of the same merge read streamed, and each input is noted."""
    from hf_rebasin.evaluation.data import char_tokenizer

    text = "to be, or not to be, that is the question\n" * 8
    (root / "corpus.txt").write_text(text)
    a, b = root / "whole-a", root / "whole-b"
    for seed, folder in enumerate((a, b)):
        shutil.copytree(_written(root, "gpt2", seed), folder)
        char_tokenizer(text).save_pretrained(str(folder))
    evaluate = {"task": "causal-lm", "data": {"dataset": "text", "data_files": str(root / "corpus.txt")}, "points": 3}
    whole, record = _merge(root, "whole", [a, b], "weight-matching", evaluate=evaluate)
    streamed, _ = _merge(root, "streamed", [a, b], "weight-matching")
    capsys.readouterr()
    assert sum("read untied" in n for n in record["notes"]) == 2, record["notes"]
    gap = float((_logits(_stock(whole)) - _logits(_stock(streamed))).abs().max())
    assert gap <= 1e-4, gap
