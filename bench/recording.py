"""What every benchmark records: the machine it ran on, and its result files in bench/results/; and for
demos made of several runs of the real commands, running each once (an interrupted demo continues) and
reading its metrics."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent


def machine() -> str:
    gpus = accelerators()
    return f"{platform.node()}: {os.cpu_count()} cores, {cpu_model()}, {platform.machine()}, {platform.platform()}" + (
        f", GPUs: {gpus}" if gpus else ""
    )


def accelerators() -> str:
    """The GPUs ``nvidia-smi`` lists (name, memory, driver), counted; empty without any. Asked of a child
    process: this one initialises no accelerator (benchmarks fork workers after recording)."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    counts = collections.Counter(line.strip() for line in listed.splitlines() if line.strip())
    return "; ".join(f"{n} x {gpu}" for gpu, n in counts.items())


def cpu_model() -> str:
    """The CPU's model name and the matrix extensions torch's CPU kernels use (bf16, AMX, VNNI): machines
    of one name differ in them, and ratios move with them."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    extensions = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    family = f"family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields else ""
    return " ".join(
        filter(
            None,
            [
                fields.get("model name", platform.processor() or "unknown CPU"),
                family,
                f"({' '.join(extensions)})" if extensions else "",
            ],
        )
    )


def versions(*packages: str) -> dict[str, str]:
    """A record's ``versions``: Python's and each installed package's (by its distribution name)."""
    from importlib.metadata import version

    return {"python": platform.python_version(), **{package: version(package) for package in packages}}


def machine_and_versions(result: dict) -> str:
    """A result table's line naming what it ran on: ``Machine: ... Versions: torch 2.x, ...``."""
    return (
        f"Machine: {result['machine']}. Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + "."
    )


def record_name(benchmark: str, label: str = "") -> str:
    """A record's name before its date: the benchmark's, with ``--label`` after it when one is given."""
    return f"{benchmark}-{label}" if label else benchmark


def save(name: str, result: dict, text: str, folder: Path = RESULTS) -> Path:
    """Write ``<name>-<date>.md`` (the table) and ``.json`` (the numbers) in ``folder`` (bench/results/ by
    default); returns the path stem."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"{name}-{result['date']}"
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


def train_command(config: str, *overrides: str) -> list[str]:
    """``areal-hpc train --config CONFIG key=value ...`` as this Python runs it."""
    return [sys.executable, "-m", "areal_hpc", "train", "--config", config, *overrides]


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
