"""Read trajectory shards: one file or a whole store directory, finalised, live or left by a dead writer.

Only committed records are ever returned (see ``format.py``); each is checked against its CRC32.
Live files are opened in SWMR mode, so a reader can tail shards that another process is still writing:
call ``refresh()`` to see what has been committed since. Damage HDF5 trips over (metadata failing its
checksum, a live shard cut short) is a ShardDamageError within about ``metadata_wait`` seconds.

    with TrajectoryStore(run_dir / "shards") as store:
        for traj in store.trajectories(TrajectoryFilter(tenant="team-a", eligible_only=True)):
            ...
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from areal_hpc.data.shards.format import (
    COLUMNS,
    COUNTED,
    FINAL_SUFFIX,
    INDEX_DTYPE,
    LIVE_SUFFIX,
    METADATA_WAIT,
    REWARD_DTYPE,
    TOKEN_DTYPE,
    ShardDamageError,
    attribute_text,
    decode,
    hdf5_damage,
    intact,
    open_shard,
    record_checksum,
    reward_from_row,
    shard_stem,
    text,
)
from areal_hpc.data.trajectory import Reward, Trajectory
from areal_hpc.errors import UserError


@dataclass(frozen=True)
class TrajectoryFilter:
    """Select records by writer (the process that stored them: a run's rollout controller, a proxy),
    tenant, policy-version range of their output tokens, training eligibility."""

    writer: str | None = None  # a writer id, or a pattern of them ("proxy-*")
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


class RecordDamageError(ShardDamageError):
    """One committed record failing a check; ``problem`` says which."""

    def __init__(self, path: Path, row: int, problem: str):
        super().__init__(f"{path} row {row}: {problem}; run 'areal-hpc shards verify {path}'")
        self.problem = problem


class ShardFile:
    """One shard: its committed index and reward rows (read incrementally, each checked against its
    row CRC32) and checked record reads. A finalised shard is read once and its file closed (HDF5
    keeps ~0.5 MB per open file): record reads reopen it. ``metadata_wait``: see ``open_shard``."""

    def __init__(self, path: Path, metadata_wait: float = METADATA_WAIT):
        self.path, self.stem = path, shard_stem(path)
        self.writer = self.stem.rpartition("-")[0]  # shards are named <writer>-<sequence>
        self.metadata_wait = metadata_wait
        self._file: h5py.File | None = open_shard(path, metadata_wait)
        try:
            with hdf5_damage(path):
                self.experiment = attribute_text(self._file.attrs["experiment"])
                self.trial = attribute_text(self._file.attrs["trial"])
            self._checked_bytes = dict.fromkeys(COLUMNS, 0)  # committed bytes known to lie within the file
            self._chunk_offsets: dict[str, tuple[int, list[int | None]]] = {}  # see _chunks_up_to
            self.index = np.empty(0, dtype=INDEX_DTYPE)
            self.rewards = np.empty(0, dtype=REWARD_DTYPE)
            self.index_intact = self.rewards_intact = np.empty(0, dtype=bool)  # rows matching their row CRC32
            self.committed = self.intended = dict.fromkeys(COUNTED, 0)
            self.refresh()
        except BaseException:
            self.close()
            raise

    @property
    def live(self) -> bool:
        """True until the writer finalises the shard (also true for a shard whose writer died)."""
        return self.path.name.endswith(LIVE_SUFFIX)

    @property
    def frozen(self) -> bool:
        """Read after finalisation (or closed): nothing can change any more."""
        return self._file is None

    @property
    def torn_trajectories(self) -> int:
        return self.intended["index"] - self.committed["index"]

    @property
    def torn_rewards(self) -> int:
        return self.intended["rewards"] - self.committed["rewards"]

    @property
    def torn(self) -> str:
        """What an interrupted commit left behind (ignored by every read), or "" when nothing."""
        if all(self.intended[n] <= self.committed[n] for n in COUNTED):
            return ""
        return (
            f"an interrupted commit of {self.torn_trajectories} trajectories and {self.torn_rewards} rewards (ignored)"
        )

    @property
    def n_tokens(self) -> int:
        return int(self.index["token_count"].sum())

    def refresh(self) -> np.ndarray:
        """Pick up newly committed rows; returns the intact reward rows that arrived since the last call."""
        if self._file is None:
            return self.rewards[:0]
        with hdf5_damage(self.path):
            state_ds = self._file["state"]
            state_ds.refresh()
            state = state_ds[:].tolist()
            counts_end = state_ds.id.get_offset() + state_ds.id.get_storage_size()
        self.committed = dict(zip(COUNTED, state[: len(COUNTED)]))
        self.intended = dict(zip(COUNTED, state[len(COUNTED) :]))
        if self.live:
            self._check_within_file(counts_end)
        before = len(self.rewards)
        self.index, self.index_intact = self._extend(self.index, self.index_intact, "index")
        self.rewards, self.rewards_intact = self._extend(self.rewards, self.rewards_intact, "rewards")
        if not self.live:
            self.close()
        return self.rewards[before:][self.rewards_intact[before:]]

    def matches(self, where: TrajectoryFilter, start: int = 0) -> np.ndarray:
        """Which rows from ``start`` on match ``where``; a row whose index row is damaged always does
        (its filter columns cannot be trusted: reading it raises rather than silently skipping it)."""
        if where.writer is not None and not fnmatch.fnmatchcase(self.writer, where.writer):
            return np.zeros(len(self.index) - start, dtype=bool)
        return where.mask(self.index[start:]) | ~self.index_intact[start:]

    def read(self, rows: Sequence[int], rewards_for) -> list[Trajectory]:
        """Decode committed rows (sorted or not); raises ShardDamageError on the first one failing a check."""
        out: dict[int, Trajectory] = {}
        for r, token_rows, header in self._records(rows):
            row = self.index[r]
            out[r] = decode(
                row,
                token_rows,
                self._checked_header(r, token_rows, header),
                self.experiment,
                self.trial,
                rewards_for(text(row["id"])),
            )
        return [out[int(r)] for r in rows]

    def damaged_rows(self, batch: int = 256) -> Iterator[tuple[int, str]]:
        """(row, what is wrong) of every committed record failing a check, ``batch`` records read at a time."""
        for start in range(0, len(self.index), batch):
            for r, token_rows, header in self._records(range(start, min(start + batch, len(self.index)))):
                try:
                    self._checked_header(r, token_rows, header)
                except ShardDamageError as exc:
                    yield r, exc.problem

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _checked_header(self, r: int, token_rows: np.ndarray, header: np.ndarray) -> dict:
        """Record ``r``'s parsed header once every check passes; else ShardDamageError saying which failed."""
        row = self.index[r]
        if not self.index_intact[r]:
            raise RecordDamageError(self.path, r, "index row fails its checksum")
        # every record has a JSON header, so an all-zero record (a zeroed block) is damage too
        if row["header_count"] == 0 or record_checksum(token_rows, header) != row["crc32"]:
            raise RecordDamageError(self.path, r, "record fails its checksum")
        meta = json.loads(header.tobytes())
        if meta["id"] != text(row["id"]) or meta["tenant"] != text(row["tenant"]):
            raise RecordDamageError(self.path, r, "index and record disagree on id/tenant")
        return meta

    def _records(self, rows: Sequence[int]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(row, token rows, header bytes) of committed rows in row order, the rows of each run of
        consecutive ones read in one go. A row whose index row is damaged comes with nothing read:
        its offsets cannot be trusted."""
        ordered = np.unique(np.asarray(rows, dtype=np.int64))
        if len(ordered) == 0:
            return
        with self._opened() as f:
            for run in np.split(ordered, np.flatnonzero(np.diff(ordered) != 1) + 1):
                good = run[self.index_intact[run]]
                if len(good):
                    first, last = self.index[good[0]], self.index[good[-1]]
                    token_base, header_base = first["token_start"], first["header_start"]
                    tokens = self._slice(f, "tokens", token_base, last["token_start"] + last["token_count"])
                    headers = self._slice(f, "headers", header_base, last["header_start"] + last["header_count"])
                for r in run.tolist():
                    row = self.index[r]
                    if not self.index_intact[r]:
                        yield r, np.empty(0, TOKEN_DTYPE), np.empty(0, np.uint8)
                        continue
                    t0, h0 = row["token_start"] - token_base, row["header_start"] - header_base
                    yield r, tokens[t0 : t0 + row["token_count"]], headers[h0 : h0 + row["header_count"]]

    @contextlib.contextmanager
    def _opened(self) -> Iterator[h5py.File]:
        if self._file is not None:
            yield self._file
        else:
            with open_shard(self.path, self.metadata_wait) as f:
                yield f

    def _check_within_file(self, counts_end: int) -> None:
        """ShardDamageError unless the commit counts and every committed byte lie within the file.

        HDF5 checks the file end when it opens a finalised shard; a SWMR reader skips that check and
        reads zeros past the end, so a live shard cut short read as holding nothing, or as records
        failing their checksums only once read. A commit writes its data before its counts, so in an
        intact file the data is there whenever the counts are. Each chunk's place in the file is
        looked up once (an unfiltered chunk never moves): tailing a live shard stays cheap."""
        size = os.fstat(self._file.id.get_vfd_handle()).st_size
        if counts_end > size:
            raise ShardDamageError(
                f"{self.path}: truncated: the commit counts lie past the end of the file ({size:,} bytes)"
            )
        for name, column in COLUMNS.items():
            committed = self.committed[column.counter]
            checked, end = self._checked_bytes[name], committed * column.dtype.itemsize
            if end <= checked:
                continue
            width, offsets = self._chunks_up_to(name, committed, end)
            for chunk in range(checked // width, -(-end // width)):
                if offsets[chunk] is None or offsets[chunk] + min(width, end - chunk * width) > size:
                    raise ShardDamageError(
                        f"{self.path}: truncated: committed {name} data lies past the end of the file ({size:,} bytes)"
                    )
            self._checked_bytes[name] = end

    def _chunks_up_to(self, name: str, committed: int, end: int) -> tuple[int, list[int | None]]:
        """Column ``name``'s chunk width and the file offset of each of its chunks holding bytes before
        ``end`` (None: no chunk stored), from the lookups of earlier calls and new ones as needed."""
        width, offsets = self._chunk_offsets.get(name, (0, []))
        if len(offsets) * width < end:
            with hdf5_damage(self.path):
                dataset = self._column(self._file, name, committed)
                width = dataset.chunks[0]  # every column is stored as bytes (u1)
                offsets += [
                    dataset.id.get_chunk_info_by_coord((start,)).byte_offset
                    for start in range(len(offsets) * width, end, width)
                ]
            self._chunk_offsets[name] = (width, offsets)
        return width, offsets

    def _extend(self, have: np.ndarray, have_intact: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``have`` with the rows committed since, and which of all of them match their row CRC32."""
        committed = self.committed[COLUMNS[name].counter]
        if committed <= len(have):
            return have, have_intact
        new = self._slice(self._file, name, len(have), committed)
        return np.concatenate([have, new]), np.concatenate([have_intact, intact(new)])

    def _slice(self, f: h5py.File, name: str, start: int, end: int) -> np.ndarray:
        """Entries [start, end) of a column (record rows are stored as bytes: viewed back as records)."""
        column = COLUMNS[name]
        scale = column.dtype.itemsize if column.as_bytes else 1
        with hdf5_damage(self.path):
            values = self._column(f, name, end)[int(start) * scale : int(end) * scale]
        return values.view(column.dtype) if column.as_bytes else values

    def _column(self, f: h5py.File, name: str, end: int) -> h5py.Dataset:
        """Column ``name``, refreshed, once it is known to hold ``end`` entries."""
        column, dataset = COLUMNS[name], f[name]
        scale = column.dtype.itemsize if column.as_bytes else 1
        dataset.refresh()
        if end * scale > dataset.shape[0]:
            raise ShardDamageError(
                f"{self.path}: committed {name} entries end at {end} but the dataset "
                f"holds {dataset.shape[0] // scale} (truncated file?)"
            )
        return dataset


class TrajectoryStore:
    """All shards under a directory (or one shard file); ``refresh()`` picks up new shards and rows.

    A reward row failing its checksum may belong to any trajectory, so while one is in the store
    every reward look-up (and so every record read) raises ShardDamageError rather than guess.
    """

    def __init__(self, path: str | Path, skip_unreadable: bool = False, metadata_wait: float = METADATA_WAIT):
        """``skip_unreadable``: list shards HDF5 cannot open in ``unreadable`` instead of raising.
        ``metadata_wait``: how long a live shard's metadata may fail its checksum before it is damage
        (HDF5 retries, as a writer may be rewriting it; see ``format.read_attempts``)."""
        self.path = Path(path)
        self.skip_unreadable, self.metadata_wait = skip_unreadable, metadata_wait
        self.unreadable: dict[Path, str] = {}
        self.shards: dict[str, ShardFile] = {}
        self._rewards: dict[str, list[Reward]] = defaultdict(list)
        self._damaged_rewards: list[str] = []
        try:
            self.refresh()
        except BaseException:
            self.close()
            raise

    def refresh(self) -> None:
        for path in shard_paths(self.path):
            stem = shard_stem(path)
            if stem in self.shards:
                if self.shards[stem].frozen:
                    continue
                self.shards[stem].path = path  # renamed live -> final; the open handle stays valid
                new_rewards = self.shards[stem].refresh()
            elif path in self.unreadable or (shard := self._open(path)) is None:
                continue
            else:
                self.shards[stem] = shard
                new_rewards = shard.rewards[shard.rewards_intact]
            for row in new_rewards:
                self._rewards[text(row["id"])].append(reward_from_row(row))
        self.shards = dict(sorted(self.shards.items()))
        self._damaged_rewards = [
            f"{s.path} reward row {r}" for s in self.shards.values() for r in np.flatnonzero(~s.rewards_intact)
        ]

    def problems(self) -> list[str]:
        """What is known to be unreadable or damaged without reading any record: files HDF5 cannot
        open, index and reward rows failing their checksums (``shards verify`` checks every record)."""
        found = list(self.unreadable.values())
        for shard in self.shards.values():
            for name, ok in (("index", shard.index_intact), ("reward", shard.rewards_intact)):
                if not ok.all():
                    found.append(f"{shard.path}: {name} rows {_rows(np.flatnonzero(~ok))} fail their checksum")
        return found

    def rewards_for(self, trajectory_id: str) -> list[Reward]:
        self._check_rewards()
        return list(self._rewards.get(trajectory_id, ()))

    def has_reward(self, trajectory_id: str) -> bool:
        self._check_rewards()
        return trajectory_id in self._rewards

    def ids(self) -> set[str]:
        return {text(i) for shard in self.shards.values() for i in shard.index["id"][shard.index_intact]}

    def __len__(self) -> int:
        return sum(len(shard.index) for shard in self.shards.values())

    def trajectories(self, where: TrajectoryFilter | None = None, batch: int = 256) -> Iterator[Trajectory]:
        """Every committed record (optionally filtered), shard by shard in commit order."""
        for shard in self.shards.values():
            rows = np.flatnonzero(shard.matches(where or TrajectoryFilter()))
            for start in range(0, len(rows), batch):
                yield from shard.read(rows[start : start + batch], self.rewards_for)

    def sample(self, n: int, rng: np.random.Generator, where: TrajectoryFilter | None = None) -> list[Trajectory]:
        """``n`` distinct records drawn uniformly from those matching ``where`` (fewer if fewer exist)."""
        where = where or TrajectoryFilter()
        candidates = [(stem, r) for stem, shard in self.shards.items() for r in np.flatnonzero(shard.matches(where))]
        picked = rng.choice(len(candidates), size=min(n, len(candidates)), replace=False)
        return [self.shards[candidates[i][0]].read([candidates[i][1]], self.rewards_for)[0] for i in picked]

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_rewards(self) -> None:
        if self._damaged_rewards:
            raise ShardDamageError(
                f"{self._damaged_rewards[0]} fails its checksum: it may belong to any "
                f"trajectory, so no reward in {self.path} can be trusted; "
                f"run 'areal-hpc shards verify {self.path}'"
            )

    def _open(self, path: Path) -> ShardFile | None:
        """``open_listed``, but with ``skip_unreadable`` a shard HDF5 cannot open is listed, not raised."""
        try:
            return open_listed(path, self.metadata_wait)
        except ShardDamageError as exc:
            if not self.skip_unreadable:
                raise
            self.unreadable[path] = str(exc)
        return None


def open_listed(path: Path, metadata_wait: float = METADATA_WAIT) -> ShardFile | None:
    """Open a shard found by a directory listing: the finalised file if its writer renamed it since,
    None if it is gone."""
    try:
        return ShardFile(path, metadata_wait)
    except UserError:
        if path.exists():
            raise
    final = path.with_name(shard_stem(path) + FINAL_SUFFIX)
    return open_listed(final, metadata_wait) if final != path and final.exists() else None


def shard_paths(path: Path) -> list[Path]:
    """The shard files of a store folder in name order (or the one file ``path`` names)."""
    if not path.exists():
        raise UserError(f"no such file or directory: {path}")
    if path.is_file():
        return [path]
    return sorted(p for p in path.glob("*.h5") if not p.name.startswith("."))


def _rows(rows: np.ndarray, shown: int = 5) -> str:
    listed = ", ".join(str(r) for r in rows[:shown])
    return listed + (f" and {len(rows) - shown} more" if len(rows) > shown else "")
