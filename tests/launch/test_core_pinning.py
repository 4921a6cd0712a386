"""Rollout servers and trainer ranks on disjoint CPU cores: the launcher's split, and a real child
process that runs (with the threads it starts) on exactly the cores it was given."""

import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.config import load_config
from areal_hpc.launch.local import core_shares
from areal_hpc.runtime.supervisor import SupervisedProcess


def config(*overrides: str):
    return load_config("configs/quickstart.yaml", list(overrides))


def test_two_cores_one_server_one_trainer_get_one_core_each():
    trainers, servers = core_shares(config(), [0, 1])
    assert [p.cores for p in servers] == [[0]] and [p.cores for p in trainers] == [[1]]
    assert [p.threads for p in servers + trainers] == [1, 1]


@given(st.integers(1, 64), st.integers(1, 4), st.integers(1, 4), st.integers(0, 8))
def test_pinned_shares_are_disjoint_and_never_empty(n_cores, servers, trainers, per_server):
    cfg = config(
        f"rollout.n_servers={servers}", f"rl.trainer_processes={trainers}", f"rollout.cores_per_server={per_server}"
    )
    cores = list(range(100, 100 + n_cores))
    trainer_shares, server_shares = core_shares(cfg, cores)
    shares = trainer_shares + server_shares
    assert len(trainer_shares) == trainers and len(server_shares) == servers
    if shares[0].cores is None:  # not enough cores to pin: everyone gets an even thread count, none pinned
        assert all(p.cores is None and p.threads == max(1, n_cores // (servers + trainers)) for p in shares)
        assert n_cores - servers * (per_server or max(1, n_cores // (servers + trainers))) < trainers
        return
    used = [core for p in shares for core in p.cores]
    assert len(used) == len(set(used)) and set(used) <= set(cores)
    assert all(p.cores and p.threads == len(p.cores) for p in shares)
    if per_server:
        assert all(len(p.cores) == per_server for p in server_shares)
    assert set(used) == set(cores) or not per_server  # asked server cores: the trainers take all the rest


def test_pinning_can_be_switched_off_and_follows_the_allocation():
    trainers, servers = core_shares(config("cluster.pin_cores=false"), [0, 1, 2, 3])
    assert all(p.cores is None and p.threads == 2 for p in trainers + servers)
    # a Slurm task whose CPU count differs from the visible cores (e.g. hyper-threads): threads only
    trainers, servers = core_shares(config(), [0, 1, 2, 3], threads=8)
    assert all(p.cores is None and p.threads == 4 for p in trainers + servers)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_a_supervised_child_and_its_threads_run_on_their_cores_only(tmp_path):
    core = sorted(os.sched_getaffinity(0))[-1]
    script = (
        "import os, threading; seen = []; t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)));"
        "t.start(); t.join(); print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))"
    )
    log = tmp_path / "child.log"
    child = SupervisedProcess("child", [sys.executable, "-c", script], log, cores=[core]).start()
    assert child.process.wait(timeout=60) == 0
    assert log.read_text().split("\n")[0] == f"[{core}] [{core}]"
