"""The ``hf-rebasin`` command on model folders.

Covers the CLI contract: exit 0 when outputs are preserved, 1 on an internal error
or outputs outside tolerance, 2 on a user error with a one-paragraph message and no traceback.
Where the process is the point (start-up, `--help`, what a user's terminal shows, the debug
switch read from the environment) the command runs as a subprocess, as a user runs it; the other
cases call `cli.main` in this process (`run_main`), which saves the 4–5 s interpreter start-up each.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import transformers as T

import tiny
from helpers import assert_user_error, finish, flat, run_cli, run_main, start_cli

# ------------------------------------------------------------------------------------------------
# the happy path
# ------------------------------------------------------------------------------------------------


def test_help_lists_verify() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "verify" in proc.stdout
    assert "hf-rebasin" in proc.stdout


def test_version() -> None:
    from hf_rebasin import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"hf-rebasin {__version__}"


def test_no_command_is_a_usage_error() -> None:
    proc = run_cli()
    assert proc.returncode == 2
    assert "verify" in proc.stderr


@pytest.mark.slow  # 5.5 s; the other verify tests cover the command fast
def test_verify_gpt2_permutation(saved_model) -> None:
    folder = saved_model("gpt2")
    proc = run_cli("verify", str(folder), "--seed", "3")
    out = flat(proc.stdout)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "max |Δ| = " in out and "(tolerance 1e-4)" in out
    assert "h.{i}.attn" in out and "head-permutation" in out
    assert "compared outputs: logits" in out
    assert "Loading weights" not in proc.stderr  # transformers' progress bar is silenced


def test_verify_gpt2_orthogonal(saved_model) -> None:
    folder = saved_model("gpt2")
    proc = run_main("verify", str(folder), "--class", "orthogonal")
    out = flat(proc.stdout)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "orthogonal (fixing 1)" in out  # LayerNorm residual stream
    assert "lm_head.weight" in out  # untied for the canonical form, and the report says so
    assert "max |Δ| = " in out
    assert "fall back" not in out


def test_verify_bert_orthogonal_falls_back_to_permutation(saved_model) -> None:
    folder = saved_model("bert-mlm")
    proc = run_main("verify", str(folder), "--class", "orthogonal")
    out = flat(proc.stdout)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "fall back to permutation" in out
    assert "'res'" in out and "post-norm" in out
    assert "max |Δ| = " in out


@pytest.mark.parametrize("case", ["marian", "m2m100"])
@pytest.mark.parametrize("cls", ["permutation", "orthogonal"])
def test_verify_a_pinned_stream_keeps_the_identity(saved_model, case: str, cls: str) -> None:
    """Marian (its files lack the sinusoidal tables: MarianMTModel makes them on load) and M2M100
    pass under both classes, the stream pinned and said so, heads still moving."""
    folder = saved_model(case)
    proc = run_main("verify", str(folder), "--class", cls)
    out = flat(proc.stdout)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "residual stream pinned: sinusoidal positions are regenerated on load" in out
    assert "pinned (identity only" in out and "head-permutation" in out
    assert "fall back" not in out and "OK: outputs unchanged" in out


def test_verify_pickle_with_allow_pickle(tmp_path: Path, saved_model) -> None:
    folder = _pickle_only(tmp_path, saved_model)
    proc = run_main("verify", str(folder), "--allow-pickle")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "max |Δ| = " in proc.stdout


# ------------------------------------------------------------------------------------------------
# bad input: exit 2, a message that says what and where, no traceback
# ------------------------------------------------------------------------------------------------


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert_user_error(run_main("verify", str(missing)), "does not exist", "no-such-model")


def test_folder_without_config(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    assert_user_error(run_main("verify", str(folder)), "config.json")


def test_checkpoint_that_does_not_match_its_config(saved_model) -> None:
    folder = saved_model("gpt2")
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["n_embd"] = 48  # the weights were saved with 32
    cfg_path.write_text(json.dumps(cfg))
    err = assert_user_error(run_main("verify", str(folder)), "tensor '", "config.json")
    assert "32" in err and "48" in err  # both shapes


def test_unsupported_model_type(saved_model) -> None:
    torch.manual_seed(0)
    # a state-space model: no attention heads, no adapter
    cfg = T.MambaConfig(vocab_size=tiny.V, hidden_size=16, num_hidden_layers=1, state_size=4, conv_kernel=2)
    folder = saved_model(T.MambaForCausalLM(cfg))
    err = assert_user_error(run_main("verify", str(folder)), "'mamba'", "not supported")
    for model_type in ("bert", "gpt2", "llama", "distilbert", "modernbert"):
        assert model_type in err


def _pickle_only(tmp_path: Path, saved_model) -> Path:
    """A folder with config.json and pytorch_model.bin only (transformers 5 always writes safetensors)."""
    source = saved_model("gpt2")
    folder = tmp_path / "pickle-only"
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    torch.save(tiny.gpt2(0).state_dict(), folder / "pytorch_model.bin")
    return folder


def test_pickle_only_checkpoint_is_refused(tmp_path: Path, saved_model) -> None:
    folder = _pickle_only(tmp_path, saved_model)
    assert_user_error(run_main("verify", str(folder)), "pytorch_model.bin", "allow_pickle", "--allow-pickle")


def test_allowed_pickle_that_does_not_match_its_config(tmp_path: Path, saved_model) -> None:
    folder = _pickle_only(tmp_path, saved_model)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"n_embd": 48}))
    assert_user_error(run_main("verify", str(folder), "--allow-pickle"), "tensor '", "config.json")


def test_model_type_unknown_to_transformers_lists_supported(saved_model) -> None:
    folder = saved_model("gpt2")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"model_type": "not-a-model"}))
    assert_user_error(run_main("verify", str(folder)), "'not-a-model'", "supported", "gpt2", "llama")


def test_bad_class_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli("verify", str(tmp_path), "--class", "affine")
    assert proc.returncode == 2
    assert "--class" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------
# internal errors and failed verification: exit 1
# ------------------------------------------------------------------------------------------------

_PATCHED = textwrap.dedent(
    """
    import sys
    import hf_rebasin.alignment.verify as v
    from hf_rebasin.cli import main

    def fake(model, transform_class="permutation", seed=0):
        if "{mode}" == "boom":
            raise RuntimeError("simulated bug")
        return v.VerifyReport(max_abs_diff=0.5, compared=["logits"], transform_class=transform_class,
                              classes={{"res": "permutation"}})

    v.verify_model = fake
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.slow  # CLI processes (8 s)
def test_internal_error_exits_1_without_traceback(saved_model) -> None:
    folder = saved_model("gpt2")
    # both runs at once: each is mostly interpreter start-up
    plain = start_cli("verify", str(folder), code=_PATCHED.format(mode="boom"))
    debugging = start_cli("verify", str(folder), code=_PATCHED.format(mode="boom"), env={"HF_REBASIN_DEBUG": "1"})
    proc, debug = finish(plain), finish(debugging)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    err = flat(proc.stderr)
    assert err.startswith("internal error: RuntimeError: simulated bug")
    assert "HF_REBASIN_DEBUG=1" in err and "Traceback" not in err

    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "simulated bug" in debug.stderr


@pytest.mark.slow  # CLI processes (6 s)
def test_outputs_outside_tolerance_exit_1(saved_model) -> None:
    folder = saved_model("gpt2")
    proc = run_cli("verify", str(folder), code=_PATCHED.format(mode="diff"))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "max |Δ| = 0.5" in proc.stdout and "FAILED" in proc.stdout
