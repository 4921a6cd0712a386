"""SFT really teaches the tiny model: held-out accuracy rises far above the untrained model's, and
every output of the run says the same thing: TensorBoard holds the metrics' values, the checkpoint
and the final model score what the run measured, in-process, through ``areal-hpc eval`` and behind a
real rollout server (one evaluation path)."""

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal_hpc.agents.engine import EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.rlvr import RLVRWorkflow
from areal_hpc.config import load_config
from areal_hpc.data.registry import build_task
from areal_hpc.data.rewards import RewardPool
from areal_hpc.models.hf import load_model, load_tokenizer
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.rollout.controller import FAILURE_KINDS
from areal_hpc.train.evaluate import evaluate, evaluate_model
from tests.conftest import embedded_server, run_cli

# Fixed seed, 1-2 digit addition, 700 steps at the quickstart's warm-up settings (constant lr 2e-3; about
# 80 s on 2 cores). Accuracy rises steeply at a step that float rounding moves: after 500 steps it was
# 50-60% with two torch threads and 11.5% with one; after 700 with one thread, 45.5%.
MIN_ACCURACY_AFTER = 0.35


@pytest.mark.slow
def test_sft_raises_eval_accuracy_and_writes_every_output(tmp_path):
    out = run_cli(
        "sft",
        "--config",
        "configs/sft_tiny.yaml",
        f"cluster.fileroot={tmp_path}",
        "sft.total_train_steps=700",
        "sft.eval_every_steps=350",
        "saver.freq_steps=350",
        "sft.lr=2e-3",
        "optimizer.lr_scheduler_type=constant",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    run_dir = tmp_path / "sft_tiny" / "trial0"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    assert list(accuracy) == [0, 350, 700]
    assert accuracy[0] <= 0.02
    assert accuracy[700] >= MIN_ACCURACY_AFTER
    assert f"eval accuracy: before {accuracy[0]:.1%}" in out.stdout
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 700 and sum(losses[-50:]) < 0.5 * sum(losses[:50])

    assert yaml.safe_load((run_dir / "config.yaml").read_text())["sft"]["total_train_steps"] == 700
    board = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert {e.step: e.value for e in board.Scalars("eval/accuracy")} == pytest.approx(accuracy)
    assert [e.value for e in board.Scalars("train/loss")] == pytest.approx(losses)
    assert imread(run_dir / "sft_curves.png").shape[:2] == (396, 1100)  # two panels, 10 x 3.6 in at 110 dpi

    cfg = load_config("configs/sft_tiny.yaml", [])
    task, tokenizer = build_task(cfg.dataset), load_tokenizer(run_dir / "model")
    with RewardPool(task.reward) as rewards:
        at_350 = evaluate_model(
            load_model(run_dir / "checkpoints" / "step350"),
            tokenizer,
            task.eval,
            rewards,
            Sampling.from_config(cfg.generation),
        )
        with embedded_server(run_dir / "model", tmp_path) as (_, address):

            async def served():
                async with RolloutClient([address]) as client:
                    settings = EpisodeSettings(
                        client.generate, tokenizer, Sampling.from_config(cfg.generation), Scorer(rewards)
                    )
                    return await evaluate(settings, RLVRWorkflow(), task.eval)

            behind_server = asyncio.run(served())
    assert at_350.accuracy == pytest.approx(accuracy[350])
    # the server batches requests as they arrive: float sums may differ in the last bits, so a near-tie
    # may decode differently; one problem of 200 at most
    assert behind_server.accuracy == pytest.approx(accuracy[700], abs=1 / len(task.eval))

    # The saved model scores the same through the eval command as it did inside the run.
    out = run_cli("eval", "--model", str(run_dir / "model"), "--config", "configs/sft_tiny.yaml", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["accuracy"] == pytest.approx(accuracy[700])
    assert json.loads(out.stdout)["failures"] == dict.fromkeys(FAILURE_KINDS, 0)  # every kind, none failed


@pytest.mark.slow
def test_sft_stops_at_the_first_evaluation_that_reaches_stop_at_accuracy(tmp_path, tiny_model_dir):
    """Four problems to memorise (train and held out alike): accuracy climbs from 0 to 100% within the
    step cap, and SFT ends at the first evaluation at or above the target, not at the cap."""
    data = tmp_path / "four.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{a} plus {a}?", "answer": str(2 * a), "target": str(2 * a)}) + "\n"
            for a in (3, 14, 25, 36)
        )
    )
    common = [
        "--config",
        "configs/sft_tiny.yaml",
        f"model.path={tiny_model_dir}",
        "dataset.task=custom",
        f"dataset.path={data}",
        f"dataset.eval_path={data}",
        f"reward.fn={Path(__file__).parents[1] / 'rewards_for_tests.py'}:exact_answer",
        "sft.total_train_steps=400",
        "sft.batch_size=8",
        "optimizer.lr_scheduler_type=constant",
        "stats.plot=false",
        "saver.freq_steps=0",
    ]
    refused = run_cli(
        "sft", *common, f"cluster.fileroot={tmp_path / 'refused'}", "sft.stop_at_accuracy=0.5", "sft.eval_every_steps=0"
    )
    assert refused.returncode == 2 and "sft.stop_at_accuracy" in refused.stderr and "eval_every_steps" in refused.stderr
    out = run_cli("sft", *common, f"cluster.fileroot={tmp_path}", "sft.stop_at_accuracy=0.75", "sft.eval_every_steps=5")
    assert out.returncode == 0, out.stderr[-2000:]
    records = [
        json.loads(line) for line in (tmp_path / "sft_tiny" / "trial0" / "metrics.jsonl").read_text().splitlines()
    ]
    accuracy = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    steps = [r["step"] for r in records if "train/loss" in r]
    assert accuracy[-1][1] >= 0.75 and all(a < 0.75 for _, a in accuracy[:-1])
    assert steps[-1] == accuracy[-1][0] < 400 and steps[-1] % 5 == 0
    assert "reached sft.stop_at_accuracy 75%" in out.stdout
