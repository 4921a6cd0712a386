"""Launch overhead of Slurm: `areal-hpc submit` (one heterogeneous job, through submitit) vs the local
launcher (`areal-hpc train`), same tiny config, on the dev cluster (slurm/dev/up.sh).

    .venv/bin/python bench/slurm_launch.py [--repeats 3] [--save]

For each side: seconds from the command to the first rollout request (the trainer's "rollouts started"
mark, which both launchers date from the command's start) and to the first trained step (the first
``trained`` line of ``logs/batches.jsonl``, seen by polling every 50 ms). For the Slurm side also the
requeue cost: ``scontrol requeue`` at step 5, to the tasks of the next incarnation running (Slurm's
part: kill, requeue, the dev cluster's 10 s credential wait, scheduling) and to the first step trained
by the resumed incarnation (ours: load the checkpoint, start servers, rendezvous, first batch).
Repeats alternate the sides; medians. The Slurm numbers include queueing on an idle cluster
(``bf_interval=1,sched_interval=1``) and submitit's start-up in every task.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from recording import machine, run_and_record

from areal_hpc.fsio import read_json_lines

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "areal_hpc"]
RUN = [
    "dataset.train_size=64",
    "dataset.eval_size=16",
    "rl.sft_warmup_steps=0",
    "rollout.consumer_batch_size=4",
    "rollout.max_concurrent_rollouts=8",
    "generation.n_samples=4",
    "generation.max_new_tokens=6",
    "rollout.max_running_requests=32",
    "stats.tensorboard=false",
    "rl.eval_every_steps=0",
    "cluster.device=cpu",
]


def trained_steps(run: Path) -> list[dict]:
    return read_json_lines(run / "logs" / "batches.jsonl")


def wait(condition, timeout: float = 600.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there in time")
        time.sleep(0.05)
    return found


def rollouts_started(log: Path) -> float:
    found = re.search(r"rollouts started ([\d.]+) s after launch", log.read_text() if log.exists() else "")
    return float(found.group(1)) if found else 0.0


def local_side(model: Path, root: Path, steps: int) -> dict:
    started = time.monotonic()
    log = root / "local.log"
    root.mkdir(parents=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                *CLI,
                "train",
                "--config",
                "configs/quickstart.yaml",
                f"model.path={model}",
                f"cluster.fileroot={root}",
                *RUN,
                f"rl.total_train_steps={steps}",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        run = root / "quickstart" / "trial0"
        wait(lambda: any("trained" in e for e in trained_steps(run)))
        first_step = time.monotonic() - started
        proc.wait(timeout=600)
    return {"first_rollout_s": rollouts_started(log), "first_step_s": first_step}


def slurm_side(model: Path, root: Path, steps: int, requeue_at: int | None) -> dict:
    started = time.monotonic()
    out = subprocess.run(
        [
            *CLI,
            "submit",
            "--profile",
            "slurm/profiles/dev.yaml",
            "--config",
            "configs/quickstart.yaml",
            f"model.path={model}",
            f"cluster.fileroot={root}",
            *RUN,
            f"rl.total_train_steps={steps}",
            "saver.freq_steps=1000",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    job = re.search(r"submitted job (\d+)", out).group(1)
    run = root / "quickstart" / "trial0"
    try:
        wait(lambda: any("trained" in e for e in trained_steps(run)))
        result = {"first_step_s": time.monotonic() - started}
        wait(lambda: rollouts_started(run / "logs" / "trainer-0.restart0.log"))
        result["first_rollout_s"] = rollouts_started(run / "logs" / "trainer-0.restart0.log")
        if requeue_at:
            wait(lambda: sum("trained" in e for e in trained_steps(run)) >= requeue_at)
            requeued = time.monotonic()
            subprocess.run(["scontrol", "requeue", job], check=True)

            def resumed_step():
                lines = trained_steps(run)
                at = next((i for i, e in enumerate(lines) if "resumed_from" in e), None)
                return at is not None and any("trained" in e for e in lines[at:])

            wait(lambda: (run / "logs" / "trainer-0.restart1.log").exists())
            result["requeue_to_restart_s"] = time.monotonic() - requeued  # Slurm: kill, requeue, start again
            wait(resumed_step)
            result["requeue_to_step_s"] = time.monotonic() - requeued
        wait(
            lambda: subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip() == "",
            timeout=600,
        )
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    return result


def run(args) -> dict:
    samples: dict[str, list[dict]] = {"local": [], "slurm": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        subprocess.run([*CLI, "init-model", "--out", str(model)], check=True, capture_output=True)
        for i in range(args.repeats):
            samples["local"].append(local_side(model, Path(tmp) / f"local{i}", args.steps))
            samples["slurm"].append(slurm_side(model, Path(tmp) / f"slurm{i}", args.steps * 10, requeue_at=5))
            print(f"repeat {i + 1}/{args.repeats}: {samples['local'][-1]} | {samples['slurm'][-1]}", file=sys.stderr)
    medians = {
        side: {key: statistics.median(s[key] for s in rows) for key in rows[0]} for side, rows in samples.items()
    }
    versions = subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "date": date.today().isoformat(),
        "machine": machine(),
        "slurm": versions,
        "repeats": args.repeats,
        "samples": samples,
        "medians": medians,
    }


def report(result: dict) -> str:
    local, slurm = result["medians"]["local"], result["medians"]["slurm"]
    rows = [
        ("submit/launch -> first rollout", local["first_rollout_s"], slurm["first_rollout_s"]),
        ("submit/launch -> first trained step", local["first_step_s"], slurm["first_step_s"]),
    ]
    lines = [
        f"# Slurm launch overhead ({result['date']})",
        "",
        f"machine: {result['machine']}; {result['slurm']}; medians of {result['repeats']}",
        "",
        "| seconds | local launcher | areal-hpc submit (het job) | ratio |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f}x |" for name, a, b in rows]
    lines += [
        f"| scontrol requeue -> the job's tasks run again (Slurm) | | {slurm['requeue_to_restart_s']:.1f} | |",
        f"| scontrol requeue -> first step trained after the resume | | {slurm['requeue_to_step_s']:.1f} | |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps of the local run (the Slurm run takes 10x)")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("slurm_launch", parser.parse_args(), run, report)
