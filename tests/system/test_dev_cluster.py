"""The one-machine dev Slurm cluster (slurm/dev/up.sh) behaves like the clusters the launcher targets:
two nodes in partitions train, rollout and all; a heterogeneous job spans both nodes; fake GPUs set
CUDA_VISIBLE_DEVICES; sacct reports finished jobs, failed ones with their exit code."""

import subprocess
from pathlib import Path

import pytest

from tests.slurm_jobs import wait_for_end

pytestmark = pytest.mark.slurm


def run(*args: str, timeout: float = 300) -> str:
    """Run a Slurm command; its stdout, or the test fails with its stderr (or, if it has not ended after
    ``timeout``, e.g. an srun still waiting for a node, with what squeue shows)."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        queue = subprocess.run(["squeue", "-o", "%i %j %T %R"], capture_output=True, text=True).stdout
        raise AssertionError(
            f"{' '.join(args)} had not ended after {timeout:g} s; stderr: {exc.stderr}\nsqueue:\n{queue}"
        ) from None
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
    return done.stdout


def sbatch(folder: Path, *args: str) -> str:
    return run("sbatch", "--parsable", f"--chdir={folder}", "--time=2", *args).strip().split(";")[0]


def finished(job: str, components: int = 1) -> dict[str, tuple[str, str]]:
    """sacct's final (state, exit code) of every component of ``job``."""
    return {jobid: (state, code) for jobid, (state, code, _) in wait_for_end(job, 300, components).items()}


def test_nodes_are_in_train_rollout_and_all():
    pairs = {tuple(line.split()) for line in run("sinfo", "-h", "-N", "-o", "%N %R").splitlines()}
    assert pairs == {("train1", "train"), ("train1", "all"), ("rollout1", "rollout"), ("rollout1", "all")}
    default = [line.split()[0] for line in run("sinfo", "-h", "-o", "%P").split()]
    assert "all*" in default, f"partition all is not the default: {default}"


def test_heterogeneous_job_spans_train_and_rollout(tmp_path):
    out = tmp_path / "het.out"
    script = tmp_path / "het.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=dev-cluster-het --partition=train --nodes=1 --ntasks=1 --output={out}
#SBATCH hetjob
#SBATCH --partition=rollout --nodes=1 --ntasks=1
srun --het-group=0,1 bash -c 'echo "rank=$SLURM_PROCID node=$SLURMD_NODENAME"'
""")
    job = sbatch(tmp_path, str(script))
    records = finished(job, components=2)
    assert records == {f"{job}+0": ("COMPLETED", "0:0"), f"{job}+1": ("COMPLETED", "0:0")}, records
    assert sorted(out.read_text().splitlines()) == ["rank=0 node=train1", "rank=1 node=rollout1"], out.read_text()


def test_fake_gpus_set_cuda_visible_devices():
    one = run("srun", "-p", "train", "--time=1", "--gres=gpu:1", "printenv", "CUDA_VISIBLE_DEVICES").strip()
    assert one in {"0", "1"}
    both = run("srun", "-p", "rollout", "--time=1", "--gres=gpu:2", "printenv", "CUDA_VISIBLE_DEVICES").strip()
    assert both == "0,1"


def test_sacct_reports_completed_and_failed_jobs(tmp_path):
    ok = sbatch(tmp_path, "--job-name=dev-cluster-ok", "--output=/dev/null", "--wrap", "true")
    failing = sbatch(tmp_path, "--job-name=dev-cluster-exit3", "--output=/dev/null", "--wrap", "exit 3")
    assert finished(ok) == {ok: ("COMPLETED", "0:0")}
    assert finished(failing) == {failing: ("FAILED", "3:0")}
