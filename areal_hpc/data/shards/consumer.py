"""Exactly-once consumption of a trajectory store by a trainer, across crashes and resumes.

The ``ConsumerCursor`` records which committed rows of which shard were handed out. It is saved in
the training checkpoint, in the same atomic write as the model, so a resumed run re-reads exactly
the records whose effect was lost with the crash and none that the checkpoint already holds.

    with TrajectoryConsumer(TrajectoryStore(shards_dir), ConsumerCursor.from_state_dict(ckpt["cursor"])) as consumer:
        batch = consumer.take(64, timeout=30)      # tails live shards written by other processes
        ...train on batch...; save {"model": ..., "cursor": consumer.cursor.state_dict()} atomically
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from areal_hpc.data.shards.format import text
from areal_hpc.data.shards.reader import TrajectoryFilter, TrajectoryStore
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_json

CURSOR_VERSION = 1


class ConsumerCursor:
    """Per shard: every row below ``next`` is consumed, plus the rows in ``extra`` beyond it."""

    def __init__(self):
        self._next: dict[str, int] = {}
        self._extra: dict[str, set[int]] = {}

    def is_consumed(self, stem: str, row: int) -> bool:
        return row < self._next.get(stem, 0) or row in self._extra.get(stem, ())

    def mark(self, stem: str, row: int) -> None:
        if self.is_consumed(stem, row):
            raise ValueError(f"row {row} of shard {stem} was already consumed")
        extra = self._extra.setdefault(stem, set())
        extra.add(row)
        nxt = self._next.get(stem, 0)
        while nxt in extra:  # keep the state small: fold the contiguous prefix into ``next``
            extra.remove(nxt)
            nxt += 1
        self._next[stem] = nxt

    def next_row(self, stem: str) -> int:
        return self._next.get(stem, 0)

    def __len__(self) -> int:
        return sum(self._next.values()) + sum(len(e) for e in self._extra.values())

    def state_dict(self) -> dict:
        return {
            "version": CURSOR_VERSION,
            "shards": {
                stem: {"next": self._next.get(stem, 0), "extra": sorted(self._extra.get(stem, ()))}
                for stem in sorted(self._next.keys() | self._extra.keys())
            },
        }

    @classmethod
    def from_state_dict(cls, state: dict | None) -> ConsumerCursor:
        cursor = cls()
        if not state:
            return cursor
        if state.get("version") != CURSOR_VERSION:
            raise UserError(f"consumer cursor version {state.get('version')!r} is not {CURSOR_VERSION}")
        for stem, entry in state["shards"].items():
            cursor._next[stem] = int(entry["next"])
            cursor._extra[stem] = {int(r) for r in entry["extra"]}
        return cursor

    def save(self, path: str | Path) -> None:
        atomic_write_json(Path(path), self.state_dict())

    @classmethod
    def load(cls, path: str | Path) -> ConsumerCursor:
        path = Path(path)
        return cls.from_state_dict(json.loads(path.read_text())) if path.exists() else cls()


class TrajectoryConsumer:
    """Hand out each committed record once, oldest first, optionally only once it has a reward.

    Records that ``where`` rejects are marked consumed as they are seen (tenant, versions and
    eligibility never change), so a cursor belongs to one filter; a record whose index row fails its
    checksum is never rejected that way: reading it raises ShardDamageError. Records still waiting
    for a reward are not marked: they are handed out when the reward arrives. Closing the consumer
    closes its store.
    """

    def __init__(
        self,
        store: TrajectoryStore,
        cursor: ConsumerCursor | None = None,
        where: TrajectoryFilter | None = None,
        require_reward: bool = False,
    ):
        self.store, self.cursor = store, cursor or ConsumerCursor()
        self.where, self.require_reward = where or TrajectoryFilter(), require_reward

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> TrajectoryConsumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def poll(self, max_records: int) -> list[Trajectory]:
        """Up to ``max_records`` records committed since the last call (possibly none); no waiting."""
        chosen = self._candidates()[:max_records]
        records = self._read(chosen)
        self._mark(chosen)
        return records

    def pending(self) -> list[Trajectory]:
        """Every record not consumed yet, oldest first, left unmarked: what a resumed run must still
        train (produced before a crash, its training lost with it)."""
        return self._read(self._candidates())

    def take_ids(self, ids: list[str]) -> list[Trajectory]:
        """Mark and return the records with these ids, in that order (a trainer that chose its batch
        elsewhere, e.g. by staleness, still consumes through the cursor). Every id must be pending."""
        chosen = self._locate(ids)
        records = self._read(chosen)
        self._mark(chosen)
        return records

    def mark_ids(self, ids: list[str]) -> None:
        """Consume these pending records without reading them (e.g. ones discarded as too stale)."""
        self._mark(self._locate(ids))

    def _locate(self, ids: list[str]) -> list[tuple[float, str, int, str]]:
        wanted = dict.fromkeys(ids)
        for candidate in self._candidates():
            if candidate[3] in wanted:
                wanted[candidate[3]] = candidate
        missing = [trajectory_id for trajectory_id, found in wanted.items() if found is None]
        if missing:
            raise KeyError(f"trajectories {missing[:3]} are not committed or already consumed")
        return list(wanted.values())

    def _mark(self, chosen: list[tuple[float, str, int, str]]) -> None:
        for _, stem, row, _ in chosen:
            self.cursor.mark(stem, row)

    def _candidates(self) -> list[tuple[float, str, int, str]]:
        """(created, shard, row, id) of every unconsumed record that passes the filter, oldest first."""
        self.store.refresh()
        ready: list[tuple[float, str, int, str]] = []
        for stem, shard in self.store.shards.items():
            start = self.cursor.next_row(stem)
            keep = shard.matches(self.where, start)
            for row in (start + np.flatnonzero(~keep)).tolist():
                if not self.cursor.is_consumed(stem, row):
                    self.cursor.mark(stem, row)
            for row in (start + np.flatnonzero(keep)).tolist():
                trajectory_id = text(shard.index[row]["id"])
                if self.cursor.is_consumed(stem, row):
                    continue
                if self.require_reward and not self.store.has_reward(trajectory_id):
                    continue
                ready.append((float(shard.index[row]["created"]), stem, row, trajectory_id))
        ready.sort()
        return ready

    def _read(self, chosen: list[tuple[float, str, int, str]]) -> list[Trajectory]:
        by_shard: dict[str, list[int]] = {}
        for _, stem, row, _ in chosen:
            by_shard.setdefault(stem, []).append(row)
        records = {}
        for stem, rows in by_shard.items():
            for row, traj in zip(rows, self.store.shards[stem].read(rows, self.store.rewards_for)):
                records[(stem, row)] = traj
        return [records[(stem, row)] for _, stem, row, _ in chosen]

    def take(self, n: int, timeout: float | None = None, poll_interval: float = 0.05) -> list[Trajectory]:
        """Wait until ``n`` records are available (or ``timeout`` seconds pass) and return them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        batch: list[Trajectory] = []
        while True:
            try:
                batch += self.poll(n - len(batch))
            except Exception:
                if batch:  # they are marked consumed: hand them out; the error comes back next call
                    return batch
                raise
            if len(batch) >= n or (deadline is not None and time.monotonic() >= deadline):
                return batch
            time.sleep(poll_interval)
