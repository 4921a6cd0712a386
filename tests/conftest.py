"""Shared fixtures: one tiny model built per test session, and a runner for the real CLI."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from areal_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0)


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``areal-hpc`` as a user would: a separate process, its exit code and its output."""
    return subprocess.run([sys.executable, "-m", "areal_hpc", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
