"""What a launcher does when Slurm says the job must stop: SIGUSR2 ``slurm.signal_lead_s`` before the
time limit or a preemption (``--signal=USR2@<lead>``).

The launcher forwards the signal to trainer rank 0, which saves a checkpoint at once and exits with
``SAVED_AND_STOPPED``; then the job is requeued and its next incarnation resumes (``--resume=auto``)
from that checkpoint and the shard cursor in it. Two ways to requeue: under submitit, its own SIGUSR2
handler (installed before our code runs) asks the submitted callable for its ``checkpoint`` and runs
``scontrol requeue``; in a plain sbatch script we run ``scontrol requeue $SLURM_JOB_ID`` ourselves.
Children of a launcher ignore SIGUSR2 unless they handle it (the supervisor starts them so), because
Slurm signals every process of a step and SIGUSR2 would otherwise kill them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys


class StopForwarder:
    """While installed, SIGUSR2 is passed on to ``target`` (trainer rank 0) once it is set."""

    def __init__(self):
        self.requested, self.target = False, None
        self._previous = signal.getsignal(signal.SIGUSR2)

    def __enter__(self) -> StopForwarder:
        signal.signal(signal.SIGUSR2, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGUSR2, self._previous)

    def set_target(self, pid: int) -> None:
        self.target = pid
        self.poke()

    def poke(self) -> None:
        """Pass a stop request on (again): a trainer that is still starting ignores SIGUSR2 until its
        handler is installed, so launchers call this from their supervision loop; the trainer's
        handler does the same thing however often it runs."""
        if self.requested and self.target is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.target, signal.SIGUSR2)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True
        print(
            f"areal-hpc: {signal.Signals(signum).name} received: the trainer saves a checkpoint, then the job "
            f"is requeued",
            file=sys.stderr,
            flush=True,
        )
        self.poke()

    def requeue(self) -> bool:
        """After the trainer saved on our SIGUSR2: requeue this job (through submitit's handler when
        submitit started us; it exits this process). False when no SIGUSR2 came (a SIGTERM: Slurm is
        already requeueing or cancelling the job) or there is no Slurm job to requeue."""
        if not self.requested:
            return False
        if callable(self._previous):
            self._previous(signal.SIGUSR2, None)  # submitit: checkpoint(), scontrol requeue, exit
        job = os.environ.get("SLURM_JOB_ID")
        if not job:
            return False
        refused = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if refused.returncode:
            print(
                f"areal-hpc: error: scontrol requeue {job} failed: {refused.stderr.strip()} (the checkpoint is "
                f"saved: resubmit with --resume)",
                file=sys.stderr,
                flush=True,
            )
            return False
        return True
