"""How long a process takes to end once its program is done: the interpreter's own exit (module
teardown and its garbage collections) against ``areal_hpc.runtime.exit.exit_process``, for processes
that imported what a trainer or a rollout server imports, and for a whole short ``areal-hpc train``.

    .venv/bin/python bench/process_exit.py [--repeats 5] [--runs 2] [--before REV] [--save]

Exit time: the program prints a wall-clock time as its last act; the parent notes when the process has
ended (``wait``); the difference, median over ``--repeats`` alternating pairs. The run: a 2-step
quickstart RL run of the tiny model (the test suite's settings), wall time of the command, the package
as it is against the package at ``--before`` (default ecd23b6, the last revision without
``exit_process``); ``--runs`` alternating pairs.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recording import REPO, machine, run_and_record, train_command
from rl_step import export

IMPORTS = ("import torch", "import torch, areal_hpc.train.driver", "import torch, areal_hpc.rollout.server")
ENDINGS = {
    "interpreter exit": "sys.exit(0)",
    "exit_process": "from areal_hpc.runtime.exit import exit_process; exit_process(0)",
}
SMALL_RUN = [
    "rl.total_train_steps=2",
    "dataset.train_size=64",
    "dataset.eval_size=16",
    "rl.sft_warmup_steps=0",
    "rollout.consumer_batch_size=4",
    "rollout.max_concurrent_rollouts=8",
    "generation.n_samples=4",
    "generation.max_new_tokens=6",
    "rollout.max_running_requests=32",
    "stats.tensorboard=false",
]


def exit_seconds(imports: str, ending: str) -> float:
    code = f"import sys, time; {imports}; print(time.time(), flush=True); {ending}"
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    printed = float(process.stdout.readline())
    process.wait()
    return time.time() - printed


def run_seconds(package_root: Path, model: Path, fileroot: Path) -> float:
    shutil.rmtree(fileroot, ignore_errors=True)
    started = time.time()
    subprocess.run(
        train_command(
            str(REPO / "configs/quickstart.yaml"),
            f"model.path={model}",
            f"cluster.fileroot={fileroot}",
            *SMALL_RUN,
        ),
        cwd=package_root,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(package_root), "HF_HUB_OFFLINE": "1"},
        check=True,
        capture_output=True,
    )
    return time.time() - started


def run(args) -> dict:
    rows = []
    for imports in IMPORTS:
        seconds = {ending: [] for ending in ENDINGS}
        for _ in range(args.repeats):
            for ending, code in ENDINGS.items():
                seconds[ending].append(exit_seconds(imports, code))
        rows.append(
            {"process": f"python -c '{imports}'", **{ending: statistics.median(s) for ending, s in seconds.items()}}
        )
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        from areal_hpc.data.registry import corpus_for_tokenizer
        from areal_hpc.models.tiny import init_model

        model = init_model(scratch / "model", corpus_for_tokenizer(0), preset="tiny", seed=0)
        slow, _ = export(args.before, scratch)
        runs = {"interpreter exit": [], "exit_process": []}
        for _ in range(args.runs):
            runs["interpreter exit"].append(run_seconds(slow, model, scratch / "runs"))
            runs["exit_process"].append(run_seconds(REPO, model, scratch / "runs"))
    rows.append(
        {
            "process": f"areal-hpc train, 2 steps (the command; {args.before} vs now, {args.runs} runs)",
            **{ending: statistics.median(s) for ending, s in runs.items()},
        }
    )
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "versions": f"python {sys.version.split()[0]}, torch {__import__('torch').__version__}",
        "repeats": args.repeats,
        "before": args.before,
        "rows": rows,
    }


def report(result: dict) -> str:
    lines = [
        f"# Process exit ({result['date']})",
        "",
        f"{result['machine']}; {result['versions']}; median of {result['repeats']} alternating pairs",
        "",
        "| process | interpreter exit (s) | exit_process (s) | ratio |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        before, after = row["interpreter exit"], row["exit_process"]
        lines.append(f"| {row['process']} | {before:.3f} | {after:.3f} | {after / before:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--before", default="ecd23b6", help="the revision to compare with")
    parser.add_argument("--save", action="store_true")
    run_and_record("process_exit", parser.parse_args(), run, report)
