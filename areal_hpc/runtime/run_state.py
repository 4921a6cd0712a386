"""What launchers read of a run's state without loading torch or the trainer: the exit code of a trainer
that saved and stopped, and the newest complete checkpoint (written by ``train.checkpoint``)."""

from __future__ import annotations

from pathlib import Path

from areal_hpc.errors import UserError

# Exit code of a trainer that was told to stop (SIGUSR2 before a time limit or preemption, SIGTERM)
# and saved a checkpoint first: its launcher requeues the job, which resumes from that checkpoint.
SAVED_AND_STOPPED = 75  # EX_TEMPFAIL: "try again later"


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
