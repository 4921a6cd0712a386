"""What trainer rank 0's rollout side costs the update it shares a process with: the quickstart's update
alone, beside a Python thread of the same process, and beside a process, each neighbour busy the same
share of the other core.

    .venv/bin/python bench/update_interference.py [--updates 30] [--rounds 3] [--duty 0.22] [--save]

Why: in ``areal-hpc train`` trainer rank 0's event loop (HTTP replies, episodes, rewards, shard commits)
runs Python on the rollout server's core while the update runs on its own. Both are threads of one
interpreter. Per thread from /proc, in a quickstart run on 2 cores the event loop uses ~17% of a core and
the shard commits 5% (hence ``--duty 0.22``), the update thread 68%; the update takes ~0.13 s in the run
and ~0.10 s alone on the same batches. This benchmark isolates the cause: the
neighbour here is a plain Python loop, busy ``duty`` of every 10 ms on the other core, either a thread
(sharing the interpreter's lock with the update, as the rollout side does now) or a process of its own
(as AReaL's rollout workers are). The update: ``TrainerRanks.update`` of the quickstart's config (tree
training, bfloat16 autocast) on a freshly initialised model, one torch thread, a batch of 16 prompts x
8 answers of 2-5 tokens (the quickstart's answers average ~3.2). Each round runs every variant in turn;
the table gives the median update time per variant and its ratio to the update alone.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, machine_and_versions, run_and_record
from trainer_step import CONFIG, quickstart_trajectories

from areal_hpc.config import load_config
from areal_hpc.data.registry import corpus_for_tokenizer
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.models.tiny import init_model
from areal_hpc.parallel.mesh import close_distributed
from areal_hpc.resolve import Host, resolve
from areal_hpc.train.build import build_actor, start_trainer
from areal_hpc.train.trainer_ranks import TrainerRanks

PERIOD_S = 0.01  # the neighbour's cycle: busy for duty x PERIOD_S, then asleep
OUTPUT_TOKENS = (2, 5)
VARIANTS = ("alone", "beside a Python thread", "beside a process")


def busy(duty: float, core: int, stop) -> None:
    """Pure Python work ``duty`` of every PERIOD_S on ``core`` until ``stop`` is set."""
    os.sched_setaffinity(0, {core})  # this thread (or process) only
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < duty * PERIOD_S:
            sum(range(200))
        time.sleep((1.0 - duty) * PERIOD_S)


class Neighbour:
    """The variant's neighbour, running while the ``with`` block does."""

    def __init__(self, variant: str, duty: float, core: int):
        self.variant, self.duty, self.core = variant, duty, core

    def __enter__(self) -> Neighbour:
        if self.variant == "beside a Python thread":
            self.stop = threading.Event()
            self.worker = threading.Thread(target=busy, args=(self.duty, self.core, self.stop), daemon=True)
        elif self.variant == "beside a process":
            context = multiprocessing.get_context("fork")  # the child runs only ``busy``
            self.stop = context.Event()
            self.worker = context.Process(target=busy, args=(self.duty, self.core, self.stop), daemon=True)
        else:
            return self
        self.worker.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.variant != "alone":
            self.stop.set()
            self.worker.join()


def run(args) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("update_interference needs two cores: the update's and the neighbour's")
    update_core, neighbour_core = cores[-1], cores[0]
    os.sched_setaffinity(0, {update_core})  # this (the update's) thread
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a group of one, as ``areal-hpc train`` runs rank 0
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="update_interference-") as tmp:
        model = init_model(Path(tmp) / "model", corpus_for_tokenizer(1), preset="tiny", seed=1)
        cfg = resolve(load_config(CONFIG, [f"model.path={model}", f"cluster.fileroot={tmp}"]), Host.probe()).cfg
        _rank, mesh = start_trainer(cfg)
        try:
            actor, engines = build_actor(cfg, mesh)
            group = TrainerRanks(actor, engines, mesh, cfg)
            batch = quickstart_trajectories(cfg, load_tokenizer(model), np.random.default_rng(0), OUTPUT_TOKENS)
            for _ in range(3):  # allocator and autocast caches warm
                group.update(batch)
            for round_ in range(args.rounds):
                for variant in VARIANTS:
                    with Neighbour(variant, args.duty, neighbour_core):
                        for _ in range(args.updates):
                            started = time.perf_counter()
                            group.update(batch)
                            times[variant].append(time.perf_counter() - started)
                print(
                    f"round {round_ + 1}/{args.rounds}: "
                    + ", ".join(f"{v} {statistics.median(t):.4f} s" for v, t in times.items()),
                    flush=True,
                )
        finally:
            close_distributed()
    alone = statistics.median(times["alone"])
    rows = [
        {
            "variant": v,
            "update_s": statistics.median(t),
            "ratio_to_alone": statistics.median(t) / alone,
            "updates": len(t),
        }
        for v, t in times.items()
    ]
    return {
        "benchmark": "update_interference",
        "date": date.today().isoformat(),
        "machine": machine(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "duty": args.duty,
        "period_s": PERIOD_S,
        "rounds": args.rounds,
        "updates_per_round": args.updates,
        "output_tokens": list(OUTPUT_TOKENS),
        "rows": rows,
    }


def report(r: dict) -> str:
    lines = [
        f"# The update beside a busy neighbour: thread vs process ({r['date']})",
        "",
        machine_and_versions(r),
        f"The quickstart's update (`TrainerRanks.update`, tree training, bfloat16 autocast, one torch thread) "
        f"on its own core; the neighbour busy {r['duty']:.0%} of every {r['period_s'] * 1e3:.0f} ms with "
        f"pure Python on the other core. {r['rounds']} rounds x {r['updates_per_round']} updates per "
        f"variant, variants in turn.",
        "",
        "| update | median s | ratio to alone |",
        "|---|---:|---:|",
    ]
    lines += [f"| {row['variant']} | {row['update_s']:.4f} | {row['ratio_to_alone']:.2f}x |" for row in r["rows"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=30, help="updates per variant per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every variant in turn")
    parser.add_argument("--duty", type=float, default=0.22, help="the neighbour's busy share of its core")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    if not 0.0 <= args.duty < 1.0:
        parser.error(f"--duty must be in [0, 1), got {args.duty}")
    run_and_record("update_interference", args, run, report)


if __name__ == "__main__":
    main()
