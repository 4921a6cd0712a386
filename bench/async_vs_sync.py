"""Asynchronous vs synchronous RL on this machine, on a workload where generation matters: the same
config, seed and starting model at eta = 0 (synchronous) and at eta = 1, 2, 4, 8 with interruptible
generation on and off; effective training throughput (trained tokens/s) and held-out accuracy, in one run.

    .venv/bin/python bench/async_vs_sync.py [--steps 30] [--save] [--label longtail]    # the long-tailed workload
    .venv/bin/python bench/async_vs_sync.py --sft-steps 120 --temperature 1.0 --max-new-tokens 48 --label quickstart

Every setting runs through the real ``areal-hpc train`` launcher with the rollout server and the trainer
pinned to disjoint cores (``cluster.pin_cores=true``; the launcher's "cores:" line is checked). The
starting model is the quickstart's SFT warm-up stopped early (``--sft-steps``): it has learnt the answer
format and to stop, but not firmly, so sampled at a high ``--temperature`` most answers stop within a few
tokens while a long tail rambles up to ``--max-new-tokens``. Before the runs the report measures the
starting model's output lengths at ``--probe-temperatures`` (the evidence for the chosen temperature),
and for every run the lengths of all the episodes it generated. At most one batch of prompts is in
flight (``--in-flight 16``, 128 episodes for 64 slots: the server never idles, and a weight update
interrupts at most 128 requests rather than the quickstart's 512). Throughput is measured between the first
and the last step (start-up and the first evaluation excluded): trained (output) tokens of steps 2..N
over their wall time. Asynchrony hides the shorter of generation and training behind the longer, so the
report also prints what perfect overlap would give from the synchronous run's times:
(generate + train) / max(generate, train).
The machine may be shared: each setting starts once other processes use under half a core (or after
30 s), the table says how many cores they used during each setting, and the synchronous baseline runs
again last (its spread is the noise of the ratios).
Simplifications on purpose: one rollout server and one trainer rank; accuracy is evaluated only before
and after (``rl.eval_every_steps=0``), which is all a 30-step run can show.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record, train_command

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/quickstart.yaml"
# actor.lr: at the quickstart's 3e-4 the near-zero rewards push end-of-answer down and mean lengths drift up
# 1.5-2.5x within 30 steps, by a different amount in every setting, which would confound the throughput
WORKLOAD = [
    "cluster.pin_cores=true",
    "actor.lr=1e-4",
    "rl.eval_every_steps=0",
    "saver.freq_steps=0",
    "stats.tensorboard=false",
    "stats.plot=false",
]
CORES_LINE = re.compile(r"^cores: rollout server 0 on \[[\d, ]+\], trainer rank 0 on \[[\d, ]+\]$", re.M)
QUIET_CORES = 0.5  # other processes' CPU (in cores) below which a setting starts; waits at most QUIET_WAIT_S
QUIET_WAIT_S = 30
PROBE_PROMPTS = 48  # training prompts the starting model answers at each probed temperature


def settings(etas: list[int]) -> dict[str, list[str]]:
    """Setting name -> overrides; the first is the synchronous baseline."""
    out = {"sync (eta=0)": ["rollout.max_head_offpolicyness=0"]}
    for eta in etas:
        for interruptible in (True, False):
            out[f"eta={eta}, {'' if interruptible else 'not '}interruptible"] = [
                f"rollout.max_head_offpolicyness={eta}",
                f"rl.interruptible={str(interruptible).lower()}",
            ]
    return out


def starting_model(root: Path, sft_steps: int) -> Path:
    """The model every setting starts from: a short SFT warm-up, or (0 steps) the initialised model."""
    out = root / "sft"
    command = (
        ["init-model", "--out", str(out / "model"), "--seed", "1"]
        if sft_steps == 0
        else [
            "sft",
            "--config",
            CONFIG,
            f"cluster.fileroot={out}",
            f"sft.total_train_steps={sft_steps}",
            "sft.eval_every_steps=0",
            "saver.freq_steps=0",
            "stats.plot=false",
        ]
    )
    subprocess.run([sys.executable, "-m", "areal_hpc", *command], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return out / "model" if sft_steps == 0 else out / "quickstart" / "trial0" / "model"


def length_stats(lengths, limit: int) -> dict:
    """Median, 90th percentile and longest output, and the fraction that ran to ``limit``."""
    lengths = np.asarray(lengths)
    return {
        "n": int(lengths.size),
        "median": float(np.median(lengths)),
        "p90": float(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
        "at_limit": float(np.mean(lengths >= limit)),
    }


def probe_lengths(model_dir: Path, temperatures: list[float], max_new_tokens: int, samples: int) -> dict:
    """Output lengths of the starting model on training prompts at each temperature, sampled by the
    embedded engine the rollout server runs (``samples`` answers per prompt, as a GRPO group)."""
    from areal_hpc.config import load_config
    from areal_hpc.data.registry import build_task
    from areal_hpc.models.chat import prompt_ids
    from areal_hpc.models.hf import load_model, load_tokenizer
    from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, SamplingParams

    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    prompts = [prompt_ids(tokenizer, ex.prompt) for ex in build_task(load_config(CONFIG).dataset).train[:PROBE_PROMPTS]]
    out = {}
    for temperature in temperatures:
        engine = EmbeddedGenerator(
            model,
            slots=64,
            context_length=max(map(len, prompts)) + max_new_tokens,
            eos_token_ids=[tokenizer.eos_token_id],
        )
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=[tokenizer.eos_token_id]
        )

        async def sample():
            return await asyncio.gather(
                *(
                    engine.generate(uuid.uuid4().hex, ids, params)  # noqa: B023 - called within this iteration
                    for ids in prompts
                    for _ in range(samples)
                )
            )

        try:
            results = asyncio.run(sample())
        finally:
            engine.stop()
        out[str(temperature)] = length_stats([len(r.output_ids) for r in results], max_new_tokens)
    return out


def generated_lengths(run_dir: Path) -> list[int]:
    """Output tokens of every episode the run stored, trained or not."""
    from areal_hpc.data.shards.reader import TrajectoryStore

    store = TrajectoryStore(run_dir / "shards")
    try:
        return [int(n) for shard in store.shards.values() for n in shard.index["n_output"]]
    finally:
        store.close()


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process's finished children)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK"), children.ru_utime + children.ru_stime


def other_load(seconds: float = 2.0) -> float:
    """Cores other processes keep busy right now (this one sleeps meanwhile)."""
    before = cpu_seconds()[0]
    time.sleep(seconds)
    return (cpu_seconds()[0] - before) / seconds


def wait_until_quiet() -> float:
    """The machine is shared: start a setting when others use under QUIET_CORES (or after QUIET_WAIT_S)."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while (load := other_load()) >= QUIET_CORES and time.monotonic() < deadline:
        time.sleep(3)
    return load


def run_setting(root: Path, model: Path, name: str, overrides: list[str], steps: int, limit: int) -> dict:
    fileroot = root / re.sub(r"[^a-z0-9]+", "_", name)
    load_at_start = wait_until_quiet()
    (busy, ours), started = cpu_seconds(), time.monotonic()
    launch = subprocess.run(
        train_command(
            CONFIG,
            f"cluster.fileroot={fileroot}",
            f"model.path={model}",
            "rl.sft_warmup_steps=0",
            f"rl.total_train_steps={steps}",
            *overrides,
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    (busy_end, ours_end), wall = cpu_seconds(), time.monotonic() - started
    if launch.returncode != 0:
        raise SystemExit(f"{name}: areal-hpc train exited with {launch.returncode}:\n{launch.stdout[-3000:]}")
    cores = CORES_LINE.search(launch.stdout)
    if cores is None:  # rollout and training must never share cores here, in any mode
        raise SystemExit(
            f"{name}: the launcher printed no 'cores: rollout server 0 on [..], trainer rank 0 on [..]' "
            f"line; rollout and training were not pinned to disjoint cores"
        )
    run_dir = fileroot / "quickstart/trial0"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "rollout/reward" in r]
    timed = steps_[1:]  # the first step also waits for the servers' first episodes
    tokens = sum(r["train/trained_tokens"] for r in timed)
    seconds = steps_[-1]["time"] - steps_[0]["time"]
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    wait, train = (float(np.mean([r[key] for r in timed])) for key in ("time/generate_wait", "time/train"))
    return {
        "setting": name,
        "overrides": overrides,
        "cores": cores.group(0),
        "trained_tokens_per_s": tokens / seconds,
        "seconds_per_step": seconds / len(timed),
        "accuracy_start": accuracy[0],
        "accuracy_end": accuracy[-1],
        "mean_staleness": float(np.mean([r["staleness/mean"] for r in steps_])),
        "generate_wait_s": wait,
        "train_s": train,
        # the rest of a step: writing the weights, pausing (or draining) generation, the push, resuming
        "update_weights_s": float(np.mean([r["time/step"] for r in timed])) - wait - train,
        "interrupted_per_step": float(np.mean([r["rollout/interruptions"] for r in timed])),
        "output_lengths": length_stats(generated_lengths(run_dir), limit),
        "dropped": steps_[-1]["rollout/dropped_total"],
        "other_load_at_start": load_at_start,
        # cores the rest of the machine (other people's work) used while this setting ran
        "other_load": max(0.0, ((busy_end - busy) - (ours_end - ours)) / wall),
    }


def run(args) -> dict:
    import torch

    workload = WORKLOAD + [
        f"generation.temperature={args.temperature}",
        f"generation.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_running_requests={args.slots}",
        f"rollout.max_concurrent_rollouts={args.in_flight}",
    ]
    with tempfile.TemporaryDirectory(prefix="async_vs_sync-") as tmp:
        model = starting_model(Path(tmp), args.sft_steps)
        probe = probe_lengths(
            model, sorted({*args.probe_temperatures, args.temperature}), args.max_new_tokens, samples=8
        )
        runs = list(settings(args.etas).items())
        runs.append((f"{runs[0][0]}, again", runs[0][1]))  # the spread of the two is the noise of the baseline
        rows = [
            run_setting(Path(tmp), model, name, workload + overrides, args.steps, args.max_new_tokens)
            for name, overrides in runs
        ]
    base = rows[0]["trained_tokens_per_s"]
    for row in rows:
        row["throughput_ratio"] = row["trained_tokens_per_s"] / base
    return {
        "benchmark": "async_vs_sync",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "steps": args.steps,
        "sft_steps": args.sft_steps,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "workload": workload,
        "probe": probe,
        "rows": rows,
        "overlap_estimate": overlap_estimate(rows[0]["generate_wait_s"], rows[0]["train_s"]),
    }


def overlap_estimate(generate: float, train: float) -> float:
    """Sync steps take generate + train; perfectly overlapped ones max(generate, train)."""
    return (generate + train) / max(generate, train)


def lengths_cell(s: dict) -> str:
    return f"{s['median']:.0f} / {s['p90']:.0f} / {s['max']}, {s['at_limit']:.1%}"


def report(result: dict) -> str:
    limit = result["max_new_tokens"]
    lines = [
        f"# async vs sync RL ({result['date']})",
        "",
        f"machine: {result['machine']}",
        f"versions: {result['versions']}; {result['steps']} RL steps per setting after {result['sft_steps']} SFT "
        f"steps; workload overrides: {' '.join(result['workload'])}",
        f"rollout and training on disjoint cores in every setting ({result['rows'][0]['cores']})",
        "",
        f"Output lengths of the starting model (training prompts, {PROBE_PROMPTS} x 8 samples, "
        f"max_new_tokens={limit}): median / p90 / max, fraction at the limit",
        "",
        "| temperature | output tokens |",
        "|---|---|",
    ]
    for temperature, stats in result["probe"].items():
        chosen = " (chosen)" if float(temperature) == result["temperature"] else ""
        lines.append(f"| {temperature}{chosen} | {lengths_cell(stats)} |")
    lines += [
        "",
        f"what perfect overlap would give, from the sync run's wait for a batch and train time: "
        f"{result['overlap_estimate']:.2f}x",
        "",
        "| setting | trained tokens/s | ratio vs sync | s/step | mean staleness | wait for batch (s) | "
        "train (s) | pause + weight update (s) | interrupted episodes/step | "
        "output tokens median / p90 / max, at limit | accuracy start -> end | dropped | other load (cores) |",
        "|---" * 13 + "|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['setting']} | {r['trained_tokens_per_s']:.0f} | **{r['throughput_ratio']:.2f}x** | "
            f"{r['seconds_per_step']:.2f} | {r['mean_staleness']:.2f} | {r['generate_wait_s']:.2f} | "
            f"{r['train_s']:.2f} | {r['update_weights_s']:.2f} | {r['interrupted_per_step']:.1f} | "
            f"{lengths_cell(r['output_lengths'])} | "
            f"{r['accuracy_start']:.1%} -> {r['accuracy_end']:.1%} | {r['dropped']:.0f} | "
            f"{r['other_load']:.2f} |"
        )
    lines += ["", json.dumps({r["setting"]: round(r["throughput_ratio"], 3) for r in result["rows"]})]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="RL steps per setting")
    parser.add_argument("--etas", type=int, nargs="+", default=[1, 2, 4, 8], help="staleness bounds of the async runs")
    parser.add_argument("--sft-steps", type=int, default=10, help="SFT steps of the starting model (0: none)")
    parser.add_argument("--temperature", type=float, default=1.5, help="sampling temperature of the rollouts")
    parser.add_argument(
        "--probe-temperatures",
        type=float,
        nargs="+",
        default=[1.0, 1.3, 1.5, 1.7, 2.0],
        help="temperatures whose output lengths the report measures on the starting model",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="generation budget per answer")
    parser.add_argument("--slots", type=int, default=64, help="sequences the rollout server decodes together")
    parser.add_argument(
        "--in-flight",
        type=int,
        default=16,
        help="prompts (groups of 8 episodes) in flight at most: one batch, twice the server's slots",
    )
    parser.add_argument("--label", default="longtail", help="workload name in the result file's name")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    arguments = parser.parse_args()
    run_and_record(f"async_vs_sync-{arguments.label}", arguments, run, report)
