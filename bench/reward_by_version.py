"""Does a run learn more slowly, or does it only score differently under the greedy evaluation?

    .venv/bin/python bench/reward_by_version.py \
        --runs "ours=/tmp/peer30/ours-seed{seed}/quickstart/trial0/metrics.jsonl" \
        --baseline "trl=/tmp/peer30/trl-seed{seed}/quickstart/trial0/metrics.jsonl" --seeds 11 ... 30 [--save]

Reads finished runs' metrics.jsonl (``areal-hpc train``'s, or the runs of ``peer_trl.py``, whose TRL side
writes the same names) and compares each run with the baseline's run of the same seed twice:

- final greedy held-out accuracy (the mean of the last three evaluations), as the other benchmarks do. The
  evaluations are those of ``peer_trl.py``'s ``areal-hpc eval`` of the run's checkpoints, ``evals.json`` in the
  run's folder (the folder ``peer_trl.py``'s ``--root`` holds: ``<side>-seed<N>/evals.json`` beside
  ``<side>-seed<N>/quickstart/trial0/metrics.jsonl``), where there is one; else the run's own in-run
  evaluations, ``eval/accuracy`` in its metrics.jsonl;
- the training reward (``rollout/reward``: the mean reward of the step's sampled answers) **of the same
  policy version**: a run whose batches are on average k versions stale (``staleness/mean``, rounded;
  0 without it) trains at step s + k on answers drawn by about the policy that drew the baseline's batch at
  step s. Compared over the second half of the run. Equal rewards per version mean that each update
  improved the sampled policy as much as the baseline's did.

Reported as points, the mean over seeds ± its standard error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

from areal_hpc.fsio import read_json_lines

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, record_name, run_and_record

LAST_EVALS = 3
PEER_RUN_FILE = Path("quickstart/trial0/metrics.jsonl")  # peer_trl.py's RUN_FILE: a run's metrics under its folder


def evals_file(metrics: Path) -> Path | None:
    """``evals.json`` of the peer_trl.py run whose metrics.jsonl is ``metrics`` (its evaluations by ``areal-hpc
    eval`` after the run), or None when ``metrics`` is not such a run's or the file is not there."""
    depth = len(PEER_RUN_FILE.parts)
    if len(metrics.parts) <= depth or metrics.parts[-depth:] != PEER_RUN_FILE.parts:
        return None
    found = metrics.parents[depth - 1] / "evals.json"
    return found if found.is_file() else None


def accuracies(metrics: Path, records: list[dict]) -> list[float]:
    """A run's held-out accuracies in step order: from its evals.json where it has one, else ``eval/accuracy``
    of its metrics ``records``."""
    found = evals_file(metrics)
    if found is None:
        return [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return [e["accuracy"] for e in sorted(json.loads(found.read_text()), key=lambda e: e["step"])]


def run_summary(metrics: Path) -> dict:
    """A run's rewards by step, mean staleness and final accuracy (mean of its last evaluations)."""
    records = read_json_lines(metrics)
    steps = sorted((r for r in records if "rollout/reward" in r and "time/step" in r), key=lambda r: r["step"])
    staleness = [r["staleness/mean"] for r in records if "staleness/mean" in r]
    evals = accuracies(metrics, records)
    if not evals:
        raise SystemExit(
            f"{metrics}: no held-out evaluation (no evals.json of peer_trl.py beside the run, no eval/accuracy in it)"
        )
    return {
        "rewards": [r["rollout/reward"] for r in steps],
        "staleness": float(np.mean(staleness)) if staleness else 0.0,
        "final": float(np.mean(evals[-LAST_EVALS:])),
    }


def version_aligned_reward_gap(run: dict, baseline: dict) -> float:
    """Mean training reward of ``run`` at steps s + lag minus ``baseline``'s at steps s, s over the second half
    of the baseline's run; lag = the difference of the two runs' mean staleness, rounded."""
    lag = round(run["staleness"] - baseline["staleness"])
    ours, theirs = run["rewards"], baseline["rewards"]
    steps = range(len(theirs) // 2, min(len(theirs), len(ours) - lag))
    return float(np.mean([ours[s + lag] for s in steps]) - np.mean([theirs[s] for s in steps]))


def mean_and_error(values: list[float]) -> str:
    return f"{np.mean(values):+.2f} ± {np.std(values, ddof=1) / np.sqrt(len(values)):.2f}"


def paired_gaps(runs: dict[int, dict], baseline: dict[int, dict]) -> dict[str, list[float]]:
    """Per seed both ran: final accuracy and same-version training reward, run minus baseline, in points."""
    seeds = sorted(set(runs) & set(baseline))
    return {
        "seeds": seeds,
        "accuracy": [100 * (runs[s]["final"] - baseline[s]["final"]) for s in seeds],
        "reward": [100 * version_aligned_reward_gap(runs[s], baseline[s]) for s in seeds],
    }


def labelled(text: str) -> tuple[str, str]:
    label, _, pattern = text.partition("=")
    if not pattern or "{seed}" not in pattern:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=PATH with {{seed}} in PATH")
    return label, pattern


def add_pairing_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """--baseline LABEL=WHAT, --runs LABEL=WHAT ... (``{seed}`` in WHAT) and --seeds: runs paired by seed."""
    parser.add_argument("--baseline", type=labelled, required=True, help=f"LABEL={what}, {{seed}} in {what}")
    parser.add_argument("--runs", type=labelled, nargs="+", required=True, help=f"LABEL={what} ..., {{seed}} in each")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)


def paired_paths(args) -> dict[str, dict[int, Path]]:
    """Each label's path for each seed (baseline first); a missing one is refused in one line (exit 2)
    before anything is read or run."""
    paths = {
        label: {seed: Path(pattern.format(seed=seed)) for seed in args.seeds}
        for label, pattern in [args.baseline, *args.runs]
    }
    missing = [(label, seed, path) for label, runs in paths.items() for seed, path in runs.items() if not path.exists()]
    if missing:
        label, seed, path = missing[0]
        print(
            f"{label} seed {seed}: {path} does not exist ({len(missing)} of the paths are missing); "
            "each --baseline/--runs pattern must name a finished run for every --seeds value",
            file=sys.stderr,
        )
        sys.exit(2)
    return paths


def run(args) -> dict:
    sides = {
        label: {seed: run_summary(path) for seed, path in runs.items()} for label, runs in paired_paths(args).items()
    }
    base_label = args.baseline[0]
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "baseline": base_label,
        "patterns": dict([args.baseline, *args.runs]),
        "comparisons": {label: paired_gaps(sides[label], sides[base_label]) for label, _ in args.runs},
        "staleness": {label: float(np.mean([r["staleness"] for r in runs.values()])) for label, runs in sides.items()},
    }


def report(result: dict) -> str:
    base = result["baseline"]
    lines = [
        f"# Learning per update or the greedy score? ({result['date']})",
        "",
        f"Runs read on {result['machine']}: "
        + "; ".join(f"{label}: `{pattern}`" for label, pattern in result["patterns"].items()),
        "",
        f"| run minus {base} | seeds | mean staleness | final greedy accuracy (points) | "
        "training reward of the same policy version, 2nd half (points) |",
        "|---|---|---|---|---|",
    ]
    for label, gaps in result["comparisons"].items():
        lines.append(
            f"| {label} | {len(gaps['seeds'])} | {result['staleness'][label]:.2f} | "
            f"{mean_and_error(gaps['accuracy'])} | {mean_and_error(gaps['reward'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pairing_arguments(parser, "PATH")
    parser.add_argument("--label", default="", help="results file reward_by_version-LABEL-<date>")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    run_and_record(record_name("reward_by_version", args.label), args, run, report)


if __name__ == "__main__":
    main()
