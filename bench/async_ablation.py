"""Why do asynchronous runs end lower than synchronous ones? An ablation on the quickstart workload.

    .venv/bin/python bench/async_ablation.py --start-model runs/quickstart/trial0/sft_warmup/model \
        --settings eta0 eta2 eta2_cap2 --seeds 1 2 3 --steps 200 [--save]

Every setting is the quickstart config (``configs/quickstart.yaml``) with a few overrides, started from
the same SFT checkpoint (``--start-model``, no warm-up), run through the real ``areal-hpc train``
launcher once per seed, one run at a time. Accuracy is greedy held-out accuracy every
``--eval-every`` steps on ``--eval-size`` problems; a run's score is the mean of its last three
evaluations (one evaluation is noisy: ±3.5 points at 200 problems). Runs already in ``--workdir`` are
read, not repeated, so an interrupted ablation continues where it stopped.
The table gives per setting: the mean start, peak and final (last-3) accuracy over seeds, the final
minus eta = 0's, and the behaviour-weight statistics that separate the settings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, record_name, run_and_record

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {
    "eta0": ["rollout.max_head_offpolicyness=0"],
    "eta1": ["rollout.max_head_offpolicyness=1"],
    "eta2": ["rollout.max_head_offpolicyness=2"],
    "eta4": ["rollout.max_head_offpolicyness=4"],
    "eta1_noninterruptible": ["rollout.max_head_offpolicyness=1", "rl.interruptible=false"],
    "eta2_noninterruptible": ["rollout.max_head_offpolicyness=2", "rl.interruptible=false"],
    "eta2_cap2": ["rollout.max_head_offpolicyness=2", "actor.behav_imp_weight_cap=2.0"],
    "eta2_mask2": ["rollout.max_head_offpolicyness=2", "actor.behav_correction=mask", "actor.behav_imp_weight_cap=2.0"],
    "eta2_nocorrection": ["rollout.max_head_offpolicyness=2", "actor.behav_correction=none"],
    "eta2_float32": ["rollout.max_head_offpolicyness=2", "model.compute_dtype=float32"],
    "eta0_float32": ["rollout.max_head_offpolicyness=0", "model.compute_dtype=float32"],
    "eta2_lr1e-4": ["rollout.max_head_offpolicyness=2", "actor.lr=1e-4"],
    "eta2_lr1e-3": ["rollout.max_head_offpolicyness=2", "actor.lr=1e-3"],
    "eta0_lr1e-4": ["rollout.max_head_offpolicyness=0", "actor.lr=1e-4"],
    # at 3e-4 asynchrony costs several points in 100 steps (at 1e-4 under one): which change removes it?
    "eta0_lr3e-4": ["rollout.max_head_offpolicyness=0", "actor.lr=3e-4"],
    "eta2_lr3e-4": ["rollout.max_head_offpolicyness=2", "actor.lr=3e-4"],
    "eta1_lr3e-4": ["rollout.max_head_offpolicyness=1", "actor.lr=3e-4"],
    "eta0_lr3e-4_drgrpo": ["rollout.max_head_offpolicyness=0", "actor.lr=3e-4", "actor.adv_estimator=dr_grpo"],
    "eta2_lr3e-4_drgrpo": ["rollout.max_head_offpolicyness=2", "actor.lr=3e-4", "actor.adv_estimator=dr_grpo"],
    "eta2_coupled": ["rollout.max_head_offpolicyness=2", "actor.decoupled_loss=false"],
    "eta2_lr3e-4_coupled": ["rollout.max_head_offpolicyness=2", "actor.lr=3e-4", "actor.decoupled_loss=false"],
    "eta2_lr3e-4_nocorrection": ["rollout.max_head_offpolicyness=2", "actor.lr=3e-4", "actor.behav_correction=none"],
    "eta2_lr3e-4_float32": ["rollout.max_head_offpolicyness=2", "actor.lr=3e-4", "model.compute_dtype=float32"],
    "eta2_lr5e-5": ["rollout.max_head_offpolicyness=2", "actor.lr=5e-5"],
    "eta2_minibatches4": ["rollout.max_head_offpolicyness=2", "actor.ppo_n_minibatches=4"],
    "eta2_dynamic": ["rollout.max_head_offpolicyness=2", "actor.dynamic_sampling=true"],
    # issue 24: does M2PO hold accuracy where GRPO's clipped loss degrades, at large staleness?
    **{
        f"eta{eta}{suffix}": [f"rollout.max_head_offpolicyness={eta}", *loss]
        for eta in (8, 16, 32)
        for suffix, loss in (("", []), ("_m2po", ["actor.policy_loss=m2po"]))
    },
}
# A setting that names no ``actor.decoupled_loss`` trains with the decoupled loss (the quickstart's earlier
# default), so that it reruns what its records ran; the *_coupled settings take PPO's own loss, as the quickstart does.
SETTINGS = {
    name: overrides
    if any(o.startswith("actor.decoupled_loss=") for o in overrides)
    else [*overrides, "actor.decoupled_loss=true"]
    for name, overrides in SETTINGS.items()
}
QUIET = ["saver.freq_steps=0", "stats.tensorboard=false", "stats.plot=false", "rl.sft_warmup_steps=0"]


def run_dir(args, setting: str, seed: int) -> Path:
    return args.workdir / f"{setting}-s{seed}"


def run_one(args, setting: str, seed: int) -> dict:
    folder = run_dir(args, setting, seed)
    metrics = folder / "ablation" / "trial0" / "metrics.jsonl"
    done = folder / "done.json"
    if not done.exists():
        command = [
            str(REPO / ".venv/bin/areal-hpc"),
            "train",
            "--config",
            str(REPO / "configs/quickstart.yaml"),
            f"model.path={args.start_model}",
            f"cluster.fileroot={folder}",
            "experiment.name=ablation",
            f"experiment.seed={seed}",
            f"rl.total_train_steps={args.steps}",
            f"rl.eval_every_steps={args.eval_every}",
            f"dataset.eval_size={args.eval_size}",
            *QUIET,
            *SETTINGS[setting],
        ]
        started = time.time()
        with open(folder.with_suffix(".log"), "w") as log:
            subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
        done.write_text(json.dumps({"seconds": time.time() - started}))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "actor/loss" in r]
    timed = sorted((r for r in records if "time/step" in r), key=lambda r: r["step"])[3:]  # past the warm-up
    return {
        "setting": setting,
        "seed": seed,
        "evals": evals,
        "start": evals[0][1],
        "peak": max(a for _, a in evals),
        "final": float(np.mean([a for _, a in evals[-3:]])),
        "seconds": json.loads(done.read_text())["seconds"],
        "behav_weight_dev": float(np.mean([r["actor/behav_weight_dev"] for r in steps])),
        "behav_capped_fraction": float(np.mean([r["actor/behav_capped_fraction"] for r in steps])),
        # the mean of w = π_prox/π_behav is 1 when the recorded logprobs are the sampler's (older runs
        # did not log it: NaN)
        "behav_weight_mean": float(np.mean([r.get("actor/behav_weight_mean", np.nan) for r in steps])),
        "entropy_end": float(np.mean([r["actor/entropy"] for r in steps[-20:]])),
        "staleness": float(np.mean([r["staleness/mean"] for r in steps])),
        "s_per_step": float(np.mean([r["time/step"] - r.get("time/eval_wait", 0.0) for r in timed])),
    }


def run(args) -> dict:
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:  # seeds outermost: an interrupted ablation has every setting at the first seeds
        for setting in args.settings:
            if args.cached_only and not (run_dir(args, setting, seed) / "done.json").exists():
                continue
            rows.append(run_one(args, setting, seed))
            row = rows[-1]
            print(
                f"{setting} seed {seed}: start {row['start']:.3f} peak {row['peak']:.3f} final {row['final']:.3f} "
                f"({row['seconds']:.0f} s)",
                flush=True,
            )
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_size": args.eval_size,
        "start_model": str(args.start_model),
        "settings": {s: SETTINGS[s] for s in args.settings},
        "runs": rows,
    }


def mean_logged(values: list[float]) -> str:
    """The mean over the runs that logged the statistic (NaN: an older run), or "-" when none did."""
    logged = [v for v in values if not np.isnan(v)]
    return f"{np.mean(logged):.4f}" if logged else "-"


def report(result: dict) -> str:
    lines = [
        f"# asynchronous RL ablation ({result['date']})",
        "",
        f"machine: {result['machine']}; {result['steps']} RL steps per run, greedy accuracy on "
        f"{result['eval_size']} held-out problems every {result['eval_every']} steps; final = mean of the "
        f"last 3 evaluations; start model {result['start_model']}",
        "",
        "| setting | overrides | seeds | start | peak | final | final - eta0 | behaviour weight dev | mean w | capped | "
        "entropy (last 20 steps) | staleness | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_setting: dict[str, list[dict]] = {}
    for row in result["runs"]:
        by_setting.setdefault(row["setting"], []).append(row)
    base = np.mean([r["final"] for r in by_setting.get("eta0", [])]) if "eta0" in by_setting else None
    for setting, rows in by_setting.items():
        final = np.mean([r["final"] for r in rows])
        spread = np.std([r["final"] for r in rows])
        delta = f"{100 * (final - base):+.1f}" if base is not None else "-"
        lines.append(
            f"| {setting} | {' '.join(result['settings'][setting])} | {len(rows)} | "
            f"{100 * np.mean([r['start'] for r in rows]):.1f} | {100 * np.mean([r['peak'] for r in rows]):.1f} | "
            f"**{100 * final:.1f}** ± {100 * spread:.1f} | {delta} | "
            f"{np.mean([r['behav_weight_dev'] for r in rows]):.3f} | "
            f"{mean_logged([r.get('behav_weight_mean', np.nan) for r in rows])} | "
            f"{np.mean([r['behav_capped_fraction'] for r in rows]):.4f} | "
            f"{np.mean([r['entropy_end'] for r in rows]):.3f} | "
            f"{np.mean([r.get('staleness', np.nan) for r in rows]):.2f} | "
            f"{np.mean([r.get('s_per_step', np.nan) for r in rows]):.3f} |"
        )
    lines += ["", "Per run (step: accuracy):"]
    for row in result["runs"]:
        curve = " ".join(f"{s}:{100 * a:.0f}" for s, a in row["evals"])
        lines.append(f"- {row['setting']} seed {row['seed']}: {curve}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start-model", type=Path, required=True, help="the SFT checkpoint every run starts from")
    parser.add_argument("--settings", nargs="+", default=["eta0", "eta2"], choices=sorted(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "async_ablation")
    parser.add_argument("--cached-only", action="store_true", help="report the finished runs in --workdir only")
    parser.add_argument("--label", default="", help="results file async_ablation-LABEL-<date>")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    args.start_model = args.start_model.resolve()
    run_and_record(record_name("async_ablation", args.label), args, run, report)


if __name__ == "__main__":
    main()
