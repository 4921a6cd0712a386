"""The supervised loop SFT, DPO and the reward model share: one process, one engine (``engines.factory``'s, built
for the job's role), ``run_supervised`` taking the job's optimizer steps with held-out evaluations before the
first step, every ``eval_every`` steps and after the last, a progress bar, metrics in JSONL and TensorBoard,
checkpoints every ``save_every`` steps and the early stop a job may ask for after an evaluation; then
``save_model`` writes the model in Hugging Face format and a PNG of its curves. What a job trains on, its loss
and its evaluation are its own (``sft.py``, ``preference.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from areal_hpc.config import RunConfig
from areal_hpc.engines.base import TrainEngine
from areal_hpc.engines.factory import build_engine
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.parallel.device import check_precision, resolve_device
from areal_hpc.train.metrics import MetricsLogger
from areal_hpc.train.plots import plot_curves

R = TypeVar("R")  # what a job's evaluation returns


def never(result: object) -> str | None:
    """A job without an early stop."""
    return None


@dataclass(frozen=True)
class SupervisedJob(Generic[R]):
    """What one job plugs into ``run_supervised``."""

    name: str  # "sft", "dpo", "rm": the progress bar's label
    title: str  # how messages name it: "SFT", "DPO"
    steps: int  # optimizer steps, at most
    eval_every: int  # 0: evaluations before the first step and after the last only
    save_every: int  # 0: no checkpoint before the final model
    step: Callable[[], dict[str, float]]  # one optimizer step on a batch it draws: its train/* statistics
    evaluate: Callable[[int], R]  # the held-out evaluation at a step, logged by the job
    describe: Callable[[R], str]  # an evaluation in one phrase: "eval accuracy 41.5% (83/200)"
    note: Callable[[dict[str, float], R], str]  # the progress bar's text beside the loss: a step's, the last evaluation
    stop: Callable[[R], str | None] = never  # after an evaluation: why to stop here, or None


def index_stream(n: int, seed: int) -> Iterator[int]:
    """Endless shuffled passes over range(n), each pass a fresh seeded permutation: the order a job draws its
    examples in."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield from torch.randperm(n, generator=generator).tolist()


def seeded_device(cfg: RunConfig) -> torch.device:
    """``cluster.device``, checked for the model's dtypes, with torch seeded by ``experiment.seed`` first (a
    reward model's fresh head depends on the seed only)."""
    torch.manual_seed(cfg.experiment.seed)
    device = resolve_device(cfg.cluster.device)
    check_precision(device, model_dtype=cfg.model.dtype, model_compute_dtype=cfg.model.compute_dtype)
    return device


def load_engine(role: str, cfg: RunConfig, model_dir: Path) -> TrainEngine:
    """The engine of ``role`` on one process, from ``model_dir`` with the run's tokenizer (``engine.tokenizer``)."""
    return build_engine(role, cfg, None, model_dir, load_tokenizer(cfg.tokenizer.path or model_dir))


def run_supervised(
    job: SupervisedJob[R], engine: TrainEngine, metrics: MetricsLogger, console: Console, run_dir: Path
) -> tuple[R, R]:
    """Train ``job`` on ``engine``: (the evaluation before the first step, the last one)."""
    before = after = job.evaluate(0)
    console.print(f"before {job.title}: {job.describe(before)}", soft_wrap=True)
    columns = [
        TextColumn(f"[bold]{job.name}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("loss {task.fields[loss]:.3f}  {task.fields[note]}"),
    ]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task(job.name, total=job.steps, loss=float("nan"), note="")
        for step in range(1, job.steps + 1):
            stats = job.step()
            metrics.log(step, stats)
            last = step == job.steps
            evaluated = last or bool(job.eval_every and step % job.eval_every == 0)
            if evaluated:
                after = job.evaluate(step)
                progress.console.print(f"step {step}: {job.describe(after)}", soft_wrap=True)
            reason = job.stop(after) if evaluated else None
            if job.save_every and step % job.save_every == 0 and not (last or reason):
                engine.save(run_dir / "checkpoints" / f"step{step}", optimizer=False)
            progress.update(bar, advance=1, loss=stats["train/loss"], note=job.note(stats, after))
            if reason:
                progress.console.print(f"step {step}: {reason}: {job.title} stops here", soft_wrap=True)
                break
    return before, after


def save_model(
    engine: TrainEngine, cfg: RunConfig, metrics: MetricsLogger, name: str, curves: dict[str, str], title: str
) -> Path:
    """The trained model, in Hugging Face format in ``<run>/model``, and (``stats.plot``) the curves of job
    ``name``, ``curves`` ({panel: metric}), in ``<run>/<name>_curves.png`` under ``title``."""
    out = cfg.run_dir / "model"
    engine.save(out, optimizer=False)
    if cfg.stats.plot:
        plot_curves(metrics.records, curves, cfg.run_dir / f"{name}_curves.png", title)
    return out
