"""Training tokens/s of every parallel layout of each engine (torch, megatron) against the single-process
baseline of the same engine, in one run (a correctness-first figure on CPU: see below).

    .venv/bin/python bench/parallel_layouts.py [--steps 4] [--preset small] [--engines torch megatron] [--save]
    .venv/bin/python bench/parallel_layouts.py --preset tiny-moe --engines torch --save   # with ep2

A layout an engine does not build is a "not run" row with its one-line reason.

Each layout starts its ranks as real gloo processes on loopback (as ``tests/trainer_processes.py``
does) through the trainer's own path: ``build_actor`` on the ``actor.parallel`` mesh, ``TrainerRanks``
scattering shares, one PPO step per batch. The workload: 16 groups x 4 samples, prompts of 32-96 and
completions of 32-160 random tokens, every batch the same. Rank 0 times each step after a warm-up
step; tokens/s = tokens forwarded per step / median step time.

On a 2-core machine four ranks share two cores, so a layout can only lose against one process: this
measures what each layout's communication and sharding cost on top of the same arithmetic, not the
speed-up a cluster gets. MFU and GPU tokens/s are recorded where a GPU machine is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record

from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.runtime.name_resolve import free_port

LAYOUTS = {  # name -> (processes, overrides); the single-process baseline first
    "single": (1, ()),
    "dp2": (2, ()),
    "fsdp2": (2, ("actor.parallel.fsdp=true",)),
    "tp2": (2, ("actor.parallel.tp=2",)),
    "pp2": (2, ("actor.parallel.pp=2",)),
    "cp2": (2, ("actor.parallel.cp=2",)),
    "tp2xfsdp2": (4, ("actor.parallel.tp=2", "actor.parallel.fsdp=true")),
    "tp2xpp2": (4, ("actor.parallel.tp=2", "actor.parallel.pp=2")),
    "ep2": (2, ("actor.parallel.ep=2",)),  # Mixture-of-Experts presets only (--preset tiny-moe)
}
REPO = Path(__file__).resolve().parent.parent


def workload(vocab: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    batch = []
    for g in range(16):
        prompt = rng.integers(3, vocab, int(rng.integers(32, 97)))
        for _ in range(4):
            n = int(rng.integers(32, 161))
            segment = Segment(prompt, rng.integers(3, vocab, n), -rng.uniform(0.5, 3.0, n), np.zeros(n, dtype=int))
            batch.append(Trajectory([segment], group_id=f"g{g}", rewards=[Reward(float(rng.integers(0, 2)))]))
    return batch


def rank_main(model: str, out: str, steps: int, overrides: list[str]) -> None:
    """One rank: ``steps`` timed PPO steps after a warm-up step; rank 0 writes the times."""
    from areal_hpc.config import load_config
    from areal_hpc.resolve import Host, resolve
    from areal_hpc.train.build import build_actor, start_trainer
    from areal_hpc.train.trainer_ranks import TrainerRanks, follow

    world = f"rl.trainer_processes={os.environ['WORLD_SIZE']}"
    cfg = load_config(None, [world, f"model.path={model}", f"rl.total_train_steps={steps + 1}", *overrides])
    cfg = resolve(cfg, Host.probe()).cfg
    rank, mesh = start_trainer(cfg)
    actor, engines = build_actor(cfg, mesh)
    if rank == 0:
        group = TrainerRanks(actor, engines, mesh, cfg)
        batch, times = workload(len(actor.actor.tokenizer)), []
        for _ in range(steps + 1):
            started = time.perf_counter()
            stats = group.update(batch)
            times.append(time.perf_counter() - started)
        group.stop()
        Path(out).write_text(json.dumps({"times": times[1:], "tokens": stats["train/tokens"]}))
    else:
        follow(actor, engines, mesh)


def run_layout(model: Path, out: Path, engine: str, layout: str, steps: int) -> dict:
    processes, overrides = LAYOUTS[layout]
    port = str(free_port("127.0.0.1"))
    command = [
        sys.executable,
        __file__,
        "--rank",
        str(model),
        str(out),
        str(steps),
        f"actor.engine={engine}",
        "model.compute_dtype=float32",
        *overrides,
    ]
    ranks = [
        subprocess.Popen(
            command,
            cwd=REPO,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(processes),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": str(max(1, 2 // processes)),
            },
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(processes)
    ]
    codes = [p.wait() for p in ranks]
    if codes != [0] * processes:
        return {"error": next(p.stderr.read().strip().splitlines()[-1] for p, c in zip(ranks, codes) if c)}
    result = json.loads(out.read_text())
    return {"processes": processes, "s_per_step": statistics.median(result["times"]), "tokens": result["tokens"]}


def run(args) -> dict:
    from areal_hpc.data.registry import corpus_for_tokenizer
    from areal_hpc.models.tiny import init_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "model", corpus_for_tokenizer(1), preset=args.preset, seed=1)
        for engine in args.engines:
            for layout in LAYOUTS:
                row = {
                    "engine": engine,
                    "layout": layout,
                    **run_layout(model, Path(tmp) / "out.json", engine, layout, args.steps),
                }
                print(row, flush=True)
                rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["engine"] == row["engine"] and r["layout"] == "single")
        if "s_per_step" in row and "s_per_step" in base:
            row["tokens_per_s"] = row["tokens"] / row["s_per_step"]
            row["vs_single"] = base["s_per_step"] / row["s_per_step"]
    import transformers

    return {
        "date": str(date.today()),
        "machine": machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "preset": args.preset,
        "steps": args.steps,
        "rows": rows,
    }


def report(result: dict) -> str:
    lines = [
        f"# Parallel layouts: training tokens/s vs one process ({result['date']})",
        "",
        f"{result['machine']}; torch {result['torch']}, transformers {result['transformers']}; "
        f"preset {result['preset']}, float32, median of "
        f"{result['steps']} PPO steps after a warm-up (64 sequences, 64-256 tokens).",
        "",
        "CPU figure, correctness first: every layout's ranks share the same 2 cores, so a layout can only lose "
        "against one process; the ratio is what communication and sharding cost here, not a cluster's speed-up.",
        "",
        "| engine | layout | processes | s/step | tokens/s | vs one process |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['engine']} | {row['layout']} | | not run: {row['error'][:90]} | | |")
        else:
            lines.append(
                f"| {row['engine']} | {row['layout']} | {row['processes']} | {row['s_per_step']:.3f} | "
                f"{row['tokens_per_s']:,.0f} | {row['vs_single']:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        from areal_hpc.parallel.mesh import close_distributed

        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
        close_distributed()  # the engines are gone with rank_main's frame
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--preset", default="small", choices=["tiny", "small", "tiny-moe"])
    parser.add_argument("--engines", nargs="+", default=["torch", "megatron"], choices=["torch", "megatron"])
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    run_and_record(f"parallel_layouts-{args.preset}", args, run, report)  # one record per model


if __name__ == "__main__":
    main()
