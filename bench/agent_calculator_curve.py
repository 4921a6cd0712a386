"""The calculator agent demo (``configs/agent_calculator.yaml``) over seeds: held-out success against RL
step, mean and range over the seeds, the SFT warm-up's accuracy (RL step 0) marked.

    .venv/bin/python bench/agent_calculator_curve.py --run --root /tmp/calc_runs --seeds 1 2 3 \\
        --md bench/results/agent_calculator.md --png docs/img/agent_calculator.png
    .venv/bin/python bench/agent_calculator_curve.py --root /tmp/calc_runs --seeds 1 2 3 --png out.png

``--run`` runs ``areal-hpc train --config configs/agent_calculator.yaml experiment.seed=S
cluster.fileroot=ROOT/seedS`` for each seed, one at a time, and records its wall time (``wall.json``);
without it the script reads runs already there. It reads each run's ``metrics.jsonl`` (``eval/accuracy``
every ``rl.eval_every_steps``, ``reward/tool_used`` and ``rollout/turns`` every step). "End" is the mean
of the last 3 evaluations. "Operands copied": of the held-out questions, the share whose call, forced to
start with ``<calc>`` and decoded greedily, holds the question's expression exactly (after the warm-up and
at the end): the copying skill apart from the habit of calling.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/agent_calculator.yaml"


def run_dir(root: Path, seed: int) -> Path:
    return root / f"seed{seed}" / "agent_calculator" / "trial0"


def run_seed(root: Path, seed: int, overrides: list[str]) -> None:
    folder = root / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with (folder / "train.log").open("w") as log:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "areal_hpc",
                "train",
                "--config",
                CONFIG,
                f"cluster.fileroot={folder}",
                f"experiment.seed={seed}",
                *overrides,
            ],
            cwd=REPO,
            check=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    (folder / "wall.json").write_text(
        json.dumps({"wall_s": time.time() - started, "started": started, "load_before": os.getloadavg()}) + "\n"
    )


@functools.cache
def held_out(questions: int) -> tuple:
    """The config's first ``questions`` held-out examples (the task is built once for every model read)."""
    from areal_hpc.config import load_config
    from areal_hpc.data.registry import build_task

    return tuple(build_task(load_config(str(REPO / CONFIG), []).dataset).eval[:questions])


def operand_copying(model_dir: Path, questions: int = 200) -> float:
    """Share of the first ``questions`` held-out questions whose forced call copies the expression exactly."""
    import torch

    from areal_hpc.agents.calculator import tool_call
    from areal_hpc.data.calculator import CALL_OPEN, expression_of
    from areal_hpc.models.chat import prompt_ids
    from areal_hpc.models.hf import load_model, load_tokenizer

    model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    right = 0
    for example in held_out(questions):
        ids = prompt_ids(tokenizer, example.prompt) + tokenizer.encode(CALL_OPEN, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=tokenizer.eos_token_id
            )
        text = CALL_OPEN + tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        right += tool_call(text) == expression_of(example.prompt)
    return right / questions


def read_seed(root: Path, seed: int) -> dict:
    folder = run_dir(root, seed)
    rl = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    sft = [json.loads(line) for line in (folder / "sft_warmup" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/accuracy"] for r in rl if "eval/accuracy" in r}
    steps = [r for r in rl if "rollout/turns" in r]
    wall_file = root / f"seed{seed}" / "wall.json"
    wall = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else None
    return {
        "seed": seed,
        "evals": evals,
        "start": evals[0],
        "end": float(np.mean(list(evals.values())[-3:])),
        "sft_s": sft[-1]["time"] - sft[0]["time"],
        "rl_s": rl[-1]["time"] - rl[0]["time"],
        "wall_s": wall,
        "tool_used": [(r["step"], r.get("reward/tool_used", float("nan"))) for r in steps],
        "copied_after_sft": operand_copying(folder / "sft_warmup" / "model"),
        "copied_at_end": operand_copying(folder / "model"),
        "turns": [(r["step"], r["rollout/turns"]) for r in steps],
    }


def report(rows: list[dict]) -> str:
    steps = sorted(set.intersection(*(set(r["evals"]) for r in rows)))
    lines = ["| RL step | held-out success mean | min | max | gain over step 0 (mean) |", "|---|---|---|---|---|"]
    base = np.mean([r["start"] for r in rows])
    for step in steps:
        values = [r["evals"][step] for r in rows]
        lines.append(
            f"| {step} | {np.mean(values):.1%} | {min(values):.1%} | {max(values):.1%} | "
            f"{np.mean(values) - base:+.1%} |"
        )
    lines += [
        "",
        "| seed | SFT start (step 0) | end (mean of last 3 evals) | gain | operands copied after SFT / at the end | "
        "SFT s | RL s | job wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        wall = f"{r['wall_s']:.0f}" if r["wall_s"] is not None else "-"
        lines.append(
            f"| {r['seed']} | {r['start']:.1%} | {r['end']:.1%} | {r['end'] - r['start']:+.1%} | "
            f"{r['copied_after_sft']:.1%} / {r['copied_at_end']:.1%} | {r['sft_s']:.0f} | {r['rl_s']:.0f} | {wall} |"
        )
    start, end = np.mean([r["start"] for r in rows]), np.mean([r["end"] for r in rows])
    lines += ["", f"mean over {len(rows)} seeds: {start:.1%} -> {end:.1%} ({end - start:+.1%})"]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(set.intersection(*(set(r["evals"]) for r in rows)))
    values = np.array([[r["evals"][s] for s in steps] for r in rows]) * 100
    fig, (ax, tools) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
    ax.fill_between(steps, values.min(0), values.max(0), alpha=0.25, label=f"range over {len(rows)} seeds")
    ax.plot(steps, values.mean(0), marker="o", label="mean")
    start = values[:, 0].mean()
    ax.axhline(start, color="grey", linestyle="--", linewidth=1)
    ax.annotate(
        f"SFT warm-up: {start:.0f}%", (steps[0], start), textcoords="offset points", xytext=(6, 6), color="grey"
    )
    ax.set(
        xlabel="RL step",
        ylabel="held-out success (%)",
        ylim=(0, 100),
        title="4-digit products with a calculator tool (greedy)",
    )
    ax.legend(loc="center right")
    for r in rows:
        tool_steps, used = zip(*r["tool_used"])
        tools.plot(tool_steps, np.array(used) * 100, linewidth=1, label=f"seed {r['seed']}")
    tools.set(
        xlabel="RL step",
        ylabel="answers after a tool call (%)",
        ylim=(0, 100),
        title="tool use while training (sampled)",
    )
    tools.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/calc_runs"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--run", action="store_true", help="run the seeds first (one at a time)")
    parser.add_argument("--md", type=Path, help="write the tables here (with the machine and the date)")
    parser.add_argument("--png", type=Path, help="write the curve here")
    parser.add_argument("overrides", nargs="*", help="config overrides for --run (key=value)")
    args = parser.parse_args(argv)
    if args.run:
        for seed in args.seeds:
            run_seed(args.root, seed, args.overrides)
    rows = [read_seed(args.root, seed) for seed in args.seeds]
    text = report(rows)
    print(text)
    if args.md:
        header = (
            f"# Calculator agent over {len(rows)} seeds ({datetime.date.today().isoformat()})\n\n"
            f"machine: {platform.node()}: {os.cpu_count()} cores, {platform.machine()}, {platform.platform()}\n"
            f"config: {CONFIG}, end to end (SFT warm-up + asynchronous GRPO)\n\n"
        )
        args.md.write_text(header + text + "\n")
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
