"""Supervised child processes of a run (rollout servers, trainer ranks, preparation stages): start one,
wait until a server answers /health, and stop it (and its children) cleanly.

When a server dies or never becomes healthy, the error says so with the tail of its log, so
"server launch failed" always comes with its cause (a CUDA OOM, a missing model file, a port in use).
Children ask the kernel to kill them when their parent dies (even by SIGKILL): a run leaves no orphans.
They start with SIGUSR2 ignored (see ``preemption``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from areal_hpc.errors import UserError
from areal_hpc.runtime.forkserver import AdoptedProcess, Forker

LOG_TAIL_LINES = 20


class ServerLaunchError(UserError):
    """A server exited or stayed unhealthy; the message ends with its log tail."""


PR_SET_PDEATHSIG = 1


def _child_setup(cores: list[int] | None) -> None:
    """In the child, before exec: run on ``cores`` only (when given), SIGKILL me when the process that
    started me exits, and ignore SIGUSR2 (Slurm's stop warning reaches every process of a step; only the
    trainer, which installs its own handler, acts on it; see ``preemption``)."""
    if cores:
        os.sched_setaffinity(0, cores)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class SupervisedProcess:
    """``log_path=None`` keeps the child on this terminal (the trainer's progress line); ``cores`` pins
    the child and everything it starts to those CPU cores; with ``fork_server`` the child is a fork of it
    (``python -m`` and ``python -c`` commands only)."""

    def __init__(
        self,
        name: str,
        command: list[str],
        log_path: Path | None,
        env: dict | None = None,
        cores: list[int] | None = None,
        fork_server: Forker | None = None,
    ):
        self.name, self.command, self.log_path = name, command, log_path and Path(log_path)
        self.env, self.cores, self.fork_server = env, cores, fork_server
        self.process: subprocess.Popen | AdoptedProcess | None = None

    def start(self) -> SupervisedProcess:
        env = {**os.environ, **(self.env or {})}
        if self.fork_server is not None:
            self.process = self.fork_server.spawn(self.name, self.command, env, self.cores, self.log_path)
            return self
        options = dict(env=env, start_new_session=True, preexec_fn=functools.partial(_child_setup, self.cores))
        if self.log_path is None:
            self.process = subprocess.Popen(self.command, **options)
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, **options)
        return self

    def wait_healthy(self, address: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise self.failure(f"exited with code {self.process.returncode} before answering /health")
            try:
                with urllib.request.urlopen(f"http://{address}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise self.failure(f"did not answer http://{address}/health within {timeout_s:g} s")
            time.sleep(0.5)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole process group (SGLang starts scheduler children, which may outlive the
        leader), SIGKILL after ``grace_s``."""
        if self.process is None:
            return
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def log_tail(self) -> str:
        if self.log_path is None:
            return "  | (its output went to this terminal, above)"
        if not self.log_path.exists():
            return "  | (no log written)"
        lines = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return "\n".join(f"  | {line}" for line in lines) or "  | (log is empty)"

    def failure(self, what: str) -> ServerLaunchError:
        return ServerLaunchError(f"{self.name} {what}; last lines of {self.log_path}:\n{self.log_tail()}")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the whole group is already gone
        pass
