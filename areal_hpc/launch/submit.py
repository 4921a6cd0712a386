"""``areal-hpc submit``: one run as one heterogeneous Slurm job, from the login node.

    areal-hpc submit --config configs/quickstart.yaml [--profile slurm/profiles/dev.yaml]
                     [--plan plan.yaml] [--dry-run] [key=value ...]

Components: the trainer ranks first (one component per training pool of a plan, else
``slurm.trainer``), then the rollout servers (one component per rollout pool, else ``slurm.rollout``).
``--plan`` takes ``areal-hpc plan --out``: each pool's partition (named in the cluster YAML) receives
the planner's groups, and the plan fixes ``rl.trainer_processes``, the trainer mesh
(``actor.parallel.allocation``, when every training group has one tp x pp shape; groups of different
shapes train as data parallel over all their ranks), ``rollout.n_servers`` and the accelerators per task. Everything is checked before anything is submitted: config keys, the plan's
arithmetic, and each component against the live cluster (partition exists, enough nodes, accelerators
and cores per node). The resolved config is written into the run folder with absolute paths, so the
job does not depend on the folder it was submitted from; submitit's files go to ``<run>/submitit/``
and each role's log to ``<run>/logs/``. ``--dry-run`` prints the job script and has
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
from areal_hpc.launch.slurm_task import run_task
from areal_hpc.parallel.dims import ParallelDims
from areal_hpc.runtime.bootstrap import LAUNCHED_AT
from areal_hpc.train.task_setup import check_task


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
        raise UserError(f"rl.trainer_processes={cfg.rl.trainer_processes} does not divide over "
                        f"slurm.trainer.nodes={trainer.nodes} (ranks are spread evenly over the nodes)")
    per_node = cfg.rl.trainer_processes // trainer.nodes
    if trainer.gpus_per_node and trainer.gpus_per_node != per_node:
        raise UserError(f"slurm.trainer.gpus_per_node={trainer.gpus_per_node} but {per_node} trainer ranks per node: "
                        f"one accelerator per rank (set rl.trainer_processes={trainer.gpus_per_node * trainer.nodes})")
    nodes = math.ceil(servers / rollout.servers_per_node)
    if servers % nodes:
        raise UserError(f"rollout.n_servers={servers} does not fill {nodes} nodes of "
                        f"slurm.rollout.servers_per_node={rollout.servers_per_node} evenly")
    return [Component("trainer", trainer.partition, trainer.nodes, per_node, trainer.cpus_per_task,
                      trainer.gpus_per_node, trainer.mem),
            Component("rollout", rollout.partition, nodes, servers // nodes, rollout.cpus_per_server,
                      rollout.gpus_per_server * (servers // nodes), rollout.mem)]


def components_from_plan(plan: dict, cfg: RunConfig) -> tuple[list[Component], list[str]]:
    """The plan as components, and the config overrides it implies. One component per pool, in the
    order that keeps every trainer rank before every server (roles follow global ranks): pools that only
    train, then the one pool that may both train and serve (its trainer tasks first), then pools that
    only serve. Groups of one pool share its component: each component takes nodes of its own."""
    pools = plan.get("pools")
    if not isinstance(pools, dict) or not plan.get("train") or not plan.get("rollout"):
        raise UserError("the plan lacks pools, train or rollout groups; write it with `areal-hpc plan --out FILE`")
    shapes = {(g["tp"], g["pp"]) for g in plan["rollout"]}
    if len(shapes) > 1:
        raise UserError("plan: rollout groups of different tensor/pipeline sizes in one run are not supported yet")
    per_server = math.prod(shapes.pop())
    train_shapes = {(g["tp"], g["pp"]) for g in plan["train"]}
    tasks: dict[str, list[int]] = {}  # pool -> [trainer ranks, servers]
    for role, slot in (("train", 0), ("rollout", 1)):
        for group in plan[role]:
            if group["pool"] not in pools:
                raise UserError(f"plan group on pool '{group['pool']}' names no pool of the plan's cluster "
                                f"(pools: {', '.join(pools)})")
            if role == "train" and group["dp"] * group["tp"] * group["pp"] != group["devices"]:
                raise UserError(f"plan: training on '{group['pool']}' uses {group['devices']} devices but "
                                f"dp{group['dp']} x tp{group['tp']} x pp{group['pp']} = "
                                f"{group['dp'] * group['tp'] * group['pp']}")
            tasks.setdefault(group["pool"], [0, 0])[slot] += group["devices"] if role == "train" else group["replicas"]
    for name, (trainers, servers) in tasks.items():
        pool, used = pools[name], trainers + servers * per_server
        if used > pool["nodes"] * pool["per_node"]:
            raise UserError(f"plan: pool '{name}' has {pool['nodes'] * pool['per_node']} devices but the plan uses {used}")
    mixed = [name for name, (trainers, servers) in tasks.items() if trainers and servers]
    if len(mixed) > 1 or (mixed and per_server > 1):
        raise UserError(f"plan: pools {', '.join(mixed)} both train and serve rollouts; one job keeps its trainer "
                        f"ranks first in at most one such pool, with one accelerator per server")
    order = sorted(tasks, key=lambda name: (not tasks[name][0], bool(tasks[name][1])))  # train, both, serve
    components = [_pool_component(pools[name], *tasks[name], per_server, cfg) for name in order]
    servers = plan["rollout"]
    overrides = [f"rl.trainer_processes={sum(t for t, _ in tasks.values())}",
                 f"rollout.n_servers={sum(s for _, s in tasks.values())}", f"rollout.tp_size={servers[0]['tp']}",
                 f"slurm.rollout.gpus_per_server={per_server}", f"slurm.trainer.gpus_per_node={components[0].gpus_per_node}"]
    if len(train_shapes) == 1:  # one trainer mesh holds replicas of one shape; else data parallel over all ranks
        (tp, pp), = train_shapes
        overrides.append(f"actor.parallel.allocation=megatron:d{sum(g['dp'] for g in plan['train'])}p{pp}t{tp}")
    return components, overrides


def _pool_component(pool: dict, trainers: int, servers: int, per_server: int, cfg: RunConfig) -> Component:
    """One pool's tasks: its trainer ranks (one accelerator each), then its servers."""
    per_task = per_server if not trainers else 1
    tasks = trainers + servers
    nodes = math.ceil(tasks / max(1, pool["per_node"] // per_task))
    tasks_per_node = math.ceil(tasks / nodes)  # spread evenly; the last node may hold fewer
    trainer, rollout = cfg.slurm.trainer, cfg.slurm.rollout
    role = "trainer" if not servers else "rollout" if not trainers else "trainer+rollout"
    cpus = max(trainer.cpus_per_task if trainers else 0, rollout.cpus_per_server if servers else 0)
    return Component(role, pool["partition"], nodes, tasks_per_node, cpus, per_task * tasks_per_node,
                     trainer.mem if trainers else rollout.mem, tasks)


def read_partitions() -> dict[str, Partition]:
    """Partitions of the live cluster (``sinfo``): node count, and the smallest node's cores and GRES."""
    try:
        out = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N|%R|%c|%G"], capture_output=True,
                             text=True, check=True, timeout=30).stdout
    except FileNotFoundError:
        raise UserError("sinfo not found: submit from a Slurm login node (or start the dev cluster: "
                        "bash slurm/dev/up.sh)") from None
    except subprocess.CalledProcessError as exc:
        raise UserError(f"sinfo failed: {exc.stderr.strip() or exc.returncode}") from None
    nodes: dict[str, dict[str, tuple[int, dict]]] = {}
    for line in out.splitlines():
        node, partition, cpus, gres = line.split("|")
        nodes.setdefault(partition, {})[node] = (int(cpus), _parse_gres(gres))
    return {name: Partition(name, len(found), min(c for c, _ in found.values()),
                            {k: min(g.get(k, 0) for _, g in found.values()) for _, g in found.values() for k in g})
            for name, found in nodes.items()}


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
            raise UserError(f"{c.role} partition '{c.partition}' does not exist{closest(c.partition, partitions)} "
                            f"(partitions: {', '.join(sorted(partitions))})")
        nodes_asked[c.partition] = nodes_asked.get(c.partition, 0) + c.nodes
        if nodes_asked[c.partition] > found.nodes:  # Slurm places each component of a het job on its own nodes
            raise UserError(f"{c.role}: {nodes_asked[c.partition]} nodes asked of partition '{c.partition}' in all, "
                            f"which has {found.nodes} (each component of a heterogeneous job takes whole nodes "
                            f"of its own)")
        if c.tasks_per_node * c.cpus_per_task > found.cpus:
            raise UserError(f"{c.role}: {c.tasks_per_node} tasks x {c.cpus_per_task} CPUs per node asked of partition "
                            f"'{c.partition}', whose nodes have {found.cpus}")
        if c.gpus_per_node > found.gres.get(gres, 0):
            raise UserError(f"{c.role}: {c.gpus_per_node} {gres} per node asked of partition '{c.partition}', whose "
                            f"nodes have {found.gres.get(gres, 0)}")


@dataclass
class Submission:
    executor: HetJobExecutor
    config: Path  # the resolved config the job's tasks load
    cfg: RunConfig


def prepare(config: str, overrides: list[str], profile: str | None, plan_file: str | None,
            resume: str = "never") -> Submission:
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
    ParallelDims.from_config(cfg.actor.parallel, cfg.rl.trainer_processes)  # the trainer mesh fits its ranks
    check_task(cfg)  # your data, reward and workflow load
    check_components(components, read_partitions(), cfg.slurm.gres)
    should_resume(cfg, resume)
    run_dir = cfg.run_dir
    s = cfg.slurm
    job = JobSpec(name=f"areal-{cfg.experiment.name}-{cfg.experiment.trial}", time=s.time, account=s.account,
                  qos=s.qos, gres=s.gres, signal_lead_s=s.signal_lead_s, mpi=s.mpi, extra_sbatch=tuple(s.extra_sbatch))
    return Submission(HetJobExecutor(run_dir / "submitit", job, components, s.max_requeues),
                      run_dir / "job" / "config.yaml", cfg)


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
    rows = [f"  component {i}: {c.role:<8} partition {c.partition}, {c.tasks} task(s) on {c.nodes} node(s), "
            f"{c.cpus_per_task} CPU(s)/task" + (f", {cfg.slurm.gres}:{c.gpus_per_node}/node" if c.gpus_per_node else "")
            for i, c in enumerate(executor.components)]
    logs = cfg.run_dir / "logs"
    return "\n".join([f"submitted job {job_id}: {cfg.experiment.name}/{cfg.experiment.trial}", *rows,
                      f"  run folder: {cfg.run_dir}", f"  progress:   tail -f {logs}/trainer-0.restart0.log",
                      f"  state:      squeue -j {job_id}; sacct -j {job_id}"])


def submit(submission: Submission):
    """Write the resolved config the tasks load, queue the job; returns submitit's job handle."""
    submission.config.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(submission.config, to_yaml(submission.cfg))
    os.environ[LAUNCHED_AT] = str(time.time())  # sbatch passes it on: the run reports its start against it
    return submission.executor.submit(RunTasks(submission.config))
