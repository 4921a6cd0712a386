"""Asynchronous vs synchronous RL on this machine: the same config and seed at eta = 0 (synchronous),
and at eta = 4 with interruptible generation on and off; effective training throughput (trained
tokens/s) and final held-out accuracy of each, in one run.

    .venv/bin/python bench/async_vs_sync.py [--steps 40] [--save]

Generation lengths are long-tailed: the model is the quickstart's SFT warm-up stopped early (it has
not yet learned to stop), sampled at temperature 1 with room for 48 new tokens, so most answers end
after a few tokens and some run to the limit. Throughput is measured between the first and the last
step (start-up and the first evaluation excluded): trained tokens of steps 2..N over their wall time.
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
WORKLOAD = ["gconfig.max_new_tokens=48", "gconfig.temperature=1.0", "rl.eval_every_steps=0", "saver.freq_steps=0",
            "stats.tensorboard=false", "stats.plot=false"]


def warm_up_model(root: Path, sft_steps: int) -> Path:
    """The starting model every setting shares: a short SFT warm-up (stops answers only sometimes)."""
    out = root / "sft"
    subprocess.run([sys.executable, "-m", "areal_hpc", "sft", "--config", CONFIG, f"cluster.fileroot={out}",
                    f"sft.total_train_steps={sft_steps}", "sft.eval_every_steps=0"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    return out / "quickstart" / "trial0" / "model"


def run_setting(root: Path, model: Path, name: str, overrides: list[str], steps: int) -> dict:
    fileroot = root / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "").replace("=", "")
    subprocess.run([sys.executable, "-m", "areal_hpc", "train", "--config", CONFIG, f"cluster.fileroot={fileroot}",
                    f"model.path={model}", "rl.sft_warmup_steps=0", f"rl.total_train_steps={steps}", *WORKLOAD,
                    *overrides], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (fileroot / "quickstart/trial0/metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "rollout/reward" in r]
    tokens = sum(r["train/tokens"] for r in steps_[1:])
    seconds = steps_[-1]["time"] - steps_[0]["time"]
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return {"setting": name, "overrides": overrides, "trained_tokens_per_s": tokens / seconds,
            "seconds_per_step": seconds / (len(steps_) - 1), "accuracy_start": accuracy[0], "accuracy_end": accuracy[-1],
            "mean_staleness": float(np.mean([r["staleness/mean"] for r in steps_])),
            "generate_wait_s": float(np.mean([r["time/generate_wait"] for r in steps_[1:]])),
            "output_tokens_p50": float(np.median([r["rollout/output_tokens"] for r in steps_])),
            "dropped": steps_[-1]["rollout/dropped_total"]}


def run(args) -> dict:
    import torch

    with tempfile.TemporaryDirectory(prefix="async_vs_sync-") as tmp:
        model = warm_up_model(Path(tmp), args.sft_steps)
        rows = [run_setting(Path(tmp), model, name, overrides, args.steps) for name, overrides in SETTINGS.items()]
    base = rows[0]["trained_tokens_per_s"]
    for row in rows:
        row["throughput_ratio"] = row["trained_tokens_per_s"] / base
    return {"benchmark": "async_vs_sync", "date": datetime.date.today().isoformat(), "machine": machine(),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__}, "steps": args.steps,
            "sft_steps": args.sft_steps, "workload": WORKLOAD, "rows": rows}


def report(result: dict) -> str:
    lines = [f"# async vs sync RL ({result['date']})", "", f"machine: {result['machine']}",
             f"versions: {result['versions']}; {result['steps']} RL steps per setting after {result['sft_steps']} SFT "
             f"steps; workload overrides: {' '.join(result['workload'])}", "",
             "| setting | trained tokens/s | ratio vs sync | s/step | mean staleness | wait for batch (s) | "
             "accuracy start -> end | dropped |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['setting']} | {r['trained_tokens_per_s']:.0f} | **{r['throughput_ratio']:.2f}x** | "
                     f"{r['seconds_per_step']:.2f} | {r['mean_staleness']:.2f} | {r['generate_wait_s']:.2f} | "
                     f"{r['accuracy_start']:.1%} -> {r['accuracy_end']:.1%} | {r['dropped']:.0f} |")
    lines += ["", json.dumps({r["setting"]: round(r["throughput_ratio"], 3) for r in result["rows"]})]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="RL steps per setting")
    parser.add_argument("--sft-steps", type=int, default=120, help="SFT warm-up steps of the shared starting model")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("async_vs_sync", parser.parse_args(), run, report)
