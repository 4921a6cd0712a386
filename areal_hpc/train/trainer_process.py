"""Trainer rank 0's training in a process of its own, apart from its rollout side.

Rank 0 drives the run: its event loop runs the rollout controller, the HTTP client, the episodes and
their rewards, the shard commits and the evaluations, all of it Python. In one process with the update
they share one interpreter lock: beside a thread busy 22% of another core with Python (what the rollout
side uses in a quickstart run) the quickstart's update takes 1.25x its time alone, beside a process
as busy 1.02x (``bench/update_interference.py``). So with ``rl.rank0_training=child``, rank 0's process
forks a child before anything else, and the child is trainer rank 0: it joins the trainer mesh, builds
the engines, loads the checkpoint and trains; the parent keeps the rollout side and asks the child, over
a pipe, for what it needs of the training (the ``TrainerRanks`` calls below), one call at a time:

    with TrainerProcess.start(cfg, resume) as trainer:   # the child built its engines (and resumed)
        trainer.state                                    # the checkpoint's driver state, {"step": 0} fresh
        trainer.update(trajectories)                     # TrainerRanks.update, in the child
        trainer.engines["actor"].save(folder, optimizer=False)   # the disk weight sync's staging
        trainer.save_checkpoint(run_dir, step, driver)   # engines, the training RNG streams, driver state
        trainer.stop()                                   # the other ranks released, the child gone

Only the disk weight sync works this way (``rl.weight_sync=disk``: the servers read what the child
wrote); the distributed one broadcasts from the training process's own tensors, so it keeps them in
rank 0's process (``rl.rank0_training=auto`` chooses that). On an accelerator ``auto`` keeps them there
too: the update then waits on the device, not on the interpreter lock, and the quickstart steps faster
with a thread than with a child (``bench/results/peer_trl-*-h200.md``). The child ignores the stop signals, as the
other ranks do: the parent decides, and a child whose parent ends (however) ends too (end of the pipe,
or the kernel's parent-death signal while it trains).
"""

from __future__ import annotations

import gc
import multiprocessing
import signal
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_hpc.config import RunConfig
from areal_hpc.errors import UserError

if TYPE_CHECKING:
    from areal_hpc.data.trajectory import Trajectory

JOIN_TIMEOUT_S = 30.0  # how long a closing parent waits for the child to end before killing it


class TrainerProcessError(RuntimeError):
    """The training process failed (the message holds its traceback) or ended unasked."""


class TrainerProcess:
    """The parent's handle on the training child (see the module's docstring): a ``trainer.Trainer``."""

    trains_elsewhere = True

    def __init__(self, connection, process, cfg: RunConfig):
        from areal_hpc.models.hf import load_tokenizer  # what the rollout side renders prompts with

        self._connection, self._process, self._lock = connection, process, threading.Lock()
        ready = self._receive()  # the child's engines are built: its errors come first
        self.state: dict = ready["state"]
        tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path)
        self.engines = {name: RemoteEngine(self, name, tokenizer, device) for name, device in ready["engines"].items()}

    @classmethod
    def start(cls, cfg: RunConfig, resume: bool) -> TrainerProcess:
        """Fork the child (from the calling thread, which must live as long as the run: the child's
        parent-death signal follows it) and wait until it has built its engines."""
        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(theirs, ours, cfg, resume), name="trainer rank 0 training")
        # Neither process's collector scans what was there at the fork: the child's copies none of those
        # pages, and the parent's full collections (0.2-0.3 s of the interpreter's lock every ~20
        # quickstart steps over torch's and transformers' objects) stay small. Unfrozen at the end.
        gc.freeze()
        process.start()
        theirs.close()
        try:
            return cls(ours, process, cfg)
        except BaseException:
            _close(ours, process)
            gc.unfreeze()
            raise

    def __enter__(self) -> TrainerProcess:
        return self

    def __exit__(self, *exc) -> None:
        _close(self._connection, self._process)
        gc.unfreeze()  # what this process frees at its exit is freed as usual

    def update(
        self, trajectories: list[Trajectory], teacher_logprobs: list[list[float]] | None = None
    ) -> dict[str, float]:
        return self.call("update", trajectories, teacher_logprobs)

    def save_checkpoint(self, run_dir: Path, step: int, driver: dict[str, Any]) -> Path:
        return self.call("checkpoint", run_dir, step, driver)

    def stop(self) -> None:
        """Release the other ranks and end the child (``TrainerRanks.stop`` there)."""
        self.call("stop")
        self._process.join()

    def call(self, command: str, *args):
        with self._lock:
            try:
                self._connection.send((command, args))
            except (BrokenPipeError, OSError):
                pass  # the child is gone: _receive says how it ended
            return self._receive()

    def _receive(self):
        try:
            outcome, payload = self._connection.recv()
        except (EOFError, OSError):
            self._process.join(JOIN_TIMEOUT_S)
            raise TrainerProcessError(
                f"trainer rank 0's training process ended unasked (exit code {self._process.exitcode})"
            ) from None
        if outcome == "ok":
            return payload
        user_error, message = payload
        raise UserError(message) if user_error else TrainerProcessError(message)


class RemoteEngine:
    """What rank 0's rollout side uses of an engine in the child: its tokenizer, its device, ``save``."""

    def __init__(self, trainer: TrainerProcess, name: str, tokenizer, device: str):
        import torch

        self.name, self.tokenizer, self.device, self._trainer = name, tokenizer, torch.device(device), trainer

    def save(self, folder: Path, *, optimizer: bool = True) -> None:
        self._trainer.call("save", self.name, folder, optimizer)


def _close(connection, process) -> None:
    """End the child however the run ends: the end of the pipe tells it (once its current call is done)."""
    connection.close()
    process.join(JOIN_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()


def _serve(connection, parents_end, cfg: RunConfig, resume: bool) -> None:
    """The child: trainer rank 0, answering the parent's calls until ``stop`` or the end of the pipe.
    The fork copied the parent's end of the pipe too: closed first, or the parent closing its own would
    never reach the child as the end of the pipe (a failed run then waited ``JOIN_TIMEOUT_S`` to kill it)."""
    from areal_hpc.parallel.mesh import close_distributed
    from areal_hpc.runtime.forkserver import PR_SET_PDEATHSIG, _prctl
    from areal_hpc.train.build import build_engines, start_trainer
    from areal_hpc.train.stopping import STOP_SIGNALS
    from areal_hpc.train.trainer_ranks import TrainerRanks

    parents_end.close()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for signum in (*STOP_SIGNALS, signal.SIGINT):  # the parent decides (a terminal's Ctrl-C reaches both)
        signal.signal(signum, signal.SIG_IGN)
    try:
        _, mesh = start_trainer(cfg)
        try:
            actor, engines, state = build_engines(cfg, mesh, resume)
            group = TrainerRanks(actor, engines, mesh, cfg)
            connection.send(
                ("ok", {"state": state, "engines": {name: str(engine.device) for name, engine in engines.items()}})
            )
            calls = {
                "update": group.update,
                "checkpoint": group.save_checkpoint,
                "save": lambda name, folder, optimizer: group.engines[name].save(folder, optimizer=optimizer),
            }
            while True:
                try:
                    command, args = connection.recv()
                except EOFError:
                    return  # the parent is gone (a failure): the launcher stops the other ranks
                if command == "stop":
                    _answer(connection, group.stop)
                    return
                _answer(connection, lambda: calls[command](*args))  # noqa: B023 - called within this iteration
        finally:
            close_distributed()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        _report(connection, exc)


def _answer(connection, work) -> None:
    try:
        result = work()
    except Exception as exc:  # noqa: BLE001 - one failed call is the parent's to raise
        _report(connection, exc)
    else:
        connection.send(("ok", result))


def _report(connection, exc: BaseException) -> None:
    message = str(exc) if isinstance(exc, UserError) else "".join(traceback.format_exception(exc)).rstrip()
    try:
        connection.send(("error", (isinstance(exc, UserError), message)))
    except (BrokenPipeError, OSError):
        pass  # the parent is gone already
