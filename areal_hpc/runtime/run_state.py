"""What launchers read of a run's state without loading torch or the trainer: the exit code of a trainer
that saved and stopped, the newest complete checkpoint (written by ``train.checkpoint``), and whether a run
folder already holds a run (a run never replaces another: it resumes it, or is refused)."""

from __future__ import annotations

from pathlib import Path

from areal_hpc.errors import UserError

# Exit code of a trainer that was told to stop (SIGUSR2 before a time limit or preemption, SIGTERM)
# and saved a checkpoint first: its launcher requeues the job, which resumes from that checkpoint.
SAVED_AND_STOPPED = 75  # EX_TEMPFAIL: "try again later"
# Slurm signals every process of a job at once (a requeue, scancel): servers, reward workers and agent programs
# may fail before the trainer has seen its signal. An error waits this long for the stop that may have caused it.
STOP_GRACE_S = 2.0


# What any run (RL, SFT, DPO, RM) leaves in its folder once it has started; its launch helpers (the initial
# model, name-resolve, logs) are not a run.
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "checkpoints", "shards", "model", "sft_warmup")


def previous_run(run_dir: Path) -> list[str]:
    """The outputs of an earlier run in ``run_dir`` (names from ``RUN_OUTPUTS``); [] when it holds none."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def refuse_previous_run(run_dir: Path) -> None:
    """``UserError`` naming the folder when it already holds a run: checked before anything is written."""
    found = previous_run(run_dir)
    if found:
        raise UserError(
            f"{run_dir} already holds a run ({', '.join(found)}); choose another experiment.trial=NAME, "
            f"or remove that folder to start over in it"
        )


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = checkpoint_root(run_dir) / "latest"
    if not pointer.exists():
        return None
    folder = checkpoint_root(run_dir) / pointer.read_text().strip()
    if not (folder / "driver.json").exists():
        raise UserError(
            f"{pointer} names {folder.name}, which is missing or incomplete; remove {pointer} to start over"
        )
    return folder


def model_to_export(path: Path) -> Path:
    """The model folder ``areal-hpc export`` writes out for ``path``: a model folder itself (an engine's save:
    config.json, or LoRA adapters), a checkpoint's actor, or for a run folder its newest model: the finished
    run's ``model/`` or its latest checkpoint's (an RL checkpoint's ``actor/``, an SFT checkpoint itself)."""
    if not path.exists():
        raise UserError(f"{path} does not exist (expected a run folder, a checkpoint or a model folder)")
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return path
    if (path / "actor").is_dir():
        return path / "actor"
    steps = sorted(checkpoint_root(path).glob("step*[0-9]"))  # ``.partial`` ones were cut short
    candidates = [folder for folder in [path / "model", *steps, *(s / "actor" for s in steps)] if _saved(folder)]
    if not candidates:
        raise UserError(
            f"{path} holds no model: not a model folder (config.json), a checkpoint (actor/) or a run folder "
            "(model/ or checkpoints/)"
        )
    return max(candidates, key=lambda folder: max(f.stat().st_mtime for f in folder.iterdir()))


def _saved(folder: Path) -> bool:
    return (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()
