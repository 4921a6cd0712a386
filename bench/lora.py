"""LoRA (``actor.lora``) vs full fine-tuning of the quickstart's trainer, in one run: s/step, peak memory,
trained parameters, the weight push and the checkpoint.

    .venv/bin/python bench/lora.py [--presets tiny small] [--rank 8] [--steps 20] [--repeats 2] [--save]

Workload: the quickstart's RL training batch (16 prompts x 8 samples of 3-8 tokens, as
``bench/trainer_step.py`` builds it) through the trainer's own path (``build_actor`` on one process:
``TorchTrainEngine`` + ``PPOActor.update``) with ``configs/quickstart.yaml``'s settings (bfloat16
autocast, AdamW), on a freshly initialised model of each preset (tiny: the quickstart's). Each variant
(full, LoRA of ``--rank`` on every attention and MLP projection) runs in its own process on one thread
(its own allocator and peak), the variants in turn ``--repeats`` times; per process: the median of
``--steps`` PPO steps after two untimed ones (``s_per_step_alone``), the peak resident set during them
over what the process held before (``repro_dta.PeakResidentSet``), the process's peak resident set
altogether (imports included), the optimizer state, one weight push (``rollout_weights``: with LoRA the merge of every
adapted layer) and one checkpoint (``save``: with LoRA the adapters only). The s/step of the table
comes from one more process that holds both trainers and steps them in turn (``--steps`` each): on a
loaded machine separate processes saw the same variant take 0.31 and 0.50 s/step.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record

CONFIG = "configs/quickstart.yaml"


def _measure(model_dir: str, overrides: list[str], steps: int) -> dict:
    """In a fresh process on one thread: the trainer's step, memory, push and checkpoint."""
    import numpy as np
    import torch
    from trainer_step import quickstart_trajectories

    from areal_hpc.algo.temperature import run_temperature
    from areal_hpc.config import load_config
    from areal_hpc.resolve import Host, resolve
    from areal_hpc.train.build import build_actor
    from areal_hpc.train.repro_dta import PeakResidentSet
    from areal_hpc.train.trajectory_batch import build_batch, split_minibatches

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        loaded = load_config(CONFIG, [f"model.path={model_dir}", f"cluster.fileroot={tmp}", *overrides])
        cfg = resolve(loaded, Host.probe()).cfg
        actor, engines = build_actor(cfg, None)
        engine = engines["actor"]
        trajectories = quickstart_trajectories(cfg, engine.tokenizer, np.random.default_rng(0))
        max_new, temperature = cfg.generation.max_new_tokens, run_temperature(cfg.generation)

        def step() -> None:
            batch = build_batch(trajectories, cfg.actor, max_new, temperature)  # as TrainerRanks does
            actor.update(split_minibatches(batch, trajectories, cfg.actor, max_new))

        times = []
        with PeakResidentSet() as memory:
            before = PeakResidentSet.now()
            for k in range(steps + 2):
                started = time.perf_counter()
                step()
                if k >= 2:
                    times.append(time.perf_counter() - started)
        started = time.perf_counter()
        pushed = sum(t.numel() * t.element_size() for bucket in engine.rollout_weights(64 << 20) for _, t in bucket)
        push_s = time.perf_counter() - started
        folder = Path(tmp) / "checkpoint"
        started = time.perf_counter()
        engine.save(folder)
        save_s = time.perf_counter() - started
        optimizer_bytes = sum(
            v.numel() * v.element_size()
            for state in engine.optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v) and v.dim()
        )
        return {
            "s_per_step": statistics.median(times),
            "peak_over_start_bytes": memory.peak - before,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "parameters": sum(p.numel() for p in engine.model.parameters()),
            "trained_parameters": sum(p.numel() for p in engine.model.parameters() if p.requires_grad),
            "optimizer_state_bytes": optimizer_bytes,
            "push_bytes": pushed,
            "push_s": push_s,
            "checkpoint_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
            "save_s": save_s,
        }


def _interleaved(model_dir: str, variants: dict[str, list[str]], steps: int) -> dict[str, float]:
    """In a fresh process on one thread: every variant's trainer, one step of each in turn (a burst of
    other load hits them alike); the median s/step of each after two untimed rounds."""
    import numpy as np
    import torch
    from trainer_step import quickstart_trajectories

    from areal_hpc.algo.temperature import run_temperature
    from areal_hpc.config import load_config
    from areal_hpc.resolve import Host, resolve
    from areal_hpc.train.build import build_actor
    from areal_hpc.train.trajectory_batch import build_batch, split_minibatches

    torch.set_num_threads(1)
    trainers, times = {}, {name: [] for name in variants}
    for name, overrides in variants.items():
        cfg = resolve(load_config(CONFIG, [f"model.path={model_dir}", *overrides]), Host.probe()).cfg
        actor, engines = build_actor(cfg, None)
        trainers[name] = cfg, actor, quickstart_trajectories(cfg, engines["actor"].tokenizer, np.random.default_rng(0))
    for k in range(steps + 2):
        for name, (cfg, actor, trajectories) in trainers.items():
            started = time.perf_counter()
            max_new = cfg.generation.max_new_tokens
            batch = build_batch(trajectories, cfg.actor, max_new, run_temperature(cfg.generation))
            actor.update(split_minibatches(batch, trajectories, cfg.actor, max_new))
            if k >= 2:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(samples) for name, samples in times.items()}


def in_child(function, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def run(args) -> dict:
    import torch

    from areal_hpc.data.registry import corpus_for_tokenizer
    from areal_hpc.models.tiny import init_model

    os.environ["OMP_NUM_THREADS"] = "1"
    variants = {
        "full": [],
        f"lora r={args.rank}": [f"actor.lora.rank={args.rank}", f"actor.lora.alpha={2 * args.rank}"],
    }
    load, rows = [os.getloadavg()[0]], []
    with tempfile.TemporaryDirectory(prefix="bench-lora-models-") as tmp:
        for preset in args.presets:
            model = init_model(Path(tmp) / preset, corpus_for_tokenizer(1), preset=preset, seed=1)
            runs: dict[str, list[dict]] = {name: [] for name in variants}
            for repeat in range(args.repeats):
                for name, overrides in variants.items():
                    runs[name].append(in_child(_measure, str(model), overrides, args.steps))
                    print(
                        f"{preset} {name} #{repeat + 1}: {runs[name][-1]['s_per_step']:.4f} s/step",
                        file=sys.stderr,
                        flush=True,
                    )
            interleaved = in_child(_interleaved, str(model), variants, args.steps)
            for name, samples in runs.items():
                row = {"preset": preset, "variant": name, "runs": samples}
                for key in samples[0]:
                    row[key] = statistics.median(s[key] for s in samples)
                row["s_per_step_alone"], row["s_per_step"] = row["s_per_step"], interleaved[name]
                rows.append(row)
    load.append(os.getloadavg()[0])
    return {
        "benchmark": "lora",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "peft": __import__("peft").__version__,
        },
        "steps": args.steps,
        "repeats": args.repeats,
        "rank": args.rank,
        "rows": rows,
        "load_average_1min": load,
    }


def report(result: dict) -> str:
    mib = 2**20
    lines = [
        f"# LoRA vs full fine-tuning, the quickstart's trainer ({result['date']})",
        "",
        f"machine: {result['machine']}; versions: {result['versions']}; one thread, one process per variant, "
        f"s/step: median of {result['steps']} steps of each variant in turn in one process; memory, push and "
        f"checkpoint: median of {result['repeats']} processes per variant; "
        f"1-minute load average at start and end: {', '.join(f'{x:.2f}' for x in result['load_average_1min'])}",
        "",
        "| model | variant | trained parameters | s/step | peak over start (MiB) | peak RSS (MiB) | "
        "optimizer state (MiB) | push (s) | checkpoint (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["preset"]: r["parameters"] for r in result["rows"] if r["variant"] == "full"}  # without adapters
    for r in result["rows"]:
        lines.append(
            f"| {r['preset']} ({base[r['preset']] / 1e6:.2f}M) | {r['variant']} | "
            f"{r['trained_parameters']:,.0f} "
            f"({r['trained_parameters'] / base[r['preset']]:.1%}) | {r['s_per_step']:.4f} | "
            f"{r['peak_over_start_bytes'] / mib:.1f} | {r['peak_rss_bytes'] / mib:.0f} | "
            f"{r['optimizer_state_bytes'] / mib:.2f} | {r['push_s']:.3f} | "
            f"{r['checkpoint_bytes'] / mib:.2f} |"
        )
    lines += ["", "LoRA / full:", ""]
    for preset in dict.fromkeys(r["preset"] for r in result["rows"]):
        full, lora = (r for r in result["rows"] if r["preset"] == preset)
        ratio = {
            key: lora[key] / full[key]
            for key in (
                "s_per_step",
                "peak_over_start_bytes",
                "peak_rss_bytes",
                "optimizer_state_bytes",
                "push_s",
                "checkpoint_bytes",
            )
        }
        lines.append(
            f"- {preset}: s/step **{ratio['s_per_step']:.2f}x**, peak over start "
            f"**{ratio['peak_over_start_bytes']:.2f}x**, peak RSS {ratio['peak_rss_bytes']:.2f}x, optimizer "
            f"state {ratio['optimizer_state_bytes']:.3f}x, push {ratio['push_s']:.2f}x, checkpoint "
            f"{ratio['checkpoint_bytes']:.3f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--steps", type=int, default=20, help="timed PPO steps per process")
    parser.add_argument("--repeats", type=int, default=2, help="processes per variant, taken in turn")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("lora", parser.parse_args(), run, report)
