"""Is a gap in greedy accuracy a gap in the policy? Final models scored greedily and by sampling.

    .venv/bin/python bench/greedy_vs_sampled.py \
        --baseline "eta0=/tmp/abl/eta01/eta0-s{seed}/ablation/trial0" \
        --runs "eta1=/tmp/abl/eta01/eta1-s{seed}/ablation/trial0" --seeds 11 ... 30 --samples 16 [--save]

Each pattern names a finished ``areal-hpc train`` run folder (its ``model/`` and ``metrics.jsonl``). Its
final model is scored on the config's held-out problems by ``areal-hpc eval --samples N``: pass@1 over N
answers a problem sampled at the config's temperature (the policy's expected accuracy, what RL's reward
measures), beside the run's own greedy evaluation at its last step (from metrics.jsonl). Each run is paired
with the baseline's run of the same seed (same prompts, same start); points, mean ± standard error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from areal_hpc.fsio import read_json_lines

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, record_name, run_and_record
from reward_by_version import add_pairing_arguments, mean_and_error, paired_paths

REPO = Path(__file__).resolve().parent.parent


def scores(run_dir: Path, config: Path, samples: int) -> dict:
    """The run's greedy accuracy at its last evaluation and its final model's sampled pass@1."""
    greedy = [r["eval/accuracy"] for r in read_json_lines(run_dir / "metrics.jsonl") if "eval/accuracy" in r][-1]
    out = subprocess.run(
        [
            str(REPO / ".venv/bin/areal-hpc"),
            "eval",
            "--model",
            str(run_dir / "model"),
            "--config",
            str(config),
            "--samples",
            str(samples),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return {"greedy": greedy, "sampled": json.loads(out.stdout)["pass@1"]}


def run(args) -> dict:
    sides: dict[str, dict[int, dict]] = {}
    for label, runs in paired_paths(args).items():
        sides[label] = {}
        for seed, run_dir in runs.items():
            sides[label][seed] = scores(run_dir, args.config, args.samples)
            print(f"{label} seed {seed}: {sides[label][seed]}", flush=True)
    base = sides[args.baseline[0]]
    comparisons = {
        label: {
            kind: [100 * (sides[label][s][kind] - base[s][kind]) for s in args.seeds] for kind in ("greedy", "sampled")
        }
        for label, _ in args.runs
    }
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "baseline": args.baseline[0],
        "patterns": dict([args.baseline, *args.runs]),
        "seeds": args.seeds,
        "samples": args.samples,
        "config": str(args.config.relative_to(REPO)),
        "scores": sides,
        "comparisons": comparisons,
    }


def report(result: dict) -> str:
    base = result["baseline"]
    lines = [
        f"# Greedy and sampled accuracy of final models ({result['date']})",
        "",
        f"{result['machine']}; config `{result['config']}`'s held-out problems; sampled: pass@1 over "
        f"{result['samples']} answers a problem; seeds {result['seeds']}. Runs: "
        + "; ".join(f"{label}: `{pattern}`" for label, pattern in result["patterns"].items()),
        "",
        "| model | greedy accuracy at the last step | sampled accuracy (pass@1) |",
        "|---|---|---|",
    ]
    for label, runs in result["scores"].items():
        mean = {kind: 100 * sum(r[kind] for r in runs.values()) / len(runs) for kind in ("greedy", "sampled")}
        lines.append(f"| {label} | {mean['greedy']:.2f}% | {mean['sampled']:.2f}% |")
    for label, gaps in result["comparisons"].items():
        lines.append(
            f"| {label} minus {base}, seed by seed (points) | {mean_and_error(gaps['greedy'])} | "
            f"{mean_and_error(gaps['sampled'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pairing_arguments(parser, "RUN_DIR")
    parser.add_argument("--samples", type=int, default=16, help="answers sampled a problem (pass@1 over them)")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "quickstart.yaml")
    parser.add_argument("--label", default="", help="results file greedy_vs_sampled-LABEL-<date>")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    args.config = args.config.resolve()
    run_and_record(record_name("greedy_vs_sampled", args.label), args, run, report)


if __name__ == "__main__":
    main()
