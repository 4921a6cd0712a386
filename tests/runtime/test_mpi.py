"""One MPI world is one torch.distributed world: under mpirun, and under Slurm as a heterogeneous job
whose single ``srun --mpi=pmix --het-group=0,1`` step spans a trainer component on ``train1`` and a
rollout component on ``rollout1`` (the dev cluster of slurm/dev/up.sh). Each rank runs an mpi4py
allreduce and gloo allreduces after the name-resolve rendezvous (tests/rank_allreduce.py). That srun runs
under the guard the launchers use: on Slurm 22.05 about one such srun in 25 hangs after its step ends."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_hpc.runtime.bootstrap import RENDEZVOUS, node_address
from tests.conftest import REPO
from tests.slurm_jobs import wait_for_end

pytestmark = [pytest.mark.mpi, pytest.mark.distributed]

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", RENDEZVOUS)


def _clean_environ() -> dict:
    """This shell's environment without any launcher's placement (a test may run inside one)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "OMPI_", "PMI"))
    }


def _reports(folder: Path) -> list[dict]:
    """The report every rank wrote to FOLDER (tests/rank_allreduce.py --reports), by rank."""
    return sorted((json.loads(path.read_text()) for path in folder.glob("rank*.json")), key=lambda r: r["rank"])


def test_mpirun_world_is_one_torch_world(tmp_path):
    done = subprocess.run(
        [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "2",
            sys.executable,
            "-m",
            "tests.rank_allreduce",
            "1",
            "--mpi",
            "--reports",
            str(tmp_path / "reports"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**_clean_environ(), RENDEZVOUS: str(tmp_path / "rendezvous"), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reports = _reports(tmp_path / "reports")
    assert [(r["rank"], r["world"], r["source"]) for r in reports] == [(0, 2, "mpi"), (1, 2, "mpi")]
    assert [(r["mpi_sum"], r["torch_rank"], r["torch_sum"]) for r in reports] == [(3, 0, 3.0), (3, 1, 3.0)]
    # with only PMIX_RANK left, Placement asks mpi4py and finds the same place
    assert all(
        r["via_mpi4py"] == {**{k: r[k] for k in ("rank", "world", "local_rank", "node")}, "source": "mpi"}
        for r in reports
    )


@pytest.mark.slurm
def test_het_job_is_one_world_across_components(tmp_path):
    out = tmp_path / "job.out"
    # Trainers: 2 tasks on one CPU (--overcommit), so the job fits beside others on the 2-core dev nodes.
    script = tmp_path / "het.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=areal-hpc-test-het -p train -n 2 --overcommit --mem-per-cpu=300M --gres=gpu:2
#SBATCH --output={out} --chdir={REPO}
#SBATCH hetjob
#SBATCH -p rollout -n 1 -c 1 --mem-per-cpu=300M --gres=gpu:1
export OMPI_MCA_btl=self,tcp  # shared memory segfaults between the two fake nodes of one host
export {RENDEZVOUS}={tmp_path}/name_resolve/trainer/$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}
{sys.executable} -m areal_hpc.launch.srun_guard --poll-s 1 --grace-s 5 \\
  srun --mpi=pmix --het-group=0,1 {sys.executable} -m tests.rank_allreduce 2 --mpi --reports {tmp_path}/reports
""")
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30, env=_clean_environ()
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    ended = wait_for_end(job, 90, components=2)  # ~5 s alone; the suite may load both nodes
    states = [state for state, _, _ in ended.values()]
    output = out.read_text() if out.exists() else "(no output file)"
    assert states == ["COMPLETED", "COMPLETED"], output
    reports = _reports(tmp_path / "reports")
    placed = [(r["rank"], r["world"], r["local_rank"], r["node"], r["source"], r["role"], r["index"]) for r in reports]
    assert placed == [
        (0, 3, 0, "train1", "slurm", "trainer", 0),
        (1, 3, 1, "train1", "slurm", "trainer", 1),
        (2, 3, 0, "rollout1", "slurm", "rollout", 0),
    ], output
    assert [(r["mpi_sum"], r["torch_rank"], r["torch_sum"]) for r in reports] == [(6, i, 6.0) for i in range(3)]
    assert [r["trainer_sum"] for r in reports] == [3.0, 3.0, 3.0]  # trainers: 1 + 2; the rollout rank's own 3
    assert [r["devices"] for r in reports] == [["0"], ["1"], ["0"]]  # GRES: gpu:2 on train1, gpu:1 on rollout1
    assert [r["threads"] for r in reports] == [None, None, 1]  # -c 1 on the rollout component only
    assert all(
        {k: r["via_mpi4py"][k] for k in ("rank", "world", "local_rank")}
        == {k: r[k] for k in ("rank", "world", "local_rank")}
        for r in reports
    )
    store = next((tmp_path / "name_resolve" / "trainer").glob(f"{job}.*/store")).read_text()
    assert store.rsplit(":", 1)[0] == node_address(environ={"SLURMD_NODENAME": "train1"})  # rank 0 published it
