"""Process tuning for an RL run on one small machine, the 2-core CPU demo it was measured on: where trainer rank
0's threads run when the local launcher pinned it and its rollout servers to cores of their own. The update, the
weight staging and the shard commits run on the trainer's own cores, the rest of rank 0 (the rollout
controller's event loop, the rollout client, reward scoring, evaluation) on the servers' cores. Without the
launcher's pinning (Slurm, ``cluster.pin_cores=false``, one core per process too few) nothing here moves a
thread, and the update runs on a thread of its own all the same. The other tunings for such a machine: the
fork server that starts its processes (``runtime.forkserver``) and rank 0's training in a child process
(``trainer_process``, ``rl.rank0_training``).

On 2 cores the local launcher pins the server to core 0 and the trainer to core 1. The update is the
step's critical path; rank 0's rollout side (about as much CPU a quickstart step as the server's generation)
allowed on core 1 as well preempts it there. Core 0 beside generation, which finishes well within a step
since a group's prompt is prefilled once, has room for it (bench/results/rl_step-primitives-rollout-side-*.md).
The launcher names the cores in ``ROLLOUT_SIDE_CORES``.

With tree training and an in-process reward the update is short enough that the servers' core is the
full one: the shard commits (a group's records, an HDF5 flush and two fsyncs, 16 times a step) run on a
thread on the trainer's cores, which mostly waits on the disk.

With the training in a child process (``rl.rank0_training=child``, on the trainer's cores) every thread of rank
0's own process belongs to the rollout side, the shard commits too: on the trainer's core they would take CPU
from the update itself, not only the interpreter's lock. With tree training's flattened subtrees the update is
short, the servers' core is the full one (generation and the rollout side) and the trainer's idles between
updates: the rollout side may then run on the trainer's cores too, ``ROLLOUT_SIDE_NICE`` lower than the
training child (which the fork left at its priority), so it takes what the child leaves
(bench/results/rl_step-primitives-rollout-side-*.md).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Mapping

ROLLOUT_SIDE_CORES = "AREAL_HPC_ROLLOUT_SIDE_CORES"  # e.g. "0": the servers' cores
ROLLOUT_SIDE_NICE = 10  # with the training in a child: the rollout side's niceness above it, on its cores too


class ThreadPlacement:
    """``with ThreadPlacement() as placement``: from then on the calling thread, and the threads and
    processes it starts, run on ``ROLLOUT_SIDE_CORES``; ``placement.training`` (the update, the weight
    staging) and ``placement.shard_commits`` are one-thread executors on the cores this process had when
    the placement was made. ``training_elsewhere``: the training runs in a child process on those cores
    (``placement.training`` only waits for it there), the shard commits stay on the rollout side, and the
    rollout side runs on the training's cores as well, every thread of this process ``ROLLOUT_SIDE_NICE``
    lower in priority (the child, already forked, keeps its own)."""

    def __init__(self, environ: Mapping[str, str] = os.environ, training_elsewhere: bool = False):
        self.training_cores = sorted(os.sched_getaffinity(0))
        self.rollout_side_cores = sorted({int(c) for c in environ.get(ROLLOUT_SIDE_CORES, "").split(",") if c.strip()})
        self.training_elsewhere = training_elsewhere
        self.training = concurrent.futures.ThreadPoolExecutor(1, "training", initializer=self._pin_training)
        self.shard_commits = concurrent.futures.ThreadPoolExecutor(
            1, "shard-commits", initializer=None if training_elsewhere else self._pin_training
        )

    def _pin_training(self) -> None:
        os.sched_setaffinity(0, self.training_cores)  # Linux: the calling thread only

    def __enter__(self) -> ThreadPlacement:
        if self.rollout_side_cores and self.training_elsewhere:
            for thread in os.listdir("/proc/self/task"):  # Linux: niceness is per thread, inherited by new ones
                niceness = os.getpriority(os.PRIO_PROCESS, int(thread))
                os.setpriority(os.PRIO_PROCESS, int(thread), min(19, niceness + ROLLOUT_SIDE_NICE))
            os.sched_setaffinity(0, sorted({*self.rollout_side_cores, *self.training_cores}))
        elif self.rollout_side_cores:
            os.sched_setaffinity(0, self.rollout_side_cores)
        return self

    def __exit__(self, *exc: object) -> None:
        self.training.shutdown(wait=True)
        self.shard_commits.shutdown(wait=True)


def rollout_side_env(server_cores: list[list[int] | None], trainer_cores: list[int] | None) -> dict[str, str]:
    """The launcher's side: ``ROLLOUT_SIDE_CORES`` for trainer rank 0 (the servers' cores) when the
    servers and rank 0 are pinned, else nothing."""
    pinned = [share for share in server_cores if share]
    if not trainer_cores or not server_cores or len(pinned) < len(server_cores):
        return {}
    cores = {c for share in pinned for c in share}
    return {ROLLOUT_SIDE_CORES: ",".join(map(str, sorted(cores)))}
