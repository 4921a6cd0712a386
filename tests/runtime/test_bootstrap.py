"""Rank bootstrap: placement from Slurm, MPI, torchrun or nothing (the Slurm environments are the ones
observed on the dev cluster), role split, GRES device shares, node addresses, and a real rendezvous of
three processes through a name-resolve folder with no MASTER_ADDR/MASTER_PORT."""

import ipaddress
import json
import os
import socket
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.errors import UserError
from areal_hpc.runtime.bootstrap import (
    RENDEZVOUS,
    Placement,
    RoleTasks,
    allocator_env,
    assigned_devices,
    cpu_threads,
    het_component,
    new_incarnation,
    node_address,
    task_role,
)
from areal_hpc.runtime.rendezvous import ADDRESS_FILE, rendezvous_store
from tests.conftest import REPO

# Observed in job 20 on the dev cluster: `#SBATCH -p train -n 2 -c 1`, `#SBATCH hetjob`,
# `#SBATCH -p rollout -n 1 -c 2`, then `srun --het-group=0,1` (the rank on rollout1) ...
HET_STEP_RANK_2 = {
    "SLURM_JOB_ID": "20",
    "SLURM_STEP_ID": "2",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_HET_SIZE": "2",
    "SLURM_NTASKS_HET_GROUP_0": "2",
    "SLURM_NTASKS_HET_GROUP_1": "1",
    "SLURM_CPUS_PER_TASK_HET_GROUP_0": "1",
    "SLURM_CPUS_PER_TASK_HET_GROUP_1": "2",
    "SLURM_JOB_NODELIST": "rollout1,train1",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "train1",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "rollout1",
    "SLURM_JOB_PARTITION": "rollout",
    "SLURMD_NODENAME": "rollout1",
    "PMIX_RANK": "2",
}
# ... `srun --het-group=1` alone (ranks from 0, the component's node list) ...
HET_GROUP_1_STEP = {
    **HET_STEP_RANK_2,
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_JOB_NODELIST": "rollout1",
    "PMIX_RANK": "0",
}
# ... and the batch script itself (component 0's SLURM_NTASKS, SLURM_PROCID=0, no step).
HET_BATCH_SCRIPT = {
    k: v for k, v in HET_STEP_RANK_2.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "PMIX_RANK")
}
HET_BATCH_SCRIPT.update(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="train1", SLURMD_NODENAME="train1")


def test_slurm_step():
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURMD_NODENAME": "gpu017",
    }
    assert Placement.detect(env) == Placement(rank=5, world=8, local_rank=1, node="gpu017", source="slurm")


def test_het_step_spans_every_component():
    placement = Placement.detect(HET_STEP_RANK_2)
    assert placement == Placement(rank=2, world=3, local_rank=0, node="rollout1", source="slurm")
    groups = [RoleTasks("trainer", 2), RoleTasks("rollout", 1)]
    assert (task_role(placement, groups).role, task_role(placement, groups).index) == ("rollout", 0)
    assert het_component(HET_STEP_RANK_2) == 1 and cpu_threads(HET_STEP_RANK_2) == 2
    trainer = {**HET_STEP_RANK_2, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURMD_NODENAME": "train1"}
    role = task_role(Placement.detect(trainer), groups)
    assert (role.role, role.index) == ("trainer", 1)
    assert het_component(trainer) == 0 and cpu_threads(trainer) == 1


def test_het_step_over_one_component():
    assert Placement.detect(HET_GROUP_1_STEP) == Placement(0, 1, 0, "rollout1", "slurm")
    assert het_component(HET_GROUP_1_STEP) == 1 and cpu_threads(HET_GROUP_1_STEP) == 2


def test_batch_script_is_one_process_not_rank_0_of_the_job():
    assert Placement.detect(HET_BATCH_SCRIPT) == Placement(0, 1, 0, "train1", "local")
    assert cpu_threads(HET_BATCH_SCRIPT) == 1


def test_mpirun():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "PMIX_RANK": "3",
    }
    assert Placement.detect(env) == Placement(3, 4, 1, socket.gethostname(), "mpi")
    # mpirun inside an allocation: srun started its daemons, so SLURM_PROCID there is the node's index
    inside = {**env, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURMD_NODENAME": "n2"}
    assert Placement.detect(inside) == Placement(3, 4, 1, "n2", "mpi")


def test_mpich_hydra():
    assert Placement.detect({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0"}).rank == 2


def test_torchrun_wins_inside_an_srun_step():
    env = {
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURMD_NODENAME": "n1",
    }
    assert Placement.detect(env) == Placement(6, 8, 2, "n1", "local")


def test_nothing_set_is_rank_0_of_1():
    assert Placement.detect({}) == Placement(0, 1, 0, socket.gethostname(), "local")


def test_bad_values_are_one_line_errors():
    with pytest.raises(UserError, match="RANK='x' is not an integer"):
        Placement.detect({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(UserError, match="rank 4 is outside a world of 4"):
        Placement.detect({"SLURM_STEP_ID": "0", "SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "4"})


def test_task_roles_follow_the_groups_in_rank_order():
    groups = [
        RoleTasks("trainer", 2, 1),
        RoleTasks("rollout", 1, 1),
        RoleTasks("trainer", 1, 1),
        RoleTasks("rollout", 2, 2, tp=2),
    ]
    roles = [task_role(Placement(r, 6, r % 3, f"n{r // 3}", "slurm"), groups) for r in range(6)]
    assert [(t.role, t.index, t.first_accelerator, t.tp) for t in roles] == [
        ("trainer", 0, 0, 1),
        ("trainer", 1, 1, 1),
        ("rollout", 0, 2, 1),  # node n0: 3 accelerators
        ("trainer", 2, 0, 1),
        ("rollout", 1, 1, 2),
        ("rollout", 2, 3, 2),
    ]  # node n1: 5
    with pytest.raises(UserError, match=r"task groups \(2 trainer \+ 1 rollout\) do not add up to its world of 5"):
        task_role(Placement(0, 5, 0, "n", "slurm"), groups[:2])


def test_cpu_threads():
    assert cpu_threads({"SLURM_CPUS_PER_TASK": "4"}) == 4
    assert cpu_threads({}) is None


@given(
    sizes=st.lists(
        st.tuples(st.sampled_from(["trainer", "rollout"]), st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=5
    ),
    per_node=st.integers(1, 6),
    data=st.data(),
)
def test_device_shares_are_disjoint_and_cover_the_node(sizes, per_node, data):
    """Any task groups, blocks of ``per_node`` consecutive ranks per node: each task gets its own count of
    the node's accelerators, disjoint from its neighbours', and the node's are all used when counts fit."""
    groups = [RoleTasks(role, tasks, accelerators) for role, tasks, accelerators in sizes]
    world = sum(g.tasks for g in groups)
    per_rank = [g for g in groups for _ in range(g.tasks)]
    for start in range(0, world, per_node):
        node_tasks = per_rank[start : start + per_node]
        needed = sum(g.accelerators for g in node_tasks)
        ids = data.draw(st.permutations([str(i) for i in range(needed)]))
        env = {"CUDA_VISIBLE_DEVICES": ",".join(ids), "SLURM_GPUS_ON_NODE": str(len(ids))}
        shares = []
        for local in range(len(node_tasks)):
            role = task_role(Placement(start + local, world, local, "n", "slurm"), groups)
            shares.append(assigned_devices(role.first_accelerator, role.accelerators, env))
        taken = [d for share in shares for d in share]
        assert [len(share) for share in shares] == [g.accelerators for g in node_tasks]
        assert sorted(taken) == sorted(ids)  # disjoint, and the node's devices all used


def test_devices_slurm_bound_per_task_and_npu():
    # --gpus-per-task=1 or --gpu-bind: each task sees its own, SLURM_GPUS_ON_NODE counts the node's (observed)
    assert assigned_devices(1, 1, {"CUDA_VISIBLE_DEVICES": "1", "SLURM_GPUS_ON_NODE": "2"}) == ["1"]
    assert assigned_devices(2, 2, {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7", "CUDA_VISIBLE_DEVICES": "0"}) == ["6", "7"]
    assert assigned_devices(2, 2, {}) == ["2", "3"]  # nothing narrowed: every device, numbered from 0
    with pytest.raises(UserError, match=r"node train1 shows 1 \(CUDA_VISIBLE_DEVICES='0'\); request at least 2"):
        assigned_devices(1, 1, {"CUDA_VISIBLE_DEVICES": "0", "SLURM_GPUS_ON_NODE": "1", "SLURMD_NODENAME": "train1"})
    with pytest.raises(UserError, match=r"this task needs accelerators 2\.\.3 but node n shows 3"):
        assigned_devices(2, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2", "SLURMD_NODENAME": "n"})


def test_node_address_of_an_interface():
    assert node_address("lo") == "127.0.0.1"
    with pytest.raises(UserError, match=r"network interface 'ib7' does not exist on .*there are: .*\blo\b"):
        node_address("ib7")


def _resolves(name):
    return [ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(name, None, socket.AF_INET)]


def test_node_address_without_an_interface():
    assert node_address(environ={"SLURMD_NODENAME": "192.0.2.77"}) == "192.0.2.77"  # resolves, not loopback
    # a node name that does not resolve (train1 on the dev cluster): another address, one others can resolve
    address = node_address(environ={"SLURMD_NODENAME": "no-such-node.invalid"})
    assert address != "no-such-node.invalid" and _resolves(address)
    # loopback only where this machine has no route at all; then it is the machine's own name
    assert not all(ip.is_loopback for ip in _resolves(address)) or address in (socket.gethostname(), "127.0.0.1")


def test_incarnation():
    assert new_incarnation({"SLURM_JOB_ID": "20"}) == "20.0"
    assert new_incarnation({"SLURM_JOB_ID": "20", "SLURM_RESTART_COUNT": "3"}) == "20.3"
    assert new_incarnation({}).startswith("local.") and new_incarnation({}) != new_incarnation({})


def test_rendezvous_deadline_names_the_folder(tmp_path):
    with pytest.raises(UserError, match=f"rank 1 of 2 waited 0.2 s for rank 0's address in {tmp_path}"):
        rendezvous_store(tmp_path, rank=1, world=2, timeout_s=0.2)


def test_world_without_a_rendezvous_is_a_user_error(monkeypatch):
    import torch

    from areal_hpc.parallel.mesh import init_distributed

    for name in ("MASTER_ADDR", "MASTER_PORT", RENDEZVOUS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="2 ranks \\(from local variables\\) need a rendezvous: AREAL_HPC_RENDEZVOUS"):
        init_distributed(torch.device("cpu"))


@pytest.mark.distributed
def test_three_ranks_meet_through_the_name_resolve_folder(tmp_path):
    folder = tmp_path / "name_resolve" / "trainer" / "local.1"
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}  # no torchrun address
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.rank_allreduce", "2"],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={
                **base,
                "RANK": str(r),
                "WORLD_SIZE": "3",
                "LOCAL_RANK": str(r),
                RENDEZVOUS: str(folder),
                "OMP_NUM_THREADS": "1",
            },
        )
        for r in range(3)
    ]
    outputs = [p.communicate(timeout=60)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0, 0], outputs
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [(r["torch_rank"], r["torch_world"], r["torch_sum"]) for r in reports] == [(i, 3, 6.0) for i in range(3)]
    assert [(r["role"], r["index"], r["trainer_sum"]) for r in reports] == [
        ("trainer", 0, 3.0),
        ("trainer", 1, 3.0),
        ("rollout", 0, 3.0),
    ]  # the rollout rank's own value, untouched
    host, port = (folder / ADDRESS_FILE).read_text().rsplit(":", 1)
    assert host == node_address() and int(port) > 0  # bound on a port the OS chose, at this node's address


def test_the_local_launcher_deals_out_listed_accelerators_disjointly():
    from areal_hpc.config import load_config
    from areal_hpc.launch.local import device_shares

    cfg = load_config(
        None, ["cluster.device=cuda", "rl.trainer_processes=2", "rollout.n_servers=2", "rollout.tp_size=2"]
    )
    trainers, servers = device_shares(cfg, {"CUDA_VISIBLE_DEVICES": "4,5,6,7,8,9"})
    assert [t["CUDA_VISIBLE_DEVICES"] for t in trainers] == ["4", "5"]
    assert [s["CUDA_VISIBLE_DEVICES"] for s in servers] == ["6,7", "8,9"]
    assert device_shares(cfg, {"CUDA_VISIBLE_DEVICES": "0,1"}) == ([{}, {}], [{}, {}])  # too few: shared as before
    assert device_shares(load_config(None, ["cluster.device=cpu"]), {"CUDA_VISIBLE_DEVICES": "0,1"}) == ([{}], [{}])


@pytest.mark.parametrize(
    "groups, message",
    [
        ("[[worker,1,1,1],[rollout,1,1,1]]", r"entry \['worker', 1, 1, 1\] is not \[trainer\|rollout"),
        ("[[trainer,1,1,0],[rollout,1,1,1]]", r"tensor-parallel size >= 1"),
        ("[[trainer,2,1,1],[rollout,1,1,1]]", "hold 2 trainer tasks but rl.trainer_processes=1"),
    ],
)
def test_task_groups_that_do_not_match_the_run_are_one_line(groups, message):
    from areal_hpc.config import load_config
    from areal_hpc.launch.slurm_task import task_groups

    cfg = load_config(None, [f"slurm.task_groups={groups}", "rl.trainer_processes=1", "rollout.n_servers=1"])
    with pytest.raises(UserError, match=message):
        task_groups(cfg)


def test_a_tree_trainer_keeps_more_onednn_primitives_and_the_users_environment_wins():
    """A tree-training trainer's update reuses its ~100 padded matmul shapes (256 kept); a rollout server
    and a trainer of packed micro-batches (rows new every step) keep 16; what the user's environment sets
    is left alone."""
    assert allocator_env({})["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    assert allocator_env({}, tree_trainer=False) == allocator_env({})
    assert allocator_env({}, tree_trainer=True) == {
        "MALLOC_ARENA_MAX": "2",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256",
        "LRU_CACHE_CAPACITY": "16",
    }
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in allocator_env(
        {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8"}, tree_trainer=True
    )
