"""The ``hf-rebasin`` command on model folders.

Covers the CLI contract: exit 0 when outputs are preserved, 1 on an internal error
or outputs outside tolerance, 2 on a user error with a one-paragraph message and no traceback.
Where the process is the point (start-up, `--help`, what a user's terminal shows, the debug
switch read from the environment) the command runs as a subprocess, as a user runs it; the other
cases call `cli.main` in this process (`run_main`), which saves the 4–5 s interpreter start-up each.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import transformers as T

import tiny

ROOT = Path(__file__).resolve().parent.parent


def start_cli(*args: str, code: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``python -m hf_rebasin ARGS`` (or ``python -c CODE ARGS``) from the repo root, offline."""
    environ = {k: v for k, v in os.environ.items() if k != "HF_REBASIN_DEBUG"}
    environ.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        COLUMNS="200",
    )
    environ.update(env or {})  # may turn downloads back on (tests against the local Hub)
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "hf_rebasin", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    """Wait for a started CLI process (killed after 300 s) and collect its output."""
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(*args: str, code: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion (see :func:`start_cli`)."""
    return finish(start_cli(*args, code=code, env=env))


def run_main(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI run in this process: no interpreter start-up (4–5 s for torch and transformers), for
    runs that need no signals or isolation. ``env`` is set for the call only, so it reaches what is
    read at call time (caches, the debug switch), not what a library read when it was imported."""
    from hf_rebasin.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def flat(text: str) -> str:
    """Whitespace collapsed, so assertions do not depend on where the console wrapped a line."""
    return " ".join(text.split())


def assert_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, an ``error:`` message on stderr naming every needle, and no traceback."""
    err = flat(proc.stderr)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert err.startswith("error:"), proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    for needle in needles:
        assert needle in err, (needle, proc.stderr)
    return err


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
    import hf_rebasin.verify as v
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


def test_outputs_outside_tolerance_exit_1(saved_model) -> None:
    folder = saved_model("gpt2")
    proc = run_cli("verify", str(folder), code=_PATCHED.format(mode="diff"))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "max |Δ| = 0.5" in proc.stdout and "FAILED" in proc.stdout
