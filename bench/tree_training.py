"""Tree training (``actor.tree_training=dta``) vs the flat engine on GRPO batches whose groups compress
by c = 2, 4 and 8, in one run: trained tokens/s and peak memory.

    .venv/bin/python bench/tree_training.py [--preset small] [--steps 3] [--save]

Workload: 4 prompts x 16 completions of exactly 14 tokens (random ids), prompts of 16, 56 and 196
tokens, so that sequence tokens / tree tokens = 16 (P + 14) / (P + 16 * 14) = 2, 4, 8 (random first
tokens of two completions may coincide: the measured c is printed). Each variant runs in its own
process on one thread (``areal_hpc.train.repro_dta.measure``): the torch engine's PPO optimizer step
(decoupled loss, AdamW) on a Qwen2 of the preset's shape with random weights, the same 4096-token
budget for micro-batches (flat) and chunks (tree); the median of ``--steps`` steps after a warm-up.
"Trained tokens/s" counts every sequence's own tokens (a shared prompt once per sequence: the work a
flat step does) over the step's seconds; peak memory is the largest resident set during the warm-up and
the timed steps over what the process held before them.

Target (issue 23): tree >= 0.8 c x flat's tokens/s for c <= 4 and >= 0.6 c at c = 8; peak <= flat's.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record

from areal_hpc.train.repro_dta import compression, grpo, measure

REPLY, SAMPLES, GROUPS = 14, 16, 4
PROMPTS = {2: 16, 4: 56, 8: 196}  # c -> prompt length
TARGET = {2: 0.8, 4: 0.8, 8: 0.6}  # c -> the least tree/flat tokens/s ratio, as a fraction of c


def run(args) -> dict:
    import torch

    rows = []
    for c, prompt in PROMPTS.items():
        workload = grpo(SAMPLES, prompt, REPLY, groups=GROUPS, spread=0.0)
        flat, tree = (measure(mode, workload, args.preset, args.steps) for mode in ("flat", "dta"))
        rows.append({"c": c, "measured_c": compression(workload), "prompt": prompt, "flat": flat, "tree": tree})
        print(f"c={c}: flat {flat['seconds']:.3f} s, tree {tree['seconds']:.3f} s", file=sys.stderr, flush=True)
    return {
        "benchmark": "tree_training",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "preset": args.preset,
        "steps": args.steps,
        "rows": rows,
    }


def report(result: dict) -> str:
    lines = [
        f"# Tree training vs flat ({result['date']})",
        "",
        f"machine: {result['machine']}",
        f"versions: {result['versions']}; preset {result['preset']}, one thread, median of {result['steps']} "
        f"steps; {GROUPS} prompts x {SAMPLES} completions of {REPLY} tokens",
        "",
        "| c (measured) | prompt | flat s/step | tree s/step | flat tokens/s | tree tokens/s | tree/flat | "
        "target | flat peak MiB | tree peak MiB | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        flat, tree = row["flat"], row["tree"]
        speed = [r["sequence_tokens"] / r["seconds"] for r in (flat, tree)]
        ratio, target = speed[1] / speed[0], TARGET[row["c"]] * row["c"]
        met = ratio >= target and tree["peak_bytes"] <= flat["peak_bytes"]
        lines.append(
            f"| {row['c']} ({row['measured_c']:.2f}) | {row['prompt']} | {flat['seconds']:.3f} | "
            f"{tree['seconds']:.3f} | {speed[0]:,.0f} | {speed[1]:,.0f} | {ratio:.2f}x | >= {target:.1f}x | "
            f"{flat['peak_bytes'] / 2**20:.0f} | {tree['peak_bytes'] / 2**20:.0f} | "
            f"{'yes' if met else '**no**'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("tree_training", parser.parse_args(), run, report)
