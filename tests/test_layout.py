"""The package reads as its pipeline: the root lists the stages, imports run down them, files stay small.

The stages, bottom to top (each may import only itself and the stages before it in `STAGES`):
``core`` (shared types) < ``symmetry`` (the graph) < ``io`` (files in and out) < ``alignment`` <
``merging`` < ``evaluation`` < ``lineage`` < ``recipe`` < ``run`` < ``cli``. Imports inside functions
count: a stage that reaches up at run time cannot be read or tested apart either.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_imports import HEAVY, PACKAGE, _imports, _modules, _python

STAGES = ("core", "symmetry", "io", "alignment", "merging", "evaluation", "lineage", "recipe", "run", "cli")
ROOT_FILES = {"__init__.py", "__main__.py"}
MAX_MODULE, MAX_RUN_MODULE, MAX_FUNCTION = 600, 400, 60
# calls that reach the Hub over the network (huggingface_hub's ModelCard or shard splitting do not)
NETWORK = re.compile(
    r"\b(HfApi|hf_hub_download|snapshot_download|create_repo|upload_folder|create_commit|list_repo_files|"
    r"model_info|repo_info|whoami|get_token|requests|urllib|httpx|socket)\b"
)


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_the_root_lists_the_stages() -> None:
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == ROOT_FILES | set(STAGES), sorted(entries ^ (ROOT_FILES | set(STAGES)))
    assert len(entries) <= 12


def test_every_package_says_what_it_does_and_each_stage_what_it_may_import() -> None:
    missing = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        stage = init.parent.name if init.parent.parent == PACKAGE else None
        if not doc or (stage and "import" not in doc.lower()):
            missing.append(str(init.relative_to(PACKAGE.parent)))
    assert not missing, "packages without a docstring (a stage's names what it may import): " + ", ".join(missing)


def _imports_up(modules: dict[str, Path]) -> list[str]:
    """``importer -> imported`` for every import (inside functions too) from a stage to a higher one."""
    up = []
    for name, path in modules.items():
        here = _stage(name)
        for target in _imports(name, path, modules, deep=True):
            there = _stage(target)
            if here and there and STAGES.index(there) > STAGES.index(here):
                up.append(f"{name} -> {target}")
    return sorted(up)


def test_imports_run_down_the_stages() -> None:
    up = _imports_up(_modules())
    assert not up, "imports from a lower stage to a higher one:\n" + "\n".join(up)


def test_no_module_or_function_is_too_long() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent).as_posix()
        source = path.read_text(encoding="utf-8")
        limit = MAX_RUN_MODULE if path.relative_to(PACKAGE).parts[0] == "run" else MAX_MODULE
        if (lines := len(source.splitlines())) > limit:
            long.append(f"{where}: {lines} lines (at most {limit})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (length := (node.end_lineno or start) - start + 1) > MAX_FUNCTION:
                    long.append(f"{where}:{node.name}: {length} lines (at most {MAX_FUNCTION})")
    assert not long, "\n".join(long)


def test_the_graph_and_the_solvers_import_no_transformers() -> None:
    """The symmetry graph is data and the solvers pure tensor functions: neither needs transformers
    (adapters declare graphs for transformers' families, and may)."""
    names = [
        n
        for n in _modules()
        if (n.startswith("hf_rebasin.symmetry") and ".adapters" not in n) or n == "hf_rebasin.alignment.solvers"
    ]
    assert "hf_rebasin.symmetry.graph" in names
    proc = _python(
        f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\nprint('transformers' in sys.modules)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_only_the_hub_package_talks_to_the_network() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "io" / "hub"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(NETWORK.search(n) for n in names):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "network access outside hf_rebasin/io/hub/:\n" + "\n".join(found)


def test_the_layout_check_catches_an_import_up_the_stages(tmp_path: Path) -> None:
    """The stage check reads imports inside functions too (a control on a module written here)."""
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from hf_rebasin.run import pipeline\n", encoding="utf-8")
    modules = {**_modules(), "hf_rebasin.core.probe": module}
    up = _imports_up(modules)
    assert "hf_rebasin.core.probe -> hf_rebasin.run.pipeline" in up
    assert all(edge.startswith("hf_rebasin.core.probe -> hf_rebasin.run") for edge in up)  # the probe alone


def test_the_public_names_load_from_their_stages() -> None:
    """``from hf_rebasin import align, graph_for, …`` works for every documented name, and importing
    the package alone loads no stage (no torch)."""
    proc = _python(
        "import sys, hf_rebasin\n"
        "light = 'torch' not in sys.modules and not any(m.startswith('hf_rebasin.') for m in sys.modules)\n"
        "missing = [n for n in hf_rebasin.__all__ if getattr(hf_rebasin, n, None) is None]\n"
        "print(light, missing)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "True []"


def test_the_python_api_page_lists_every_public_name() -> None:
    page = (PACKAGE.parent / "docs" / "python-api.md").read_text(encoding="utf-8")
    import hf_rebasin

    missing = [n for n in hf_rebasin.__all__ if n != "__version__" and f"`{n}`" not in page]
    assert not missing, f"docs/python-api.md does not name {missing}"


def test_every_stage_package_imports_no_heavy_library() -> None:
    """A stage's ``__init__`` is its face, not its work: importing the folder alone loads no torch nor
    any library of `HEAVY`, so the torch-free parts (the recipe, the zoo's catalogue, the file gate)
    stay cheap to reach."""
    proc = _python(
        "import importlib, sys\n"
        f"for stage in {STAGES!r}:\n"
        "    if stage in ('lineage', 'run', 'cli'):\n"
        "        continue  # their faces export verdicts, run_recipe and main, which need torch\n"
        "    importlib.import_module('hf_rebasin.' + stage)\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_tests_mirror_the_stages() -> None:
    """A stage's tests are in ``tests/<stage>/``; only the package-wide checks stay in ``tests/``."""
    tests = PACKAGE.parent / "tests"
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    assert folders <= set(STAGES), sorted(folders - set(STAGES))
    assert {p.name for p in tests.glob("test_*.py")} <= {
        "test_docs.py",
        "test_gpu.py",
        "test_imports.py",
        "test_layout.py",
    }
    names = [p.name for p in tests.glob("**/test_*.py")]
    # every folder is on the path (tests import each other's builders by module name): names are unique
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
