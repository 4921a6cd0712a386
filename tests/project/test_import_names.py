"""No name importable from the checkout's root shadows an installed distribution's module. Everything the
project runs from its root (``python -m``, ``python -c``, pytest with ``tests/__init__.py``) has the root
first on ``sys.path``, so a top-level ``kernels/__init__.py`` there once replaced the Hub's ``kernels``
distribution that transformers imports at start-up, and every model load failed on a fresh install."""

import importlib.metadata
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_cli


def importable_from_root() -> set[str]:
    """Top-level names ``import`` finds in the root: packages (folders with ``__init__.py``) and modules."""
    names = {path.name for path in REPO.iterdir() if (path / "__init__.py").is_file()}
    return names | {path.stem for path in REPO.glob("*.py")}


def shadowed(root_names: set[str]) -> dict[str, list[str]]:
    """Each root name that is also a top-level module of an installed distribution other than this project."""
    installed = importlib.metadata.packages_distributions()
    return {
        name: installed[name]
        for name in sorted(root_names)
        if set(installed.get(name, [])) - {"areal-hpc", "areal_hpc"}
    }


def test_no_root_name_is_an_installed_distributions_module():
    assert not shadowed(importable_from_root()), "rename these root packages/modules: they shadow installed ones"


def test_the_check_sees_a_shadowing_package(tmp_path):
    """The check above is not vacuous: today's venv holds the Hub's ``kernels`` (transformers needs it), and
    a root ``kernels/__init__.py``, as the checkout once had, is caught by name."""
    assert "kernels" in importlib.metadata.packages_distributions(), "the lock no longer installs 'kernels'"
    assert shadowed(importable_from_root() | {"kernels"}) == {"kernels": ["kernels"]}


def run_from_root(code: str) -> subprocess.CompletedProcess:
    """``python -c`` from the checkout's root: the root is first on ``sys.path``, as for a user's command."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.smoke
def test_transformers_model_code_imports_from_the_root():
    done = run_from_root("import kernels, transformers.models.qwen2.modeling_qwen2; print(kernels.__file__)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "site-packages" in done.stdout, f"'kernels' came from the checkout: {done.stdout}"


@pytest.mark.smoke
def test_the_quickstart_model_initialises_from_the_root(tmp_path):
    """``areal-hpc init-model`` (the quickstart's start) run with the root as its working folder."""
    done = run_cli("init-model", "--out", str(tmp_path / "model"), cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "model" / "config.json").is_file()
