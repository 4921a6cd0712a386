"""One heterogeneous Slurm job per run, submitted through submitit.

submitit's ``SlurmExecutor`` writes single-component jobs only. ``HetJobExecutor`` keeps everything it
does (the pickled call, its logs, ``job.result()``, the requeue on SIGUSR2) and adds components: the
executor's own parameters make component 0, every ``Component`` after it adds a ``#SBATCH hetjob``
block, and one ``srun --het-group=0,...,k`` starts every task of every component in one step, so one
``--kill-on-bad-exit`` ends the whole job when any task fails. That srun runs under ``srun_guard``: on
Slurm before 24.11 an srun across het groups under PMIx can hang after its step has ended. The executor
folder must not contain ``%j``: only component 0 would get its output folder ("Slurmd could not connect
IO").
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from submitit.slurm.slurm import SlurmExecutor

from areal_hpc.errors import UserError
from areal_hpc.launch import srun_guard
from areal_hpc.launch.slurm_options import extra_sbatch_options, slurm_minutes


@dataclass(frozen=True)
class Component:
    """One component of the job: ``tasks`` tasks (trainer ranks or rollout servers) on ``nodes`` nodes
    of ``partition``, at most ``tasks_per_node`` on one node (the last node may hold fewer)."""

    role: str  # "trainer" or "rollout"
    partition: str
    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int = 0
    mem: str = ""
    tasks: int = 0  # 0: nodes x tasks_per_node

    def __post_init__(self):
        if not self.tasks:
            object.__setattr__(self, "tasks", self.nodes * self.tasks_per_node)

    def sbatch_options(self, gres: str) -> dict[str, str]:
        options = {
            "partition": self.partition,
            "nodes": str(self.nodes),
            "ntasks-per-node": str(self.tasks_per_node),
            "cpus-per-task": str(self.cpus_per_task),
        }
        if self.tasks != self.nodes * self.tasks_per_node:  # uneven: the total, with the per-node figure as a cap
            options["ntasks"] = str(self.tasks)
        if self.gpus_per_node:
            options["gres"] = f"{gres}:{self.gpus_per_node}"
        if self.mem:
            options["mem"] = self.mem
        return options


@dataclass(frozen=True)
class JobSpec:
    """What the whole job asks for, beside its components."""

    name: str
    time: str
    account: str = ""
    qos: str = ""
    gres: str = "gpu"
    signal_lead_s: int = 120
    mpi: str = ""
    extra_sbatch: tuple[str, ...] = ()


class HetJobExecutor(SlurmExecutor):
    def __init__(self, folder: Path, job: JobSpec, components: list[Component], max_requeues: int):
        if "%j" in str(folder):
            raise UserError(f"the submitit folder {folder} must not contain %j in a heterogeneous job")
        super().__init__(folder, max_num_timeout=max_requeues)
        self.job, self.components = job, components
        srun = [
            "--kill-on-bad-exit=1",
            f"--het-group=0-{len(components) - 1}" if len(components) > 1 else None,
            f"--mpi={job.mpi}" if job.mpi else None,
        ]
        first = components[0]
        self.update_parameters(
            job_name=job.name,
            time=slurm_minutes(job.time),
            partition=first.partition,
            nodes=first.nodes,
            ntasks_per_node=first.tasks_per_node,
            cpus_per_task=first.cpus_per_task,
            signal_delay_s=job.signal_lead_s,
            srun_args=[a for a in srun if a],
            stderr_to_stdout=True,
            additional_parameters=_job_options(job, first),
        )

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        """submitit's script, with one ``#SBATCH hetjob`` block per component after the first."""
        text = super()._make_submission_file_text(command, uid)
        blocks = []
        for component in self.components[1:]:
            options = {
                **component.sbatch_options(self.job.gres),
                "time": str(slurm_minutes(self.job.time)),
                **_account_options(self.job),
            }
            blocks += ["#SBATCH hetjob", *(f"#SBATCH --{k}={shlex.quote(v)}" for k, v in options.items())]
        cut = min(i for i in (text.find("\n\n# setup"), text.find("\n\n# command")) if i >= 0)
        text = "\n".join([text[:cut], *blocks]) + text[cut:]
        if len(self.components) > 1:
            text = text.replace("\nsrun ", f"\n{shlex.quote(sys.executable)} -m {srun_guard.__name__} srun ", 1)
        return text

    def _num_tasks(self) -> int:
        return sum(c.tasks for c in self.components)


# Component 0's options submitit writes itself (from ``update_parameters``); the rest come from ours.
SUBMITIT_WRITES = ("partition", "nodes", "ntasks-per-node", "cpus-per-task")


def _account_options(job: JobSpec) -> dict[str, str]:
    """Options every component repeats (Slurm reads them per component)."""
    return {key: value for key, value in (("account", job.account), ("qos", job.qos)) if value}


def _job_options(job: JobSpec, first: Component) -> dict[str, str | bool]:
    """Component 0's options beyond submitit's own, including job-wide ones (requeue) and the user's
    extra lines (``--exclusive``, ``--constraint=a100``)."""
    own = {k: v for k, v in first.sbatch_options(job.gres).items() if k not in SUBMITIT_WRITES}
    return {**_account_options(job), **own, "requeue": True, **extra_sbatch_options(list(job.extra_sbatch))}
