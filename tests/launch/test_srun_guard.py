"""The srun guard on the dev Slurm cluster: an srun (here a stand-in process) that is still there after
its step has ended is ended, and the batch script exits with the step's exit code as sacct recorded it
over every het component; an srun that ends by itself keeps its own exit code and is left alone."""

import datetime
import os
import subprocess
import sys

import pytest

from areal_hpc.launch.srun_guard import steps_of_sacct
from tests.conftest import REPO
from tests.slurm_jobs import elapsed_s, wait_for_end

GUARD = f"{sys.executable} -m areal_hpc.launch.srun_guard"
HET_JOB = """#!/bin/bash
#SBATCH --job-name=areal-hpc-test-guard -p train -n 1 --mem-per-cpu=100M
#SBATCH --output={out} --chdir={repo}
#SBATCH hetjob
#SBATCH -p rollout -n 1 --mem-per-cpu=100M
exec {guard} --poll-s 1 --grace-s 3 {command}
"""


def _run_job(tmp_path, command: str) -> tuple[dict, str, float]:
    """sacct's final records of the job's two components, its output, and how long it ran by Slurm's
    clock (its time in the queue, on a busy cluster, and sacct's lag after its end left out)."""
    out = tmp_path / "job.out"
    script = tmp_path / "guard.sbatch"
    script.write_text(HET_JOB.format(out=out, repo=REPO, guard=GUARD, command=command))
    job = (
        subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, timeout=60)
        .stdout.strip()
        .split(";")[0]
    )
    ended = wait_for_end(job, 300, components=2)  # ~10 s alone; the bound allows for a loaded cluster
    return ended, out.read_text(), elapsed_s(job)


@pytest.mark.slurm
def test_an_srun_still_there_after_its_step_ended_is_ended_with_the_step_exit_code(tmp_path):
    # The stand-in runs a real het step (task 0 exits 3 on train1, task 1 exits 4 on rollout1), then stays.
    ended, output, took = _run_job(
        tmp_path, """bash -c 'srun --het-group=0,1 bash -c "exit \\$((SLURM_PROCID + 3))"; exec sleep 600'"""
    )
    assert "ended it; the step's exit code is 4" in output, output
    assert [code for _, code, _ in ended.values()] == ["4:0", "4:0"], (ended, output)
    assert took < 60, took  # not the stand-in's 600 s


@pytest.mark.slurm
def test_an_srun_that_ends_by_itself_keeps_its_exit_code(tmp_path):
    ended, output, _ = _run_job(tmp_path, """srun --het-group=0,1 bash -c 'sleep 3; exit 5'""")
    assert "areal-hpc:" not in output, output
    assert [code for _, code, _ in ended.values()] == ["5:0", "5:0"], (ended, output)


# sacct on the dev cluster while a het step (task 0 exits 3 on train1, task 1 exits 4 on rollout1) ended,
# before and after slurmdbd had learnt the job's components (job 649).
BEFORE_COMPONENTS = """649|2026-11-28T01:42:21|PENDING|0:0
649.batch|2026-11-28T01:42:21|RUNNING|0:0
649.0|2026-11-28T01:42:21|FAILED|3:0
"""
AFTER_COMPONENTS = """649+0|2026-11-28T01:42:21|RUNNING|0:0
649+0.batch|2026-11-28T01:42:21|RUNNING|0:0
649+0.0|2026-11-28T01:42:21|FAILED|3:0
649+1|2026-11-28T01:42:21|RUNNING|0:0
649+1.0|2026-11-28T01:42:21|FAILED|4:0
"""
SINCE = datetime.datetime.fromisoformat("2026-11-28T01:42:20").timestamp()


def test_a_het_step_has_ended_only_once_sacct_has_every_components_record():
    # CI once saw the first record and reported exit code 3 for a step whose srun reported 4.
    assert steps_of_sacct(BEFORE_COMPONENTS, SINCE, heterogeneous=True) == {"0": None}
    assert steps_of_sacct(AFTER_COMPONENTS, SINCE, heterogeneous=True) == {"0": 4}
    assert steps_of_sacct(BEFORE_COMPONENTS, SINCE, heterogeneous=False) == {"0": 3}
    component_still_running = AFTER_COMPONENTS.replace(
        "649+1.0|2026-11-28T01:42:21|FAILED|4:0", "649+1.0|2026-11-28T01:42:21|RUNNING|0:0"
    )
    assert steps_of_sacct(component_still_running, SINCE, heterogeneous=True) == {"0": None}
    assert steps_of_sacct(AFTER_COMPONENTS, SINCE + 60, heterogeneous=True) == {}  # an earlier incarnation's


def test_outside_a_job_it_runs_the_command_and_refuses_no_command():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    ran = subprocess.run([*GUARD.split(), "bash", "-c", "exit 6"], env=environ, cwd=REPO, capture_output=True)
    assert ran.returncode == 6
    refused = subprocess.run([*GUARD.split(), "--grace-s", "2"], env=environ, cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "no command given" in refused.stderr, refused.stderr
