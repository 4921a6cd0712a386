"""One task of a run's heterogeneous Slurm job: find its role from its place in the job, start that
role's process, and supervise it. ``areal-hpc submit`` (through submitit) and the plain sbatch scripts
in ``slurm/`` (``areal-hpc slurm-task``) both end here, on every task of the one ``srun`` step:

    global ranks [0, trainers)          trainer ranks (rank 0 prepares the model, then drives)
    global ranks [trainers, world)      rollout servers, one per task

or, for a plan (``slurm.task_groups``, written by ``submit --plan``), its groups of trainer ranks and
servers in rank order, each server with its own tensor-parallel size and accelerator count; a task's
accelerators follow those of the tasks before it on its node.

Each role's output goes to ``<run>/logs/<role>-<i>.restart<N>.log`` (N: ``SLURM_RESTART_COUNT``). The
run ends when trainer rank 0 finishes: it leaves a ``finished`` mark for this incarnation, the other
tasks see it, stop their process and exit 0. A task whose process fails writes the reason into
trainer rank 0's log and ``<run>/logs/failures.log`` and exits non-zero; ``srun --kill-on-bad-exit``
then ends the job (FAILED in ``sacct``). SIGUSR2 before the time limit makes trainer rank 0 save and
the job requeue (``preemption.py``); SIGTERM (``scontrol requeue``, ``scancel``) reaches every role,
and the trainer saves before it exits. The next incarnation resumes (``--resume=auto``). A run that
completed with failed episodes or rewards is finished too (not requeued): its summary, already in
``failures.log`` and trainer rank 0's log, becomes the job's comment, and the task exits with
``rollout.failure_budget.exit_code_on_failures``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_hpc.config import RunConfig, load_config
from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_text
from areal_hpc.launch.local import should_resume
from areal_hpc.launch.preemption import StopForwarder
from areal_hpc.launch.roles import (
    config_args,
    forget_other_incarnations,
    incarnation_folder,
    initial_model,
    prepare_start_model,
    server_command,
    start_model_path,
    trainer_command,
    wait_for_model,
)
from areal_hpc.resolve import Host, resolve
from areal_hpc.runtime.bootstrap import (
    INCARNATION,
    INTERFACE,
    LAUNCHED_AT,
    RENDEZVOUS,
    RUN_MARKER,
    TRAINERS_AT,
    Placement,
    RoleTasks,
    TaskRole,
    allocator_env,
    assigned_devices,
    cpu_threads,
    new_incarnation,
    task_role,
)
from areal_hpc.runtime.run_state import SAVED_AND_STOPPED
from areal_hpc.runtime.supervisor import SupervisedProcess
from areal_hpc.train.failure_report import last_summary

POLL_S = 1.0
COMMENT_CHARS = 200  # of a failure's first line, kept as the job's comment


def task_groups(cfg: RunConfig) -> list[RoleTasks]:
    """The job's tasks in global-rank order: ``slurm.task_groups`` (a plan's), else the trainer ranks
    (one accelerator each when ``slurm.trainer.gpus_per_node``), then the servers. ``UserError`` when
    the groups do not hold exactly the config's trainer ranks and servers."""
    if not cfg.slurm.task_groups:
        return [
            RoleTasks("trainer", cfg.rl.trainer_processes, 1 if cfg.slurm.trainer.gpus_per_node else 0),
            RoleTasks("rollout", cfg.rollout.n_servers, cfg.slurm.rollout.gpus_per_server, cfg.rollout.tp_size),
        ]
    groups = []
    for entry in cfg.slurm.task_groups:
        entry = list(entry)
        if not (
            len(entry) == 4
            and entry[0] in ("trainer", "rollout")
            and all(type(n) is int and n >= 0 for n in entry[1:])
            and entry[3] >= 1
        ):
            raise UserError(
                f"slurm.task_groups entry {entry} is not [trainer|rollout, tasks, accelerators per task, "
                f"tensor-parallel size >= 1]"
            )
        groups.append(RoleTasks(*entry))
    for role, expected, key in (
        ("trainer", cfg.rl.trainer_processes, "rl.trainer_processes"),
        ("rollout", cfg.rollout.n_servers, "rollout.n_servers"),
    ):
        if sum(g.tasks for g in groups if g.role == role) != expected:
            raise UserError(
                f"slurm.task_groups hold {sum(g.tasks for g in groups if g.role == role)} {role} tasks "
                f"but {key}={expected}"
            )
    return groups


class TaskFailed(RuntimeError):
    """This task's role process failed; the message says which and why."""


def run_task(config: str, overrides: list[str]) -> int:
    cfg = resolve(load_config(config, overrides), Host.probe()).cfg  # settled on this task's node
    placement = Placement.detect()
    task = task_role(placement, task_groups(cfg))
    role, index = task.role, task.index
    run_dir, restart, incarnation = cfg.run_dir, os.environ.get("SLURM_RESTART_COUNT", "0"), new_incarnation()
    marks = incarnation_folder(run_dir, incarnation)
    env = {
        RUN_MARKER: str(run_dir.resolve()),
        INCARNATION: incarnation,
        INTERFACE: cfg.cluster.interface,
        "HF_HUB_OFFLINE": "1",
        **allocator_env(),
        LAUNCHED_AT: os.environ.get(LAUNCHED_AT, str(time.time())),
        RENDEZVOUS: str(marks / "trainer"),
        **_threads_and_devices(task),
    }
    args = config_args(config, overrides)
    log = run_dir / "logs" / f"{role}-{index}.restart{restart}.log"
    _note_placement(log, task, placement, env)
    if role == "rollout":
        model = wait_for_model(initial_model(cfg))
        command = [*server_command(args, model), "rollout.host=0.0.0.0", f"rollout.tp_size={task.tp}"]
        return _supervise(SupervisedProcess(f"rollout server {index}", command, log, env), cfg, marks)
    resume = should_resume(cfg, "auto")  # the same answer on every rank: nothing is written before they meet
    env.update(
        {
            "RANK": str(index),
            "WORLD_SIZE": str(cfg.rl.trainer_processes),
            "LOCAL_RANK": str(placement.local_rank),
            **allocator_env(tree_trainer=cfg.actor.tree_training == "dta"),
        }
    )
    if index > 0:
        start_model = wait_for_model(start_model_path(cfg))
        env[TRAINERS_AT] = str(time.time())
        trainer = SupervisedProcess(f"trainer rank {index}", trainer_command(args, start_model, resume), log, env)
        return _supervise(trainer, cfg, marks)
    with StopForwarder() as stop_warning:  # from the start: a warning during the SFT warm-up counts too
        forget_other_incarnations(run_dir, incarnation)
        start_model = prepare_start_model(cfg, args, env)
        env[TRAINERS_AT] = str(time.time())
        trainer = SupervisedProcess("trainer rank 0", trainer_command(args, start_model, resume), log, env)
        return _supervise(trainer, cfg, marks, stop_warning)


def _threads_and_devices(task: TaskRole) -> dict[str, str]:
    env = {}
    threads = cpu_threads()
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if task.accelerators:
        devices = ",".join(assigned_devices(task.first_accelerator, task.accelerators))
        env["CUDA_VISIBLE_DEVICES"] = env["ASCEND_RT_VISIBLE_DEVICES"] = devices
    return env


def _note_placement(log: Path, task: TaskRole, placement: Placement, env: dict[str, str]) -> None:
    """The role's log starts with where the task runs: node, accelerators and a server's TP size."""
    log.parent.mkdir(parents=True, exist_ok=True)
    line = (
        f"[slurm-task] {task.role} {task.index} (global rank {placement.rank}) on {placement.node}: "
        f"accelerators {env.get('CUDA_VISIBLE_DEVICES', 'none')}"
    )
    with open(log, "a") as out:
        out.write(line + (f", tensor-parallel size {task.tp}\n" if task.role == "rollout" else "\n"))


def _supervise(proc: SupervisedProcess, cfg: RunConfig, marks: Path, stop_warning: StopForwarder | None = None) -> int:
    """Run ``proc`` to its end (with ``stop_warning``: trainer rank 0, whose end is the run's) or, for
    the other tasks, until the run has finished. A failure raises ``TaskFailed`` after writing its
    reason where people look; a process stopped because the job is being stopped (SIGTERM) is not a
    failure."""
    finished, terminated, owner = marks / "finished", [], stop_warning is not None

    def forward_sigterm(signum, frame) -> None:
        terminated.append(signum)
        if proc.process is not None:
            proc.process.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward_sigterm)
    try:
        proc.start()
        if owner:
            stop_warning.set_target(proc.process.pid)
        while (code := proc.process.poll()) is None and (owner or not finished.exists()):
            time.sleep(POLL_S)
            if owner:
                stop_warning.poke()
    finally:
        proc.stop(grace_s=30)  # after the run finished: a server's clean shutdown
        signal.signal(signal.SIGTERM, previous)
    if owner and code == SAVED_AND_STOPPED:
        stop_warning.requeue()  # after SIGUSR2: requeue (submitit's handler exits here); after SIGTERM: end
        return code
    if code is None or finished.exists() or terminated or (code == 0 and not owner):
        return 0 if not terminated else 128 + signal.SIGTERM
    completed_with_failures = owner and code == cfg.rollout.failure_budget.exit_code_on_failures
    summary = last_summary(cfg.run_dir) if completed_with_failures else None
    if code == 0 or summary:  # trainer rank 0 completed the run (with failed episodes: non-zero, not requeued)
        finished.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(finished, f"{code}\n")
        if summary:
            _comment(summary)
        return code
    reason = proc.failure(f"exited with code {code} on {os.environ.get('SLURMD_NODENAME', 'this node')}")
    _report(cfg.run_dir, marks.name, str(reason))
    raise TaskFailed(str(reason))


def _report(run_dir: Path, incarnation: str, reason: str) -> None:
    """Put a task's failure where the run's owner looks: the failures log, trainer rank 0's log, and
    the job's comment (``sacct -o Comment``, where the site stores job comments)."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} job {incarnation}: {reason}\n"
    for path in (run_dir / "logs" / "failures.log", run_dir / "logs" / f"trainer-0.restart{restart}.log"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as out:
            out.write(line)
    print(f"areal-hpc: error: {reason}", file=sys.stderr, flush=True)
    _comment(reason)


def _comment(reason: str) -> None:
    """The first line of ``reason`` as the job's comment (``sacct -o Comment``), under Slurm."""
    job = os.environ.get("SLURM_HET_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job:
        summary = reason.splitlines()[0][:COMMENT_CHARS]
        subprocess.run(["scontrol", "update", f"JobId={job}", f"Comment={summary}"], capture_output=True, timeout=30)


def main(config: str, overrides: list[str]) -> int:
    """``areal-hpc slurm-task``: a task of a plain sbatch script (no submitit). Slurm's stop warning
    reaches every task: only trainer rank 0 acts on it (its forwarder replaces this)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        return run_task(config, overrides)
    except TaskFailed:
        return 1
    except UserError as exc:
        print(f"areal-hpc: error: {exc}", file=sys.stderr)
        return 2
