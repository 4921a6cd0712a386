"""`make demo` over several seeds: held-out accuracy against wall time from the launch, for the whole
job (SFT warm-up, then asynchronous GRPO), so "the demo learns" is a spread, not one lucky run.

    .venv/bin/python bench/demo_seeds.py [--seeds 1 2 3] [--set KEY=VALUE ...] [--label NAME] [--save]

Each seed is ``areal-hpc train --config configs/quickstart.yaml experiment.seed=S`` end to end (the seed
draws the model's initialisation, the SFT order and the RL prompts). The baseline is the accuracy RL
starts from (the SFT warm-up's, step 0); the report gives each evaluation's mean and range over seeds,
the gain over the baseline, the job's wall time, and a plot of accuracy against wall seconds. Per seed: the
SFT point, the mean of the last three evaluations (one evaluation alone is noisy), the gain, the job's
wall time and its peak memory (the launcher's PSS line), against the demo's targets: SFT point within
35-60% and within ±5 points over the seeds, gain >= +20 points, <= 4 minutes, <= 1 GiB.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record, train_command

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/quickstart.yaml"
PEAK = re.compile(r"peak memory of the run's processes: ([\d.]+) GiB")
TARGETS = {"sft_range": (0.35, 0.60), "sft_spread": 0.05, "gain": 0.20, "wall_s": 240, "peak_gib": 1.0}


def run_seed(root: Path, seed: int, overrides: list[str]) -> dict:
    started = time.time()
    done = subprocess.run(
        train_command(
            CONFIG,
            f"cluster.fileroot={root}",
            f"experiment.seed={seed}",
            *overrides,
        ),
        cwd=REPO,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    wall = time.time() - started
    peak = PEAK.search(done.stdout)
    run_dir = root / "quickstart" / "trial0"
    rl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sft = [json.loads(line) for line in (run_dir / "sft_warmup" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["time"] - started, r["eval/accuracy"]) for r in rl if "eval/accuracy" in r]
    steps = [r for r in rl if "time/step" in r]
    return {
        "seed": seed,
        "wall_s": wall,
        "evals": evals,
        "peak_gib": float(peak.group(1)) if peak else None,
        "sft_accuracy": [r["eval/accuracy"] for r in sft if "eval/accuracy" in r][-1],
        "sft_steps": max(r["step"] for r in sft if "train/loss" in r),
        "last3": float(np.mean([a for _, _, a in evals[-3:]])),
        "rl_seconds_per_step": (steps[-1]["time"] - steps[0]["time"]) / max(1, len(steps) - 1),
    }


def run(args) -> dict:
    import torch

    rows = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix="demo_seeds-") as tmp:
            rows.append(run_seed(Path(tmp), seed, args.set))
    return {
        "benchmark": "demo_seeds",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "config": CONFIG,
        "overrides": args.set,
        "rows": rows,
    }


def report(result: dict) -> str:
    rows = result["rows"]
    steps = [step for step, _, _ in rows[0]["evals"]]
    lines = [
        f"# make demo over {len(rows)} seeds ({result['date']})",
        "",
        f"machine: {result['machine']}",
        f"versions: {result['versions']}; config {result['config']} {' '.join(result.get('overrides', []))}, "
        "end to end (SFT warm-up + RL)",
        "",
        "| RL step | wall s from launch (mean) | eval accuracy mean | min | max | gain over step 0 (mean) |",
        "|---|---|---|---|---|---|",
    ]
    start = np.mean([r["evals"][0][2] for r in rows])
    for i, step in enumerate(steps):
        accuracy = [r["evals"][i][2] for r in rows]
        wall = np.mean([r["evals"][i][1] for r in rows])
        lines.append(
            f"| {step} | {wall:.0f} | {np.mean(accuracy):.1%} | {min(accuracy):.1%} | {max(accuracy):.1%} | "
            f"{np.mean(accuracy) - start:+.1%} |"
        )
    lines += [
        "",
        "| seed | SFT steps | SFT point (RL step 0) | mean of the last 3 evaluations | gain | best | "
        "job wall time | RL s/step | peak PSS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        accuracy = [a for _, _, a in r["evals"]]
        peak = f"{r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else "-"
        lines.append(
            f"| {r['seed']} | {r['sft_steps']} | {accuracy[0]:.1%} | {r['last3']:.1%} | "
            f"{100 * (r['last3'] - accuracy[0]):+.1f} | {max(accuracy):.1%} | {r['wall_s']:.0f} s | "
            f"{r['rl_seconds_per_step']:.3f} | {peak} |"
        )
    return "\n".join(lines + ["", verdict(rows)])


def verdict(rows: list[dict]) -> str:
    """Each target of the demo, met or not, from the per-seed rows."""
    low, high = TARGETS["sft_range"]
    points = [r["evals"][0][2] for r in rows]
    gains = [r["last3"] - r["evals"][0][2] for r in rows]
    peaks = [r["peak_gib"] for r in rows if r.get("peak_gib") is not None]
    checks = [
        (
            f"SFT point in {low:.0%}-{high:.0%}",
            all(low <= p <= high for p in points),
            ", ".join(f"{p:.1%}" for p in points),
        ),
        (
            f"SFT points within one ±{100 * TARGETS['sft_spread']:.0f}-point band (range <= {200 * TARGETS['sft_spread']:.0f})",
            max(points) - min(points) <= 2 * TARGETS["sft_spread"],
            f"range {100 * (max(points) - min(points)):.1f}",
        ),
        (
            f"gain >= +{100 * TARGETS['gain']:.0f} points (mean of seeds)",
            np.mean(gains) >= TARGETS["gain"],
            f"{100 * np.mean(gains):+.1f} (each: {', '.join(f'{100 * g:+.1f}' for g in gains)})",
        ),
        (
            f"job <= {TARGETS['wall_s']} s",
            all(r["wall_s"] <= TARGETS["wall_s"] for r in rows),
            ", ".join(f"{r['wall_s']:.0f} s" for r in rows),
        ),
        (
            f"peak PSS <= {TARGETS['peak_gib']} GiB",
            bool(peaks) and max(peaks) <= TARGETS["peak_gib"],
            ", ".join(f"{p:.2f}" for p in peaks) or "not printed",
        ),
    ]
    return "\n".join(f"- {'met' if ok else '**not met**'}: {name} ({value})" for name, ok, value in checks)


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in result["rows"]:
        _, seconds, accuracy = zip(*r["evals"])
        ax.plot(seconds, accuracy, marker="o", label=f"seed {r['seed']}")
    ax.set_xlabel("wall seconds from launch (SFT warm-up, then RL)")
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle("make demo: accuracy over time")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--label", default="", help="recorded as demo_seeds-LABEL (e.g. the overrides' name)")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    arguments = parser.parse_args()
    run_and_record("demo_seeds" + (f"-{arguments.label}" if arguments.label else ""), arguments, run, report, plot)
