"""The folder tells the architecture (docs/architecture.md): no module imports a module that imports it
back (directly or through others), and every import goes down the floors, never up or sideways:

    errors, _kernels  <  fsio, extras, builtins  <  config, arguments  <  algo, data, models, reward, layout
        <  runtime, resolve  <  parallel  <  sched  <  engines, rollout  <  proxy  <  agents  <  train  <  launch
        <  cli  <  __main__

A module imports its own package and packages on lower floors only; so ``launch`` is imported by the
CLI alone, engines import nothing above them, and rollout and the proxy never import the trainer.
Inside ``engines`` the two engines share ``engines.base`` and never import each other."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "areal_hpc"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
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


FLOORS = [
    {"errors", "areal_hpc", "_kernels"},  # "areal_hpc": the package's own __init__; "_kernels": kernels/, no imports
    {"fsio", "extras", "builtins"},
    {"config", "arguments"},  # "arguments": the argparse arguments the subcommands share
    {"algo", "data", "models", "reward", "layout"},  # "layout": the trainer ranks' layout arithmetic (no torch)
    {"runtime", "resolve"},  # "resolve": the one place that settles a run (auto values, rules between keys)
    {"parallel"},
    {"sched"},
    {"engines", "rollout"},
    {"proxy"},
    {"agents"},
    {"train"},
    {"launch"},
    {"cli"},
    {"__main__"},
]
FLOOR = {package: level for level, packages in enumerate(FLOORS) for package in packages}
SIBLINGS_APART = [("areal_hpc.engines.torch", "areal_hpc.engines.megatron")]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def floor_violations(edges) -> list[str]:
    """Each import (importer, imported) that goes up a floor, sideways to another package of the same
    floor, or between two packages kept apart."""
    wrong = []
    for importer, imported in edges:
        a, b = package_of(importer), package_of(imported)
        if a != b and FLOOR[b] >= FLOOR[a]:
            wrong.append(f"{importer} (floor {FLOOR[a]}) imports {imported} (floor {FLOOR[b]})")
        wrong += [
            f"{importer} imports {imported}: {x} and {y} stay apart"
            for x, y in SIBLINGS_APART
            if (within(importer, x) and within(imported, y)) or (within(importer, y) and within(imported, x))
        ]
    return sorted(wrong)


def test_every_package_has_a_floor():
    assert not {package_of(m) for m in import_graph()} - set(FLOOR), "a new package needs a floor in FLOORS"


def test_imports_only_go_down_the_floors():
    wrong = floor_violations(import_graph().edges)
    assert not wrong, "imports against the floors:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("areal_hpc.rollout.client", "areal_hpc.train.driver"),  # up
        ("areal_hpc.train.build", "areal_hpc.launch.local"),  # the launchers, from below the CLI
        ("areal_hpc.proxy.gateway", "areal_hpc.train.actor"),  # sideways
        ("areal_hpc.engines.base", "areal_hpc.rollout.client"),  # sideways
        ("areal_hpc.engines.megatron.engine", "areal_hpc.engines.torch.engine"),  # the two engines
        ("areal_hpc.runtime.name_resolve", "areal_hpc.parallel.mesh"),  # up
    ],
)
def test_a_forbidden_import_is_caught(importer, imported):
    graph = import_graph().copy()
    assert importer in graph and imported in graph
    assert not floor_violations(graph.edges)
    graph.add_edge(importer, imported)
    (wrong,) = floor_violations(graph.edges)
    assert wrong.startswith(f"{importer} ") and f" imports {imported}" in wrong


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
        return max(
            (MODULES_ADDED_IN[n.split(".")[0]] for n in names if n.split(".")[0] in MODULES_ADDED_IN), default=None
        )
    return None


def test_requires_python_admits_no_interpreter_the_code_cannot_run_on():
    import re
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    floor = tuple(int(x) for x in re.fullmatch(r">=\s*(\d+)\.(\d+)", pyproject["project"]["requires-python"]).groups())
    too_new = sorted(
        {
            f"{path.relative_to(PACKAGE.parent)}:{node.lineno} needs {'.'.join(map(str, version))}"
            for path in PACKAGE.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if (version := needed_python(node)) and version > floor
        }
    )
    assert not too_new, f"requires-python >= {'.'.join(map(str, floor))}, but {too_new}"


# Folders of tests/ besides one per package of areal_hpc (tests/engines/ for areal_hpc/engines/, ...).
TEST_FOLDERS = {
    "core": "the package's top-level modules (config, resolve, builtins, the CLI's table, ...)",
    "project": "the repository as a whole (floors, names, docs, import names, the wheel)",
    "bench": "the benchmark scripts of bench/",
    "kernels": "the Triton kernels of kernels/",
    "system": "end-to-end runs across packages",
}


def test_tests_sit_in_a_folder_per_package():
    """tests/ mirrors the package: each test file sits in tests/<package>/ or one of TEST_FOLDERS, each such
    folder is a package (so two folders may hold files of the same name), and tests/ itself keeps only
    conftest.py and the helpers several folders share."""
    tests = PACKAGE.parent / "tests"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and not p.name.startswith("_")}
    misplaced = sorted(
        str(path.relative_to(tests))
        for path in tests.rglob("test_*.py")
        if len(path.relative_to(tests).parts) != 2 or path.parent.name not in packages | set(TEST_FOLDERS)
    )
    assert not misplaced, f"test files outside tests/<package>/ or tests/{{{','.join(TEST_FOLDERS)}}}/: {misplaced}"
    no_init = sorted(d.name for d in tests.iterdir() if any(d.glob("test_*.py")) and not (d / "__init__.py").exists())
    assert not no_init, f"test folders without __init__.py: {no_init}"
