"""How failed episodes and rewards reach the user: the first failure of each kind, its message with the user's
file and line, is printed and appended to the run's ``logs/failures.log``; later ones are only counted (an RL
run's metrics ``rollout/failures/<kind>``); the last line of a run or an evaluation that had any says how many
of each kind, and it exits with ``rollout.failure_budget.exit_code_on_failures``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from areal_hpc.rollout.controller import FailureLog

EXIT_CODE_KEY = "rollout.failure_budget.exit_code_on_failures"
FINISHED = "finished with "  # how the last line starts


def failures_log(run_dir: Path) -> Path:
    """Where a run's failures are written (under Slurm, the launcher's task failures too)."""
    return run_dir / "logs" / "failures.log"


class FailureReport:
    """Shows each kind's first failure once, through ``say`` (e.g. a progress bar's console) and into ``log``."""

    def __init__(self, say: Callable[[str], None], log: Path | None, counted_in: str):
        """``counted_in``: where later failures of a kind are counted, with ``{kind}`` in it."""
        self.say, self.log, self.counted_in = say, log, counted_in
        self._shown: set[str] = set()

    def show_new(self, failures: FailureLog) -> None:
        """The first failure of each kind not shown yet."""
        for kind, message in list(failures.first.items()):
            if kind not in self._shown:
                self._shown.add(kind)
                self._write(f"first {kind}: {message}; later ones are counted in {self.counted_in.format(kind=kind)}")

    def finish(self, failures: FailureLog, exit_code: int) -> int:
        """The last line when anything failed, and the exit status: ``exit_code`` then, else 0."""
        self.show_new(failures)
        if not failures.total:
            return 0
        where = f"; the first of each kind is in {self.log}" if self.log is not None else ""
        counts = f"{failures.total} failures ({failures.summary()})"
        self._write(f"{FINISHED}{counts}{where}; exit {exit_code} ({EXIT_CODE_KEY})")
        return exit_code

    def _write(self, line: str) -> None:
        self.say(line)
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with self.log.open("a") as out:
                out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


def last_summary(run_dir: Path) -> str | None:
    """The last line a finished run wrote about its failures, if that is the log's last line."""
    log = failures_log(run_dir)
    lines = log.read_text().splitlines() if log.is_file() else []
    last = lines[-1].split(" ", 2)[-1] if lines else ""
    return last if last.startswith(FINISHED) else None
