"""Append trajectories (and late rewards) to HDF5 shards: one writer per process, crash-safe commits.

Each flush is a commit (see ``format.py``): a writer killed at any moment, or whose node crashes
(with ``fsync=True``, the default), loses only what it had not flushed, and a reader never sees half
a record. Shards rotate by size or count; a full shard is closed, renamed from
``<writer>-<seq>.live.h5`` to ``<writer>-<seq>.h5`` and listed, with counts, size and CRC32s of its
index and reward rows (kept as it writes: nothing is re-read), in ``manifest-<writer>.json``.

    with TrajectoryShardWriter(run_dir / "shards", "rollout0", experiment="gsm8k", trial="t0") as w:
        w.append(trajectory)                 # flushed now (flush_every=1)
        w.set_reward(trajectory.id, 1.0)     # late reward: appended, tokens untouched
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
import zlib
from pathlib import Path

import h5py
import numpy as np

from areal_hpc.data.shards.format import (
    COLUMNS,
    COUNTED,
    FINAL_SUFFIX,
    INDEX_DTYPE,
    LIVE_SUFFIX,
    REWARD_DTYPE,
    create_shard,
    encode,
    pack_tokens,
    reward_row,
    seal,
    shard_stem,
)
from areal_hpc.data.shards.stored_ids import StoredIds
from areal_hpc.data.trajectory import MAX_ID_BYTES, MAX_SOURCE_BYTES, Reward, Trajectory, check_name
from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_json, fsync_path

WRITER_ID = re.compile(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*")
PROXY_WRITER_PREFIX = "proxy-"  # login-node proxies write as proxy-<host>-<pid> (proxy/records.py)


class UnknownTrajectoryError(UserError):
    """A reward for a trajectory id that no shard in the store holds."""


class TrajectoryShardWriter:
    """Buffer records and commit them to the current live shard every ``flush_every`` records.

    ``fsync=False`` skips the two fsyncs a commit makes: commits still survive a killed process, but
    not a crashed node (see ``bench/trajectory_store.py`` for what they cost).
    """

    def __init__(
        self,
        directory: str | Path,
        writer_id: str,
        *,
        experiment: str = "",
        trial: str = "",
        flush_every: int = 1,
        max_shard_bytes: int = 1 << 30,
        max_shard_trajectories: int = 100_000,
        fsync: bool = True,
    ):
        if not WRITER_ID.fullmatch(writer_id):
            raise UserError(f"writer id {writer_id!r} must be letters, digits, '_', '.' or inner '-'")
        if flush_every < 1 or max_shard_bytes < 1 or max_shard_trajectories < 1:
            raise UserError(
                "flush_every, max_shard_bytes and max_shard_trajectories must be >= 1, got "
                f"{flush_every}, {max_shard_bytes}, {max_shard_trajectories}"
            )
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer_id, self.experiment, self.trial = writer_id, experiment, trial
        self.flush_every, self.fsync = flush_every, fsync
        self.max_shard_bytes, self.max_shard_trajectories = max_shard_bytes, max_shard_trajectories
        self._seq = self._next_sequence()
        self._file: h5py.File | None = None
        self._path: Path | None = None
        self._columns: dict[str, _Column] | None = None
        self._counts = dict.fromkeys(COUNTED, 0)
        self._pending_records: list[tuple[np.ndarray, np.ndarray, np.void]] = []
        self._pending_rewards: list[np.ndarray] = []
        self._pending_ids: set[str] = set()  # ids of the buffered records, known once committed
        self._ids = StoredIds(self.directory)  # this writer's ids, and others' read when a reward asks

    # -- public surface -------------------------------------------------------------------------
    def append(self, traj: Trajectory) -> None:
        """Add a record; its ``rewards`` (if any) go to the reward table with it."""
        if traj.id in self._pending_ids or self._ids.held(traj.id):
            raise UserError(f"trajectory id {traj.id!r} was already written to {self.directory}")
        traj.experiment, traj.trial = self.experiment, self.trial
        traj.created = traj.created or time.time()
        self._pending_records.append(encode(traj))
        self._pending_rewards.extend(reward_row(traj.id, r) for r in traj.rewards)
        self._pending_ids.add(traj.id)
        self._maybe_flush()

    def set_reward(
        self, trajectory_id: str, value: float, *, step: int = 0, source: str = "", at: float | None = None
    ) -> None:
        """Bind a (late) reward to a stored trajectory; an unknown id raises and writes nothing."""
        check_name("trajectory id", trajectory_id, MAX_ID_BYTES, allow_empty=False)
        check_name("reward source", source, MAX_SOURCE_BYTES)
        if trajectory_id not in self._pending_ids and trajectory_id not in self._ids:
            raise UnknownTrajectoryError(f"no trajectory with id {trajectory_id!r} in {self.directory}")
        reward = Reward(value=float(value), step=step, source=source, time=time.time() if at is None else at)
        self._pending_rewards.append(reward_row(trajectory_id, reward))
        self._maybe_flush()

    def flush(self) -> None:
        """Commit everything buffered; after this returns it survives a SIGKILL of this process.

        A commit that fails (a full disk, an I/O error) raises and drops what it held: the caller
        was told those records were not stored, so they never appear later behind its back. The
        next commit starts from the last committed counts, writing over what the failed one left.
        """
        if not self._pending_records and not self._pending_rewards:
            return
        try:
            if self._file is None:
                self._open_next_shard()
            self._commit()
        except BaseException:
            self._pending_records, self._pending_rewards, self._pending_ids = [], [], set()
            raise
        if self._bytes_written() >= self.max_shard_bytes or self._counts["index"] >= self.max_shard_trajectories:
            self._finalize()

    def close(self) -> None:
        """Flush, then finalise the live shard (close, rename, manifest)."""
        try:
            self.flush()
            if self._file is not None:
                self._finalize()
        finally:
            self._ids.close()

    def __enter__(self) -> TrajectoryShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def manifest_path(self) -> Path:
        return self.directory / f"manifest-{self.writer_id}.json"

    # -- internals ------------------------------------------------------------------------------
    def _maybe_flush(self) -> None:
        if len(self._pending_records) + len(self._pending_rewards) >= self.flush_every:
            self.flush()

    def _next_sequence(self) -> int:
        """Continue after the highest shard number this writer id left (a restart never overwrites)."""
        pattern = re.compile(re.escape(self.writer_id) + r"-(\d+)$")
        taken = [
            int(m.group(1))
            for p in self.directory.glob(f"{self.writer_id}-*.h5")
            if (m := pattern.fullmatch(shard_stem(p)))
        ]
        return max(taken, default=-1) + 1

    def _open_next_shard(self) -> None:
        self._path = self.directory / f"{self.writer_id}-{self._seq:06d}{LIVE_SUFFIX}"
        self._seq += 1
        self._file = create_shard(self._path, self.experiment, self.trial, self.writer_id, durable=self.fsync)
        self._ids.skip(shard_stem(self._path))
        self._columns = {name: _Column(self._file[name], column.dtype) for name, column in COLUMNS.items()}
        self._columns["state"] = _Column(self._file["state"], np.dtype("<i8"))
        self._counts = dict.fromkeys(COUNTED, 0)
        self._index_crc = self._rewards_crc = 0  # running checksums of every committed row, for the manifest

    def _commit(self) -> None:
        """Intended counts, data, metadata flush, fsync, committed counts, fsync (see format.py)."""
        start, records = dict(self._counts), self._pending_records
        rows = _concat([row for _, _, row in records], INDEX_DTYPE)
        token_counts, header_counts = rows["token_count"].tolist(), rows["header_count"].tolist()
        rows["token_start"] = _starts(start["tokens"], token_counts)
        rows["header_start"] = _starts(start["headers"], header_counts)
        seal(rows)
        new = {
            "tokens": pack_tokens([parts for parts, _, _ in records], sum(token_counts)),
            "headers": _concat([header for _, header, _ in records], np.dtype("u1")),
            "index": rows,
            "rewards": _concat(self._pending_rewards, REWARD_DTYPE),
        }
        end = {
            "index": start["index"] + len(rows),
            "tokens": start["tokens"] + sum(token_counts),
            "headers": start["headers"] + sum(header_counts),
            "rewards": start["rewards"] + len(new["rewards"]),
        }
        self._write_state(start, end)
        for name, values in new.items():
            if len(values):
                self._columns[name].write(start[COLUMNS[name].counter], values)
        self._file.flush()
        self._sync()  # the data is on disk before the counts that commit it
        self._write_state(end, end)
        self._sync()
        self._counts = end
        self._index_crc = zlib.crc32(rows, self._index_crc)
        self._rewards_crc = zlib.crc32(new["rewards"], self._rewards_crc)
        for trajectory_id in self._pending_ids:
            self._ids.add(trajectory_id)
        self._pending_records, self._pending_rewards, self._pending_ids = [], [], set()

    def _sync(self) -> None:
        if self.fsync:
            os.fsync(self._file.id.get_vfd_handle())

    def _write_state(self, committed: dict, intended: dict) -> None:
        state = np.array([committed[n] for n in COUNTED] + [intended[n] for n in COUNTED], dtype="<i8")
        self._columns["state"].write(0, state)

    def _bytes_written(self) -> int:
        return sum(self._counts[c.counter] * c.dtype.itemsize for c in COLUMNS.values())

    def _finalize(self) -> None:
        counts = dict(self._counts)
        self._file.close()
        final = self._path.with_name(shard_stem(self._path) + FINAL_SUFFIX)
        if self.fsync:
            fsync_path(self._path)  # what closing wrote, before the name says "finalised"
        os.replace(self._path, final)  # made durable with the manifest's folder fsync below
        manifest = (
            json.loads(self.manifest_path.read_text())
            if self.manifest_path.exists()
            else {"writer": self.writer_id, "shards": []}
        )
        manifest["shards"].append(
            {
                "name": final.name,
                "trajectories": counts["index"],
                "tokens": counts["tokens"],
                "rewards": counts["rewards"],
                "bytes": final.stat().st_size,
                "index_crc32": self._index_crc,
                "rewards_crc32": self._rewards_crc,
                "finalized": time.time(),
            }
        )
        atomic_write_json(self.manifest_path, manifest)
        self._file = self._path = self._columns = None


def _starts(first: int, lengths: list[int]) -> np.ndarray:
    """Where each of several back-to-back pieces begins."""
    return first + np.cumsum([0, *lengths], dtype=np.int64)[:-1]


def _concat(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    if len(arrays) == 1:
        return arrays[0]  # the common case with per-record flushes: no copy
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)


class _Column:
    """A dataset open for appends, its HDF5 type, dataspace and capacity cached (h5py's per-call
    look-ups cost more than writing a trajectory's tokens). Record rows are written as their bytes."""

    def __init__(self, dataset: h5py.Dataset, dtype: np.dtype):
        self.dataset, self.scale = dataset, dtype.itemsize if dtype.names else 1
        self.file_type = dataset.id.get_type()
        self.space = dataset.id.get_space()
        self.capacity = dataset.shape[0]

    def write(self, start: int, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values)
        if self.scale > 1:
            values, start = values.view(np.uint8), start * self.scale
        end = start + len(values)
        if end > self.capacity:
            self.capacity = max(end, 2 * self.capacity)  # grow geometrically; unwritten chunks take no space
            self.dataset.id.set_extent((self.capacity,))
            self.space = self.dataset.id.get_space()
        self.space.select_hyperslab((start,), (len(values),))
        self.dataset.id.write(_memory_space(len(values)), self.space, values, mtype=self.file_type)


@functools.lru_cache(maxsize=64)
def _memory_space(length: int) -> h5py.h5s.SpaceID:
    return h5py.h5s.create_simple((length,))
