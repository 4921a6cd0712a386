"""What every benchmark records: the machine it ran on, and its result files in bench/results/."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


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
