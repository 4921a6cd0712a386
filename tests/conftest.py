"""Shared fixtures: one tiny model built per test session, runners for the real CLI and rollout servers."""

import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from areal_hpc.data.registry import corpus_for_tokenizer
    from areal_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("tiny") / "model", corpus_for_tokenizer(0), preset="tiny", seed=0)


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``areal-hpc`` as a user would: a separate process, its exit code and its output."""
    return subprocess.run([sys.executable, "-m", "areal_hpc", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@contextlib.contextmanager
def embedded_server(model_dir: Path, fileroot: Path, *extra: str):
    """A real ``areal-hpc serve`` process on a free loopback port; yields (process, host:port), then stops it."""
    from areal_hpc.launch.name_resolve import ROLLOUT_SERVERS, NameResolve

    trial = uuid.uuid4().hex[:8]
    names = NameResolve(fileroot / "quickstart" / trial / "name_resolve")
    names.root.mkdir(parents=True)
    log = open(names.root.parent / "server.log", "w")  # a file, not a pipe: a full pipe would block the server
    process = subprocess.Popen([sys.executable, "-m", "areal_hpc", "serve", "backend=embedded", f"model.path={model_dir}",
                                "port=0", f"cluster.fileroot={fileroot}", f"experiment.trial={trial}", *extra],
                               cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not names.values(ROLLOUT_SERVERS):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not register: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.1)
        yield process, names.values(ROLLOUT_SERVERS)[0]
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        log.close()
