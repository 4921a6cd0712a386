"""Asynchronous vs synchronous RL on this machine: the same config and seed at eta = 0 (synchronous),
and at eta = 4 with interruptible generation on and off; effective training throughput (trained
tokens/s) and final held-out accuracy of each, in one run.

    .venv/bin/python bench/async_vs_sync.py [--steps 40] [--save]                  # the quickstart's workload
    .venv/bin/python bench/async_vs_sync.py --sft-steps 0 --max-new-tokens 64 --slots 16 --label generation-heavy --save

The starting model is the quickstart's SFT warm-up stopped early (``--sft-steps``; 0 = the freshly
initialised model, which never learns to stop, so every answer runs to ``--max-new-tokens``), sampled
at temperature 1. Throughput is measured between the first and the last step (start-up and the first
evaluation excluded): trained (output) tokens of steps 2..N over their wall time. Asynchrony hides
the shorter of generation and training behind the longer, so the report also prints what perfect
overlap would give from the synchronous run's times: (generate + train) / max(generate, train).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/quickstart.yaml"
SETTINGS = {  # name -> overrides; the first is the baseline
    "sync (eta=0)": ["rollout.max_head_offpolicyness=0"],
    "async eta=4, interruptible": ["rollout.max_head_offpolicyness=4", "rl.interruptible=true"],
    "async eta=4, not interruptible": ["rollout.max_head_offpolicyness=4", "rl.interruptible=false"],
}
WORKLOAD = ["gconfig.temperature=1.0", "rl.eval_every_steps=0", "saver.freq_steps=0", "stats.tensorboard=false",
            "stats.plot=false"]


def starting_model(root: Path, sft_steps: int) -> Path:
    """The model every setting starts from: a short SFT warm-up, or (0 steps) the initialised model."""
    out = root / "sft"
    command = (["init-model", "--out", str(out / "model"), "--seed", "1"] if sft_steps == 0 else
               ["sft", "--config", CONFIG, f"cluster.fileroot={out}", f"sft.total_train_steps={sft_steps}",
                "sft.eval_every_steps=0"])
    subprocess.run([sys.executable, "-m", "areal_hpc", *command], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return out / "model" if sft_steps == 0 else out / "quickstart" / "trial0" / "model"


def run_setting(root: Path, model: Path, name: str, overrides: list[str], steps: int) -> dict:
    fileroot = root / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "").replace("=", "")
    subprocess.run([sys.executable, "-m", "areal_hpc", "train", "--config", CONFIG, f"cluster.fileroot={fileroot}",
                    f"model.path={model}", "rl.sft_warmup_steps=0", f"rl.total_train_steps={steps}", *overrides],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (fileroot / "quickstart/trial0/metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "rollout/reward" in r]
    tokens = sum(r["train/trained_tokens"] for r in steps_[1:])
    seconds = steps_[-1]["time"] - steps_[0]["time"]
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return {"setting": name, "overrides": overrides, "trained_tokens_per_s": tokens / seconds,
            "seconds_per_step": seconds / (len(steps_) - 1),
            "accuracy_start": accuracy[0], "accuracy_end": accuracy[-1],
            "mean_staleness": float(np.mean([r["staleness/mean"] for r in steps_])),
            "generate_wait_s": float(np.mean([r["time/generate_wait"] for r in steps_[1:]])),
            "train_s": float(np.mean([r["time/train"] for r in steps_[1:]])),
            "output_tokens_p50": float(np.median([r["rollout/output_tokens"] for r in steps_])),
            "dropped": steps_[-1]["rollout/dropped_total"]}


def run(args) -> dict:
    import torch

    workload = WORKLOAD + [f"gconfig.max_new_tokens={args.max_new_tokens}",
                           f"rollout.max_running_requests={args.slots}"]
    with tempfile.TemporaryDirectory(prefix="async_vs_sync-") as tmp:
        model = starting_model(Path(tmp), args.sft_steps)
        rows = [run_setting(Path(tmp), model, name, workload + overrides, args.steps)
                for name, overrides in SETTINGS.items()]
    base = rows[0]["trained_tokens_per_s"]
    for row in rows:
        row["throughput_ratio"] = row["trained_tokens_per_s"] / base
    return {"benchmark": "async_vs_sync", "date": datetime.date.today().isoformat(), "machine": machine(),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__}, "steps": args.steps,
            "sft_steps": args.sft_steps, "workload": workload, "rows": rows,
            "overlap_estimate": overlap_estimate(rows[0]["generate_wait_s"], rows[0]["train_s"])}


def overlap_estimate(generate: float, train: float) -> float:
    """Sync steps take generate + train; perfectly overlapped ones max(generate, train)."""
    return (generate + train) / max(generate, train)


def report(result: dict) -> str:
    lines = [f"# async vs sync RL ({result['date']})", "", f"machine: {result['machine']}",
             f"versions: {result['versions']}; {result['steps']} RL steps per setting after {result['sft_steps']} SFT "
             f"steps; workload overrides: {' '.join(result['workload'])}",
             f"what perfect overlap would give, from the sync run's wait for a batch and train time: "
             f"{result['overlap_estimate']:.2f}x", "",
             "| setting | trained tokens/s | ratio vs sync | s/step | mean staleness | wait for batch (s) | "
             "train (s) | output tokens (median) | accuracy start -> end | dropped |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['setting']} | {r['trained_tokens_per_s']:.0f} | **{r['throughput_ratio']:.2f}x** | "
                     f"{r['seconds_per_step']:.2f} | {r['mean_staleness']:.2f} | {r['generate_wait_s']:.2f} | "
                     f"{r['train_s']:.2f} | {r['output_tokens_p50']:.1f} | "
                     f"{r['accuracy_start']:.1%} -> {r['accuracy_end']:.1%} | {r['dropped']:.0f} |")
    lines += ["", json.dumps({r["setting"]: round(r["throughput_ratio"], 3) for r in result["rows"]})]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="RL steps per setting")
    parser.add_argument("--sft-steps", type=int, default=120, help="SFT steps of the starting model (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="generation budget per answer")
    parser.add_argument("--slots", type=int, default=64, help="sequences the rollout server decodes together")
    parser.add_argument("--label", default="quickstart", help="workload name in the result file's name")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    arguments = parser.parse_args()
    run_and_record(f"async_vs_sync-{arguments.label}", arguments, run, report)
