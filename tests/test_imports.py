"""Import hygiene: every module imports on its own, the recipe imports no torch, no import cycles.

Modules are found on disk (every ``.py`` file of every package folder under ``hf_rebasin``), so a new
module or sub-package is checked without touching this file. The checks run in subprocesses on the
same copy of the package the tests import.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

import hf_rebasin

PACKAGE = Path(hf_rebasin.__file__).resolve().parent
# libraries `import hf_rebasin.recipe` must leave unloaded: validating a recipe, its JSON Schema
# and a dry run's plan would otherwise cost seconds (torch alone takes 2-4 s to import)
HEAVY = ("torch", "transformers", "datasets", "scipy", "accelerate", "peft", "safetensors", "evaluate")


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = path.parent
        if any(not (f / "__init__.py").is_file() for f in [folder, *folder.parents] if f.is_relative_to(PACKAGE)):
            continue  # inside a folder that is not a package (shipped data, not code)
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports the package from where the tests do."""
    path = os.pathsep.join(p for p in (str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow  # every module imported afresh, one after another (40 s)
def test_every_module_imports_on_its_own() -> None:
    # one interpreter; before each module every hf_rebasin module is dropped from sys.modules, so
    # each import finds its own dependencies (third-party libraries stay loaded: that is only speed)
    code = textwrap.dedent(
        f"""
        import importlib, json, sys, traceback
        failed = {{}}
        for name in {sorted(_modules())!r}:
            for loaded in [m for m in sys.modules if m == "hf_rebasin" or m.startswith("hf_rebasin.")]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except BaseException:
                failed[name] = traceback.format_exc(limit=-3)
        print(json.dumps(failed))
        """
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(f"{name}:\n{trace}" for name, trace in failed.items())


def test_the_recipe_imports_no_heavy_library() -> None:
    # importing, validating and describing a recipe (and building its JSON Schema) must all stay
    # torch-free: `--dry-run`, `schema` and editors' validation depend on it
    code = textwrap.dedent(
        f"""
        import json, sys
        from hf_rebasin.recipe.describe import describe
        from hf_rebasin.recipe import loads_recipe, recipe_json_schema
        recipe = loads_recipe('''
        job: merge
        models: [zoo:gpt2-seed0, zoo:gpt2-seed1]
        strategy: {{name: generalized-orthogonal, learned: true}}
        data: {{dataset: shakespeare, split: train}}
        evaluate: {{task: causal-lm, data: {{dataset: shakespeare, split: test}}, compare: [vanilla, head-perm]}}
        output: {{dir: out}}
        ''')
        describe(recipe)
        recipe_json_schema()
        from hf_rebasin.alignment.strategies import REGISTRY
        runners = [REGISTRY.get(n).module_path for n in REGISTRY.names]
        print(json.dumps(sorted(m for m in [*{HEAVY!r}, *runners] if m in sys.modules)))
        """
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_registry_refuses_a_strategy_whose_module_is_missing() -> None:
    # run modules are imported only when a strategy runs: a misspelt one must fail at registration
    from hf_rebasin.alignment.strategies.base import Strategy, StrategyRegistry
    from hf_rebasin.alignment.strategies.options import VanillaOptions

    registry = StrategyRegistry()
    registry.register(Strategy("plain", "", VanillaOptions, "vanilla"))
    for module in ("vanila", "vanilla.run", ""):
        with pytest.raises(ValueError, match=r"names no module of hf_rebasin\.alignment\.strategies"):
            registry.register(Strategy("other", "", VanillaOptions, module))


def _imports(name: str, path: Path, modules: Mapping[str, Path], *, deep: bool = False) -> set[str]:
    """The package's modules that ``name`` imports when it is imported: statements at module level
    (also inside a top-level ``try`` or ``if``), not under ``TYPE_CHECKING``; with ``deep``, also
    those inside functions and classes (run later, but an arrow all the same)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(block)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                found.add(source)
                found.update(f"{source}.{alias.name}" for alias in node.names)  # `from . import x`
            elif deep:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    block = getattr(node, field, None)
                    if isinstance(block, list):
                        visit([b for b in block if isinstance(b, ast.stmt)])
                        for inner in block:  # except handlers and match cases hold statements
                            if isinstance(inner, (ast.ExceptHandler, ast.match_case)):
                                visit(inner.body)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts (``[a, b, a]``), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_find_cycle_names_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_modules() -> None:
    modules = _modules()
    assert {"hf_rebasin.recipe", "hf_rebasin.alignment.strategies", "hf_rebasin.alignment.strategies.base"} <= set(
        modules
    )
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["hf_rebasin.recipe.sections"] >= {
        "hf_rebasin.core.names",
        "hf_rebasin.alignment.strategies",
    }  # the parser sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_counting_imports_inside_functions() -> None:
    """A circle closed by an import inside a function is still a circle: the two modules cannot be
    read, tested or moved apart. (Strategy modules, loaded by name from the registry, are data.)"""
    modules = _modules()
    graph = {name: _imports(name, path, modules, deep=True) for name, path in modules.items()}
    assert "hf_rebasin.io.offload" in graph["hf_rebasin.io.models"]  # the deep walk sees function bodies
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
