"""`areal-hpc sweep`: the grid and its point names; bad input refused in one line before anything reaches
Slurm; and on the dev cluster a real 3-point sweep of a tiny run as one job array through submitit,
submitted from /tmp with relative paths, one element told to stop mid-run (SIGUSR2) requeuing itself and
resuming, then ``--status`` with its results table, CSV, Markdown and plot."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from areal_hpc.errors import UserError
from areal_hpc.launch.slurm_options import slurm_minutes
from areal_hpc.launch.sweep.grid import grid, split_items
from areal_hpc.launch.sweep.results import read_metrics, state_from_result
from tests.conftest import REPO, run_cli
from tests.slurm_jobs import states, wait_for
from tests.system.test_async_rl import SMALL_RUN

CONFIG = "configs/quickstart.yaml"
SWEEP_RUN = [*SMALL_RUN, "stats.plot=false", "slurm.time=00:10:00", "slurm.trainer.partition=all"]


def slurm_jobs_named(name: str) -> list[str]:
    """Jobs of that name Slurm knows of, queued or (sacct) finished."""
    queued = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True, check=True)
    past = subprocess.run(
        ["sacct", "-n", "-X", "--name", name, "-o", "JobID"], capture_output=True, text=True, check=True
    )
    return queued.stdout.split() + past.stdout.split()


def test_the_grid_is_the_cartesian_product_with_readable_unique_point_names():
    common, axes = split_items(
        ["rl.total_train_steps=3", "sweep.actor.lr=[1e-4, 3e-4]", "sweep.rollout.max_head_offpolicyness=[0,2,4]"]
    )
    assert common == ["rl.total_train_steps=3"]
    points = grid(CONFIG, common, axes)
    assert [p.name for p, _ in points] == [f"lr={lr},eta={eta}" for lr in ("0.0001", "0.0003") for eta in (0, 2, 4)]
    point, cfg = points[-1]
    assert point.overrides == ["actor.lr=3e-4", "rollout.max_head_offpolicyness=4"]
    assert (cfg.actor.lr, cfg.rollout.max_head_offpolicyness, cfg.rl.total_train_steps) == (3e-4, 4, 3)
    # keys with the same last segment keep their full names; text cannot nest folders
    names = [
        p.name
        for p, _ in grid(
            CONFIG, *split_items(["sweep.actor.lr=[1e-4]", "sweep.sft.lr=[1e-3]", "sweep.dataset.arithmetic.ops=[*/]"])
        )
    ]
    assert names == ["actor.lr=0.0001,sft.lr=0.001,ops=%2A%2F"]


@pytest.mark.parametrize(
    "items, message",
    [
        (["sweep.actor.lr=[1e-4,1e-4]"], "sweep.actor.lr: 1e-4 and 1e-4 are the same value"),
        (["actor.lr=1e-4", "sweep.actor.lr=[1e-4,3e-4]"], "actor.lr is both swept"),
        (["sweep.slurm.time=[10,20]"], "sweep.slurm.time cannot be swept"),
        (["experiment.trial=x", "sweep.actor.lr=[1e-4]"], "experiment.trial is set by the sweep"),
        (["actor.lr=1e-4"], "sweep needs at least one sweep.KEY"),
    ],
)
def test_items_that_make_no_grid_are_refused(items, message):
    with pytest.raises(UserError, match=re.escape(message)):
        grid(CONFIG, *split_items(items))


def test_slurm_time_limits_in_minutes():
    assert [slurm_minutes(t) for t in ("30", "5:30", "04:00:00", "1-2", "2-00:00:00", "1-00:00:01")] == [
        30,
        6,
        240,
        1560,
        2880,
        1441,
    ]
    for bad in ("abc", "0:30", "1:2:3:4"):
        with pytest.raises(UserError, match="slurm.time"):
            slurm_minutes(bad)


@pytest.mark.slurm
@pytest.mark.parametrize(
    "items, message",
    [
        (["sweep.actor.lrr=[1e-4,2e-4]"], "sweep point actor.lrr=1e-4: unknown config key 'actor.lrr'"),
        (
            ["sweep.actor.lr=[1e-4,2e-4]", "sweep.rollout.max_head_offpolicyness=[0,-1]"],  # only the last point is bad
            "sweep point actor.lr=1e-4,rollout.max_head_offpolicyness=-1: config key 'rollout.max_head_offpolicyness'",
        ),
        (["sweep.actor.lr=1e-4,2e-4"], "is not of the form sweep.KEY=[v1,v2,...]"),
        (["sweep.actor.lr=[1e-4,]"], "is not of the form sweep.KEY=[v1,v2,...]"),
        (
            ["slurm.trainer.partition=nope", "sweep.actor.lr=[1e-4,2e-4]"],
            "sbatch refused the job array: Batch job submission failed: Invalid partition",
        ),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_submitted(tmp_path, items, message):
    name = f"bad-{uuid.uuid4().hex[:8]}"
    result = run_cli("sweep", "--config", CONFIG, "--name", name, f"cluster.fileroot={tmp_path}", *items)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("areal-hpc: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert slurm_jobs_named(name) == []
    assert not (tmp_path / "quickstart" / name).exists()


def test_status_of_a_folder_that_is_no_sweep(tmp_path):
    result = run_cli("sweep", "--status", str(tmp_path))
    assert result.returncode == 2 and "is not a sweep folder (no sweep.json)" in result.stderr


@pytest.mark.slurm
@pytest.mark.slow
def test_a_three_point_sweep_runs_as_one_array_requeues_a_stopped_element_and_reports(tiny_model_dir, tmp_path):
    """Submitted from /tmp with a relative config path and file root (the sweep makes both absolute);
    two elements at a time (each needs a whole 2-CPU node); element 0 gets SIGUSR2 mid-run like a
    job near its time limit: the trainer saves, submitit requeues the element, and it resumes."""
    name = f"sweep-{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "quickstart" / name
    sweep = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_hpc",
            "sweep",
            "--config",
            os.path.relpath(REPO / CONFIG, "/tmp"),
            "--profile",
            str(REPO / "slurm" / "profiles" / "dev.yaml"),
            "--name",
            name,
            "--parallel",
            "2",
            "--wait",
            f"model.path={tiny_model_dir}",
            f"cluster.fileroot={os.path.relpath(tmp_path, '/tmp')}",
            *SWEEP_RUN,
            "rl.total_train_steps=12",
            "rl.eval_every_steps=4",
            "saver.freq_steps=0",
            "sweep.actor.lr=[1e-4,2e-4,3e-4]",
        ],
        cwd="/tmp",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    record = None

    def submitted():  # sweep.json is written whole (renamed into place) once the array is submitted
        assert sweep.poll() is None or (folder / "sweep.json").exists(), (
            f"the sweep exited {sweep.returncode} before writing sweep.json: {sweep.communicate()}"
        )
        return (folder / "sweep.json").exists() and json.loads((folder / "sweep.json").read_text())

    def last_step(run_dir: str) -> int:
        return max((r["step"] for r in read_metrics(Path(run_dir))), default=0)

    try:
        record = wait_for(submitted, 120, "sweep.json")
        first = record["points"][0]
        assert "device: cpu" in (folder / "config.yaml").read_text()  # the site profile, merged for the elements
        wait_for(
            lambda: last_step(first["run_dir"]) >= 1,
            240,
            "element 0 to train a step",
            seen=lambda: f"element 0 at step {last_step(first['run_dir'])}, {states(first['job_id'])}",
        )
        # then 11 steps left: seconds to signal it mid-run
        subprocess.run(["scancel", "--signal=USR2", first["job_id"]], check=True)
        try:
            out, err = sweep.communicate(timeout=200)  # ~30 s alone; all three bounds within pytest's 600 s
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the sweep had not ended after 200 s; {states(record['array_job_id'])}") from None
    finally:
        if sweep.poll() is None:
            sweep.kill()
        # Only a sweep that failed leaves elements to clean up. After a good one, an element whose function has
        # returned may still be finishing in Slurm: cancelling it then made it CANCELLED in sacct, which
        # --status below rightly reported (one run, 2026-12-06).
        if record is not None and sweep.returncode != 0:
            subprocess.run(["scancel", record["array_job_id"]], check=False)
    assert sweep.returncode == 0, f"{out}\n{err}"
    assert record["config"] == str(folder / "config.yaml") and f"cluster.fileroot={tmp_path}" in record["overrides"]
    assert [p["name"] for p in record["points"]] == ["lr=0.0001", "lr=0.0002", "lr=0.0003"]
    assert [p["job_id"] for p in record["points"]] == [f"{record['array_job_id']}_{i}" for i in range(3)]
    for point in record["points"]:
        run = Path(point["run_dir"])
        assert run == folder / point["name"]
        evaluated = [r["step"] for r in read_metrics(run) if "eval/accuracy" in r]
        if point is first:  # stopped right at an evaluation step, element 0 resumes without that evaluation
            assert evaluated[0] == 0 and evaluated[-1] == 12 and set(evaluated) <= {0, 4, 8, 12}
        else:
            assert evaluated == [0, 4, 8, 12]
    # element 0 saved, was requeued by submitit, resumed, and trained every trajectory once
    run0 = Path(first["run_dir"])
    log = (folder / "submitit" / f"{first['job_id']}_0_log.out").read_text()
    assert "Requeued job" in log, log[-2000:]
    audit = [json.loads(line) for line in (run0 / "logs" / "batches.jsonl").read_text().splitlines()]
    assert any("resumed_from" in entry for entry in audit)
    trained = [i for entry in audit for i in entry.get("trained", [])]
    assert len(trained) == len(set(trained)) == 12 * 4 * 4

    (folder / "results.png").unlink()
    status = run_cli("sweep", "--status", str(folder))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"sweep {name}: job array {record['array_job_id']}, 3/3 points finished" in status.stdout
    table = status.stdout.split("\n\n")[1].splitlines()
    assert table[0].split()[:2] == ["point", "final"] and len(table) == 4
    assert sorted(row.split()[0] for row in table[1:]) == ["lr=0.0001", "lr=0.0002", "lr=0.0003"]
    assert all(row.split()[-1] == "COMPLETED" for row in table[1:])
    rows = list(csv.DictReader((folder / "results.csv").open()))
    assert len(rows) == 3 and all(float(r["trained_tokens_per_s"]) > 0 for r in rows)
    assert (folder / "results.md").read_text().count("\n") == 5
    assert (folder / "results.png").stat().st_size > 10_000


@pytest.mark.parametrize("outcome, state", [("success", "COMPLETED"), ("error", "FAILED")])
def test_a_point_whose_function_returned_takes_its_state_from_submitits_result(outcome, state, tmp_path):
    """sacct may still say RUNNING for seconds after an element's function returned (a sweep once
    exited 1 on it in CI); the state then comes from the outcome submitit itself pickled."""
    from submitit.core.utils import cloudpickle_dump

    cloudpickle_dump((outcome, "value or traceback"), tmp_path / "result.pkl")
    assert state_from_result(tmp_path / "result.pkl") == state
