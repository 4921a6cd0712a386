"""``areal-hpc submit``: one run as one heterogeneous Slurm job, from the login node.

    areal-hpc submit --config configs/quickstart.yaml [--profile slurm/profiles/dev.yaml]
                     [--plan plan.yaml] [--dry-run] [key=value ...]

Components: the trainer ranks (``slurm.trainer``), then the rollout servers (``slurm.rollout``); or,
with ``--plan`` (``areal-hpc plan --out``), one component per pool of the plan on the pool's partition
(named in the cluster YAML), holding the planner's groups there: trainer ranks, servers of any
tensor-parallel size, or both. The plan fixes ``rl.trainer_processes``, ``rollout.n_servers``, each
task's role, accelerators and tensor-parallel size (``slurm.task_groups``) and the trainer mesh
(``actor.parallel.allocation``, when every training group has one tp x pp shape; groups of different
shapes train as data parallel over all their ranks). Everything is checked before anything is
submitted: config keys, the plan's arithmetic, and each component against the live cluster
(partition exists, enough nodes, accelerators and cores per node). The resolved config is written
into the run folder with absolute paths, so the job does not depend on the folder it was submitted
from; submitit's files go to ``<run>/submitit/`` and each role's log to ``<run>/logs/``. ``--dry-run`` prints the job
script and has
``sbatch --test-only`` check it, submitting nothing.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from submitit.helpers import DelayedSubmission

from areal_hpc.config import RunConfig, absolute_path_overrides, load_config, to_yaml
from areal_hpc.errors import UserError, closest
from areal_hpc.fsio import atomic_write_text
from areal_hpc.launch.hetjob import Component, HetJobExecutor, JobSpec
from areal_hpc.launch.local import should_resume
from areal_hpc.launch.slurm_task import run_task, task_groups
from areal_hpc.layout import MixedLayout, ParallelDims
from areal_hpc.resolve import resolve
from areal_hpc.runtime.bootstrap import LAUNCHED_AT, RoleTasks
from areal_hpc.train.task_setup import check_inputs


@dataclass(frozen=True)
class Partition:
    """What one partition of the live cluster offers per node (the smallest node of it)."""

    name: str
    nodes: int
    cpus: int
    gres: dict[str, int]


def components_from_config(cfg: RunConfig) -> list[Component]:
    trainer, rollout, servers = cfg.slurm.trainer, cfg.slurm.rollout, cfg.rollout.n_servers
    if cfg.rl.trainer_processes % trainer.nodes:
        raise UserError(
            f"rl.trainer_processes={cfg.rl.trainer_processes} does not divide over "
            f"slurm.trainer.nodes={trainer.nodes} (ranks are spread evenly over the nodes)"
        )
    per_node = cfg.rl.trainer_processes // trainer.nodes
    if trainer.gpus_per_node and trainer.gpus_per_node != per_node:
        raise UserError(
            f"slurm.trainer.gpus_per_node={trainer.gpus_per_node} but {per_node} trainer ranks per node: "
            f"one accelerator per rank (set rl.trainer_processes={trainer.gpus_per_node * trainer.nodes})"
        )
    nodes = math.ceil(servers / rollout.servers_per_node)
    if servers % nodes:
        raise UserError(
            f"rollout.n_servers={servers} does not fill {nodes} nodes of "
            f"slurm.rollout.servers_per_node={rollout.servers_per_node} evenly"
        )
    return [
        Component(
            "trainer",
            trainer.partition,
            trainer.nodes,
            per_node,
            trainer.cpus_per_task,
            trainer.gpus_per_node,
            trainer.mem,
        ),
        Component(
            "rollout",
            rollout.partition,
            nodes,
            servers // nodes,
            rollout.cpus_per_server,
            rollout.gpus_per_server * (servers // nodes),
            rollout.mem,
        ),
    ]


def components_from_plan(plan: dict, cfg: RunConfig) -> tuple[list[Component], list[str]]:
    """The plan as components, and the config overrides it implies. One component per pool (more when
    its nodes must hold different numbers of tasks; each takes nodes of its own): pools that only
    train, then pools that train and serve, then pools that only serve; within a pool its trainer
    ranks, then its servers, group by group. ``slurm.task_groups``
    records that order, so each task knows its role, its accelerators and its server's tensor-parallel
    size: rollout groups of different sizes and several pools that both train and serve run as planned."""
    pools = plan.get("pools")
    if not isinstance(pools, dict) or not plan.get("train") or not plan.get("rollout"):
        raise UserError("the plan lacks pools, train or rollout groups; write it with `areal-hpc plan --out FILE`")
    groups: dict[str, list[RoleTasks]] = {}
    device_speeds: dict[str, list[float]] = {}
    for role in ("train", "rollout"):
        for group in plan[role]:
            if group["pool"] not in pools:
                raise UserError(
                    f"plan group on pool '{group['pool']}' names no pool of the plan's cluster "
                    f"(pools: {', '.join(pools)})"
                )
            if role == "train" and group["dp"] * group["tp"] * group["pp"] != group["devices"]:
                raise UserError(
                    f"plan: training on '{group['pool']}' uses {group['devices']} devices but "
                    f"dp{group['dp']} x tp{group['tp']} x pp{group['pp']} = "
                    f"{group['dp'] * group['tp'] * group['pp']}"
                )
            task = (
                RoleTasks("trainer", group["devices"], 1)
                if role == "train"
                else RoleTasks("rollout", group["replicas"], group["tp"] * group["pp"], group["tp"])
            )
            groups.setdefault(group["pool"], []).append(task)
            if role == "train":  # each device's planned training speed, for the batch split
                device_speeds.setdefault(group["pool"], []).extend(
                    [group.get("tokens_per_s", 1.0) / group["devices"]] * group["devices"]
                )
    for name, tasks in groups.items():
        pool, used = pools[name], sum(g.tasks * g.accelerators for g in tasks)
        if used > pool["nodes"] * pool["per_node"]:
            raise UserError(
                f"plan: pool '{name}' has {pool['nodes'] * pool['per_node']} devices but the plan uses {used}"
            )

    def serves_only_then_trains(name: str) -> tuple[bool, bool]:
        roles = {g.role for g in groups[name]}
        return "trainer" not in roles, "rollout" in roles

    order = sorted(groups, key=serves_only_then_trains)  # train, both, serve
    components = [c for name in order for c in _pool_components(name, pools[name], groups[name], cfg)]
    in_rank_order = [g for name in order for g in groups[name]]
    overrides = [
        f"rl.trainer_processes={sum(g.tasks for g in in_rank_order if g.role == 'trainer')}",
        f"rollout.n_servers={sum(g.tasks for g in in_rank_order if g.role == 'rollout')}",
        "slurm.task_groups=[" + ",".join(f"[{g.role},{g.tasks},{g.accelerators},{g.tp}]" for g in in_rank_order) + "]",
    ]
    train = [g for name in order for g in plan["train"] if g["pool"] == name]  # in rank order
    if len({(g["tp"], g["pp"]) for g in train}) == 1:  # one trainer mesh holds replicas of one shape
        dims = ParallelDims(dp=sum(g["dp"] for g in train), tp=train[0]["tp"], pp=train[0]["pp"])
        layout = MixedLayout((dims,))
        overrides.append(f"actor.parallel.allocation=megatron:d{dims.dp}p{dims.pp}t{dims.tp}")
    else:  # each group its own mesh
        layout = MixedLayout(tuple(ParallelDims(dp=g["dp"], tp=g["tp"], pp=g["pp"]) for g in train))
        overrides.append("actor.parallel.groups=[" + ",".join(f"[{g['dp']},{g['tp']},{g['pp']}]" for g in train) + "]")
    weights = replica_weights(layout, [speed for name in order for speed in device_speeds.get(name, [])])
    if len(set(weights)) > 1:
        overrides.append("actor.parallel.dp_weights=[" + ",".join(f"{w:.4g}" for w in weights) + "]")
    return components, overrides


def replica_weights(layout: MixedLayout, device_speeds: list[float]) -> list[float]:
    """Each data-parallel replica's share of a batch (over every training group): the planned speed of
    its slowest device (trainer ranks in rank order) times its devices (a tp2 replica of one group
    against a tp1 replica of another), normalised to sum to 1."""
    slowest: dict[int, float] = {}
    devices = [0] * layout.replicas
    for rank, speed in enumerate(device_speeds):
        replica = layout.replica(rank)
        slowest[replica] = min(speed, slowest.get(replica, speed))
        devices[replica] += 1
    speeds = [slowest[replica] * devices[replica] for replica in range(layout.replicas)]
    return [speed / sum(speeds) for speed in speeds]


def _pool_components(name: str, pool: dict, groups: list[RoleTasks], cfg: RunConfig) -> list[Component]:
    """One pool's tasks (in rank order) on its nodes: one component spread evenly over the fewest nodes
    that hold it (the last node may hold fewer); when no even spread fits (mixed accelerator counts
    that fill the nodes exactly), nodes filled in turn, one component per run of nodes holding as many
    tasks. Slurm places a component's consecutive tasks on a node."""
    per_rank = [g for g in groups for _ in range(g.tasks)]

    def load(block: list[RoleTasks]) -> int:
        return sum(g.accelerators for g in block)

    for nodes in range(1, pool["nodes"] + 1):
        per_node = math.ceil(len(per_rank) / nodes)
        blocks = [per_rank[i : i + per_node] for i in range(0, len(per_rank), per_node)]
        if max(map(load, blocks)) <= pool["per_node"]:
            return [_component(pool, blocks, cfg)]
    blocks = [[]]
    for task in per_rank:
        if blocks[-1] and load(blocks[-1]) + task.accelerators > pool["per_node"]:
            blocks.append([])
        blocks[-1].append(task)
    if len(blocks) > pool["nodes"] or max(map(load, blocks)) > pool["per_node"]:
        asked = ", ".join(f"{g.tasks} {g.role} x {g.accelerators}" for g in groups)
        raise UserError(
            f"plan: pool '{name}' cannot place its tasks ({asked} accelerators) on {pool['nodes']} "
            f"nodes of {pool['per_node']} accelerators"
        )
    runs: list[list[list[RoleTasks]]] = []
    for i, block in enumerate(blocks):  # a node joins the run before it when as full (the last: or less full)
        if runs and (len(block) == len(runs[-1][0]) or (i == len(blocks) - 1 and len(block) < len(runs[-1][0]))):
            runs[-1].append(block)
        else:
            runs.append([block])
    return [_component(pool, run, cfg) for run in runs]


def _component(pool: dict, blocks: list[list[RoleTasks]], cfg: RunConfig) -> Component:
    """The component of consecutive nodes holding ``blocks``, each node's tasks."""
    roles = {task.role for block in blocks for task in block}
    trainer, rollout = cfg.slurm.trainer, cfg.slurm.rollout
    role = "trainer+rollout" if len(roles) == 2 else roles.pop()
    cpus = max(trainer.cpus_per_task if "trainer" in role else 0, rollout.cpus_per_server if "rollout" in role else 0)
    return Component(
        role,
        pool["partition"],
        len(blocks),
        len(blocks[0]),
        cpus,
        max(sum(task.accelerators for task in block) for block in blocks),
        trainer.mem if "trainer" in role else rollout.mem,
        sum(map(len, blocks)),
    )


def read_partitions() -> dict[str, Partition]:
    """Partitions of the live cluster (``sinfo``): node count, and the smallest node's cores and GRES."""
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--format=%N|%R|%c|%G"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except FileNotFoundError:
        raise UserError(
            "sinfo not found: submit from a Slurm login node (or start the dev cluster: bash slurm/dev/up.sh)"
        ) from None
    except subprocess.CalledProcessError as exc:
        raise UserError(f"sinfo failed: {exc.stderr.strip() or exc.returncode}") from None
    nodes: dict[str, dict[str, tuple[int, dict]]] = {}
    for line in out.splitlines():
        node, partition, cpus, gres = line.split("|")
        nodes.setdefault(partition, {})[node] = (int(cpus), _parse_gres(gres))
    return {
        name: Partition(
            name,
            len(found),
            min(c for c, _ in found.values()),
            {k: min(g.get(k, 0) for _, g in found.values()) for _, g in found.values() for k in g},
        )
        for name, found in nodes.items()
    }


def _parse_gres(text: str) -> dict[str, int]:
    """``gpu:2,npu:a910:8(S:0-1)`` -> {"gpu": 2, "npu": 8}."""
    counts = {}
    for item in text.split(","):
        fields = item.split("(")[0].split(":")
        if len(fields) >= 2 and fields[-1].isdigit():
            counts[fields[0]] = counts.get(fields[0], 0) + int(fields[-1])
    return counts


def check_components(components: list[Component], partitions: dict[str, Partition], gres: str) -> None:
    nodes_asked: dict[str, int] = {}
    for c in components:
        found = partitions.get(c.partition)
        if found is None:
            raise UserError(
                f"{c.role} partition '{c.partition}' does not exist{closest(c.partition, partitions)} "
                f"(partitions: {', '.join(sorted(partitions))})"
            )
        nodes_asked[c.partition] = nodes_asked.get(c.partition, 0) + c.nodes
        if nodes_asked[c.partition] > found.nodes:  # Slurm places each component of a het job on its own nodes
            raise UserError(
                f"{c.role}: {nodes_asked[c.partition]} nodes asked of partition '{c.partition}' in all, "
                f"which has {found.nodes} (each component of a heterogeneous job takes whole nodes "
                f"of its own)"
            )
        if c.tasks_per_node * c.cpus_per_task > found.cpus:
            raise UserError(
                f"{c.role}: {c.tasks_per_node} tasks x {c.cpus_per_task} CPUs per node asked of partition "
                f"'{c.partition}', whose nodes have {found.cpus}"
            )
        if c.gpus_per_node > found.gres.get(gres, 0):
            raise UserError(
                f"{c.role}: {c.gpus_per_node} {gres} per node asked of partition '{c.partition}', whose "
                f"nodes have {found.gres.get(gres, 0)}"
            )


@dataclass
class Submission:
    executor: HetJobExecutor
    config: Path  # the resolved config the job's tasks load
    cfg: RunConfig


def prepare(
    config: str, overrides: list[str], profile: str | None, plan_file: str | None, resume: str = "never"
) -> Submission:
    """Everything a submission needs, checked; nothing written or submitted yet. ``resume`` as for
    ``areal-hpc train`` (the job itself always resumes what its earlier incarnations wrote)."""
    files = [profile, config] if profile else [config]
    cfg = load_config(files, overrides)
    plan_overrides = []
    if plan_file:
        components, plan_overrides = components_from_plan(_read_plan(plan_file), cfg)
        cfg = load_config(files, [*overrides, *plan_overrides])
    else:
        components = components_from_config(cfg)
    cfg = load_config(files, [*overrides, *plan_overrides, *absolute_path_overrides(cfg)])  # tasks start elsewhere
    cfg = resolve(cfg, None).cfg  # on the login node: what a node shows (cluster.device=auto) each task decides
    task_groups(cfg)  # the tasks' roles add up
    check_inputs(cfg, reach=False)  # the job's nodes reach the teacher, maybe not this login node
    check_components(components, read_partitions(), cfg.slurm.gres)
    should_resume(cfg, resume)
    run_dir = cfg.run_dir
    s = cfg.slurm
    job = JobSpec(
        name=f"areal-{cfg.experiment.name}-{cfg.experiment.trial}",
        time=s.time,
        account=s.account,
        qos=s.qos,
        gres=s.gres,
        signal_lead_s=s.signal_lead_s,
        mpi=s.mpi,
        extra_sbatch=tuple(s.extra_sbatch),
    )
    return Submission(
        HetJobExecutor(run_dir / "submitit", job, components, s.max_requeues), run_dir / "job" / "config.yaml", cfg
    )


def _read_plan(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"plan file not found: {path} (write one with `areal-hpc plan --out FILE`)")
    plan = yaml.safe_load(file.read_text())
    if not isinstance(plan, dict):
        raise UserError(f"plan file {path} is not a plan (write one with `areal-hpc plan --out FILE`)")
    return plan


def script(submission: Submission) -> str:
    return submission.executor._make_submission_file_text(submission.executor._submitit_command_str, "dry-run")


def test_only(text: str) -> str:
    """``sbatch --test-only`` on the script: Slurm's own check, nothing queued."""
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch") as file:
        file.write(text)
        file.flush()
        result = subprocess.run(["sbatch", "--test-only", file.name], capture_output=True, text=True, timeout=60)
    if result.returncode:
        raise UserError(f"sbatch --test-only rejected the job: {result.stderr.strip()}")
    return result.stderr.strip()


class RunTasks:
    """The callable submitit runs on every task of the job (pickled): ``run_task`` with the resolved
    config. ``checkpoint`` (submitit calls it on SIGUSR2) resubmits the same call: the next incarnation
    resumes from the checkpoint the trainer just wrote."""

    def __init__(self, config: Path):
        self.config = str(config)

    def __call__(self) -> int:
        code = run_task(self.config, [])
        if code:  # stopped for a requeue: no result file, so submitit does not report the job as done
            raise SystemExit(code)
        return code

    def checkpoint(self) -> DelayedSubmission:
        return DelayedSubmission(self)


def describe(submission: Submission, job_id: str) -> str:
    """What was submitted and where to look, for the terminal."""
    cfg, executor = submission.cfg, submission.executor
    rows = [
        f"  component {i}: {c.role:<8} partition {c.partition}, {c.tasks} task(s) on {c.nodes} node(s), "
        f"{c.cpus_per_task} CPU(s)/task" + (f", {cfg.slurm.gres}:{c.gpus_per_node}/node" if c.gpus_per_node else "")
        for i, c in enumerate(executor.components)
    ]
    logs = cfg.run_dir / "logs"
    return "\n".join(
        [
            f"submitted job {job_id}: {cfg.experiment.name}/{cfg.experiment.trial}",
            *rows,
            f"  run folder: {cfg.run_dir}",
            f"  progress:   tail -f {logs}/trainer-0.restart0.log",
            f"  state:      squeue -j {job_id}; sacct -j {job_id}",
        ]
    )


def submit(submission: Submission):
    """Write the resolved config the tasks load, queue the job; returns submitit's job handle."""
    submission.config.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(submission.config, to_yaml(submission.cfg))
    os.environ[LAUNCHED_AT] = str(time.time())  # sbatch passes it on: the run reports its start against it
    return submission.executor.submit(RunTasks(submission.config))
