"""Output folders survive kills, signals and concurrent runs; modes follow the umask; no local paths.

The kill and signal cases need real processes or a simulated kill between the two renames of a
replace; the plain bad-input rows are in ``bad_cases_output.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bad_input import ROOT, Case, Workspace, offline_env, run_case

fcntl = pytest.importorskip("fcntl")


def _previous(folder: Path, label: str = "previous") -> Path:
    """A stand-in for an earlier hf-rebasin output."""
    folder.mkdir(parents=True)
    (folder / "rebasin.json").write_text(json.dumps({"label": label}), encoding="utf-8")
    return folder


def _label(folder: Path) -> Any:
    return json.loads((folder / "rebasin.json").read_text(encoding="utf-8")).get("label")


def _run(ws: Workspace, argv: list[str]) -> Any:
    return run_case(Case("in-process", "output", lambda _ws: argv, 0), ws, argv)


# -- the replace, killed between its two renames ---------------------------------------------------


def test_a_kill_between_the_renames_is_recovered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_rebasin.core.errors import OutputExistsError
    from hf_rebasin.io import output

    target = _previous(tmp_path / "result")
    real_rename = Path.rename

    def rename(self: Path, dest: Any) -> Any:
        if self.name.startswith(".result.tmp-"):  # the second rename: the run dies here
            raise SystemExit("killed")
        return real_rename(self, dest)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(SystemExit), output.output_folder(target, overwrite=True) as tmp:
        (tmp / "rebasin.json").write_text(json.dumps({"label": "new"}), encoding="utf-8")
    monkeypatch.setattr(Path, "rename", real_rename)
    assert not target.exists() and [p.name[:12] for p in tmp_path.iterdir()] == [".result.old-"]

    # the next run restores the previous result before it checks the folder, and says so
    with pytest.raises(OutputExistsError, match="restored"), output.output_folder(target, overwrite=False):
        pass
    assert _label(target) == "previous" and [p.name for p in tmp_path.iterdir()] == ["result"]


def test_recover_removes_unfinished_and_stale_copies(tmp_path: Path) -> None:
    from hf_rebasin.io.output import recover

    target = _previous(tmp_path / "out", "current")
    (tmp_path / ".out.tmp-abc12345").mkdir()
    (tmp_path / ".out.tmp-abc12345" / "model.safetensors").write_bytes(b"half")
    _previous(tmp_path / ".out.old-def67890", "stale")
    (tmp_path / ".out.old-mine").mkdir()
    (tmp_path / ".out.old-mine" / "notes.txt").write_text("not an hf-rebasin output: left alone")
    notes = recover(target)
    assert len(notes) == 2 and "unfinished" in notes[0] and "already replaced" in notes[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old-mine", "out"] and _label(target) == "current"


def test_a_run_after_a_killed_run_restores_and_reports(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    recipe = ws.merge_recipe({"dir": "out", "overwrite": True})
    _previous(tmp_path / ".out.old-k1ll3d00")  # the run was killed between the renames: no `out`
    (tmp_path / ".out.tmp-k1ll3d01").mkdir()
    result = _run(ws, [str(recipe)])
    assert result.code == 0, result.stderr
    assert "restored" in result.out and "unfinished" in result.out
    assert _label(tmp_path / "out") is None  # replaced by this run's record
    assert not ws.leftovers() and not list(tmp_path.glob(".out*"))


# -- one run at a time ----------------------------------------------------------------------------


def test_a_second_run_on_a_held_output_is_refused(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    recipe = ws.merge_recipe({"dir": "out", "overwrite": True})
    previous = _previous(tmp_path / "out")
    lock = tmp_path / ".out.lock"
    with open(lock, "w") as held:  # what a run holds while it writes `out`
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = _run(ws, [str(recipe)])
    assert result.code == 2 and "another hf-rebasin run is writing" in result.err, result.stderr
    assert _label(previous) == "previous" and lock.exists() and not ws.leftovers()


def test_the_lock_is_released_and_removed_when_the_run_fails(tmp_path: Path) -> None:
    """The lock (filelock, ``.out.lock``) is held only inside the claim: gone after a block that
    raises, and a second claim of the same output inside the first is refused as busy."""
    from hf_rebasin.core.errors import OutputBusyError
    from hf_rebasin.io.output import claim_output

    lock = tmp_path / ".out.lock"
    with pytest.raises(RuntimeError, match="boom"), claim_output(tmp_path / "out", overwrite=False):
        assert lock.exists()
        with pytest.raises(OutputBusyError, match="another hf-rebasin run is writing"):
            with claim_output(tmp_path / "out", overwrite=False):
                pass
        raise RuntimeError("boom")
    assert not lock.exists() and not list(tmp_path.iterdir())
    with claim_output(tmp_path / "out", overwrite=False):  # the next run takes it
        assert lock.exists()
    assert not lock.exists()


# -- signals ----------------------------------------------------------------------------------------


def _slow_save_process(ws: Workspace, recipe: Path) -> subprocess.Popen[str]:
    """``hf-rebasin RECIPE`` in a real process whose save waits after writing the weights."""
    code = (
        "import sys, time\n"
        "import hf_rebasin.io.export as e\n"
        "save = e.save_merged_model\n"
        "def slow(*a, **k):\n"
        "    save(*a, **k)\n"
        "    time.sleep(60)\n"
        "e.save_merged_model = slow\n"
        "from hf_rebasin.cli import main\n"
        f"sys.exit(main([{str(recipe)!r}]))\n"
    )
    env = {**os.environ, **offline_env(ws), "PYTHONPATH": str(ROOT)}
    env.pop("HF_REBASIN_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ws.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow  # a real process signalled mid-save (6 s)
def test_sigterm_during_the_save_removes_the_temporary_folder(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    recipe = ws.merge_recipe({"dir": "out", "overwrite": True})
    _previous(tmp_path / "out")  # replaced by the run, had it finished
    proc = _slow_save_process(ws, recipe)
    deadline = time.monotonic() + 90
    while not list(tmp_path.glob(".out.tmp-*/model.safetensors")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted before the output was written" in err and "unchanged" in err
    assert not ws.leftovers() and not list(tmp_path.glob(".out.*"))
    assert _label(tmp_path / "out") == "previous"


def test_an_interrupt_during_the_swap_waits_for_it_and_says_the_output_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_rebasin.io import output

    target = _previous(tmp_path / "out")
    replace = output._replace

    def interrupted_replace(tmp: Path, dest: Path, overwrite: bool) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C between the two renames
        replace(tmp, dest, overwrite)

    monkeypatch.setattr(output, "_replace", interrupted_replace)
    with pytest.raises(output.OutputInterrupted, match="output was complete"):
        with output.output_folder(target, overwrite=True) as tmp:
            (tmp / "rebasin.json").write_text(json.dumps({"label": "new"}), encoding="utf-8")
    assert _label(target) == "new" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_interrupt_while_writing_leaves_nothing(tmp_path: Path) -> None:
    from hf_rebasin.io import output

    with pytest.raises(output.OutputInterrupted, match="nothing was written"):
        with output.output_folder(tmp_path / "out", overwrite=False) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


# -- what is on disk ------------------------------------------------------------------------------


def test_modes_follow_the_umask_and_the_record_holds_no_local_path(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "project")
    ws.root.mkdir()
    recipe = ws.merge_recipe({"dir": "results/out"}, evaluate=True)
    mask = os.umask(0o022)
    try:
        result = _run(ws, [str(recipe)])
    finally:
        os.umask(mask)
    assert result.code == 0, result.stderr
    out = ws.root / "results" / "out"
    assert out.stat().st_mode & 0o777 == 0o755
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (out / "rebasin.json").stat().st_mode & 0o777 == 0o644
    text = (out / "rebasin.json").read_text(encoding="utf-8")
    assert str(tmp_path) not in text and str(Path.home()) not in text
    record = json.loads(text)
    assert record["recipe"]["output"]["dir"] == "results/out"
    assert [m["model"] for m in record["models"]] == ["a", "b"] == [m["folder"] for m in record["models"]]
    assert record["recipe"]["evaluate"]["data"]["data_files"] == "corpus.txt"
    assert str(tmp_path) not in (out / "README.md").read_text(encoding="utf-8")
