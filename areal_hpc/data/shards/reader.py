"""Read trajectory shards: one file or a whole store directory, finalised, live or left by a dead writer.

Only committed records are ever returned (see ``format.py``); each is checked against its CRC32.
Files are opened in SWMR mode, so a reader can tail shards that another process is still writing:
call ``refresh()`` to see what has been committed since.

    with TrajectoryStore(run_dir / "shards") as store:
        for traj in store.trajectories(TrajectoryFilter(tenant="team-a", eligible_only=True)):
            ...
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from areal_hpc.data.shards.format import (COLUMNS, COUNTED, INDEX_DTYPE, LIVE_SUFFIX, REWARD_DTYPE, ShardDamageError,
                                          decode, open_shard, record_checksum, reward_from_row, shard_stem, text)
from areal_hpc.data.trajectory import Reward, Trajectory
from areal_hpc.errors import UserError


@dataclass(frozen=True)
class TrajectoryFilter:
    """Select records by tenant, policy-version range of their output tokens, training eligibility."""

    tenant: str | None = None
    min_version: int | None = None  # the oldest output token is at least this version
    max_version: int | None = None  # the newest output token is at most this version
    eligible_only: bool = False

    def mask(self, index: np.ndarray) -> np.ndarray:
        keep = np.ones(len(index), dtype=bool)
        if self.tenant is not None:
            keep &= index["tenant"] == self.tenant.encode()
        if self.min_version is not None:
            keep &= index["version_min"] >= self.min_version
        if self.max_version is not None:
            keep &= index["version_max"] <= self.max_version
        if self.eligible_only:
            keep &= index["eligible"] == 1
        return keep


class ShardFile:
    """One shard: its committed index and reward rows (read incrementally) and record reads."""

    def __init__(self, path: Path):
        self.path, self.stem = path, shard_stem(path)
        self._file = open_shard(path)
        self.experiment = str(self._file.attrs["experiment"])
        self.trial = str(self._file.attrs["trial"])
        self.index = np.empty(0, dtype=INDEX_DTYPE)
        self.rewards = np.empty(0, dtype=REWARD_DTYPE)
        self.torn_trajectories = self.torn_rewards = 0  # written by a commit that never finished
        self.frozen = False  # read after finalisation: nothing can change any more
        try:
            self.refresh()
        except Exception:
            self._file.close()
            raise

    @property
    def live(self) -> bool:
        """True until the writer finalises the shard (also true for a shard whose writer died)."""
        return self.path.name.endswith(LIVE_SUFFIX)

    @property
    def torn(self) -> str:
        """What an interrupted commit left behind (ignored by every read), or "" when nothing."""
        if not (self.torn_trajectories or self.torn_rewards):
            return ""
        return (f"an interrupted commit of {self.torn_trajectories} trajectories and {self.torn_rewards} "
                f"rewards (ignored)")

    @property
    def n_tokens(self) -> int:
        return int(self.index["token_count"].sum())

    def refresh(self) -> np.ndarray:
        """Pick up newly committed rows; returns the reward rows that arrived since the last call."""
        state_ds = self._file["state"]
        state_ds.refresh()
        state = state_ds[:]
        committed = dict(zip(COUNTED, state[:len(COUNTED)].tolist()))
        intended = dict(zip(COUNTED, state[len(COUNTED):].tolist()))
        self.torn_trajectories = intended["index"] - committed["index"]
        self.torn_rewards = intended["rewards"] - committed["rewards"]
        self.index = self._extend(self.index, "index", committed["index"])
        before = len(self.rewards)
        self.rewards = self._extend(self.rewards, "rewards", committed["rewards"])
        self.frozen = not self.live
        return self.rewards[before:]

    def read(self, rows: Sequence[int], rewards_for) -> list[Trajectory]:
        """Decode committed rows (sorted or not), reading each run of consecutive rows in one go."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return []
        out: dict[int, Trajectory] = {}
        ordered = np.sort(rows)
        for run in np.split(ordered, np.flatnonzero(np.diff(ordered) != 1) + 1):
            first, last = self.index[run[0]], self.index[run[-1]]
            token_base, header_base = first["token_start"], first["header_start"]
            tokens = self._slice("tokens", token_base, last["token_start"] + last["token_count"])
            headers = self._slice("headers", header_base, last["header_start"] + last["header_count"])
            for r in run:
                row = self.index[r]
                t0, h0 = row["token_start"] - token_base, row["header_start"] - header_base
                token_rows, header = tokens[t0:t0 + row["token_count"]], headers[h0:h0 + row["header_count"]]
                # every record has a JSON header, so an all-zero row (a zeroed block) is damage too
                if row["header_count"] == 0 or record_checksum(token_rows, header) != row["crc32"]:
                    raise ShardDamageError(f"{self.path} row {r} fails its checksum; "
                                           f"run 'areal-hpc shards verify {self.path}'")
                traj = decode(row, token_rows, header, self.experiment, self.trial, rewards_for(text(row["id"])))
                if traj.id != text(row["id"]) or traj.tenant != text(row["tenant"]):
                    raise ShardDamageError(f"{self.path} row {r}: index and record disagree on id/tenant")
                out[int(r)] = traj
        return [out[int(r)] for r in rows]

    def damaged_rows(self) -> list[int]:
        """Committed rows that fail the checks a read makes (reads every record once)."""
        bad = []
        for r in range(len(self.index)):
            try:
                self.read([r], lambda _: [])
            except ShardDamageError:
                bad.append(r)
        return bad

    def close(self) -> None:
        self._file.close()

    def _extend(self, have: np.ndarray, name: str, committed: int) -> np.ndarray:
        if committed <= len(have):
            return have
        return np.concatenate([have, self._slice(name, len(have), committed)])

    def _slice(self, name: str, start: int, end: int) -> np.ndarray:
        """Entries [start, end) of a column (record rows are stored as bytes: viewed back as records)."""
        column, dataset = COLUMNS[name], self._file[name]
        scale = column.dtype.itemsize if column.as_bytes else 1
        dataset.refresh()
        if end * scale > dataset.shape[0]:
            raise ShardDamageError(f"{self.path}: committed {name} entries end at {end} but the dataset "
                                   f"holds {dataset.shape[0] // scale} (truncated file?)")
        values = dataset[int(start) * scale:int(end) * scale]
        return values.view(column.dtype) if column.as_bytes else values


class TrajectoryStore:
    """All shards under a directory (or one shard file); ``refresh()`` picks up new shards and rows."""

    def __init__(self, path: str | Path, skip_unreadable: bool = False):
        """``skip_unreadable``: list shards HDF5 cannot open in ``unreadable`` instead of raising."""
        self.path = Path(path)
        if not self.path.exists():
            raise UserError(f"no such file or directory: {self.path}")
        self.skip_unreadable = skip_unreadable
        self.unreadable: dict[Path, str] = {}
        self.shards: dict[str, ShardFile] = {}
        self._rewards: dict[str, list[Reward]] = defaultdict(list)
        self.refresh()

    def refresh(self) -> None:
        for path in self._shard_paths():
            stem = shard_stem(path)
            if stem in self.shards:
                if self.shards[stem].frozen:
                    continue
                self.shards[stem].path = path  # renamed live -> final; the open handle stays valid
                new_rewards = self.shards[stem].refresh()
            elif path in self.unreadable:
                continue
            elif (shard := self._open_unless_renamed(path)) is not None:
                self.shards[stem] = shard
                new_rewards = shard.rewards
            else:
                continue
            for row in new_rewards:
                self._rewards[text(row["id"])].append(reward_from_row(row))
        self.shards = dict(sorted(self.shards.items()))

    def rewards_for(self, trajectory_id: str) -> list[Reward]:
        return list(self._rewards.get(trajectory_id, ()))

    def has_reward(self, trajectory_id: str) -> bool:
        return trajectory_id in self._rewards

    def ids(self) -> set[str]:
        return {text(i) for shard in self.shards.values() for i in shard.index["id"]}

    def __len__(self) -> int:
        return sum(len(shard.index) for shard in self.shards.values())

    def trajectories(self, where: TrajectoryFilter | None = None, batch: int = 256) -> Iterator[Trajectory]:
        """Every committed record (optionally filtered), shard by shard in commit order."""
        for shard in self.shards.values():
            rows = np.flatnonzero((where or TrajectoryFilter()).mask(shard.index))
            for start in range(0, len(rows), batch):
                yield from shard.read(rows[start:start + batch], self.rewards_for)

    def sample(self, n: int, rng: np.random.Generator, where: TrajectoryFilter | None = None) -> list[Trajectory]:
        """``n`` distinct records drawn uniformly from those matching ``where`` (fewer if fewer exist)."""
        where = where or TrajectoryFilter()
        candidates = [(stem, r) for stem, shard in self.shards.items()
                      for r in np.flatnonzero(where.mask(shard.index))]
        picked = rng.choice(len(candidates), size=min(n, len(candidates)), replace=False)
        return [self.shards[candidates[i][0]].read([candidates[i][1]], self.rewards_for)[0] for i in picked]

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    def __enter__(self) -> "TrajectoryStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_unless_renamed(self, path: Path) -> ShardFile | None:
        """Open a shard found by a directory listing; None if its writer finalised (renamed) it since
        or, with ``skip_unreadable``, if it is damaged beyond opening."""
        try:
            return ShardFile(path)
        except ShardDamageError as exc:
            if not self.skip_unreadable:
                raise
            self.unreadable[path] = str(exc)
        except UserError:
            if path.exists():
                raise
        return None

    def _shard_paths(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        return sorted(p for p in self.path.glob("*.h5") if not p.name.startswith("."))

