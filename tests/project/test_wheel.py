"""The wheel a cluster site installs works on its own: built from this checkout and installed into a
fresh virtual environment, run from a folder outside the source tree, ``areal-hpc plan``, ``simulate``
and ``repro hex`` find the shipped cluster catalog and model specs."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run(*command, cwd: Path) -> subprocess.CompletedProcess:
    """A process without this checkout on its path (no PYTHONPATH), offline."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "HF_HUB_OFFLINE": "1"},
    )


def checked(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def wheel_bin(tmp_path_factory) -> Path:
    """The bin/ folder of a fresh venv holding only the wheel; its dependencies come from this venv's
    site-packages through a .pth line (a plain path: the editable install's own .pth files stay unread)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy, so the build leaves no build/ or egg-info in the checkout
    shutil.copytree(REPO / "areal_hpc", source / "areal_hpc", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    checked(
        run(
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--wheel-dir",
            root,
            source,
            cwd=root,
        )
    )
    (wheel,) = root.glob("areal_hpc-*.whl")
    fresh = root / "venv"
    venv.create(fresh, with_pip=False)
    purelib = checked(
        run(fresh / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=root)
    ).stdout.strip()
    Path(purelib, "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    checked(run(fresh / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", wheel, cwd=root))
    return fresh / "bin"


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    assert not tmp_path.resolve().is_relative_to(REPO)
    return tmp_path


def test_the_package_comes_from_the_wheel(wheel_bin, elsewhere):
    where = checked(run(wheel_bin / "python", "-c", "import areal_hpc; print(areal_hpc.__file__)", cwd=elsewhere))
    assert Path(where.stdout.strip()).resolve().is_relative_to(wheel_bin.parent.resolve())


def test_plan_with_catalog_cluster_and_model_then_simulate(wheel_bin, elsewhere):
    plan = elsewhere / "plan.yaml"
    done = checked(
        run(
            wheel_bin / "areal-hpc",
            "plan",
            "--cluster",
            "paper-8h800-24h20",
            "--model",
            "r1-distill-qwen-7b",
            "--out",
            plan,
            cwd=elsewhere,
        )
    )
    assert "allocation:      sglang:" in done.stdout
    record = yaml.safe_load(plan.read_text())
    assert record["allocation"].startswith("sglang:") and record["predicted"]["tokens_per_s"] > 0
    sim = checked(run(wheel_bin / "areal-hpc", "simulate", "--plan", plan, "--steps", "5", "--json", cwd=elsewhere))
    assert json.loads(sim.stdout)["simulated_tokens_per_s"] > 0


def test_repro_hex_prints_the_paper_tables(wheel_bin, elsewhere):
    done = checked(run(wheel_bin / "areal-hpc", "repro", "hex", cwd=elsewhere))
    assert "7B generation $/token, H800 / H20" in done.stdout and "14B 8 H800 + 24 H20" in done.stdout
