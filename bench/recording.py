"""What every benchmark records: the machine it ran on, and its result files in bench/results/; and for
demos made of several runs of the real commands, running each once (an interrupted demo continues) and
reading its metrics."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent


def machine() -> str:
    return f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}, {platform.platform()}"


def save(name: str, result: dict, text: str) -> Path:
    """Write ``<name>-<date>.md`` (the table) and ``.json`` (the numbers); returns the path stem."""
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{name}-{result['date']}"
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return stem


def run_and_record(name: str, args, run, report, plot=None) -> None:
    """Run the benchmark, print its table, and with ``--save`` record it (and its plot, if any)."""
    result = run(args)
    text = report(result)
    print(text)
    if args.save:
        stem = save(name, result, text)
        if plot is not None:
            plot(result, stem.with_suffix(".png"))


def once(done: Path, command: list[str], log: Path) -> float:
    """Run ``command`` unless ``done`` exists; its seconds (from ``done``)."""
    if not done.exists():
        started = time.time()
        with open(log, "w") as out:
            subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=True)
        done.write_text(json.dumps({"seconds": time.time() - started}))
    return json.loads(done.read_text())["seconds"]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def last3(values: list[float]) -> float:
    return float(np.mean(values[-3:]))
