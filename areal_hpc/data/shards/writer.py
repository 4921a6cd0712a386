"""Append trajectories (and late rewards) to HDF5 shards: one writer per process, crash-safe commits.

Each flush is a commit (see ``format.py``): a writer killed at any moment loses only what it had not
flushed, and a reader never sees half a record. Shards rotate by size or count; a full shard is
closed, renamed from ``<writer>-<seq>.live.h5`` to ``<writer>-<seq>.h5`` and listed, with counts and
its SHA-256, in ``manifest-<writer>.json``.

    with TrajectoryShardWriter(run_dir / "shards", "rollout0", experiment="gsm8k", trial="t0") as w:
        w.append(trajectory)                 # flushed now (flush_every=1)
        w.set_reward(trajectory.id, 1.0)     # late reward: appended, tokens untouched
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import h5py
import numpy as np

from areal_hpc.data.shards.format import (COUNTED, FINAL_SUFFIX, INDEX_DTYPE, LIVE_SUFFIX, create_shard,
                                          encode, reward_row, shard_stem)
from areal_hpc.data.shards.reader import TrajectoryStore
from areal_hpc.data.trajectory import MAX_ID_BYTES, MAX_SOURCE_BYTES, Reward, Trajectory, check_name
from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_json, file_sha256

WRITER_ID = re.compile(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*")


class UnknownTrajectoryError(UserError):
    """A reward for a trajectory id that no shard in the store holds."""


class TrajectoryShardWriter:
    """Buffer records and commit them to the current live shard every ``flush_every`` records."""

    def __init__(self, directory: str | Path, writer_id: str, *, experiment: str = "", trial: str = "",
                 flush_every: int = 1, max_shard_bytes: int = 1 << 30, max_shard_trajectories: int = 100_000):
        if not WRITER_ID.fullmatch(writer_id):
            raise UserError(f"writer id {writer_id!r} must be letters, digits, '_', '.' or inner '-'")
        if flush_every < 1 or max_shard_bytes < 1 or max_shard_trajectories < 1:
            raise UserError("flush_every, max_shard_bytes and max_shard_trajectories must be >= 1, got "
                            f"{flush_every}, {max_shard_bytes}, {max_shard_trajectories}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer_id, self.experiment, self.trial = writer_id, experiment, trial
        self.flush_every = flush_every
        self.max_shard_bytes, self.max_shard_trajectories = max_shard_bytes, max_shard_trajectories
        self._seq = self._next_sequence()
        self._file: h5py.File | None = None
        self._path: Path | None = None
        self._counts = dict.fromkeys(COUNTED, 0)
        self._pending_records: list[tuple[np.ndarray, np.ndarray, np.void]] = []
        self._pending_rewards: list[np.ndarray] = []
        self._known_ids: set[str] = set()
        self._store_ids_loaded = False

    # -- public surface -------------------------------------------------------------------------
    def append(self, traj: Trajectory) -> None:
        """Add a record; its ``rewards`` (if any) go to the reward table with it."""
        if traj.id in self._known_ids:
            raise UserError(f"trajectory id {traj.id!r} was already written by this writer")
        traj.experiment, traj.trial = self.experiment, self.trial
        traj.created = traj.created or time.time()
        self._pending_records.append(encode(traj))
        self._pending_rewards.extend(reward_row(traj.id, r) for r in traj.rewards)
        self._known_ids.add(traj.id)
        self._maybe_flush()

    def set_reward(self, trajectory_id: str, value: float, *, step: int = 0, source: str = "",
                   at: float | None = None) -> None:
        """Bind a (late) reward to a stored trajectory; an unknown id raises and writes nothing."""
        check_name("trajectory id", trajectory_id, MAX_ID_BYTES, allow_empty=False)
        check_name("reward source", source, MAX_SOURCE_BYTES)
        if not self._is_known(trajectory_id):
            raise UnknownTrajectoryError(f"no trajectory with id {trajectory_id!r} in {self.directory}")
        reward = Reward(value=float(value), step=step, source=source, time=time.time() if at is None else at)
        self._pending_rewards.append(reward_row(trajectory_id, reward))
        self._maybe_flush()

    def flush(self) -> None:
        """Commit everything buffered; after this returns it survives a SIGKILL of this process."""
        if not self._pending_records and not self._pending_rewards:
            return
        if self._file is None:
            self._open_next_shard()
        self._commit()
        if (self._bytes_written() >= self.max_shard_bytes
                or self._counts["index"] >= self.max_shard_trajectories):
            self._finalize()

    def close(self) -> None:
        """Flush, then finalise the live shard (close, rename, manifest)."""
        self.flush()
        if self._file is not None:
            self._finalize()

    def __enter__(self) -> "TrajectoryShardWriter":
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
        taken = [int(m.group(1)) for p in self.directory.glob(f"{self.writer_id}-*.h5")
                 if (m := pattern.fullmatch(shard_stem(p)))]
        return max(taken, default=-1) + 1

    def _open_next_shard(self) -> None:
        self._path = self.directory / f"{self.writer_id}-{self._seq:06d}{LIVE_SUFFIX}"
        self._seq += 1
        self._file = create_shard(self._path, self.experiment, self.trial, self.writer_id)
        self._counts = dict.fromkeys(COUNTED, 0)

    def _commit(self) -> None:
        """Intended counts, flush, data, flush, committed counts, flush (see format.py)."""
        f, start = self._file, dict(self._counts)
        tokens = [t for t, _, _ in self._pending_records]
        headers = [h for _, h, _ in self._pending_records]
        rows = np.array([r for _, _, r in self._pending_records], dtype=INDEX_DTYPE)
        token_starts = start["tokens"] + np.cumsum([0] + [len(t) for t in tokens[:-1]], dtype=np.int64)
        header_starts = start["headers"] + np.cumsum([0] + [len(h) for h in headers[:-1]], dtype=np.int64)
        if len(rows):
            rows["token_start"], rows["header_start"] = token_starts, header_starts
        new = {"index": rows, "tokens": _concat(tokens), "headers": _concat(headers),
               "rewards": _concat(self._pending_rewards)}
        end = {name: start[name] + len(new[name]) for name in COUNTED}
        self._write_state(start, end)
        f.flush()
        for name in COUNTED:
            if len(new[name]):
                _write_at(f[name], start[name], new[name])
        f.flush()
        self._write_state(end, end)
        f.flush()
        self._counts = end
        self._pending_records, self._pending_rewards = [], []

    def _write_state(self, committed: dict, intended: dict) -> None:
        self._file["state"][:] = [committed[n] for n in COUNTED] + [intended[n] for n in COUNTED]

    def _bytes_written(self) -> int:
        return sum(self._counts[name] * self._file[name].dtype.itemsize for name in COUNTED)

    def _finalize(self) -> None:
        counts = dict(self._counts)
        self._file.close()
        digest = file_sha256(self._path)
        final = self._path.with_name(shard_stem(self._path) + FINAL_SUFFIX)
        os.replace(self._path, final)
        manifest = (json.loads(self.manifest_path.read_text()) if self.manifest_path.exists()
                    else {"writer": self.writer_id, "shards": []})
        manifest["shards"].append({"name": final.name, "trajectories": counts["index"],
                                   "tokens": counts["tokens"], "rewards": counts["rewards"],
                                   "bytes": final.stat().st_size, "sha256": digest,
                                   "finalized": time.time()})
        atomic_write_json(self.manifest_path, manifest)
        self._file = self._path = None

    def _is_known(self, trajectory_id: str) -> bool:
        if trajectory_id in self._known_ids:
            return True
        if not self._store_ids_loaded:  # written by an earlier run or another writer of this store
            with TrajectoryStore(self.directory) as store:
                self._known_ids |= store.ids()
            self._store_ids_loaded = True
        return trajectory_id in self._known_ids


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0)


def _write_at(dataset: h5py.Dataset, start: int, values: np.ndarray) -> None:
    """Write rows at ``start`` through the low-level API (the high-level one costs ~4x per call)."""
    end = start + len(values)
    if end > dataset.shape[0]:
        dataset.id.set_extent((max(end, 2 * dataset.shape[0]),))  # grow geometrically
    file_space = dataset.id.get_space()
    file_space.select_hyperslab((start,), (len(values),))
    dataset.id.write(h5py.h5s.create_simple((len(values),)), file_space, np.ascontiguousarray(values))

