"""Tree training's flattened subtrees against a level at a time, on GRPO groups of growing size, in one
run: what sets ``engines.torch.tree.FLAT_SUBTREE_TOKENS``.

    .venv/bin/python bench/tree_flat_subtrees.py [--presets tiny small] [--steps 3] [--save]

Workload: 4 prompts x 8 answers (``train.repro_dta.grpo``: log-normal answer lengths, spread 0.5),
prompts of P = 16 ... 512 tokens and answers of P / 4 on average, so that a group's subtree holds about
3P tokens (48 ... 1,536). Each size is trained both ways with the torch engine's PPO optimizer step
(``train.repro_dta._measure``, one thread, this process pinned to one core): "levels", every
subtree a level at a time (the prompt, then its answers each over a copy of the prompt's K/V), and
"flattened", every group's subtree one row under its tree mask. The ratio is flattened / levels s/step.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch
from recording import machine, machine_and_versions, run_and_record

from areal_hpc.engines.torch import tree
from areal_hpc.train.repro_dta import _measure, grpo

PROMPTS = (16, 32, 64, 128, 256, 512)
SAMPLES = 8
VARIANTS = {"levels": 0, "flattened": 1 << 30}  # FLAT_SUBTREE_TOKENS of each


def run(args) -> dict:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    rows = []
    for preset in args.presets:
        for prompt in PROMPTS:
            workload = grpo(SAMPLES, prompt=prompt, reply=prompt / 4, groups=4)
            seconds = {}
            for variant, cap in VARIANTS.items():
                tree.FLAT_SUBTREE_TOKENS = cap
                seconds[variant] = _measure("dta", workload, preset, args.steps, 8192)["seconds"]
            rows.append(
                {
                    "preset": preset,
                    "prompt": prompt,
                    "subtree_tokens": prompt + SAMPLES * prompt // 4,
                    **{f"{v}_s": s for v, s in seconds.items()},
                    "ratio": seconds["flattened"] / seconds["levels"],
                }
            )
            print(f"{preset} prompt {prompt}: flattened / levels {rows[-1]['ratio']:.2f}x", flush=True)
    return {
        "benchmark": "tree_flat_subtrees",
        "date": date.today().isoformat(),
        "machine": machine(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "steps": args.steps,
        "rows": rows,
    }


def report(r: dict) -> str:
    lines = [
        f"# Tree training: flattened subtrees vs a level at a time ({r['date']})",
        "",
        machine_and_versions(r),
        f"4 prompts x {SAMPLES} answers (answers P / 4 on average), the torch engine's PPO step, one thread, "
        f"median of {r['steps']} steps.",
        "",
        "| preset | prompt P | subtree (~tokens) | levels s/step | flattened s/step | flattened / levels |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {x['preset']} | {x['prompt']} | {x['subtree_tokens']} | {x['levels_s']:.4f} | "
        f"{x['flattened_s']:.4f} | **{x['ratio']:.2f}x** |"
        for x in r["rows"]
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after a warm-up)")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    run_and_record("tree_flat_subtrees", args, run, report)


if __name__ == "__main__":
    main()
