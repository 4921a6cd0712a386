"""Real writer and consumer processes for the crash tests (the tests SIGKILL them at random points).

    python -m tests.shard_processes write DIR SEED COUNT [--die-mid-commit K] [--sleep S] [--exit-without-close]
    python -m tests.shard_processes consume DIR CHECKPOINT TOTAL SEED

``write`` prints ``committed <id>`` after each flushed trajectory; ``--exit-without-close`` ends the
process without finalising (its shard stays live, as a crashed writer's does). ``consume`` keeps its "model"
(the ids it trained on) and the consumer cursor in one checkpoint written atomically, like a trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from areal_hpc.data.shards import ConsumerCursor, TrajectoryConsumer, TrajectoryShardWriter, TrajectoryStore
from areal_hpc.data.shards import writer as writer_module
from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.fsio import atomic_write_json


def make_trajectory(seed: int, i: int) -> Trajectory:
    """The i-th trajectory of a seeded stream: a 1-3 turn record with varied lengths and versions."""
    rng = np.random.default_rng([seed, i])
    segments = []
    for _ in range(int(rng.integers(1, 4))):
        n_out = int(rng.integers(0, 300))
        versions = np.sort(rng.integers(i // 8, i // 8 + 2, n_out))
        segments.append(
            Segment(
                rng.integers(0, 50_000, int(rng.integers(1, 64))),
                rng.integers(0, 50_000, n_out),
                -rng.exponential(1.0, n_out),
                versions,
                rng.integers(0, 2, n_out),
            )
        )
    return Trajectory(
        segments,
        id=f"s{seed}-t{i}",
        tenant=f"tenant{i % 3}",
        task="arithmetic",
        group_id=str(i // 4),
        rewards=[Reward(float(i % 2), time=float(i))],
        metadata={"i": i, "seed": seed},
    )


def write(args) -> None:
    if args.die_mid_commit is not None:
        _die_after_data_of_record(args.die_mid_commit)
    writer = TrajectoryShardWriter(args.dir, "w0", experiment="crash", trial="t0", max_shard_trajectories=25)
    for i in range(args.count):
        traj = make_trajectory(args.seed, i)
        writer.append(traj)
        print(f"committed {traj.id}", flush=True)
        time.sleep(args.sleep)
    if args.exit_without_close:
        os._exit(0)
    writer.close()


def _die_after_data_of_record(k: int) -> None:
    """SIGKILL this process in the middle of committing record k: data written, counts not yet."""
    real_write, seen = writer_module._Column.write, {"index": 0}

    def write(column, start, values):
        real_write(column, start, values)
        if column.dataset.name == "/index":
            seen["index"] += len(values)
            if seen["index"] > k:
                os.kill(os.getpid(), signal.SIGKILL)

    writer_module._Column.write = write


def consume(args) -> None:
    checkpoint = Path(args.checkpoint)
    state = json.loads(checkpoint.read_text()) if checkpoint.exists() else {"trained": [], "cursor": None}
    rng = np.random.default_rng([args.seed, os.getpid()])
    with TrajectoryStore(args.dir) as store:
        consumer = TrajectoryConsumer(store, ConsumerCursor.from_state_dict(state["cursor"]))
        while len(state["trained"]) < args.total:
            batch = consumer.take(int(rng.integers(1, 12)), timeout=0.2)
            if not batch:
                continue
            state["trained"] += [t.id for t in batch]  # the "model update"
            state["cursor"] = consumer.cursor.state_dict()
            atomic_write_json(checkpoint, state)  # model and cursor in one atomic checkpoint
            print(f"step {len(state['trained'])}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir")
    w.add_argument("seed", type=int)
    w.add_argument("count", type=int)
    w.add_argument("--die-mid-commit", type=int)
    w.add_argument("--sleep", type=float, default=0.0)
    w.add_argument("--exit-without-close", action="store_true")
    c = sub.add_parser("consume")
    c.add_argument("dir")
    c.add_argument("checkpoint")
    c.add_argument("total", type=int)
    c.add_argument("seed", type=int)
    args = parser.parse_args()
    write(args) if args.mode == "write" else consume(args)


if __name__ == "__main__":
    sys.exit(main())
