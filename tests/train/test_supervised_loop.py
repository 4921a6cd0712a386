"""The loop SFT, DPO and the reward model share (``train.supervised.run_supervised``): evaluations before the
first step, every ``eval_every`` steps and after the last; checkpoints every ``save_every`` steps but not at the
step the job ends (the final model is saved there); a stop after the first evaluation that asks for one; every
step's statistics logged. A toy job on a stand-in engine: the jobs' own training is tested with them."""

import io
from pathlib import Path

from rich.console import Console

from areal_hpc.train.metrics import MetricsLogger
from areal_hpc.train.supervised import SupervisedJob, run_supervised


class SavingEngine:
    def __init__(self):
        self.saved: list[str] = []

    def save(self, folder: Path, *, optimizer: bool = True) -> None:
        assert not optimizer
        self.saved.append(folder.name)


def run_toy(tmp_path, steps: int, eval_every: int, save_every: int, stop_at: int | None = None):
    """(the loop's result, the steps evaluated, the checkpoints saved, the steps logged, what it printed); the
    toy evaluation's result is its step."""
    evaluated, engine, out = [], SavingEngine(), io.StringIO()

    def evaluate(step: int) -> int:
        evaluated.append(step)
        return step

    job = SupervisedJob(
        name="toy",
        title="TOY",
        steps=steps,
        eval_every=eval_every,
        save_every=save_every,
        step=lambda: {"train/loss": 1.0},
        evaluate=evaluate,
        describe=lambda step: f"evaluated at {step}",
        note=lambda stats, step: f"last evaluated {step}",
        stop=lambda step: "enough" if stop_at is not None and step >= stop_at else None,
    )
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    try:
        result = run_supervised(job, engine, metrics, Console(file=out, width=200), tmp_path)
    finally:
        metrics.close()
    logged = [record["step"] for record in metrics.records if "train/loss" in record]
    return result, evaluated, engine.saved, logged, out.getvalue()


def test_evaluations_checkpoints_and_statistics_follow_the_schedule(tmp_path):
    result, evaluated, saved, logged, printed = run_toy(tmp_path, steps=10, eval_every=4, save_every=3)
    assert result == (0, 10) and evaluated == [0, 4, 8, 10]
    assert saved == ["step3", "step6", "step9"]
    assert logged == list(range(1, 11))
    assert "before TOY: evaluated at 0" in printed and "step 8: evaluated at 8" in printed


def test_without_a_period_it_evaluates_before_and_after_and_saves_nothing_before_the_end(tmp_path):
    result, evaluated, saved, _, _ = run_toy(tmp_path, steps=5, eval_every=0, save_every=0)
    assert result == (0, 5) and evaluated == [0, 5] and saved == []


def test_a_job_stops_after_the_first_evaluation_that_asks(tmp_path):
    result, evaluated, saved, logged, printed = run_toy(tmp_path, steps=20, eval_every=5, save_every=5, stop_at=10)
    assert result == (0, 10) and evaluated == [0, 5, 10]
    assert saved == ["step5"]  # not step10: the job ends there, and its final model is saved
    assert logged == list(range(1, 11))
    assert "step 10: enough: TOY stops here" in printed
