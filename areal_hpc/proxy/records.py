"""The proxy's one shard writer: ended sessions' records and late rewards, committed (fsync) on one
thread so the event loop never waits on the disk and h5py is only ever used from one thread.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from areal_hpc.data.shards import TrajectoryShardWriter
from areal_hpc.data.shards.writer import PROXY_WRITER_PREFIX
from areal_hpc.data.trajectory import Trajectory


def writer_id() -> str:
    """One writer per proxy process: ``proxy-<host>-<pid>``, so two proxies never share a shard."""
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
    return f"{PROXY_WRITER_PREFIX}{host}-{os.getpid()}"


class RecordSink:
    def __init__(self, directory: str | Path, *, experiment: str, trial: str, fsync: bool = True):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proxy-shards")
        # one commit per session's records, or per late reward: flushed by hand, never by count
        self.writer = TrajectoryShardWriter(
            directory, writer_id(), experiment=experiment, trial=trial, fsync=fsync, flush_every=1 << 30
        )
        self.written = 0

    async def write(self, records: list[Trajectory]) -> None:
        """Commit ``records``; when this returns they survive the proxy being killed."""
        await asyncio.get_running_loop().run_in_executor(self._thread, self._append, records)
        self.written += len(records)

    def _append(self, records: list[Trajectory]) -> None:
        for record in records:
            self.writer.append(record)
        self.writer.flush()

    async def reward(self, record_id: str, value: float, step: int, source: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._reward, record_id, value, step, source)

    def _reward(self, record_id: str, value: float, step: int, source: str) -> None:
        self.writer.set_reward(record_id, value, step=step, source=source)
        self.writer.flush()

    def close(self) -> None:
        """Finalise the live shard (after every write queued so far)."""
        self._thread.submit(self.writer.close).result()
        self._thread.shutdown()
