"""The quickstart's RL step (s/step of ``areal-hpc train``) at several commits, run in turn on one machine.

    .venv/bin/python bench/rl_step.py [--steps 60] [--repeats 3] [--start-model DIR] [--save]
    .venv/bin/python bench/rl_step.py --variant "before=bb7d738" --variant "after=HEAD cluster.pin_cores=false"

Each variant is a commit of this repository (exported with ``git archive``, so uncommitted edits in the
working tree never leak in) and optional config overrides. Every repeat runs each variant once, in turn,
so all of them see the same load; the table gives medians over the repeats and, per variant, the median
over repeats of its s/step divided by the first variant's in the same repeat.

Workload: ``configs/quickstart.yaml`` (1.07M-parameter Qwen2, 16 prompts x 8 samples a step, eta = 2,
the local launcher's core split) from a starting model after the quickstart's SFT warm-up, RL only, no
evaluations but the first and last and no checkpoints. Per run: the median of ``time/step`` (and of its
parts in metrics.jsonl: ``time/stage`` on the step's path, ``time/push`` beside the next update since the
disk push was overlapped, on it before) over the steps after ``--skip``; CPU seconds per step of the run's processes by
role, and the other processes' load on the machine (cores), over the same steps.

Default variants: before (bb7d738: a /generate request per sample, the rollout controller on the
trainer's core), batched (912c434: a group's samples in one /generate, a reward call per event-loop turn),
after (HEAD: also trainer rank 0's rollout side on the rollout server's cores) and after without pinning
(``cluster.pin_cores=false``: the other way to give the update a core of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from async_vs_sync import cpu_seconds
from recording import machine, machine_and_versions, run_and_record, train_command
from run_processes import role

from areal_hpc.config import load_config

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/quickstart.yaml"
VARIANTS = ["before=bb7d738", "batched=912c434", "after=HEAD", "after, not pinned=HEAD cluster.pin_cores=false"]
PARTS = ("time/step", "time/train", "time/generate_wait", "time/stage", "time/push", "sync/seconds")
TICK = os.sysconf("SC_CLK_TCK")


def export(commit: str, root: Path) -> tuple[Path, str]:
    """``commit`` of this repository as a folder of its own (once), and its short hash."""
    short = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", commit], check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = root / f"tree-{short}"
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", short], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree, short


def start_model(root: Path) -> Path:
    """The quickstart's SFT warm-up (what ``areal-hpc train`` runs before RL), written under ``root``."""
    fileroot = root / "sft"
    shutil.rmtree(fileroot, ignore_errors=True)
    steps = load_config(CONFIG).rl.sft_warmup_steps  # at most: it stops at sft.stop_at_accuracy
    subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_hpc",
            "sft",
            "--config",
            CONFIG,
            f"cluster.fileroot={fileroot}",
            f"sft.total_train_steps={steps}",
            "saver.freq_steps=0",
            "stats.tensorboard=false",
            "stats.plot=false",
        ],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return fileroot / "quickstart" / "trial0" / "model"


def run_cpu(marker: bytes) -> dict[str, float]:
    """CPU seconds so far of the processes whose command line or environment names ``marker``, by role."""
    by_role: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if marker not in command and marker not in Path(f"/proc/{pid}/environ").read_bytes():
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        name = role(int(pid))
        by_role[name] = by_role.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return by_role


def last_step(metrics: Path) -> int:
    try:
        return max(
            (json.loads(line)["step"] for line in metrics.read_text().splitlines() if "time/step" in line), default=0
        )
    except OSError:
        return 0


def run_once(tree: Path, overrides: list[str], model: Path, fileroot: Path, steps: int, skip: int) -> dict:
    """One ``areal-hpc train`` of ``tree``: medians of the step's parts, CPU per step by role, other load."""
    shutil.rmtree(fileroot, ignore_errors=True)
    command = train_command(
        CONFIG,
        f"model.path={model}",
        "rl.sft_warmup_steps=0",
        f"rl.total_train_steps={steps}",
        "rl.eval_every_steps=0",
        "saver.freq_steps=0",
        "stats.plot=false",
        "stats.tensorboard=false",
        f"cluster.fileroot={fileroot}",
        *overrides,
    )
    metrics = fileroot / "quickstart" / "trial0" / "metrics.jsonl"
    process = subprocess.Popen(
        command,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    marks = []  # (step, time, CPU of the run by role, machine CPU) at the first and the last measured step
    while process.poll() is None:
        step = last_step(metrics)
        if (not marks and step >= skip) or (len(marks) == 1 and step >= steps - 1):
            marks.append((step, time.monotonic(), run_cpu(str(fileroot).encode()), cpu_seconds()[0]))
        time.sleep(0.05)
    output = process.stdout.read()
    if process.returncode or len(marks) < 2:
        raise RuntimeError(f"{' '.join(command)} failed (exit {process.returncode}):\n{output[-3000:]}")
    (s0, t0, cpu0, all0), (s1, t1, cpu1, all1) = marks
    ours = {role: (cpu1[role] - cpu0.get(role, 0.0)) / (s1 - s0) for role in cpu1}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps_measured = [r for r in records if "time/step" in r and r["step"] > skip]
    # a step's parts, and its weight push's (its own record since the push runs beside the next update)
    row = {
        part: statistics.median(values)
        for part in PARTS
        if (values := [r[part] for r in records if part in r and r["step"] > skip])
    }
    return {
        **row,
        "cpu_per_step": ours,
        "cpu_per_step_total": sum(ours.values()),
        "other_load_cores": (all1 - all0 - sum(ours.values()) * (s1 - s0)) / (t1 - t0),
        "mean_reward": statistics.fmean(r["rollout/reward"] for r in steps_measured),
    }


def parse_variant(spec: str) -> tuple[str, str, list[str]]:
    label, _, rest = spec.partition("=")
    commit, *overrides = rest.split()
    return label, commit, overrides


def run(args) -> dict:
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model = Path(args.start_model).resolve() if args.start_model else start_model(root)
    variants = []
    for label, commit, overrides in map(parse_variant, args.variant or VARIANTS):
        tree, short = export(commit, root)
        variants.append({"label": label, "commit": short, "overrides": overrides, "tree": tree, "runs": []})
    started_load = os.getloadavg()
    for repeat in range(args.repeats):
        for v in variants:
            v["runs"].append(run_once(v["tree"], v["overrides"], model, root / "run", args.steps, args.skip))
            r = v["runs"][-1]
            print(
                f"repeat {repeat + 1}/{args.repeats} {v['label']}: {r['time/step']:.3f} s/step, "
                f"{r['cpu_per_step_total']:.3f} CPU-s/step, other load {r['other_load_cores']:.2f} cores",
                flush=True,
            )
    first = variants[0]["runs"]
    rows = []
    for v in variants:
        runs = v["runs"]

        def median(key: str) -> float | None:
            values = [r[key] for r in runs if key in r]  # noqa: B023 - called within this iteration
            return statistics.median(values) if values else None

        rows.append(
            {
                "variant": v["label"],
                "commit": v["commit"],
                "overrides": v["overrides"],
                **{part: median(part) for part in PARTS},
                "cpu_per_step_total": median("cpu_per_step_total"),
                "cpu_per_step": {
                    role: statistics.median(r["cpu_per_step"].get(role, 0.0) for r in runs)
                    for role in runs[0]["cpu_per_step"]
                },
                "other_load_cores": median("other_load_cores"),
                "ratio_vs_first": statistics.median(r["time/step"] / f["time/step"] for r, f in zip(runs, first)),
                "s_per_step_each": [r["time/step"] for r in runs],
            }
        )
    return {
        "benchmark": "rl_step",
        "date": date.today().isoformat(),
        "machine": machine(),
        "versions": {"python": platform.python_version(), **_versions()},
        "steps": args.steps,
        "skip": args.skip,
        "repeats": args.repeats,
        "start_model": str(model),
        "load_average_start_end": [started_load[0], os.getloadavg()[0]],
        "rows": rows,
    }


def _versions() -> dict:
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in ("torch", "transformers", "aiohttp")}


def report(r: dict) -> str:
    lines = [
        f"# The quickstart's RL step at several commits ({r['date']})",
        "",
        machine_and_versions(r)
        + f" 1-minute load average at the start and the end: {r['load_average_start_end'][0]:.2f}, "
        f"{r['load_average_start_end'][1]:.2f}.",
        f"{r['repeats']} repeats, each running every variant in turn; per run {r['steps']} RL steps of "
        f"`areal-hpc train --config {CONFIG}` from {r['start_model']}, medians over the steps after the first "
        f"{r['skip']}; the table: medians over the repeats.",
        "",
        "| variant | commit, overrides | s/step | vs first (median of per-repeat ratios) | train (s) | "
        "wait for batch (s) | stage (s) | push (s) | CPU-s/step (trainer, server, helpers, launcher) | "
        "other load (cores) | s/step of each repeat |",
        "|---" * 11 + "|",
    ]
    for row in r["rows"]:
        cpu = row["cpu_per_step"]
        stage, push = (f"{row[part]:.3f}" if row[part] is not None else "-" for part in ("time/stage", "time/push"))
        lines.append(
            f"| {row['variant']} | {row['commit']} {' '.join(row['overrides'])} | {row['time/step']:.3f} | "
            f"**{row['ratio_vs_first']:.2f}x** | {row['time/train']:.3f} | {row['time/generate_wait']:.3f} | {stage} | {push} | "
            f"{row['cpu_per_step_total']:.3f} ({cpu.get('trainer', 0):.3f}, {cpu.get('rollout server', 0):.3f}, "
            f"{cpu.get('helpers', 0):.3f}, {cpu.get('launcher', 0):.3f}) | {row['other_load_cores']:.2f} | "
            + ", ".join(f"{s:.3f}" for s in row["s_per_step_each"])
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variant",
        action="append",
        metavar="LABEL=COMMIT [KEY=VALUE ...]",
        help=f"a commit and config overrides (repeatable; default: {VARIANTS})",
    )
    parser.add_argument("--steps", type=int, default=60, help="RL steps of every run")
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=3, help="times every variant runs, in turn")
    parser.add_argument("--start-model", default="", help="starting model folder (default: a fresh SFT warm-up)")
    parser.add_argument(
        "--root",
        default=str(Path(tempfile.gettempdir()) / "areal-hpc-rl-step"),
        help="folder of the exported commits, the warm-up and the runs",
    )
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    parser.add_argument("--name", default="rl_step", help="the record's name: bench/results/NAME-<date>.md")
    args = parser.parse_args()
    run_and_record(args.name, args, run, report)


if __name__ == "__main__":
    main()
