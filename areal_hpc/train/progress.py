"""What an RL run shows and records: a live progress line (step, reward, eval accuracy, staleness,
tokens/s, failed episodes), metrics in JSONL and TensorBoard (rollout failures by kind also while the
trainer waits, whenever they change; the first of each kind also printed and in ``logs/failures.log``,
``failure_report``), the audit log of which trajectories each step trained
or dropped (``logs/batches.jsonl``; after a resume, a ``resumed_from`` line, and steps trained again
after it supersede their lost attempts), and at the end a PNG of reward and eval accuracy.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from areal_hpc.config import RunConfig, save_resolved
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.rollout.controller import FailureLog
from areal_hpc.runtime.bootstrap import LAUNCHED_AT, TRAINERS_AT
from areal_hpc.train.evaluate import EvalResult
from areal_hpc.train.failure_report import FailureReport, failures_log
from areal_hpc.train.metrics import MetricsLogger
from areal_hpc.train.plots import plot_curves

LINE = (
    "reward {task.fields[reward]:.3f}  eval {task.fields[acc]}  staleness {task.fields[stale]:.2f}  "
    "{task.fields[tps]:.0f} tok/s  failures {task.fields[failures]}"
)


class RLProgress:
    def __init__(self, cfg: RunConfig, start_step: int, console: Console | None = None):
        self.cfg, self.console = cfg, console or Console()
        save_resolved(cfg)
        self.metrics = MetricsLogger(cfg.run_dir, cfg.stats.tensorboard, resume_step=start_step or None)
        (cfg.run_dir / "logs").mkdir(exist_ok=True)
        self._audit = (cfg.run_dir / "logs" / "batches.jsonl").open("a", buffering=1)
        if start_step:  # entries after this marker replace those of the same steps before it
            self._audit.write(json.dumps({"resumed_from": start_step}) + "\n")
        self._progress = Progress(
            TextColumn("[bold]rl"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn(LINE),
            console=self.console,
        )
        self._bar = self._progress.add_task(
            "rl",
            total=cfg.rl.total_train_steps,
            completed=start_step,
            reward=float("nan"),
            acc="-",
            stale=0.0,
            tps=0.0,
            failures=0,
        )
        self._started, self._trained_tokens = time.perf_counter(), 0
        self._step, self._counts = start_step, None  # last step trained, rollout counts last logged
        self.failures = FailureReport(
            lambda line: self.console.print(line, soft_wrap=True, markup=False, highlight=False),
            failures_log(cfg.run_dir),
            "rollout/failures/{kind}",
        )

    def __enter__(self) -> RLProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()
        self._audit.close()
        self.metrics.close()

    def rollouts_started(self) -> None:
        """When launched by ``areal-hpc train``: seconds since the launch and since the trainers started."""
        marks = [
            (os.environ.get(LAUNCHED_AT), "after launch"),
            (os.environ.get(TRAINERS_AT), "after the trainers started"),
        ]
        since = ", ".join(f"{time.time() - float(at):.1f} s {what}" for at, what in marks if at)
        self.console.print(f"rollouts started{f' {since}' if since else ''}", soft_wrap=True)

    def evaluated(self, step: int, result: EvalResult, seconds: float) -> None:
        """``seconds``: from the evaluation's first request to its score (``eval/seconds``; the record's
        ``time`` is its end): it ran beside the training steps whose time overlaps that span."""
        self.metrics.log(step, {**result.scalars(), "eval/seconds": seconds})
        self._progress.update(self._bar, acc=f"{result.accuracy:.1%}")
        line = f"step {step}: eval accuracy {result.summary()}{result.failed()}"
        self.console.print(line, soft_wrap=True, markup=False)

    def pushed(self, step: int, stats: dict[str, float]) -> None:
        """The weight push of ``step``'s weights, logged when it ends (it may run beside the next step)."""
        self.metrics.log(step, stats)

    def trained(
        self, step: int, batch: list[Trajectory], stats: dict[str, float], waited: float, seconds: float, controller
    ) -> None:
        staleness = [max(0, step - 1 - t.version_range[0]) for t in batch]  # trained at version step - 1 (0: recovered)
        rewards = [t.reward or 0.0 for t in batch]
        self._trained_tokens += int(stats["train/trained_tokens"])
        self._step, self._counts = step, controller.counters()
        scalars = {
            **stats,
            "rollout/reward": float(np.mean(rewards)),
            "rollout/output_tokens": float(np.mean([t.n_output_tokens for t in batch])),
            "rollout/interruptions": float(sum(t.metadata.get("interruptions", 0) for t in batch)),
            "rollout/turns": float(np.mean([len(t.segments) for t in batch])),
            **reward_metrics(batch),
            **self._counts,
            "staleness/mean": float(np.mean(staleness)),
            "staleness/max": float(max(staleness)),
            "time/generate_wait": waited,
            "time/step": seconds,
            "perf/trained_tokens_per_s": stats["train/trained_tokens"] / seconds,
            "perf/tokens_per_s": stats["train/tokens"] / seconds,
            "perf/trained_tokens_per_s_run": self._trained_tokens / (time.perf_counter() - self._started),
        }
        self.metrics.log(step, scalars)
        self.metrics.histogram(step, "staleness", staleness)
        self._audit.write(json.dumps({"step": step, "trained": [t.id for t in batch]}) + "\n")
        self._progress.update(
            self._bar,
            completed=step,
            reward=scalars["rollout/reward"],
            stale=scalars["staleness/mean"],
            tps=scalars["perf/trained_tokens_per_s"],
            failures=int(scalars["rollout/failures_total"]),
        )

    def rollout_counts(self, controller) -> None:
        """Log the controller's counts (failures by kind, filtered, dropped) at the last trained step,
        if they changed since they were last logged: a run that waits on failing rollouts says why. The first
        failure of each kind is shown."""
        self.failures.show_new(controller.failures)
        counts = controller.counters()
        if counts != self._counts:
            self._counts = counts
            self.metrics.log(self._step, counts)
            self._progress.update(self._bar, failures=int(counts["rollout/failures_total"]))

    async def watch(self, controller, every_s: float = 1.0) -> None:
        """``rollout_counts`` every ``every_s`` seconds, until cancelled."""
        while True:
            self.rollout_counts(controller)
            await asyncio.sleep(every_s)

    def stopped(self, step: int) -> None:
        self.console.print(
            f"stop signal: checkpoint of step {step} saved in {self.cfg.run_dir / 'checkpoints'}; "
            f"exiting (a requeued job resumes from it)",
            soft_wrap=True,
        )

    def dropped(self, ids: list[str]) -> None:
        self._audit.write(json.dumps({"dropped": ids}) + "\n")

    def finish(self, failures: FailureLog) -> int:
        """The run's result in one line (held-out accuracy at the start and the mean of the last three
        evaluations: one evaluation alone is noisy), and its curves; the last line says how many episodes
        or rewards failed, if any did. The run's exit status (``FailureReport.finish``)."""
        gain = accuracy_gain(self.metrics.records)
        title = f"asynchronous RL on {self.cfg.dataset.task}"
        if gain is not None:
            start, last3 = gain
            line = (
                f"held-out accuracy {start:.1%} at the start, {last3:.1%} over the last 3 evaluations "
                f"({100 * (last3 - start):+.1f} points)"
            )
            self.console.print(line, soft_wrap=True)
            title += f": {line}"
        if self.cfg.stats.plot:
            panels = {"reward": "rollout/reward", "eval accuracy": "eval/accuracy", "policy entropy": "actor/entropy"}
            out = plot_curves(self.metrics.records, panels, self.cfg.run_dir / "rl_curves.png", title)
            self.console.print(f"curves: {out}")
        return self.failures.finish(failures, self.cfg.rollout.failure_budget.exit_code_on_failures)


def accuracy_gain(records: list[dict]) -> tuple[float, float] | None:
    """(first evaluation's accuracy, mean of the last three), or None before two evaluations."""
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return (accuracy[0], float(np.mean(accuracy[-3:]))) if len(accuracy) >= 2 else None


def reward_metrics(batch: list[Trajectory]) -> dict[str, float]:
    """``reward/<name>``: the batch mean of each extra number the reward function returned."""
    values: dict[str, list[float]] = {}
    for trajectory in batch:
        for name, value in trajectory.metadata.get("reward_metrics", {}).items():
            values.setdefault(f"reward/{name}", []).append(value)
    return {name: float(np.mean(v)) for name, v in values.items()}
