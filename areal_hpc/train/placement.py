"""Where trainer rank 0's threads run on a machine it shares with its rollout servers: the update on
the trainer's own cores, the rest of rank 0 (the rollout controller's event loop, the rollout client,
reward workers, shard commits, evaluation) on the rollout servers' cores, beside the generation it drives.

On 2 cores the local launcher pins the server to core 0 and the trainer to core 1. Rank 0's rollout
side takes about a third of its CPU; on core 1 it stretched the update while core 0 idled between
generations. The launcher names the servers' cores in ``ROLLOUT_CORES``; without them (Slurm, pinning
off) nothing moves, and the update runs on a thread of its own all the same.
"""

from __future__ import annotations

import concurrent.futures
import os

ROLLOUT_CORES = "AREAL_HPC_ROLLOUT_CORES"  # e.g. "0" or "0,1": the rollout servers' cores on this machine


class ThreadPlacement:
    """``with ThreadPlacement() as placement``: from then on the calling thread, and the threads and
    processes it starts, run on the rollout servers' cores; ``placement.training`` is a one-thread
    executor for the update, on the cores this process had when the placement was made."""

    def __init__(self, environ=os.environ):
        self.training_cores = sorted(os.sched_getaffinity(0))
        self.rollout_cores = sorted({int(c) for c in environ.get(ROLLOUT_CORES, "").split(",") if c.strip()})
        self.training = concurrent.futures.ThreadPoolExecutor(1, "training", initializer=self._pin_training)

    def _pin_training(self) -> None:
        os.sched_setaffinity(0, self.training_cores)  # Linux: the calling thread only

    def __enter__(self) -> "ThreadPlacement":
        if self.rollout_cores:
            os.sched_setaffinity(0, self.rollout_cores)
        return self

    def __exit__(self, *exc) -> None:
        self.training.shutdown(wait=True)


def rollout_cores_env(server_cores: list[list[int] | None]) -> dict[str, str]:
    """The launcher's side: ``ROLLOUT_CORES`` for trainer rank 0 when every server is pinned, else nothing."""
    if not server_cores or not all(server_cores):
        return {}
    return {ROLLOUT_CORES: ",".join(map(str, sorted({c for cores in server_cores for c in cores})))}
