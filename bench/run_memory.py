"""Memory of the quickstart's RL run, process by process: PSS (shared pages split between the
processes sharing them) of the launcher, fork server, rollout server, trainer and helpers, at steady
state and at peak, with today's defaults and with the previous ones, run in turn on one machine.

    .venv/bin/python bench/run_memory.py --start-model DIR [--steps 60] [--repeats 2] [--save]

Workload: ``areal-hpc train --config configs/quickstart.yaml`` from ``--start-model`` (RL only, evaluations
every 20 steps on 500 problems, as ``make demo`` runs its RL). Variants:
- ``defaults``: as shipped (fork server, glibc arenas and oneDNN caches bounded, KV cache grown on demand);
- ``previous``: ``cluster.fork_server=false`` and glibc's and oneDNN's own defaults (MALLOC_ARENA_MAX=8 per
  core, 1024 cached primitives each). The KV cache's growth has no switch: both variants have it, so the
  difference understates what changed (it saved ~130 MB in the rollout server).
The tree of the launcher is sampled every ``SAMPLE_S`` s from /proc; each process is named by its role;
steady = the median over the second half of the run, peak = the largest sample (of each role, and of
the sum over the tree, which is what the issue's 1 GiB target is about).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record, train_command
from run_processes import process_tree, pss_mib, role

REPO = Path(__file__).resolve().parent.parent
SAMPLE_S = 0.5
TARGET_GIB = 1.0
VARIANTS = {
    "defaults": ([], {}),
    "previous": (
        ["cluster.fork_server=false"],
        {
            "MALLOC_ARENA_MAX": str(8 * os.cpu_count()),
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024",
            "LRU_CACHE_CAPACITY": "1024",
        },
    ),
}


def sample_roles(root: int, done: threading.Event, samples: list) -> None:
    start = time.monotonic()
    while not done.is_set():
        by_role: dict[str, float] = {}
        for pid in process_tree(root):
            name = role(pid)
            by_role[name] = by_role.get(name, 0.0) + pss_mib(pid)
        samples.append((time.monotonic() - start, by_role))
        done.wait(SAMPLE_S)


def run_variant(name: str, args, fileroot: Path) -> dict:
    overrides, env = VARIANTS[name]
    command = train_command(
        "configs/quickstart.yaml",
        f"model.path={args.start_model}",
        "rl.sft_warmup_steps=0",
        f"rl.total_train_steps={args.steps}",
        f"cluster.fileroot={fileroot}",
        *overrides,
    )
    samples, done = [], threading.Event()
    with open(fileroot.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}
        )
        sampler = threading.Thread(target=sample_roles, args=(process.pid, done, samples), daemon=True)
        sampler.start()
        code = process.wait()
    done.set()
    sampler.join()
    if code:
        raise SystemExit(f"{name}: the run exited with {code}; see {fileroot.with_suffix('.log')}")
    half = samples[-1][0] / 2
    roles = sorted({r for _, by_role in samples for r in by_role} - {"gone"})
    row = {"variant": name}
    for r in [*roles, "total"]:
        values = [(t, by_role.get(r, 0.0) if r != "total" else sum(by_role.values())) for t, by_role in samples]
        row[r] = {
            "steady_mib": statistics.median(v for t, v in values if t >= half),
            "peak_mib": max(v for _, v in values),
        }
    return row


def run(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="run_memory-") as scratch:
        for repeat in range(args.repeats):
            for name in VARIANTS:
                print(f"repeat {repeat + 1}/{args.repeats}: {name}", flush=True)
                rows.append(run_variant(name, args, Path(scratch) / f"{name}-{repeat}"))
    totals = {
        name: statistics.median(r["total"]["peak_mib"] for r in rows if r["variant"] == name) for name in VARIANTS
    }
    return {
        "date": str(date.today()),
        "machine": machine(),
        "steps": args.steps,
        "start_model": args.start_model,
        "rows": rows,
        "peak_total_mib": totals,
        "peak_ratio_defaults_over_previous": totals["defaults"] / totals["previous"],
        "target_gib": TARGET_GIB,
        "target_met": totals["defaults"] / 1024 <= TARGET_GIB,
    }


def report(result: dict) -> str:
    lines = [
        f"# Memory of the quickstart's RL run by process ({result['date']})",
        "",
        f"{result['machine']}; {result['steps']} RL steps from {result['start_model']}; PSS in MiB, "
        "steady (median of the second half) / peak.",
        "",
        "| variant | role | steady | peak |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        for r, values in row.items():
            if r != "variant" and values["peak_mib"] >= 1:  # a role seen only while starting or gone
                lines.append(f"| {row['variant']} | {r} | {values['steady_mib']:.0f} | {values['peak_mib']:.0f} |")
    totals = result["peak_total_mib"]
    lines += [
        "",
        f"Peak of the whole tree (median over repeats): defaults {totals['defaults'] / 1024:.2f} GiB, "
        f"previous {totals['previous'] / 1024:.2f} GiB (ratio {result['peak_ratio_defaults_over_previous']:.2f}); "
        f"target <= {result['target_gib']} GiB: {'met' if result['target_met'] else 'not met'}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start-model", required=True, help="model folder after the quickstart's SFT warm-up")
    parser.add_argument("--steps", type=int, default=60, help="RL steps of every run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, in turn")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    args.start_model = str(Path(args.start_model).resolve())
    run_and_record("run_memory", args, run, report)


if __name__ == "__main__":
    main()
