"""Repeatability: a synchronous run (eta = 0) with the same config and seed trains the same weights and
logs the same metrics, bit for bit, and evaluating along the way changes nothing it trains; the same
for SFT with and without periodic evaluation.

What makes it hold: every generation carries a sampling seed derived from the run's seed, the episode
and the sample (``agents.engine.derive_seed``), the embedded engine draws from a hash of that seed and
the token's position (``rollout.sampling``), batches are ordered by when their episodes started, not
by when they finished, and the trainer runs on one thread (the local launcher's split of 2 cores).
One KV slot (``rollout.max_running_requests=1``): a row's logits otherwise depend on the batch it was
decoded in, in the last bits (matrix-multiply blocking), as SGLang documents for its own kernels. No
prefix cache (``rollout.prefix_cache_mb=0``): a prompt's cached keys were computed by whichever request
ran them first, an evaluation's among them, which moves its logprobs in the last bits the same way.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from areal_hpc.fsio import read_json_lines
from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REWARD = f"reward.fn={REPO / 'tests' / 'rewards_for_tests.py'}:digit_share"
SYNC_RUN = [
    "rl.sft_warmup_steps=0",
    "dataset.train_size=64",
    "dataset.eval_size=8",
    "rollout.consumer_batch_size=4",
    "generation.n_samples=4",
    "generation.max_new_tokens=6",
    "rollout.max_head_offpolicyness=0",
    "rollout.max_running_requests=1",
    "rollout.prefix_cache_mb=0",
    "rl.total_train_steps=4",
    "saver.freq_steps=0",
    "stats.tensorboard=false",
    "stats.plot=false",
    REWARD,
]
TIMING = ("time", "time/", "perf/")  # wall-clock values, and every key ending in "seconds"


def weights(run: Path) -> dict:
    return load_file(next((run / "model").glob("*.safetensors")))


def training_metrics(run: Path) -> list[dict]:
    """Every logged value but wall-clock times and evaluation records, per step."""
    return [
        {k: v for k, v in record.items() if not k.startswith((*TIMING, "eval/")) and not k.endswith("seconds")}
        for record in read_json_lines(run / "metrics.jsonl")
        if "actor/loss" in record
    ]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def train(model: Path, fileroot: Path, *extra: str) -> Path:
    done = run_cli(
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"model.path={model}",
        f"cluster.fileroot={fileroot}",
        *SYNC_RUN,
        *extra,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return fileroot / "quickstart" / "trial0"


def test_a_synchronous_run_repeats_itself_bit_for_bit_and_evaluating_changes_nothing(tiny_model_dir, tmp_path):
    first = train(tiny_model_dir, tmp_path / "a", "rl.eval_every_steps=0")
    again = train(tiny_model_dir, tmp_path / "b", "rl.eval_every_steps=0")
    evaluated = train(tiny_model_dir, tmp_path / "c", "rl.eval_every_steps=1")
    steps = training_metrics(first)
    assert len(steps) == 4 and all(math.isfinite(s["actor/loss"]) for s in steps)
    assert any(s["actor/grad_norm"] > 0 for s in steps)  # it learnt something: the comparison is not vacuous
    start = load_file(next(tiny_model_dir.glob("*.safetensors")))
    assert not same_weights(weights(first), {k: v for k, v in start.items() if k in weights(first)})
    assert same_weights(weights(first), weights(again))
    assert training_metrics(first) == training_metrics(again)
    assert sum("eval/accuracy" in r for r in read_json_lines(evaluated / "metrics.jsonl")) == 5  # steps 0-4
    assert same_weights(weights(first), weights(evaluated))
    assert training_metrics(first) == training_metrics(evaluated)


def test_sft_with_and_without_periodic_evaluation_trains_the_same_weights(tiny_model_dir, tmp_path):
    runs = []
    for every in (0, 3):
        done = run_cli(
            "sft",
            "--config",
            "configs/sft_tiny.yaml",
            f"model.path={tiny_model_dir}",
            f"cluster.fileroot={tmp_path / str(every)}",
            "sft.total_train_steps=9",
            "sft.batch_size=16",
            f"sft.eval_every_steps={every}",
            "dataset.eval_size=8",
            "stats.plot=false",
            "saver.freq_steps=0",
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(tmp_path / str(every) / "sft_tiny" / "trial0")
    assert len([r for r in read_json_lines(runs[1] / "metrics.jsonl") if "eval/accuracy" in r]) == 4  # 0, 3, 6, 9
    assert same_weights(weights(runs[0]), weights(runs[1]))
