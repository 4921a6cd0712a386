"""bench/reward_by_version.py compares rewards of the same policy version: a run that is the baseline
delayed by its staleness shows no gap, a constant offset shows as itself, and its command reads real
metrics.jsonl files written in the trainer's format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from reward_by_version import version_aligned_reward_gap  # noqa: E402

rewards = st.lists(st.floats(0, 1), min_size=8, max_size=60)


@given(rewards, st.integers(0, 3), st.floats(-0.5, 0.5))
def test_a_run_delayed_by_its_staleness_differs_only_by_its_offset(baseline, lag, offset):
    """Drawn by the baseline's policies ``lag`` steps later (what staleness ``lag`` means), shifted by
    ``offset``: the gap is ``offset``, whatever the curve."""
    delayed = [0.0] * lag + [r + offset for r in baseline]
    gap = version_aligned_reward_gap(
        {"rewards": delayed, "staleness": lag + 0.4}, {"rewards": baseline, "staleness": 0.0}
    )
    assert gap == pytest.approx(offset, abs=1e-9)


def write_run(folder: Path, rewards: list[float], staleness: float, accuracy: list[float]) -> None:
    folder.mkdir(parents=True)
    steps = [
        {"step": s + 1, "time/step": 0.1, "rollout/reward": r, "staleness/mean": staleness}
        for s, r in enumerate(rewards)
    ]
    evals = [{"step": 10 * i, "eval/accuracy": a} for i, a in enumerate(accuracy)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + evals))


def pair_runs(tmp_path: Path, *seeds: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "bench/reward_by_version.py",
            "--baseline",
            f"sync={tmp_path}/sync{{seed}}/metrics.jsonl",
            "--runs",
            f"async={tmp_path}/async{{seed}}/metrics.jsonl",
            "--seeds",
            *seeds,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_command_pairs_runs_by_seed(tmp_path):
    for seed, (gap, accuracy_gap) in {1: (0.02, -0.01), 2: (0.04, -0.03)}.items():
        curve = [0.3 + 0.01 * s for s in range(40)]
        write_run(tmp_path / f"sync{seed}", curve, 0.0, [0.5, 0.6, 0.7, 0.8])
        write_run(
            tmp_path / f"async{seed}",
            [0.3] + [r + gap for r in curve],
            1.0,
            [0.5, 0.6, 0.7 + accuracy_gap, 0.8 + accuracy_gap],
        )
    done = pair_runs(tmp_path, "1", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    # final accuracy: the mean of the last 3 evaluations, so 2/3 of each run's offset; rewards: 2 and 4 points
    assert "| async | 2 | 1.00 | -1.33 ± 0.67 | +3.00 ± 1.00 |" in done.stdout


def test_a_seed_without_a_run_is_refused_in_one_line_before_anything_is_read(tmp_path):
    write_run(tmp_path / "sync1", [0.5] * 10, 0.0, [0.5, 0.6, 0.7])
    done = pair_runs(tmp_path, "1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        f"async seed 1: {tmp_path}/async1/metrics.jsonl does not exist (1 of the paths are "
        "missing); each --baseline/--runs pattern must name a finished run for every "
        "--seeds value"
    )
