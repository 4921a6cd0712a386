"""``areal-hpc submit`` on the real dev Slurm cluster (slurm/dev/up.sh): one heterogeneous job per run,
trainer on ``train1``, rollout servers on ``rollout1``, through submitit.

A tiny run submitted from /tmp completes with its shards, metrics and per-role logs; the planner's
split becomes the job's components; ``scontrol requeue`` mid-run and Slurm's stop warning (SIGUSR2)
both resume the run with every stored trajectory trained exactly once; a rollout server that dies
fails the whole job within 30 s with the reason in the trainer's log and in sacct; ``--dry-run`` is
accepted by ``sbatch --test-only``; bad input is one line before anything is queued.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from areal_hpc.runtime.bootstrap import RUN_MARKER
from tests.conftest import REPO, run_cli
from tests.run_audit import assert_each_trajectory_trained_once, read_audit
from tests.slurm_jobs import cancel, components_of, ended_at, states, submitted_job, wait_for, wait_for_end
from tests.system.test_async_rl import SMALL_RUN, metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PROFILE = str(REPO / "slurm" / "profiles" / "dev.yaml")
CONFIG = str(REPO / "configs" / "quickstart.yaml")


def submit_args(model: Path, fileroot: Path, *extra: str) -> list[str]:
    return [
        "submit",
        "--profile",
        PROFILE,
        "--config",
        CONFIG,
        f"model.path={model}",
        f"cluster.fileroot={fileroot}",
        *SMALL_RUN,
        "rl.eval_every_steps=0",
        *extra,
    ]


def run_folder(fileroot: Path) -> Path:
    return fileroot / "quickstart" / "trial0"


@pytest.fixture
def submit(tmp_path):
    """Submit from /tmp (not the repository) and cancel whatever is still queued at the end."""
    jobs = []

    def run(*args: str) -> str:
        result = run_cli(*args, cwd=Path("/tmp"), timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        jobs.append(submitted_job(result.stdout))
        return jobs[-1]

    yield run
    for job in jobs:
        cancel(job)


def processes_of(run: Path, role: str) -> list[int]:
    """Pids of this run's processes with ``role`` as one of their command-line arguments."""
    marker, pids = f"{RUN_MARKER}={run}".encode(), []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and marker in (proc / "environ").read_bytes().split(b"\0")
                and role.encode() in (proc / "cmdline").read_bytes().split(b"\0")
            ):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_a_run_submitted_from_tmp_completes_as_one_heterogeneous_job(tiny_model_dir, tmp_path, submit, sync):
    job = submit(*submit_args(tiny_model_dir, tmp_path, "rl.total_train_steps=4", f"rl.weight_sync={sync}"))
    ended = wait_for_end(job, 240, components=2)
    assert {state for state, _, _ in ended.values()} == {"COMPLETED"}, ended
    assert ended[f"{job}+0"][2] == "train1" and ended[f"{job}+1"][2] == "rollout1"
    run = run_folder(tmp_path)
    assert [r["step"] for r in metrics(run) if "rollout/reward" in r] == [1, 2, 3, 4]
    assert (run / "logs" / "trainer-0.restart0.log").read_text().count("eval accuracy") >= 1
    assert "embedded rollout server" in (run / "logs" / "rollout-0.restart0.log").read_text()
    assert run_cli("shards", "verify", str(run / "shards")).returncode == 0
    assert not (run / "logs" / "failures.log").exists()
    pushed = [r["sync/bytes"] for r in metrics(run) if "sync/bytes" in r]
    assert len(pushed) == 4 and min(pushed) > 0  # every step's weights reached the server on rollout1
    assert yaml.safe_load((run / "job" / "config.yaml").read_text())["cluster"]["fileroot"] == str(tmp_path)


def test_the_planners_split_becomes_the_jobs_components(tiny_model_dir, tmp_path, submit):
    """The planner's own plan for the dev cluster with A100s in partition rollout runs as one job: both
    pools train and serve, each trainer rank's share of a batch set by its device's planned speed.
    (The plan of slurm/dev/cluster.yaml, one pool training and one serving, is the same path with one
    task group per component; the component test of the shipped clusters covers it.)"""
    plan = tmp_path / "plan.yaml"
    made = run_cli(
        "plan", "--cluster", "slurm/dev/cluster-mixed.yaml", "--model", "r1-distill-qwen-1.5b", "--out", str(plan)
    )
    assert made.returncode == 0, made.stderr
    groups = yaml.safe_load(plan.read_text())
    trainers = sum(g["devices"] for g in groups["train"])
    servers = sum(g["replicas"] for g in groups["rollout"])
    job = submit(*submit_args(tiny_model_dir, tmp_path, "rl.total_train_steps=2"), "--plan", str(plan))
    ended = wait_for_end(job, 300, components=2)
    assert {state for state, _, _ in ended.values()} == {"COMPLETED"}, ended
    logs = {p.name for p in (run_folder(tmp_path) / "logs").glob("*.restart0.log")}
    assert logs == {f"trainer-{i}.restart0.log" for i in range(trainers)} | {
        f"rollout-{i}.restart0.log" for i in range(servers)
    }
    resolved = yaml.safe_load((run_folder(tmp_path) / "job" / "config.yaml").read_text())
    assert (resolved["rl"]["trainer_processes"], resolved["rollout"]["n_servers"]) == (trainers, servers)
    pools = {g["pool"]: groups["pools"][g["pool"]]["partition"] for g in groups["train"] + groups["rollout"]}
    assert ended[f"{job}+0"][2] == {"train": "train1", "rollout": "rollout1"}[pools[groups["train"][0]["pool"]]]
    assert {g["device"] for g in groups["train"]} == {"H100", "A100"}  # both pools train ...
    assert {g["pool"] for g in groups["rollout"]} == {"train", "rollout"}  # ... and both serve
    speeds = [g["tokens_per_s"] / g["devices"] for g in groups["train"] for _ in range(g["devices"])]
    assert resolved["actor"]["parallel"]["dp_weights"] == pytest.approx([s / sum(speeds) for s in speeds], rel=1e-3)


def test_a_plan_with_servers_of_two_sizes_and_a_pool_that_trains_and_serves_runs_as_planned(
    tiny_model_dir, tmp_path, submit
):
    """train1 holds the trainer rank and a server of tp 1, rollout1 one server of tp 2 (both fake GPUs):
    each task takes the accelerators and tensor-parallel size the plan gives it, and the run completes."""
    plan = tmp_path / "plan.yaml"
    pools = {
        name: {"device": device, "partition": name, "nodes": 1, "per_node": 2}
        for name, device in (("train", "H100"), ("rollout", "H20"))
    }
    plan.write_text(
        yaml.safe_dump(
            {
                "pools": pools,
                "train": [{"pool": "train", "devices": 1, "dp": 1, "tp": 1, "pp": 1}],
                "rollout": [
                    {"pool": "train", "replicas": 1, "devices": 1, "tp": 1, "pp": 1},
                    {"pool": "rollout", "replicas": 1, "devices": 2, "tp": 2, "pp": 1},
                ],
            }
        )
    )
    job = submit(*submit_args(tiny_model_dir, tmp_path, "rl.total_train_steps=2"), "--plan", str(plan))
    ended = wait_for_end(job, 300, components=2)
    assert {state for state, _, _ in ended.values()} == {"COMPLETED"}, ended
    assert (ended[f"{job}+0"][2], ended[f"{job}+1"][2]) == ("train1", "rollout1")
    logs = run_folder(tmp_path) / "logs"
    first_lines = {
        name: (logs / f"{name}.restart0.log").read_text().splitlines()[0]
        for name in ("trainer-0", "rollout-0", "rollout-1")
    }
    assert first_lines["trainer-0"].endswith("on train1: accelerators 0")
    assert first_lines["rollout-0"].endswith("on train1: accelerators 1, tensor-parallel size 1")
    assert first_lines["rollout-1"].endswith("on rollout1: accelerators 0,1, tensor-parallel size 2")
    assert [r["step"] for r in metrics(run_folder(tmp_path)) if "rollout/reward" in r] == [1, 2]


def test_a_plan_with_training_groups_of_different_shapes_runs_as_planned(tiny_model_dir, tmp_path, submit):
    """train1's two fake GPUs train at tp2, rollout1 trains at tp1 beside the server: two meshes in one
    het job, each replica's share of a batch set by its devices' planned speed, and the run completes."""
    plan = tmp_path / "plan.yaml"
    pools = {
        name: {"device": device, "partition": name, "nodes": 1, "per_node": 2}
        for name, device in (("train", "H100"), ("rollout", "A100"))
    }
    plan.write_text(
        yaml.safe_dump(
            {
                "pools": pools,
                "rollout": [{"pool": "rollout", "replicas": 1, "devices": 1, "tp": 1, "pp": 1}],
                "train": [
                    {"pool": "train", "devices": 2, "dp": 1, "tp": 2, "pp": 1, "tokens_per_s": 3000.0},
                    {"pool": "rollout", "devices": 1, "dp": 1, "tp": 1, "pp": 1, "tokens_per_s": 1000.0},
                ],
            }
        )
    )
    job = submit(*submit_args(tiny_model_dir, tmp_path, "rl.total_train_steps=2"), "--plan", str(plan))
    ended = wait_for_end(job, 300, components=2)
    assert {state for state, _, _ in ended.values()} == {"COMPLETED"}, ended
    resolved = yaml.safe_load((run_folder(tmp_path) / "job" / "config.yaml").read_text())
    assert resolved["actor"]["parallel"]["groups"] == [[1, 2, 1], [1, 1, 1]]
    assert resolved["actor"]["parallel"]["dp_weights"] == pytest.approx([0.75, 0.25])
    logs = run_folder(tmp_path) / "logs"
    said = {i: (logs / f"trainer-{i}.restart0.log").read_text() for i in range(3)}
    assert "training group 0 of 2 (dp1 tp2 pp1), batch share 0 of 2" in said[1], said[1]
    assert "training group 1 of 2 (dp1 tp1 pp1), batch share 1 of 2" in said[2], said[2]
    assert said[2].splitlines()[0].endswith("on rollout1: accelerators 0")
    steps = [r for r in metrics(run_folder(tmp_path)) if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["actor/loss_tokens"] > 0 for r in steps)


def wait_for_step(run: Path, step: int, job: str, timeout: float = 180) -> None:
    def reached():
        state = components_of(job)
        assert not any(s in ("FAILED", "CANCELLED") for s, _, _ in state.values()), state
        return (run / "logs" / "batches.jsonl").exists() and max(read_audit(run).effective, default=0) >= step

    def seen():
        trained = max(read_audit(run).effective, default=0) if (run / "logs" / "batches.jsonl").exists() else 0
        return f"trained up to step {trained}; {states(job)}"

    wait_for(reached, timeout, f"step {step}", seen=seen)


@pytest.mark.parametrize("how", ["scontrol requeue", "stop warning (SIGUSR2)"])
def test_a_requeued_job_resumes_and_trains_each_trajectory_once(tiny_model_dir, tmp_path, submit, how):
    total = 40  # steps: the stop at step 5 lands well before the end (~0.2 s a step)
    job = submit(*submit_args(tiny_model_dir, tmp_path, f"rl.total_train_steps={total}", "saver.freq_steps=1000"))
    run = run_folder(tmp_path)
    wait_for_step(run, 5, job)
    if how == "scontrol requeue":
        subprocess.run(["scontrol", "requeue", job], check=True)  # SIGTERM to every task, then requeue
    else:
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # what --signal=USR2@lead sends
    ended = wait_for_end(job, 300, components=2)
    assert {state for state, _, _ in ended.values()} == {"COMPLETED"}, ended
    audit = assert_each_trajectory_trained_once(run, total)
    assert len(audit.resumed_from) == 1 and 5 <= audit.resumed_from[0] < total  # saved when stopped, not at a period
    assert audit.trained_after_resume
    assert (run / "logs" / "trainer-0.restart1.log").exists() and (run / "logs" / "rollout-0.restart1.log").exists()
    assert "stop signal: checkpoint of step" in (run / "logs" / "trainer-0.restart0.log").read_text()
    assert [p.name for p in (run / "name_resolve" / "job").iterdir()] == [f"{job}.1"]  # the killed one's forgotten


def test_a_rollout_server_that_dies_fails_the_job_within_30_s_with_the_reason(tiny_model_dir, tmp_path, submit):
    job = submit(*submit_args(tiny_model_dir, tmp_path, "rl.total_train_steps=400"))
    run = run_folder(tmp_path)
    wait_for_step(run, 2, job)
    server = wait_for(lambda: processes_of(run, "serve"), 30, "the rollout server process")
    os.kill(server[0], signal.SIGKILL)
    killed = time.time()
    ended = wait_for_end(job, 120, components=2)
    took = ended_at(job) - killed  # by Slurm's own end time: sacct's lag on a loaded machine is not the job's
    assert took < 30, f"the job took {took:.0f} s to end"
    assert "FAILED" in {state for state, _, _ in ended.values()}, ended
    reason = "rollout server 0 exited with code -9 on rollout1"
    assert reason in (run / "logs" / "failures.log").read_text()
    assert reason in (run / "logs" / "trainer-0.restart0.log").read_text()
    comment = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "Comment"], capture_output=True, text=True)
    assert reason in comment.stdout


def test_dry_run_prints_the_script_and_sbatch_test_only_accepts_it(tiny_model_dir, tmp_path):
    result = run_cli(*submit_args(tiny_model_dir, tmp_path), "--dry-run", cwd=Path("/tmp"))
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert script.count("#SBATCH hetjob") == 1 and "#SBATCH --partition=train" in script
    assert "#SBATCH --partition=rollout" in script and "--het-group=0-1" in script and "--kill-on-bad-exit=1" in script
    assert "#SBATCH --signal=USR2@30" in script and "#SBATCH --requeue" in script
    assert "sbatch --test-only: sbatch: Job" in result.stderr
    assert not (tmp_path / "quickstart").exists()  # a dry run writes nothing


@pytest.mark.parametrize(
    "extra, message",
    [
        (["slurm.trainer.partition=gpu-h100"], "trainer partition 'gpu-h100' does not exist"),
        (["slurm.rollout.gpus_per_server=3"], "3 gpu per node asked of partition 'rollout', whose nodes have 2"),
        (["slurm.trainer.nodes=2", "rl.trainer_processes=2"], "2 nodes asked of partition 'train' in all, which has 1"),
        (
            ["rl.trainer_processes=3", "slurm.trainer.nodes=2"],
            "rl.trainer_processes=3 does not divide over slurm.trainer.nodes=2",
        ),
        (["rl.trainer_processes=3", "slurm.trainer.gpus_per_node=2"], "one accelerator per rank"),
        (["slurm.trainer.cpus_per_task=3"], "1 tasks x 3 CPUs per node asked of partition 'train', whose nodes have 2"),
        (["slurm.time=forever"], "slurm.time: 'forever' is not a Slurm time limit"),
        (["slurm.partition=train"], "unknown config key 'slurm.partition'"),
        (["distill.teacher_url=http://127.0.0.1:9", "actor.adv_estimator=ppo"], "needs a sequence advantage estimator"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_submitted(tiny_model_dir, tmp_path, extra, message):
    result = run_cli(
        *submit_args(tiny_model_dir, tmp_path, *extra, f"experiment.trial={tmp_path.name}"), cwd=Path("/tmp")
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    queued = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout.split()
    assert f"areal-quickstart-{tmp_path.name}" not in queued
    assert not (tmp_path / "quickstart").exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda plan: plan["pools"].pop("rollout"), "names no pool of the plan's cluster"),
        (lambda plan: plan["train"][0].update(dp=3), "dp3 x tp1 x pp1 = 3"),
        (lambda plan: plan["rollout"][0].update(replicas=5), "pool 'rollout' has 2 devices but the plan uses 5"),
        (lambda plan: plan["pools"]["train"].update(partition="h100"), "partition 'h100' does not exist"),
    ],
)
def test_a_plan_that_does_not_fit_is_one_line(tiny_model_dir, tmp_path, edit, message):
    plan = tmp_path / "plan.yaml"
    assert (
        run_cli(
            "plan", "--cluster", "slurm/dev/cluster.yaml", "--model", "r1-distill-qwen-1.5b", "--out", str(plan)
        ).returncode
        == 0
    )
    content = yaml.safe_load(plan.read_text())
    edit(content)
    plan.write_text(yaml.safe_dump(content))
    result = run_cli(*submit_args(tiny_model_dir, tmp_path), "--plan", str(plan), "--dry-run", cwd=Path("/tmp"))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script", ["areal-hetjob.sbatch", "areal-node.sbatch"])
def test_the_plain_sbatch_scripts_run_a_tiny_run(tiny_model_dir, tmp_path, script):
    """What a user who copies slurm/*.sbatch does: sbatch it with a config and overrides."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    overrides = [
        f"model.path={tiny_model_dir}",
        f"cluster.fileroot={tmp_path}",
        "cluster.device=cpu",
        *SMALL_RUN,
        "rl.eval_every_steps=0",
        "rl.total_train_steps=3",
    ]
    queued = subprocess.run(
        ["sbatch", str(REPO / "slurm" / script), CONFIG, *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job = queued.stdout.split()[-1]
    try:
        ended = wait_for_end(job, 240, components=2 if script == "areal-hetjob.sbatch" else 1)
    finally:
        cancel(job)
    output = (tmp_path / f"areal-{job}.out").read_text()
    assert {state for state, _, _ in ended.values()} == {"COMPLETED"}, (ended, output[-3000:])
    run = run_folder(tmp_path)
    assert [r["step"] for r in metrics(run) if "rollout/reward" in r] == [1, 2, 3]
    if script == "areal-hetjob.sbatch":
        assert (run / "logs" / "trainer-0.restart0.log").exists() and (run / "logs" / "rollout-0.restart0.log").exists()


def placed_tasks(components, groups):
    """Each task's role as the job's tasks would see it: Slurm places a component's tasks on its nodes in
    blocks of ``tasks_per_node`` (the last may hold fewer), components after one another."""
    from areal_hpc.runtime.bootstrap import Placement, task_role

    world, placed, rank = sum(c.tasks for c in components), [], 0
    for index, c in enumerate(components):
        for local in range(c.tasks):
            node = f"c{index}n{local // c.tasks_per_node}"
            placed.append((c, node, task_role(Placement(rank, world, local % c.tasks_per_node, node, "slurm"), groups)))
            rank += 1
    return placed


@pytest.mark.parametrize("cluster", ["example-site", "paper-8h800-24h20", "paper-48h20"])
def test_a_plan_becomes_one_component_per_pool_and_every_task_knows_its_share(tmp_path, cluster):
    """Any plan the planner writes for the shipped clusters maps onto components: one per pool, holding
    exactly that pool's share of the plan (a pool may both train and serve: example-site's A100s do) on
    its own nodes, also when a pool's tasks do not fill its nodes evenly; and the task groups give every
    task its role and accelerators, disjoint on each node and within the component's request."""
    from areal_hpc.config import load_config
    from areal_hpc.launch.hetjob import HetJobExecutor, JobSpec
    from areal_hpc.launch.slurm_task import task_groups
    from areal_hpc.launch.submit import components_from_plan
    from areal_hpc.layout import MixedLayout

    plan = tmp_path / "plan.yaml"
    made = run_cli("plan", "--cluster", cluster, "--model", "r1-distill-qwen-1.5b", "--out", str(plan))
    assert made.returncode == 0, made.stderr
    content = yaml.safe_load(plan.read_text())
    components, overrides = components_from_plan(content, load_config(None))
    for name, pool in content["pools"].items():
        trainers = sum(g["devices"] for g in content["train"] if g["pool"] == name)
        servers = sum(g["replicas"] for g in content["rollout"] if g["pool"] == name)
        mine = [c for c in components if c.partition == pool["partition"]]
        assert sum(c.tasks for c in mine) == trainers + servers and sum(c.nodes for c in mine) <= pool["nodes"]
        for c in mine:
            assert c.gpus_per_node <= pool["per_node"] and (c.nodes - 1) * c.tasks_per_node < c.tasks
    roles = [c.role for c in components]
    assert roles == sorted(roles, key=["trainer", "trainer+rollout", "rollout"].index)
    cfg = load_config(None, overrides)
    placed = placed_tasks(components, task_groups(cfg))
    assert [t.index for _, _, t in placed if t.role == "trainer"] == list(range(cfg.rl.trainer_processes))
    assert sorted(t.index for _, _, t in placed if t.role == "rollout") == list(range(cfg.rollout.n_servers))
    servers = sorted((t.accelerators, t.tp) for _, _, t in placed if t.role == "rollout")
    assert servers == sorted((g["tp"] * g["pp"], g["tp"]) for g in content["rollout"] for _ in range(g["replicas"]))
    for node in {n for _, n, _ in placed}:
        on_node = [(c, t) for c, n, t in placed if n == node]
        taken = [a for _, t in on_node for a in range(t.first_accelerator, t.first_accelerator + t.accelerators)]
        assert len(set(taken)) == len(taken) and max(taken) < on_node[0][0].gpus_per_node
    train = content["train"]  # the mesh: every replica of the plan's training groups, when they share a shape
    allocation = [o for o in overrides if o.startswith("actor.parallel.allocation=")]
    layout = MixedLayout.from_config(cfg.actor.parallel, cfg.rl.trainer_processes)
    if len({(g["tp"], g["pp"]) for g in train}) == 1:
        assert allocation == [
            f"actor.parallel.allocation=megatron:d{sum(g['dp'] for g in train)}p{train[0]['pp']}t{train[0]['tp']}"
        ]
    else:  # each group its own mesh
        assert allocation == [] and sorted(g.shape for g in layout.groups) == sorted(
            (g["pp"], g["dp"], 1, g["tp"]) for g in train
        )
    assert layout.replicas == sum(g["dp"] for g in train)
    script = HetJobExecutor(tmp_path / "submitit", JobSpec("x", "01:00:00"), components, 1)._make_submission_file_text(
        "true", "test"
    )
    assert script.count("#SBATCH hetjob") == len(components) - 1
    for c in components:
        assert (f"--ntasks={c.tasks}" in script) == (c.tasks != c.nodes * c.tasks_per_node)


def test_rollout_groups_of_different_sizes_and_two_pools_that_train_and_serve():
    """What the planner may write for larger models: servers of tp 1, 2 and 4 in one run, and two pools
    that each train and serve; every node's tasks get disjoint accelerators within its request, and each
    replica's share of a batch follows its devices' planned speed."""
    from areal_hpc.config import load_config
    from areal_hpc.launch.slurm_task import task_groups
    from areal_hpc.launch.submit import components_from_plan

    plan = {
        "pools": {
            "a": {"device": "H100", "partition": "pa", "nodes": 2, "per_node": 8},
            "b": {"device": "A100", "partition": "pb", "nodes": 3, "per_node": 8},
            "c": {"device": "H20", "partition": "pc", "nodes": 2, "per_node": 8},
        },
        "train": [
            {"pool": "a", "devices": 6, "dp": 3, "tp": 2, "pp": 1, "tokens_per_s": 6000.0},
            {"pool": "b", "devices": 4, "dp": 2, "tp": 2, "pp": 1, "tokens_per_s": 1000.0},
        ],
        "rollout": [
            {"pool": "a", "replicas": 5, "devices": 10, "tp": 2, "pp": 1},
            {"pool": "b", "replicas": 4, "devices": 4, "tp": 1, "pp": 1},
            {"pool": "b", "replicas": 3, "devices": 12, "tp": 4, "pp": 1},
            {"pool": "c", "replicas": 4, "devices": 16, "tp": 4, "pp": 1},
        ],
    }
    components, overrides = components_from_plan(plan, load_config(None))
    # No even spread fits pa or pb: nodes filled in turn. pa: 6 trainers + 1 server, then 4 servers of 2
    # (one component, at most 7 per node); pb: 4 trainers + 4 servers of 1, then servers of 4, two a node.
    assert [(c.role, c.partition, c.nodes, c.tasks_per_node, c.tasks, c.gpus_per_node) for c in components] == [
        ("trainer+rollout", "pa", 2, 7, 11, 8),
        ("trainer+rollout", "pb", 1, 8, 8, 8),
        ("rollout", "pb", 2, 2, 3, 8),
        ("rollout", "pc", 2, 2, 4, 8),
    ]
    assert (
        "slurm.task_groups=[[trainer,6,1,1],[rollout,5,2,2],[trainer,4,1,1],[rollout,4,1,1],[rollout,3,4,4],"
        "[rollout,4,4,4]]" in overrides
    )
    assert "actor.parallel.allocation=megatron:d5p1t2" in overrides
    assert "actor.parallel.dp_weights=[0.2857,0.2857,0.2857,0.07143,0.07143]" in overrides  # 1000 vs 250 per device
    placed = placed_tasks(components, task_groups(load_config(None, overrides)))
    assert [t.index for _, _, t in placed if t.role == "trainer"] == list(range(10))
    for node in {n for _, n, _ in placed}:
        on_node = [(c, t) for c, n, t in placed if n == node]
        taken = [a for _, t in on_node for a in range(t.first_accelerator, t.first_accelerator + t.accelerators)]
        assert len(set(taken)) == len(taken) and max(taken) < on_node[0][0].gpus_per_node <= 8


def test_training_groups_of_different_shapes_become_groups_sharing_batches_by_replica_speed():
    """Pool a trains at dp2 x tp2 (1000 tokens/s a device), pool b at dp2 x tp1 (500): each group its own
    mesh, replicas numbered group by group, a tp2 replica of a worth two of its devices."""
    from areal_hpc.config import load_config
    from areal_hpc.launch.submit import components_from_plan
    from areal_hpc.layout import MixedLayout

    plan = {
        "pools": {
            "a": {"device": "H100", "partition": "pa", "nodes": 1, "per_node": 8},
            "b": {"device": "A100", "partition": "pb", "nodes": 1, "per_node": 8},
        },
        "train": [
            {"pool": "b", "devices": 2, "dp": 2, "tp": 1, "pp": 1, "tokens_per_s": 1000.0},
            {"pool": "a", "devices": 4, "dp": 2, "tp": 2, "pp": 1, "tokens_per_s": 4000.0},
        ],
        "rollout": [{"pool": "b", "replicas": 2, "devices": 2, "tp": 1, "pp": 1}],
    }
    _, overrides = components_from_plan(plan, load_config(None))
    assert "actor.parallel.groups=[[2,2,1],[2,1,1]]" in overrides  # pool a only trains: its ranks come first
    assert "actor.parallel.dp_weights=[0.4,0.4,0.1,0.1]" in overrides
    cfg = load_config(None, overrides)
    layout = MixedLayout.from_config(cfg.actor.parallel, cfg.rl.trainer_processes)
    assert [layout.replica(rank) for rank in range(6)] == [0, 0, 1, 1, 2, 3]


def test_groups_that_do_not_fill_their_nodes_are_spread_with_a_per_node_cap(tmp_path):
    from areal_hpc.config import load_config
    from areal_hpc.launch.hetjob import HetJobExecutor, JobSpec
    from areal_hpc.launch.submit import components_from_plan

    plan = {
        "pools": {
            "a": {"device": "H100", "partition": "pa", "nodes": 2, "per_node": 8},
            "b": {"device": "H20", "partition": "pb", "nodes": 4, "per_node": 8},
        },
        "train": [{"pool": "a", "devices": 11, "dp": 11, "tp": 1, "pp": 1}],
        "rollout": [{"pool": "b", "replicas": 27, "devices": 27, "tp": 1, "pp": 1}],
    }
    components, _ = components_from_plan(plan, load_config(None))
    assert [(c.partition, c.tasks, c.nodes, c.tasks_per_node) for c in components] == [
        ("pa", 11, 2, 6),
        ("pb", 27, 4, 7),
    ]
    script = HetJobExecutor(tmp_path / "submitit", JobSpec("x", "01:00:00"), components, 1)._make_submission_file_text(
        "true", "test"
    )
    assert (
        "#SBATCH --ntasks=11" in script and "#SBATCH --ntasks=27" in script and "#SBATCH --ntasks-per-node=7" in script
    )
