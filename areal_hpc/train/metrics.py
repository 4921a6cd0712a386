"""Run metrics: one JSON object per line in metrics.jsonl, the same scalars in TensorBoard.

A run starts its metrics afresh: rerunning a trial replaces that trial's curves rather than
interleaving two runs in one file.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("w", buffering=1)  # line-buffered: a killed run keeps its metrics
        self.records: list[dict] = []
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **scalars}
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
