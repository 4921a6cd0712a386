"""Shared reward pieces: bounded answer parsing, and a worker pool that turns a hanging or crashing
reward function into a recorded failure instead of a stalled caller.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import signal
import threading
from dataclasses import dataclass
from fractions import Fraction

# Rewards look at the tail of a completion only: parsing cost stays bounded whatever the model writes.
MAX_SCORED_CHARS = 4096
STARTUP_TIMEOUT_S = 300.0  # reward workers starting up, at most (then calls time out as usual)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def tail(text: str) -> str:
    return text[-MAX_SCORED_CHARS:] if isinstance(text, str) else ""


def parse_number(text: str) -> Fraction | None:
    """'1,234' -> 1234, '-2.5' -> -5/2; None when the text is not a number."""
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | None:
    """The last number written in the completion (the usual place of a final answer)."""
    matches = _NUMBER.findall(tail(text))
    return parse_number(matches[-1]) if matches else None


@dataclass(frozen=True)
class RewardOutcome:
    value: float
    error: str | None = None  # why the reward failed; the value is then 0
    error_kind: str | None = None  # "exception" (the reward function raised) or "timeout" (it hung or died)


def _call(reward_fn, completion, example):
    return float(reward_fn(completion, example))


def _ignore_stop_warning() -> None:
    """Slurm's SIGUSR2 reaches every process of a step: the trainer acts on it, its workers must not die."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _load(reward_fn) -> None:
    """Nothing: a worker receiving the reward function imports its module (start-up, not scoring)."""


class RewardPool:
    """Scores (completion, example) pairs in worker processes, each call bounded by ``timeout_s``.
    Starting the workers (spawn, imports: seconds on a loaded machine) is not charged to a call."""

    def __init__(self, reward_fn, workers: int = 1, timeout_s: float = 5.0):
        self.reward_fn, self.workers, self.timeout_s = reward_fn, workers, timeout_s
        self._pool = None
        self._lock = threading.Lock()  # calls from several threads (rollouts, an evaluation) run one at a time

    def _fresh_pool(self):
        self.close()
        self._pool = mp.get_context("spawn").Pool(self.workers, initializer=_ignore_stop_warning)
        # Errors (an unimportable module) are not raised here: each call then records its own.
        self._pool.map_async(_load, [self.reward_fn] * self.workers, chunksize=1).wait(STARTUP_TIMEOUT_S)
        return self._pool

    def score(self, pairs: list[tuple[str, object]]) -> list[RewardOutcome]:
        with self._lock:
            return self._score(pairs)

    def _score(self, pairs: list[tuple[str, object]]) -> list[RewardOutcome]:
        outcomes: list[RewardOutcome | None] = [None] * len(pairs)
        pending = list(range(len(pairs)))
        while pending:
            pool = self._pool or self._fresh_pool()
            handles = [(i, pool.apply_async(_call, (self.reward_fn, *pairs[i]))) for i in pending]
            pending = []
            for k, (i, handle) in enumerate(handles):
                try:
                    outcomes[i] = RewardOutcome(handle.get(timeout=self.timeout_s))
                except mp.TimeoutError:
                    # The worker may be stuck for good: replace the pool, re-run what is left.
                    outcomes[i] = RewardOutcome(0.0, f"reward timed out after {self.timeout_s:g}s", "timeout")
                    self.close()
                    pending = [j for j, _ in handles[k + 1:]]
                    break
                except Exception as exc:  # noqa: BLE001 - any failure of user reward code is recorded
                    outcomes[i] = RewardOutcome(0.0, f"reward raised {type(exc).__name__}: {exc}", "exception")
        return outcomes

    def close(self):
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
