"""The preference demos on the quickstart task, from one SFT checkpoint, through the real commands:

    .venv/bin/python bench/preference_demos.py --start-model runs/bench/demo_start/seed1-45.8 [--seeds 1 2 3] [--save]

1. ``areal-hpc pairs``: per training prompt, a correct sample of the SFT model against a wrong one; the
   same for the task's held-out prompts (problems that are not training problems).
2. ``areal-hpc rm``: a Bradley-Terry reward model from the SFT model on the training pairs, its body
   regularised as a language model of the chosen answers (``--rm-nll-weight``: ``preference.nll_weight``);
   its pairwise accuracy on the held-out prompts' pairs. (Pairs held out of the training file are no test here: the
   task's 20,000 training prompts are 6,095 distinct problems: of 5,247 pairs from 8,000 prompts, 72%
   share their problem with another pair and 36% have an identical twin.)
3. ``areal-hpc train`` (asynchronous GRPO, the quickstart's settings, ``--rl-steps`` steps) per seed: with
   ``reward.model`` = the reward model and ``--rm-kl`` as the KL penalty to the start model; with the
   task's rule reward and the same penalty (the controlled comparison: only the reward differs); and
   with the rule alone (the quickstart as it is). Held-out accuracy is the rule's in all three (500
   problems, greedy), final = mean of the last three evaluations.
4. ``areal-hpc dpo`` per seed on the same pairs (RPO: ``preference.nll_weight``), its task accuracy.
``--extra-pairs`` adds pairs to the training pairs of 2 and 4: the reward model refreshed on a policy's
samples (``areal-hpc pairs --model <a run against the first reward model>/model``), as RLHF pipelines
retrain theirs on what the policy now writes. Every step writes into ``--workdir`` and is skipped when
its output is there, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from recording import last3, machine, once, records, run_and_record

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "areal_hpc"]
QUIET = ["saver.freq_steps=0", "stats.tensorboard=false", "stats.plot=false"]


def run(args) -> dict:
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    pairs = work / "pairs.jsonl"
    held_out = work / "eval_pairs.jsonl"
    for split, out, limit in (
        ("train", pairs, ["--limit", str(args.prompts), "--pairing", args.pairing]),
        ("eval", held_out, []),
    ):
        once(
            work / f"{out.stem}.done",
            [
                *CLI,
                "pairs",
                "--model",
                str(args.start_model),
                "--config",
                "configs/quickstart.yaml",
                "--split",
                split,
                "--out",
                str(out),
                "--samples",
                "4",
                *limit,
            ],
            work / f"{out.stem}.log",
        )
    if args.extra_pairs is not None:  # e.g. a policy's own samples: the reward model refreshed where RL goes
        combined = work / "pairs+extra.jsonl"
        combined.write_text(pairs.read_text() + args.extra_pairs.read_text())
        pairs = combined
    n_pairs = len(pairs.read_text().splitlines())
    preference = [
        "--config",
        "configs/preference_arithmetic.yaml",
        f"model.path={args.start_model}",
        f"preference.path={pairs}",
        f"preference.eval_path={held_out}",
        "preference.eval_size=100000",
        f"cluster.fileroot={work}",
        *QUIET,
    ]
    rm_seconds = once(
        work / "rm.done",
        [
            *CLI,
            "rm",
            *preference,
            "experiment.trial=rm",
            f"preference.lr={args.rm_lr}",
            f"preference.total_train_steps={args.rm_steps}",
            f"preference.nll_weight={args.rm_nll_weight}",
            "preference.eval_every_steps=250",
        ],
        work / "rm.log",
    )
    rm_run = work / "preference" / "rm"
    rm_evals = [(r["step"], r["eval/pair_accuracy"]) for r in records(rm_run) if "eval/pair_accuracy" in r]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "start_model": str(args.start_model),
        "pairs": n_pairs,
        "prompts": args.prompts,
        "pairing": args.pairing,
        "extra_pairs": str(args.extra_pairs) if args.extra_pairs else None,
        "rm": {
            "steps": args.rm_steps,
            "seconds": rm_seconds,
            "nll_weight": args.rm_nll_weight,
            "lr": args.rm_lr,
            "pair_accuracy": rm_evals,
        },
        "rl_steps": args.rl_steps,
        "rm_kl": args.rm_kl,
        "rl": [],
        "dpo": [],
    }
    for seed in args.seeds:
        kl = [f"actor.kl_coef={args.rm_kl}"]
        runs = {
            "rule": ("rule", []),
            "rule, same KL": ("rule-kl", kl),  # reward as reported: (run name, overrides)
            "reward model": ("rm", [f"reward.model={rm_run / 'model'}", *kl]),
        }
        for reward, (short, extra) in runs.items():
            name = f"rl-{short}-s{seed}"
            folder = work / name
            seconds = once(
                work / f"{name}.done",
                [
                    *CLI,
                    "train",
                    "--config",
                    "configs/quickstart.yaml",
                    f"model.path={args.start_model}",
                    f"cluster.fileroot={folder}",
                    f"experiment.seed={seed}",
                    "rl.sft_warmup_steps=0",
                    f"rl.total_train_steps={args.rl_steps}",
                    *QUIET,
                    *extra,
                ],
                work / f"{name}.log",
            )
            evals = [
                (r["step"], r["eval/accuracy"])
                for r in records(folder / "quickstart" / "trial0")
                if "eval/accuracy" in r
            ]
            result["rl"].append(
                {
                    "reward": reward,
                    "seed": seed,
                    "evals": evals,
                    "seconds": seconds,
                    "final": last3([a for _, a in evals]),
                }
            )
        name = f"dpo-s{seed}"
        seconds = once(
            work / f"{name}.done",
            [
                *CLI,
                "dpo",
                *preference,
                f"experiment.trial={name}",
                f"experiment.seed={seed}",
                f"preference.total_train_steps={args.dpo_steps}",
                f"preference.nll_weight={args.nll_weight}",
            ],
            work / f"{name}.log",
        )
        rows = records(work / "preference" / name)
        evals = [(r["step"], r["eval/accuracy"], r["eval/pair_accuracy"]) for r in rows if "eval/accuracy" in r]
        result["dpo"].append(
            {
                "seed": seed,
                "evals": evals,
                "seconds": seconds,
                "nll_weight": args.nll_weight,
                "final": last3([a for _, a, _ in evals]),
            }
        )
    return result


def report(result: dict) -> str:
    rm = result["rm"]["pair_accuracy"]
    start = result["rl"][0]["evals"][0][1]
    lines = [
        f"# preference demos ({result['date']})",
        "",
        f"machine: {result['machine']}; start model {result['start_model']} (held-out accuracy {start:.1%}); "
        f"{result['pairs']} pairs ({result.get('pairing', 'best-worst')}) from {result['prompts']} training "
        "prompts (4 samples each)" + (f", with {result['extra_pairs']}" if result.get("extra_pairs") else ""),
        "",
        f"**Reward model** (Bradley-Terry, language-model regulariser nll_weight "
        f"{result['rm'].get('nll_weight', 0):g}, lr {result['rm'].get('lr', 5e-4):g}, {result['rm']['steps']} steps, {result['rm']['seconds']:.0f} s): "
        f"held-out pairwise accuracy {rm[0][1]:.1%} -> {rm[-1][1]:.1%} (best {max(a for _, a in rm):.1%}); "
        "curve " + " ".join(f"{s}:{100 * a:.0f}" for s, a in rm),
        "",
        f"**RL** ({result['rl_steps']} steps of the quickstart's asynchronous GRPO from the start model; "
        "accuracy is the task's rule on 500 held-out problems, final = mean of the last 3 evaluations)",
        "",
        f"(against the reward model, and 'rule, same KL', with actor.kl_coef={result['rm_kl']:g}: the KL penalty "
        "to the start model)",
        "",
        "| reward | seeds | start | final (mean ± sd) | gain |",
        "|---|---|---|---|---|",
    ]
    for reward in dict.fromkeys(r["reward"] for r in result["rl"]):  # in the order they ran
        finals = [r["final"] for r in result["rl"] if r["reward"] == reward]
        lines.append(
            f"| {reward} | {len(finals)} | {100 * start:.1f} | **{100 * np.mean(finals):.1f}** ± "
            f"{100 * np.std(finals):.1f} | {100 * (np.mean(finals) - start):+.1f} |"
        )
    finals = [r["final"] for r in result["dpo"]]
    lines += [
        "",
        f"**DPO** (RPO, nll_weight {result['dpo'][0]['nll_weight']:g}; task accuracy, greedy, 500 problems): "
        f"{100 * start:.1f}% -> **{100 * np.mean(finals):.1f}%** ± {100 * np.std(finals):.1f} "
        f"({100 * (np.mean(finals) - start):+.1f} points, {len(finals)} seeds)",
        "",
        "Per run (step: accuracy):",
    ]
    for r in result["rl"]:
        lines.append(f"- RL {r['reward']} seed {r['seed']}: " + " ".join(f"{s}:{100 * a:.0f}" for s, a in r["evals"]))
    for r in result["dpo"]:
        lines.append(
            f"- DPO seed {r['seed']}: " + " ".join(f"{s}:{100 * a:.0f} (pairs {100 * p:.0f})" for s, a, p in r["evals"])
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start-model", type=Path, required=True, help="the SFT checkpoint everything starts from")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--prompts", type=int, default=8000, help="training prompts sampled for pairs")
    parser.add_argument(
        "--pairing",
        choices=["best-worst", "all"],
        default="best-worst",
        help="the training pairs per prompt (`areal-hpc pairs --pairing`)",
    )
    parser.add_argument(
        "--extra-pairs",
        type=Path,
        help="more training pairs (JSONL), e.g. `areal-hpc pairs` of a "
        "policy trained against a first reward model: the reward model then also learns where RL goes",
    )
    parser.add_argument("--rm-steps", type=int, default=3000)
    parser.add_argument("--rm-lr", type=float, default=1e-3, help="the reward model's peak learning rate")
    parser.add_argument(
        "--rm-nll-weight",
        type=float,
        default=1.0,
        help="the reward model's language-model regulariser (0: Bradley-Terry alone)",
    )
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument(
        "--rm-kl",
        type=float,
        default=0.3,
        help="actor.kl_coef of the runs against the reward model "
        "(without it the policy drifts to answers the reward model overrates)",
    )
    parser.add_argument("--dpo-steps", type=int, default=200)
    parser.add_argument("--nll-weight", type=float, default=1.0, help="DPO's (RPO's) chosen-NLL weight")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "preference_demos")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    args.start_model = args.start_model.resolve()
    run_and_record("preference_demos", args, run, report)


if __name__ == "__main__":
    main()
