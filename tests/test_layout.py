"""The folder tells the architecture: no module imports a module that imports it back (directly or
through others), and the layers of DESIGN.md section 2 hold: the planner (``sched``) and the data
layer never reach into training or rollout code, the rollout service never imports the trainer, and
only the launchers import the launchers."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "areal_hpc"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module -> areal_hpc modules it imports (anywhere in the file, lazy imports included)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("areal_hpc"):
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("areal_hpc")]
            for target in targets:
                if target in modules and target != name:
                    graph.add_edge(name, target)
                    break
    return graph


def test_no_module_imports_itself_back():
    cycles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("lower, upper", [
    ("areal_hpc.sched", "areal_hpc.train"), ("areal_hpc.sched", "areal_hpc.rollout"),
    ("areal_hpc.data", "areal_hpc.train"), ("areal_hpc.data", "areal_hpc.rollout"),
    ("areal_hpc.models", "areal_hpc.data"), ("areal_hpc.algo", "areal_hpc.train"),
    ("areal_hpc.rollout", "areal_hpc.train"), ("areal_hpc.parallel", "areal_hpc.rollout"),
    ("areal_hpc.parallel", "areal_hpc.train"), ("areal_hpc.train", "areal_hpc.launch.local"),
    ("areal_hpc.rollout", "areal_hpc.launch.local"),
])
def test_lower_layers_never_import_upper_ones(lower, upper):
    graph = import_graph()
    wrong = sorted((a, b) for a, b in graph.edges
                   if (a == lower or a.startswith(lower + ".")) and (b == upper or b.startswith(upper + ".")))
    assert not wrong, f"{lower} must not import {upper}: {wrong}"


# What the package uses from the standard library that a Python release added, and that release.
ASYNCIO_ADDED_IN = {"TaskGroup": (3, 11), "timeout": (3, 11), "Runner": (3, 11), "to_thread": (3, 9)}
BUILTINS_ADDED_IN = {"ExceptionGroup": (3, 11), "BaseExceptionGroup": (3, 11)}
MODULES_ADDED_IN = {"tomllib": (3, 11), "zoneinfo": (3, 9), "graphlib": (3, 9)}


def needed_python(node: ast.AST) -> tuple[int, int] | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "asyncio":
        return ASYNCIO_ADDED_IN.get(node.attr)
    if isinstance(node, ast.Name):
        return BUILTINS_ADDED_IN.get(node.id)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        return max((MODULES_ADDED_IN[n.split(".")[0]] for n in names if n.split(".")[0] in MODULES_ADDED_IN),
                   default=None)
    return None


def test_requires_python_admits_no_interpreter_the_code_cannot_run_on():
    import re
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    floor = tuple(int(x) for x in re.fullmatch(r">=\s*(\d+)\.(\d+)", pyproject["project"]["requires-python"]).groups())
    too_new = sorted({f"{path.relative_to(PACKAGE.parent)}:{node.lineno} needs {'.'.join(map(str, version))}"
                      for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                      if (version := needed_python(node)) and version > floor})
    assert not too_new, f"requires-python >= {'.'.join(map(str, floor))}, but {too_new}"
