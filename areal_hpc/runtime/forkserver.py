"""A fork server for the local launcher's processes on a CPU machine (SFT warm-up, rollout servers,
trainer ranks): one interpreter imports what they all import, the modules the launcher names
(``launch.roles.FORK_SERVER_PRELOAD``: torch, transformers, the server, the trainer), and each of them
starts as a fork of it, so those pages are shared instead of copied per process. Importing them costs a
process ~380-450 MB, most of the quickstart's memory; shared, they cost it once. The launcher closes the
fork server once every process is started (what no child shares is then freed): the quickstart's RL run
peaked at 0.86 GiB instead of 1.17 (``bench/run_memory.py``). It also closes it while the SFT warm-up, its
only child for minutes, runs, and starts another after it (``launch.roles.run_stage``).

    launcher ── fork server (imports once, then waits for commands on its stdin)
       └─ adopted: rollout server 0, trainer rank 0, ...  (forked twice, so the launcher is their parent)

Each child is forked twice: the first fork exits at once, so the child is re-parented to the launcher
(``PR_SET_CHILD_SUBREAPER``), which waits for it, signals it and reads its exit code as for any child it
started (``AdoptedProcess``). Then it behaves as ``python <command>`` would: its own session, cores,
log, environment, thread count and ``sys.argv``, SIGKILLed when the launcher dies; it ends as our
commands do (``runtime.exit``: threads joined, atexit run, no module teardown), whether its command ends
that way itself or returns. Values read only when a library loads are the fork server's:
it starts with the launcher's environment and one OpenMP thread, and each child sets its own count.

Only on CPU: nothing here may initialise CUDA or an NPU before forking, so with accelerators every
process starts as its own interpreter.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_hpc.runtime.exit import exit_process

PR_SET_PDEATHSIG, PR_SET_NAME, PR_SET_CHILD_SUBREAPER = 1, 15, 36
ADOPTION_TIMEOUT_S = 10.0


class ForkerError(RuntimeError):
    """The fork server is gone or could not start a child."""


def _prctl(option: int, value) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value)


class Forker:
    """The launcher's handle on the fork server (a process, not a server of the run's requests: hence not
    ``ForkServer``): ``start()`` it, ``spawn()`` children through it, ``close()`` it (then it may start again)."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()):
        """``preload``: the modules the server imports before its first fork (what its children will import;
        the caller names them, since what they run is the caller's)."""
        self.env, self.preload = env, preload
        self.process: subprocess.Popen | None = None

    def start(self) -> Forker:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of our descendants (the adopted children) come to us
        replies_in, replies_out = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "areal_hpc.runtime.forkserver", str(replies_out), *self.preload],
            stdin=subprocess.PIPE,
            env={**os.environ, **self.env, "OMP_NUM_THREADS": "1"},
            pass_fds=(replies_out,),
            start_new_session=True,
            preexec_fn=lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGKILL),
        )
        os.close(replies_out)
        self._replies = os.fdopen(replies_in, "r")
        return self

    def spawn(
        self, name: str, command: list[str], env: dict[str, str], cores: list[int] | None, log_path: Path | None
    ) -> AdoptedProcess:
        """Start ``command`` (``python -m MODULE ...`` or ``python -c CODE ...``) as a fork of the server."""
        if len(command) < 3 or command[1] not in ("-m", "-c"):
            raise ForkerError(f"the fork server runs 'python -m' and 'python -c' commands, not {command!r}")
        request = {
            "name": name,
            "command": command,
            "env": env,
            "cores": cores,
            "parent": os.getpid(),
            "log": str(log_path) if log_path else None,
        }
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            reply = self._replies.readline()
        except (BrokenPipeError, OSError) as exc:
            raise ForkerError(f"the fork server is gone ({exc}); could not start {name}") from exc
        if not reply.strip().isdigit():
            raise ForkerError(f"the fork server could not start {name}: {reply.strip() or 'it exited'}")
        return AdoptedProcess(int(reply))

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait()
        self._replies.close()


class AdoptedProcess:
    """``subprocess.Popen``'s poll/wait/send_signal/returncode for a child the launcher adopted."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def _serve(replies: int, preload: list[str]) -> int:
    """The fork server's loop: one JSON request per stdin line, the adopted child's pid (or an error)
    on ``replies``. In a child this returns the command's exit code instead of looping."""
    for module in preload:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()  # the collector never writes to what was imported: those pages stay shared
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops us; Ctrl-C is its to handle
    for line in sys.stdin:
        request = json.loads(line)
        pid_in, pid_out = os.pipe()
        first = os.fork()
        if first == 0:
            os.close(pid_in)
            grandchild = os.fork()
            if grandchild:
                os.write(pid_out, str(grandchild).encode())
                os._exit(0)  # orphaned, the grandchild is re-parented to the launcher
            os.close(pid_out)
            os.close(replies)
            sys.stdin.close()
            return _run_adopted(request)
        os.close(pid_out)
        os.waitpid(first, 0)  # once it is reaped, the grandchild's parent is the launcher
        pid = os.read(pid_in, 32).decode() or "the second fork failed"
        os.close(pid_in)
        os.write(replies, f"{pid}\n".encode())
    return 0


def _run_adopted(request: dict) -> int:
    """In the grandchild: become ``request``'s process, run its command, return its exit code."""
    deadline = time.monotonic() + ADOPTION_TIMEOUT_S
    while os.getppid() != request["parent"]:
        if time.monotonic() > deadline:
            os._exit(1)  # the launcher is gone
        time.sleep(0.001)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != request["parent"]:
        os._exit(1)
    os.setsid()
    _prctl(PR_SET_NAME, request["name"].encode()[:15])
    if request["cores"]:
        os.sched_setaffinity(0, request["cores"])
    for sig, action in ((signal.SIGINT, signal.default_int_handler), (signal.SIGUSR2, signal.SIG_IGN)):
        signal.signal(sig, action)  # SIGUSR2 as every supervised child (see ``runtime.supervisor``)
    _redirect(os.open(os.devnull, os.O_RDONLY), 0)  # the fork server's stdin is its command pipe
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 for the child's lifetime
    if request["log"]:
        Path(request["log"]).parent.mkdir(parents=True, exist_ok=True)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        _redirect(log, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    torch = sys.modules.get("torch")  # preloaded, it read its thread count in the server; else it reads ours
    if torch is not None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return _run_command(request["command"])


def _redirect(fd: int, to: int) -> None:
    os.dup2(fd, to)
    os.close(fd)


def _run_command(command: list[str]) -> int:
    """``command`` as its interpreter would run it: ``python -m MODULE ARGS`` or ``python -c CODE ARGS``."""
    _, flag, target, *args = command
    try:
        if flag == "-m":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        return stop.code
    return 0


if __name__ == "__main__":
    exit_process(_serve(int(sys.argv[1]), sys.argv[2:]))  # the fork server's, or in a child its command's
