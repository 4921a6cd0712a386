"""Name-resolve: where the processes of one run find each other, as files on the shared filesystem.

Keys are paths under ``<fileroot>/<experiment>/<trial>/name_resolve/``; values are small strings
(``host:port``). Writes are atomic renames, so a reader sees a whole value or none; NFS and Lustre
both honour that, and nothing else (no etcd, no Ray) needs to run on the cluster.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from areal_hpc.errors import UserError

ROLLOUT_SERVERS = "rollout/servers"


class NameResolve:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def add(self, key: str, value: str) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(value)
        os.replace(tmp, path)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def get(self, key: str) -> str | None:
        path = self._path(key)
        return path.read_text() if path.exists() else None

    def values(self, prefix: str) -> list[str]:
        """Every value under ``prefix``, in key order."""
        folder = self._path(prefix)
        if not folder.is_dir():
            return []
        return [p.read_text() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")]

    def wait_values(self, prefix: str, count: int, timeout: float) -> list[str]:
        """Block until ``count`` values exist under ``prefix`` (servers registering), or fail clearly."""
        deadline = time.monotonic() + timeout
        while len(found := self.values(prefix)) < count:
            if time.monotonic() > deadline:
                raise UserError(f"only {len(found)} of {count} entries appeared under {self._path(prefix)} "
                                f"within {timeout:.0f} s")
            time.sleep(0.1)
        return found

    def _path(self, key: str) -> Path:
        parts = [p for p in key.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise UserError(f"name-resolve key {key!r} must be a relative path without '.' or '..'")
        return self.root.joinpath(*parts)
