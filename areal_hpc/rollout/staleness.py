"""AReaL's staleness bound: no trained episode lags more than eta policy versions.

The gate: with training batches of B episodes and the trainer at version v, at most
(eta + v + 1) * B episodes may have been started in total (accepted or running). Episodes finish
out of order, so the ready queue hands them out oldest start version first, and one that would
still be too stale when trained (a straggler overtaken by younger episodes) is dropped and its
place in the gate given back. eta = 0 is synchronous RL: each batch comes from the weights it is
trained on, and nothing is ever dropped.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StalenessGate:
    batch_size: int
    max_staleness: int
    max_concurrent: int
    version: int = 0
    accepted: int = 0
    running: int = 0

    @classmethod
    def resumed(cls, batch_size: int, max_staleness: int, max_concurrent: int, version: int) -> StalenessGate:
        """After a restart at version v every earlier batch was consumed: count them as accepted."""
        return cls(batch_size, max_staleness, max_concurrent, version=version, accepted=version * batch_size)

    def capacity(self) -> int:
        """Episodes that may start now."""
        return min(
            self.max_concurrent - self.running,
            (self.max_staleness + self.version + 1) * self.batch_size - (self.accepted + self.running),
        )

    def start(self) -> None:
        if self.capacity() <= 0:
            raise RuntimeError("staleness gate is closed: no capacity to start an episode")
        self.running += 1

    def finish(self, accepted: bool) -> None:
        """An episode ended: accepted into the ready queue, or rejected (e.g. filtered out)."""
        self.running -= 1
        self.accepted += accepted

    def drop(self, count: int) -> None:
        """Accepted episodes discarded as too stale: their places open again."""
        self.accepted -= count

    def set_version(self, version: int) -> None:
        self.version = version


@dataclass
class ReadyQueue:
    """Finished episodes, handed out oldest start version first (ties: the order they finished)."""

    _heap: list = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)

    def put(self, start_version: int, episode: Any) -> None:
        heapq.heappush(self._heap, (start_version, next(self._order), episode))

    def __len__(self) -> int:
        return len(self._heap)

    def take(self, n: int, version: int, max_staleness: int) -> tuple[list[Any], list[Any]]:
        """Up to ``n`` episodes trainable at ``version``, and the too-stale ones dropped on the way."""
        taken, dropped = [], []
        while self._heap and len(taken) < n:
            start_version, _, episode = heapq.heappop(self._heap)
            if version - start_version > max_staleness:
                dropped.append(episode)
            else:
                taken.append(episode)
        return taken, dropped
