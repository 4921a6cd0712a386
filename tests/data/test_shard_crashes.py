"""Crash safety and exactly-once consumption, proven by SIGKILLing real writer and consumer processes."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from areal_hpc.data.shards import TrajectoryStore
from tests.conftest import REPO, run_cli
from tests.data.test_trajectory_store import same_record
from tests.shard_processes import make_trajectory

pytestmark = pytest.mark.slow
KILLS = 30


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.shard_processes", *args], cwd=REPO, stdout=subprocess.PIPE, text=True
    )


def kill(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    process.stdout.close()


def test_writer_killed_at_random_moments_loses_only_unflushed_records(tmp_path):
    rng = random.Random(0)
    for attempt in range(KILLS):
        directory, seed = tmp_path / f"run{attempt}", attempt
        writer = start("write", str(directory), str(seed), "10000")
        flushed = [writer.stdout.readline().split()[1] for _ in range(rng.randint(1, 40))]
        time.sleep(rng.uniform(0, 0.004))  # land anywhere: between commits or inside one
        kill(writer)
        with TrajectoryStore(directory) as store:
            back = list(store.trajectories())
        ids = [t.id for t in back]
        assert ids[: len(flushed)] == flushed, attempt  # every flushed record survives, in order
        assert all(same_record(t, make_trajectory(seed, i)) for i, t in enumerate(back)), attempt  # no garbage


def test_a_commit_torn_by_sigkill_is_a_note_and_never_returned(tmp_path):
    writer = start("write", str(tmp_path), "9", "100", "--die-mid-commit", "7")
    lines = writer.stdout.read().splitlines()
    assert writer.wait(timeout=30) == -signal.SIGKILL
    assert len(lines) == 7
    with TrajectoryStore(tmp_path) as store:
        assert [t.id for t in store.trajectories()] == [f"s9-t{i}" for i in range(7)]
        shard = next(iter(store.shards.values()))
        assert (shard.torn_trajectories, shard.torn_rewards) == (1, 1)
    inspect = run_cli("shards", "inspect", str(tmp_path))
    assert "w0-000000.live.h5: an interrupted commit of 1 trajectories and 1 rewards (ignored)" in inspect.stdout
    verify = run_cli("shards", "verify", str(tmp_path))  # expected after a crash: nothing committed is lost
    assert verify.returncode == 0, verify.stdout
    assert (
        "note: w0-000000.live.h5: torn tail, an interrupted commit of 1 trajectories and 1 rewards (ignored): "
        "its writer stopped mid-commit"
    ) in verify.stdout
    assert "DAMAGE" not in verify.stdout and "ok, 7 committed records checked" in verify.stdout


def test_consumer_killed_between_and_during_steps_trains_every_record_exactly_once(tmp_path):
    total, shards, checkpoint = 400, tmp_path / "shards", tmp_path / "checkpoint.json"
    writer = start("write", str(shards), "11", str(total), "--sleep", "0.03")
    assert writer.stdout.readline().startswith("committed")  # the store exists now
    rng, kills = random.Random(1), 0
    while True:
        consumer = start("consume", str(shards), str(checkpoint), str(total), str(kills))
        if kills < KILLS:
            for _ in range(rng.randint(0, 6)):
                if not consumer.stdout.readline():
                    break
            time.sleep(rng.uniform(0, 0.01))
            if consumer.poll() is None:
                kill(consumer)
                kills += 1
                continue
        consumer.stdout.read()
        assert consumer.wait(timeout=120) == 0
        consumer.stdout.close()
        break
    assert writer.wait(timeout=120) == 0
    writer.stdout.close()
    trained = json.loads(checkpoint.read_text())["trained"]
    assert kills >= KILLS // 2  # most kills landed while the writer was still producing
    assert sorted(trained) == sorted(f"s11-t{i}" for i in range(total))  # none lost, none twice
