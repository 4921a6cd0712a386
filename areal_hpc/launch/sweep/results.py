"""A submitted sweep's progress and results: each point's Slurm state and step (``--status``, ``--wait``),
then, once every point has finished, the results table and its CSV, Markdown and plot files."""

from __future__ import annotations

import csv
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.errors import UserError
from areal_hpc.fsio import read_json_lines
from areal_hpc.launch.sweep.submit import SWEEP_FILE

POLL_S = 2.0


@dataclass
class PointState:
    name: str
    job_id: str
    state: str  # Slurm's, as sacct says it (through submitit)
    done: bool
    step: int | None  # last step in the run's metrics
    total_steps: int
    run_dir: Path


def point_states(record: dict) -> list[PointState]:
    """Each point's Slurm state (one sacct call for the whole array) and its last step."""
    from submitit import SlurmJob

    jobs = [SlurmJob(folder=record["submitit_folder"], job_id=p["job_id"]) for p in record["points"]]
    SlurmJob.watcher.update()
    states = []
    for point, job in zip(record["points"], jobs):
        state = job.watcher.get_state(job.job_id, mode="cache")
        ended_in_slurm = job.watcher.is_done(job.job_id, mode="cache")
        returned = job.paths.result_pickle.exists()
        if returned and not ended_in_slurm:  # Slurm's accounting lags the function's return by seconds
            state = state_from_result(job.paths.result_pickle)
        done = ended_in_slurm or returned
        run_dir = Path(point["run_dir"])
        step = max((r["step"] for r in read_metrics(run_dir)), default=None)
        states.append(PointState(point["name"], job.job_id, state, done, step, point["total_steps"], run_dir))
    return states


def state_from_result(result_pickle: Path) -> str:
    """COMPLETED or FAILED, from the outcome submitit pickled when the point's function returned."""
    from submitit.core.utils import pickle_load

    outcome, _ = pickle_load(result_pickle)
    return "COMPLETED" if outcome == "success" else "FAILED"


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``<run>/metrics.jsonl``, read as the trainer reads them back; none before it exists."""
    return read_json_lines(run_dir / "metrics.jsonl")


def point_result(state: PointState) -> dict:
    records = read_metrics(state.run_dir)
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    reward = [r["rollout/reward"] for r in records if "rollout/reward" in r]
    speed = [r["perf/trained_tokens_per_s_run"] for r in records if "perf/trained_tokens_per_s_run" in r]
    return {
        "point": state.name,
        "state": state.state,
        "final_eval_accuracy": accuracy[-1] if accuracy else None,
        "best_eval_accuracy": max(accuracy, default=None),
        "final_reward": reward[-1] if reward else None,
        "trained_tokens_per_s": speed[-1] if speed else None,
        "curve": [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r],
    }


COLUMNS = {
    "point": "point",
    "final_eval_accuracy": "final eval acc",
    "best_eval_accuracy": "best eval acc",
    "final_reward": "final reward",
    "trained_tokens_per_s": "trained tok/s",
    "state": "state",
}


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key.endswith("accuracy"):
        return f"{value:.1%}"
    return f"{value:.3f}" if key == "final_reward" else f"{value:.0f}" if key == "trained_tokens_per_s" else str(value)


def write_results(folder: Path, name: str, results: list[dict]) -> str:
    """results.csv, results.md and results.png in the sweep folder; returns the table as text."""
    rows = [[_cell(k, r[k]) for k in COLUMNS] for r in results]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    writer.writerows([[r[k] for k in COLUMNS] for r in results])
    (folder / "results.csv").write_text(buffer.getvalue())
    (folder / "results.md").write_text(
        "\n".join(["| " + " | ".join(row) + " |" for row in [list(COLUMNS.values()), ["---"] * len(COLUMNS), *rows]])
        + "\n"
    )
    _plot(folder / "results.png", name, results)
    widths = [max(len(row[i]) for row in [list(COLUMNS.values()), *rows]) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [list(COLUMNS.values()), *rows]
    )


def _plot(out: Path, name: str, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for result in results:
        if result["curve"]:
            steps, values = zip(*result["curve"])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=result["point"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("step")
    ax.set_ylabel("eval accuracy")
    ax.set_title(f"sweep {name}: eval accuracy")
    ax.grid(alpha=0.3)
    if any(r["curve"] for r in results):
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def report(folder: Path, wait: bool = False) -> int:
    """Print each point's state; once all have finished, the results table (and write its files).
    Exit code 1 when a point did not complete."""
    try:
        record = json.loads((folder / SWEEP_FILE).read_text())
    except FileNotFoundError:
        raise UserError(
            f"{folder} is not a sweep folder (no {SWEEP_FILE}); it is <cluster.fileroot>/<experiment.name>/<sweep name>"
        ) from None
    states = _wait(record) if wait else point_states(record)
    finished = sum(s.done for s in states)
    print(f"sweep {record['name']}: job array {record['array_job_id']}, {finished}/{len(states)} points finished")
    width = max(len(s.name) for s in states)
    for s in states:
        step = "-" if s.step is None else s.step
        print(f"  {s.name:<{width}}  {s.job_id:<12} {s.state:<12} step {step}/{s.total_steps}")
    if finished < len(states):
        return 0
    results = sorted(
        (point_result(s) for s in states),
        key=lambda r: -1 if r["final_eval_accuracy"] is None else r["final_eval_accuracy"],
        reverse=True,
    )
    table = write_results(folder, record["name"], results)
    print(f"\n{table}\n\nwrote results.csv, results.md, results.png in {folder}")
    return 0 if all(s.state == "COMPLETED" for s in states) else 1


def _wait(record: dict) -> list[PointState]:
    """Poll until every point has finished, with a progress line (points finished, running, steps)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn(f"[bold]sweep {record['name']}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[line]}"),
        console=Console(stderr=True),
    )
    with progress:
        bar = progress.add_task("points", total=len(record["points"]), line="")
        while True:
            states = point_states(record)
            running = sum(s.state == "RUNNING" for s in states)
            steps = sum(s.step or 0 for s in states)
            progress.update(
                bar,
                completed=sum(s.done for s in states),
                line=f"running {running}  steps {steps}/{sum(s.total_steps for s in states)}",
            )
            if all(s.done for s in states):
                return states
            time.sleep(POLL_S)
