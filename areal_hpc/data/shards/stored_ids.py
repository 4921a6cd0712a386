"""Which trajectory ids a store folder holds, so that a writer refuses a reward for an unknown id.

Ids are kept as 64-bit hashes in a sorted array (8 bytes an id, no Python object per id), and a
look-up that misses reads only what was committed since the previous miss: a finalised shard is
read once and closed, a live one is kept open and read on from where the last look-up stopped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from areal_hpc.data.shards.format import shard_stem, text
from areal_hpc.data.shards.reader import ShardFile, open_listed, shard_paths

MERGE_EVERY = 1024  # ids added one by one are merged into the sorted array in batches this large


class StoredIds:
    """A set of trajectory ids that reads newly committed ones from ``directory`` when asked about
    one it does not hold. A false "held" needs two ids with the same 64-bit hash (~n / 2**64)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._sorted = np.empty(0, dtype=np.uint64)
        self._recent: set[int] = set()
        self._live: dict[str, tuple[ShardFile, int]] = {}  # stem -> open live shard, index rows taken in
        self._finished: set[str] = set()  # stems never to read again (finalised, or written here)

    def add(self, trajectory_id: str) -> None:
        self._recent.add(_hash(trajectory_id))
        if len(self._recent) >= MERGE_EVERY:
            self._merge(np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent)))
            self._recent.clear()

    def held(self, trajectory_id: str) -> bool:
        """Whether the id was added or read, without reading anything new."""
        h = _hash(trajectory_id)
        i = np.searchsorted(self._sorted, np.uint64(h))
        return h in self._recent or (i < len(self._sorted) and int(self._sorted[i]) == h)

    def __contains__(self, trajectory_id: str) -> bool:
        return self.held(trajectory_id) or (self._read_new() and self.held(trajectory_id))

    def skip(self, stem: str) -> None:
        """Never read this shard (its writer adds its ids as it appends them)."""
        self._finished.add(stem)

    def close(self) -> None:
        for shard, _ in self._live.values():
            shard.close()
        self._live.clear()

    def _read_new(self) -> bool:
        """Take in the ids of intact index rows committed since the last call; True if there were any."""
        found = []
        for path in shard_paths(self.directory):
            stem = shard_stem(path)
            if stem in self._finished:
                continue
            if stem in self._live:
                shard, start = self._live[stem]
                shard.path = path  # renamed live -> final since: the open handle stays valid
                shard.refresh()
            elif (shard := open_listed(path)) is None:
                continue
            else:
                start = 0
            found += [_hash(text(i)) for i in shard.index["id"][start:][shard.index_intact[start:]]]
            if shard.frozen:
                self._finished.add(stem)
                self._live.pop(stem, None)
            else:
                self._live[stem] = (shard, len(shard.index))
        if found:
            self._merge(np.array(found, dtype=np.uint64))
        return bool(found)

    def _merge(self, hashes: np.ndarray) -> None:
        # two sorted runs: the stable sort (timsort) merges them in linear time
        self._sorted = np.sort(np.concatenate([self._sorted, np.sort(hashes)]), kind="stable")


def _hash(trajectory_id: str) -> int:
    return hash(trajectory_id) & 0xFFFF_FFFF_FFFF_FFFF  # SipHash, salted per process: never stored
