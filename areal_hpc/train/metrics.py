"""Run metrics: one JSON object per line in metrics.jsonl, the same scalars in TensorBoard.

A run starts its metrics afresh: rerunning a trial replaces that trial's curves rather than
interleaving two runs in one file. A resumed run (``resume_step``) keeps the records up to the
checkpoint it resumed from and drops the later ones, whose training was lost.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from areal_hpc.fsio import atomic_write_text, read_json_lines


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.records: list[dict] = []
        if resume_step is not None and self.path.exists():
            self.records = [r for r in read_json_lines(self.path) if r["step"] <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self._file = self.path.open("a" if resume_step is not None else "w", buffering=1)  # a killed run keeps them
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            if resume_step is None:
                shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
            self._tb = SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=None if resume_step is None else resume_step + 1
            )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **scalars}
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)

    def histogram(self, step: int, key: str, values: list[float]) -> None:
        """A distribution (e.g. staleness of a batch): TensorBoard only; log its summary with ``log``."""
        if self._tb is not None and values:
            self._tb.add_histogram(key, np.asarray(values), step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
