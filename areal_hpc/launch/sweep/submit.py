"""Submitting a sweep: its validated grid as one Slurm job array through submitit, each element a
``SweepTrial`` (the local launcher, requeued and resumed on SIGUSR2), and ``sweep.json`` in the sweep folder."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shutil
import sys
from datetime import datetime
from pathlib import Path

from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_json, atomic_write_text
from areal_hpc.launch.slurm_options import extra_sbatch_options, slurm_minutes
from areal_hpc.launch.sweep.grid import grid, split_items

SWEEP_FILE = "sweep.json"


def submit(config: str, items: list[str], name: str | None, parallel: int | None, profile: str | None = None) -> Path:
    """Validate the grid, submit it as one job array, write ``sweep.json``; returns the sweep folder.
    With a site ``profile``, the elements load the profile and the config merged into
    ``<sweep folder>/config.yaml``."""
    from areal_hpc.config import absolute_path_overrides, load_config, to_yaml

    config = str(Path(config).resolve())  # the array runs from wherever sbatch was called
    files = [str(Path(profile).resolve()), config] if profile else config
    common, axes = split_items(items)
    common = [*common, *absolute_path_overrides(load_config(files, common))]  # elements start elsewhere
    fileroot = Path(load_config(files, common).cluster.fileroot)
    name = name or f"sweep-{datetime.now():%Y%m%d-%H%M%S}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+=,-]*", name):
        raise UserError(f"--name {name!r}: use letters, digits and . _ + = , - (it names a folder)")
    points = grid(files, common, axes)
    if parallel is not None and parallel < 1:
        raise UserError(f"--parallel must be a positive number of array elements, got {parallel}")
    folder = fileroot / points[0][1].experiment.name / name
    if (folder / SWEEP_FILE).exists():
        raise UserError(f"{folder} already holds a sweep; choose another --name")
    points = [
        (point, dataclasses.replace(cfg, experiment=dataclasses.replace(cfg.experiment, trial=f"{name}/{point.name}")))
        for point, cfg in points
    ]
    executor = _executor(folder / "submitit", name, [cfg for _, cfg in points], parallel or len(points))
    if profile:
        folder.mkdir(parents=True, exist_ok=True)
        config = str(folder / "config.yaml")
        atomic_write_text(Path(config), to_yaml(load_config(files)))
    jobs = _submit_array(
        executor, config, [[*common, *p.overrides, f"experiment.trial={name}/{p.name}"] for p, _ in points]
    )
    array = jobs[0].job_id.partition("_")[0]
    record = {
        "name": name,
        "config": config,
        "overrides": common,
        "array_job_id": array,
        "submitit_folder": str(executor.folder),
        "submitted": datetime.now().isoformat(timespec="seconds"),
        "points": [
            {
                "name": p.name,
                "overrides": p.overrides,
                "job_id": job.job_id,
                "run_dir": str(cfg.run_dir),
                "total_steps": cfg.rl.total_train_steps,
            }
            for (p, cfg), job in zip(points, jobs)
        ],
    }
    atomic_write_json(folder / SWEEP_FILE, record)
    print(
        f"submitted sweep {name}: {len(points)} point{'s' * (len(points) > 1)} as Slurm job array {array} "
        f"({parallel or len(points)} at a time)\n  sweep folder: {folder}\n"
        f"  check it:     areal-hpc sweep --status {folder} [--wait]   (or: squeue -j {array})",
        flush=True,
    )
    return folder


def _executor(folder: Path, name: str, cfgs: list, parallel: int):
    """submitit's Slurm executor for one array element: one task on one node of the trainer partition,
    with the CPUs of every process the local launcher starts there."""
    from submitit import SlurmExecutor

    slurm = cfgs[0].slurm
    cpus = max(
        c.slurm.trainer.cpus_per_task * c.rl.trainer_processes + c.slurm.rollout.cpus_per_server * c.rollout.n_servers
        for c in cfgs
    )
    extra = {"requeue": True, **extra_sbatch_options(slurm.extra_sbatch)}  # requeue: where JobRequeue=0 too
    if slurm.trainer.mem:
        extra["mem"] = slurm.trainer.mem  # submitit's own `mem` wants gigabytes as a number
    params = {
        "job_name": name,
        "partition": slurm.trainer.partition,
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": cpus,
        "time": slurm_minutes(slurm.time),
        "signal_delay_s": slurm.signal_lead_s,
        "array_parallelism": parallel,
        "additional_parameters": extra,
    }
    gpus = max(c.slurm.trainer.gpus_per_node + c.slurm.rollout.gpus_per_server * c.rollout.n_servers for c in cfgs)
    if gpus:  # the trainer ranks' and the rollout servers' accelerators, all on the element's node
        params["gres"] = f"{slurm.gres}:{gpus}"
    params.update({k: v for k, v in (("account", slurm.account), ("qos", slurm.qos)) if v})
    if "%j" in str(folder):
        raise UserError(f"the sweep folder {folder} must not contain %j")
    try:
        executor = SlurmExecutor(folder, max_num_timeout=slurm.max_requeues)
    except RuntimeError:
        raise UserError("srun not found: submit sweeps from a machine with the Slurm commands") from None
    executor.update_parameters(**params)
    return executor


def _submit_array(executor, config: str, overrides: list[list[str]]) -> list:
    from submitit.core.utils import FailedJobError

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's refusal: we say it in one line
            return executor.map_array(sys.modules[__name__].SweepTrial(), [config] * len(overrides), overrides)
    except FailedJobError as exc:  # sbatch refused it (a partition that does not exist, an account, ...)
        shutil.rmtree(executor.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            executor.folder.parent.rmdir()  # the sweep folder, unless something else is in it
        lines = [line.removeprefix("sbatch: error: ") for line in str(exc).splitlines() if line.strip()]
        raise UserError(f"sbatch refused the job array: {lines[-1] if lines else exc}") from None


def _define_sweep_trial():
    from submitit.helpers import Checkpointable

    class SweepTrial(Checkpointable):
        """One array element: the local launcher in the element's allocation. ``resume="auto"`` continues
        what an earlier incarnation saved; submitit's default ``checkpoint`` (resubmit this same call)
        is the requeue, after the launcher had the trainer save on SIGUSR2."""

        def __call__(self, config: str, overrides: list[str]) -> str:
            from areal_hpc.config import load_config
            from areal_hpc.launch.local import launch

            code = launch(config, overrides, resume="auto")
            run_dir = load_config(config, overrides).run_dir
            if code:
                raise RuntimeError(f"the run in {run_dir} exited with code {code} (its logs: {run_dir / 'logs'})")
            return str(run_dir)

    SweepTrial.__module__, SweepTrial.__qualname__ = __name__, "SweepTrial"
    return SweepTrial


def __getattr__(name: str):
    """``SweepTrial`` is defined on first use (pickling the call, unpickling it in the job): it subclasses
    submitit's ``Checkpointable``, and importing submitit (asyncio, cloudpickle) with this module would
    slow every ``areal-hpc`` command, ``--help`` included."""
    if name != "SweepTrial":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = _define_sweep_trial()
    return globals()[name]
