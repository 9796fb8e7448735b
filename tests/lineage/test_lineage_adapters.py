"""A PEFT adapter folder given to `hf-rebasin lineage`: compared as its base with the adapter merged
in (the base named by ``adapter_config.json``), or refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as T

import tiny
from helpers import assert_user_error, flat, run_main


def _adapter(root: Path) -> tuple[Path, Path]:
    """A tiny GPT-2 saved in ``root/base`` and a LoRA adapter of it (factors moved off zero)."""
    from peft import LoraConfig, get_peft_model

    base = tiny.FACTORIES["gpt2"](0).eval()
    base.save_pretrained(str(root / "base"))
    peft_model = get_peft_model(
        T.GPT2LMHeadModel.from_pretrained(str(root / "base")),
        LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True),
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.add_(0.02 * torch.randn_like(p))
    peft_model.save_pretrained(str(root / "adapter"))
    return root / "base", root / "adapter"


def test_an_adapter_is_compared_as_its_base_with_the_adapter_merged_in(tmp_path: Path) -> None:
    base, adapter = _adapter(tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == base  # as PEFT saved it
    proc = run_main("lineage", str(base), str(adapter), "--json")
    assert proc.returncode == 0, proc.stderr
    assert "MODEL 2 is a LoRA adapter: compared as its base" in flat(proc.stderr)
    record = json.loads(proc.stdout)  # the record alone
    assert record["pairs"][0]["verdict"] == "same basis"


def test_an_adapter_whose_base_is_missing_says_which_base(tmp_path: Path) -> None:
    _, adapter = _adapter(tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    proc = run_main("lineage", str(tmp_path / "base"), str(adapter))
    assert_user_error(proc, "MODEL 2", "is a PEFT LoRA adapter", "base_model_name_or_path", "gone")
