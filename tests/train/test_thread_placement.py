"""Trainer rank 0's threads on a machine it shares with its rollout servers: the update and the shard
commits on the trainer's cores, the event loop and what it starts (threads, reward workers) on the
servers' cores."""

import os
import subprocess
import sys

import pytest

from areal_hpc.config import load_config
from areal_hpc.launch.local import core_shares
from areal_hpc.train.demo_tuning import ROLLOUT_SIDE_CORES, ROLLOUT_SIDE_NICE, rollout_side_env


def test_rank_0_learns_the_run_cores_only_when_they_are_pinned():
    trainers, servers = core_shares(load_config("configs/quickstart.yaml", []), [0, 1])
    assert rollout_side_env([s.cores for s in servers], trainers[0].cores) == {ROLLOUT_SIDE_CORES: "0"}
    trainers, servers = core_shares(load_config("configs/quickstart.yaml", ["cluster.pin_cores=false"]), [0, 1])
    assert rollout_side_env([s.cores for s in servers], trainers[0].cores) == {}
    assert rollout_side_env([[4, 5], [0, 1]], [2, 3]) == {ROLLOUT_SIDE_CORES: "0,1,4,5"}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("training_elsewhere", [False, True])
def test_the_update_and_the_commits_stay_on_the_trainers_cores_and_the_rest_runs_on_the_servers(training_elsewhere):
    """With the training in a child process (on the trainer's cores), the shard commits run on the rollout
    side, which may also use the trainer's cores, 10 lower in priority than the child (threads and
    processes it starts too)."""
    server, trainer = sorted(os.sched_getaffinity(0))[:2]
    script = (
        "import os, threading, multiprocessing as mp\n"
        "from areal_hpc.train.demo_tuning import ThreadPlacement\n"
        f"with ThreadPlacement(training_elsewhere={training_elsewhere}) as p:\n"
        "    where = lambda: (sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0))\n"
        "    training = p.training.submit(where).result()\n"
        "    commits = p.shard_commits.submit(where).result()\n"
        "    seen = []\n"
        "    t = threading.Thread(target=lambda: seen.append(where())); t.start(); t.join()\n"
        "    with mp.get_context('spawn').Pool(1) as pool:\n"
        "        worker = pool.apply(os.sched_getaffinity, (0,)), pool.apply(os.getpriority, (os.PRIO_PROCESS, 0))\n"
        "    print([training, commits, where(), seen[0], (sorted(worker[0]), worker[1])])\n"
    )
    done = subprocess.run(
        ["taskset", "-c", str(trainer), sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, ROLLOUT_SIDE_CORES: str(server)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if training_elsewhere:  # the commits with the rest: the servers' cores and the trainer's, niced
        side = ([server, trainer], min(19, base + ROLLOUT_SIDE_NICE))
        assert done.stdout.split("\n")[0] == str([([trainer], side[1]), side, side, side, side])
    else:
        assert done.stdout.split("\n")[0] == str(
            [([trainer], base), ([trainer], base), ([server], base), ([server], base), ([server], base)]
        )
